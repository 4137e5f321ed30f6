"""A model as the planner sees it: shapes, parameter counts and FLOPs per token.

Built from an ndtrain preset (name or YAML path, via ``ndtrain.config.load``) or a Hugging Face
``config.json`` (Llama / Mistral / Qwen dense; Mixtral ``num_local_experts`` /
``num_experts_per_tok``; Qwen-MoE ``num_experts`` / ``moe_intermediate_size`` /
``shared_expert_intermediate_size``; DeepSeek-V2/V3 ``n_routed_experts`` / ``n_shared_experts`` /
``first_k_dense_replace`` / ``moe_layer_freq`` and MLA ranks). Missing fields take Llama defaults.

FLOPs per token follow the MFU convention of training logs (PaLM, Chowdhery et al. 2022, appendix
B; the count ``ndtrain.train.metrics`` logs MFU with)::

    6 * N_active_nonembed + 12 * L * H * D * T

N counts every parameter a token's matmuls touch (routed experts: only the top-k), including the
output head and norms, excluding the input embedding (a lookup). The attention term counts all
T x T query-key pairs (causal masking is not subtracted). Recompute is not counted (that is HFU).
MTP modules (DeepSeek-V3 multi-token prediction, ``mtp_depth``) add their projection (C, 2C), three
norms, one block like the last layer and one more pass through the shared output head, and L + depth
attention layers. Parameter counts equal those of ``ndtrain.model.Transformer`` for every preset
(tests/unit/test_planner_v2.py builds each on the meta device).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ndtrain.mixer_spec import MixerFields, param_delta, seq_flops_total


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer with SwiGLU MLPs, GQA or MLA attention, dense or MoE layers."""

    name: str
    vocab_size: int
    dim: int  # model width h
    n_layers: int  # L
    n_heads: int  # query heads a
    n_kv_heads: int  # kv heads g
    head_dim: int  # D
    ffn_hidden: int  # dense SwiGLU hidden f (0: mixer-only blocks, model.block_ffn=false)
    tie_embeddings: bool = False
    # MoE (n_experts == 0: dense)
    n_experts: int = 0  # routed experts E
    top_k: int = 0  # routed experts per token
    moe_ffn_hidden: int = 0  # hidden of one routed expert
    n_shared_experts: int = 0  # always-on experts of width shared_ffn_hidden each
    shared_ffn_hidden: int = 0
    first_dense_layers: int = 0  # DeepSeek first_k_dense_replace
    moe_layer_freq: int = 1  # every k-th layer (after the dense ones) is MoE
    moe_seq_aux_loss: bool = False  # DeepSeek-V3 sequence-wise balance loss (a layout rule reads it)
    moe_capacity: bool = False  # token dropping at a capacity factor (a layout rule reads it)
    # MLA (DeepSeek-V2/V3); kv_lora_rank == 0: standard GQA attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V3 multi-token prediction modules (ndtrain presets only; HF configs: 0)
    mtp_depth: int = 0
    # softmax-attention extras (Qwen3 / Qwen3-Next): per-head q / k RMSNorms, a sigmoid output gate
    # projection (h x a*D), a per-token sigmoid gate on the shared experts (h)
    qk_norm: bool = False
    attn_output_gate: bool = False
    shared_expert_gate: bool = False
    # per-layer token mixers (ndtrain.mixer_spec.MixerFields of model.layer_pattern); None = all attention
    mixers: MixerFields | None = None
    max_seq_len: int = 0  # longest position the trainer accepts (model.max_seq_len; 0: unknown, no rule)

    # ---- structure ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        rest = range(self.first_dense_layers, self.n_layers)
        return sum(1 for i in rest if (i - self.first_dense_layers) % self.moe_layer_freq == 0)

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    # ---- parameters (counts, not bytes) --------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """One layer's attention projections (+ its RMSNorm; MLA: + the q / kv latent norms)."""
        h, a, D = self.dim, self.n_heads, self.head_dim
        if self.kv_lora_rank:  # MLA: low-rank q / kv with a decoupled RoPE key (ndtrain/model/mla.py)
            rope, v, qr, kr = self.qk_rope_head_dim, self.v_head_dim or D, self.q_lora_rank, self.kv_lora_rank
            q = (h * qr + qr + qr * a * (D + rope)) if qr else h * a * (D + rope)
            kv = h * (kr + rope) + kr + kr * a * (D + v)
            return q + kv + a * v * h + h
        extras = 2 * D * self.qk_norm + h * a * D * self.attn_output_gate
        return h * a * D + 2 * h * self.n_kv_heads * D + a * D * h + h + extras

    @property
    def dense_mlp_params(self) -> int:
        """Gate, up, down + their RMSNorm; 0 for a mixer-only block (``ffn_hidden`` 0: Mamba-2)."""
        return 3 * self.dim * self.ffn_hidden + self.dim if self.ffn_hidden else 0

    @property
    def expert_params(self) -> int:
        """One routed expert (SwiGLU)."""
        return 3 * self.dim * self.moe_ffn_hidden

    @property
    def moe_shared_params(self) -> int:
        """The parts of a MoE layer every token uses: shared experts, router, RMSNorm."""
        return (self.n_shared_experts * 3 * self.dim * self.shared_ffn_hidden
                + self.dim * self.n_experts + self.dim + self.dim * self.shared_expert_gate)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """Output head (counted as a matmul even when tied) + final norm."""
        return self.vocab_size * self.dim + self.dim

    @property
    def last_layer_is_moe(self) -> bool:
        i = self.n_layers - 1
        return self.is_moe and i >= self.first_dense_layers and (i - self.first_dense_layers) % self.moe_layer_freq == 0

    def mtp_params(self, active: bool = False) -> int:
        """All MTP modules (ndtrain/model/mtp.py): per depth hnorm, enorm, norm (3C), proj (2C x C) and
        one block like the last layer (MoE: all experts, or the top-k when ``active``); they share the
        model's embedding and output head, which are not counted here."""
        if not self.mtp_depth:
            return 0
        return self.mtp_depth * (3 * self.dim + 2 * self.dim * self.dim
                                 + self.layer_params(self.last_layer_is_moe, active))

    @property
    def params_total(self) -> int:
        """Distinct parameters, = ``sum(p.numel())`` of ``ndtrain.model.Transformer`` for presets."""
        layers = self.n_layers * self.attn_params + self.n_dense_layers * self.dense_mlp_params
        layers += self.n_moe_layers * (self.n_experts * self.expert_params + self.moe_shared_params)
        layers += param_delta(self.mixers, self.attn_params - self.dim) if self.mixers else 0
        head = self.dim if self.tie_embeddings else self.head_params
        return layers + self.embedding_params + head + self.mtp_params()

    @property
    def params_active(self) -> int:
        """Parameters one token touches (top-k routed experts only, MTP modules included)."""
        trunk = self.params_total - self.mtp_params()
        trunk -= self.n_moe_layers * (self.n_experts - self.top_k) * self.expert_params
        return trunk + self.mtp_params(active=True)

    @property
    def params_nonembed_active(self) -> int:
        """N of the FLOPs convention: active parameters minus the input embedding, head included."""
        n = self.params_active - self.embedding_params
        n += self.vocab_size * self.dim if self.tie_embeddings else 0
        return n + self.mtp_depth * self.vocab_size * self.dim  # each MTP depth runs the head again

    def layer_params(self, moe: bool, active: bool = False) -> int:
        """One block's parameters (MoE: all experts, or only the top-k when ``active``)."""
        return _layer_params(self, moe, active)

    def rank_block_params(self, moe: bool, tp: int = 1, ep: int = 1, expert_tp: int = 0) -> float:
        """One block's parameters on one rank: dense parts over tp, routed experts over expert_tp x ep
        (``expert_tp`` 0: the attention tp, the tied expert mesh; a ZeRO-3 rank gathers only its own
        experts)."""
        experts = self.n_experts * self.expert_params if moe else 0
        return (self.layer_params(moe) - experts) / tp + experts / ((expert_tp or tp) * ep)

    def _count_layer_params(self, moe: bool, active: bool) -> int:
        if not moe:
            return self.attn_params + self.dense_mlp_params
        experts = self.top_k if active else self.n_experts
        return self.attn_params + self.moe_shared_params + experts * self.expert_params

    # ---- FLOPs ---------------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (fwd + bwd), PaLM convention (see module docstring)."""
        return 6.0 * self.params_nonembed_active + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """12 * (L + MTP depth) * H * D * T: QK^T and AV over all T x T pairs, fwd + bwd (PaLM
        appendix B); FLOPs per token."""
        if self.mixers:  # hybrid: each layer's own sequence term (no T term for linear mixers)
            d_v = (self.v_head_dim or self.head_dim) if self.kv_lora_rank else self.head_dim
            d_qk = self.head_dim + (self.qk_rope_head_dim if self.kv_lora_rank else 0)
            return seq_flops_total(self.mixers, seq_len, d_qk, d_v) + self.mtp_depth * self.attention_flops_per_layer(seq_len)
        return (self.n_layers + self.mtp_depth) * self.attention_flops_per_layer(seq_len)

    def attention_flops_per_layer(self, seq_len: int) -> float:
        """6 * H * (d_qk + d_v) * T FLOPs per token for one attention layer (= 12 H D T for MHA)."""
        d_qk = self.head_dim + self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim
        d_v = (self.v_head_dim or self.head_dim) if self.kv_lora_rank else self.head_dim
        return 6.0 * self.n_heads * (d_qk + d_v) * seq_len


@lru_cache(maxsize=256)
def _layer_params(spec: ModelSpec, moe: bool, active: bool) -> int:
    return spec._count_layer_params(moe, active)


def _llama_ffn(dim: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


def from_model_config(m, name: str = "") -> ModelSpec:
    """From an ``ndtrain.config.ModelConfig`` (dense Llama, or MoE / MLA via its ``moe_*`` /
    ``mla_*`` fields; ``mtp_depth`` MTP modules)."""
    moe = {"n_experts": m.moe_experts, "top_k": m.moe_top_k, "moe_ffn_hidden": m.expert_ffn_dim,
           # moe_shared_ffn_hidden (Qwen3-Next) sizes the shared experts together: one of that width
           "n_shared_experts": min(m.moe_shared_experts, 1) if m.moe_shared_ffn_hidden else m.moe_shared_experts,
           "shared_ffn_hidden": m.moe_shared_ffn_hidden or m.expert_ffn_dim,
           "first_dense_layers": m.moe_layer_start, "moe_layer_freq": m.moe_layer_interleave,
           "moe_seq_aux_loss": m.moe_seq_aux_loss_coef > 0, "moe_capacity": m.moe_capacity_factor > 0} if m.is_moe else {}
    mla = {"q_lora_rank": m.mla_q_rank, "kv_lora_rank": m.mla_kv_rank, "qk_rope_head_dim": m.mla_rope_dim,
           "v_head_dim": m.mla_v_dim or m.head_dim} if m.attention == "mla" else {}
    head_dim = (m.mla_nope_dim or m.head_dim) if mla else m.head_dim
    return ModelSpec(name or m.name, m.vocab_size, m.dim, m.n_layers, m.n_heads, m.kv_heads,
                     head_dim, m.ffn_dim if m.block_ffn else 0, m.tie_embeddings, **moe, **mla, mtp_depth=m.mtp_depth,
                     qk_norm=m.qk_norm and not mla, attn_output_gate=m.attn_output_gate and not mla,
                     shared_expert_gate=m.is_moe and m.moe_shared_gate, mixers=MixerFields.from_model_config(m),
                     max_seq_len=m.max_seq_len)


def from_hf_config(cfg: dict, name: str = "") -> ModelSpec:
    """From a Hugging Face ``config.json`` dict; tolerates missing fields (Llama defaults)."""
    g = cfg.get
    dim = int(g("hidden_size") or g("d_model") or g("n_embd") or 4096)
    heads = int(g("num_attention_heads") or g("n_head") or max(1, dim // 128))
    kv = int(g("num_key_value_heads") or heads)
    head_dim = int(g("head_dim") or dim // heads)
    layers = int(g("num_hidden_layers") or g("n_layer") or 32)
    ffn = int(g("intermediate_size") or _llama_ffn(dim))
    n_exp = int(g("num_local_experts") or g("n_routed_experts") or g("num_experts") or 0)
    top_k = int(g("num_experts_per_tok") or g("moe_top_k") or (2 if n_exp else 0))
    moe_ffn = int(g("moe_intermediate_size") or ffn) if n_exp else 0
    shared_hidden = int(g("shared_expert_intermediate_size") or 0)
    n_shared = int(g("n_shared_experts") or (1 if shared_hidden else 0))
    if n_shared and not shared_hidden:
        shared_hidden = moe_ffn
    mla = int(g("kv_lora_rank") or 0)
    return ModelSpec(
        name=name or str(g("_name_or_path") or g("model_type") or "hf"),
        vocab_size=int(g("vocab_size") or 32000), dim=dim, n_layers=layers, n_heads=heads,
        n_kv_heads=kv, head_dim=int(g("qk_nope_head_dim") or head_dim) if mla else head_dim,
        ffn_hidden=ffn, tie_embeddings=bool(g("tie_word_embeddings", False)), n_experts=n_exp,
        top_k=top_k, moe_ffn_hidden=moe_ffn, n_shared_experts=n_shared, shared_ffn_hidden=shared_hidden,
        first_dense_layers=int(g("first_k_dense_replace") or 0) if n_exp else 0,
        moe_layer_freq=int(g("moe_layer_freq") or g("decoder_sparse_step") or 1),
        q_lora_rank=int(g("q_lora_rank") or 0), kv_lora_rank=mla,
        qk_rope_head_dim=int(g("qk_rope_head_dim") or 0), v_head_dim=int(g("v_head_dim") or 0),
        qk_norm=g("model_type") in _QK_NORM_FAMILIES, attn_output_gate=g("model_type") == "qwen3_next",
        shared_expert_gate=g("model_type") == "qwen3_next" and bool(shared_hidden),
        max_seq_len=int(g("max_position_embeddings") or 0))  # ndtrain's HF import sets max_seq_len to it


_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next")  # transformers models with q / k RMSNorms


def load_model_spec(source: str) -> tuple[ModelSpec, int]:
    """A spec from a preset name / YAML path / HF ``config.json`` path or directory.

    Returns (spec, default sequence length: the preset's ``data.seq_len`` or 4096 for HF configs).
    Raises ValueError when the source is neither.
    """
    path = Path(source)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        cfg = json.loads(path.read_text())
        seq = int(cfg.get("max_position_embeddings") or 4096)
        return from_hf_config(cfg, name=path.parent.name or path.stem), min(seq, 4096)
    from ndtrain.config import ConfigError, load_config

    try:
        cfg = load_config(source)
    except ConfigError as e:
        raise ValueError(f"model {source!r}: not a HF config.json and not a preset ({e})") from None
    return from_model_config(cfg.model, name=Path(source).stem), cfg.data.seq_len


def estimate_training_flops(n_params: float, tokens: float) -> float:
    """C = 6 N D: forward 2 N D plus backward 4 N D FLOPs (Kaplan et al. 2020), attention ignored.

    The seed's examples: an 8B model on a 4 x 4096-token step, 7.9e14 FLOPs; Llama 3 405B on
    15.6T tokens, 3.8e25 FLOPs.
    """
    return 6.0 * n_params * tokens
