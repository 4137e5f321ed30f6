"""Chat templates: a conversation (``[{"role", "content"}, ...]``) -> one string, and the character
spans of its assistant turns.

Where the template comes from (``DataConfig.chat_template``):

- ``""``: the tokenizer's own, read beside its ``tokenizer.json``: ``chat_template.jinja`` if present,
  else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}``
  of which ``"default"`` is used). Rendered the way ``transformers``' ``apply_chat_template`` renders
  it: a sandboxed Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, ``loopcontrols``, a
  ``tojson`` filter and ``raise_exception``; the variables are ``messages``, ``add_generation_prompt``
  and the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...).
- a built-in name: ``chatml`` renders each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
  and, with ``add_generation_prompt``, ends with ``<|im_start|>assistant\\n``.
- a path to a ``.jinja`` file, rendered as above.

Assistant spans come from prefix renders (``assistant_spans``): the span of assistant message i is
``render(messages[:i + 1])`` minus ``render(messages[:i], add_generation_prompt=True)``, so it holds
the reply and whatever the template closes it with (``<|im_end|>\\n`` for ChatML: the model learns
to stop). A template whose renders are not prefixes of each other is refused (ValueError).
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

BUILTIN = {
    "chatml": ("{% for message in messages %}"
               "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A compiled template plus the special-token strings it may use.

    ``name``: where it came from (``chatml``, a file path); ``digest``: sha256 of the source and
    the special tokens (part of the cache key of the rendered data)."""

    def __init__(self, source: str, name: str, special: dict[str, str] | None = None):
        self.source, self.name, self.special = source, name, dict(special or {})
        self.digest = hashlib.sha256(json.dumps([source, self.special], sort_keys=True).encode()).hexdigest()[:16]
        self._template = _compile(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as one string (the template's exact output, nothing added)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the ``[start, end)`` character range of
        each assistant turn in it (module docstring). Raises ValueError when a prefix render is
        not a prefix of the whole."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"chat template {self.name}: the render up to message {i} is not a prefix "
                                 "of the whole conversation, so the assistant turns cannot be located")
            spans.append((len(before), len(upto)))
        return text, spans


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from None


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for key in _SPECIAL:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def load_chat_template(spec: str, tokenizer_spec: str) -> ChatTemplate:
    """The template ``spec`` names (module docstring) for the tokenizer ``tokenizer_spec``
    (``"bytes"`` or a ``tokenizer.json`` path / folder).

    Raises:
        ValueError: an unknown name, a missing file, or ``""`` with a tokenizer that has no template
            (the message lists the built-ins).
    """
    folder = None
    if tokenizer_spec not in ("bytes", "bpe"):
        p = Path(tokenizer_spec).expanduser()
        folder = p if p.is_dir() else p.parent
    config_path = folder / "tokenizer_config.json" if folder else None
    config = json.loads(config_path.read_text()) if config_path and config_path.is_file() else {}
    special = _special_tokens(config)
    if spec in BUILTIN:
        return ChatTemplate(BUILTIN[spec], spec, special)
    if spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"data.chat_template: {spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
                             "nor an existing template file")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special)
    if folder and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if isinstance(source, str):
        return ChatTemplate(source, str(config_path), special)
    raise ValueError(f"data.chat_template is empty and tokenizer {tokenizer_spec!r} has no chat template "
                     f"(no chat_template in tokenizer_config.json); name a built-in ({', '.join(BUILTIN)}) "
                     "or a .jinja file")
