"""A layout (mesh degrees + per-run knobs) and a workload (sequence, batch, tokens, precision).

Layout strings look like ``"tp=8,cp=1,pp=16,dp_shard=64,dp_replicate=1,ep=1,zero_stage=3,ac=none,
microbatch=1,pp_schedule=1f1b,pp_virtual_stages=1"``; missing keys take defaults, ``dp_shard=-1``
takes the ranks left over. Field names are the config's (``parallel.pp_schedule``...); ``schedule``,
``v`` and ``virtual_stages`` are accepted as short aliases when parsing. Axis order outer to inner is ndtrain's mesh order ``pp, dp_replicate, dp_shard, cp, tp`` (TP
innermost, on the fastest link); ``ep`` borrows ranks from ``dp_shard x cp``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ndtrain.errors import ConfigError
from ndtrain.parallel.ac_policy import every_blocks
from ndtrain.parallel.cp import rules as cp_rules
from ndtrain.parallel.dp import rules as dp_rules
from ndtrain.parallel.ep import rules as ep_rules
from ndtrain.parallel.pp import rules as pp_rules
from ndtrain.parallel.rules import check_activation_checkpoint
from ndtrain.parallel.tp import rules as tp_rules
from ndtrain.parallel.zero import rules as zero_rules

CP_IMPLS = ("ring", "allgather", "ulysses")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_shard: int = -1  # -1: the ranks left over
    dp_replicate: int = 1
    ep: int = 1
    zero_stage: int = 0
    ac: str = "none"  # none | full | every:C | sqrt | selective
    microbatch: int = 1  # sequences per microbatch per rank
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved)
    sp: int = -1  # sequence parallel with TP: 1 / 0; -1 = on when tp > 1
    cp_impl: str = "ring"  # ring | allgather (Llama 3) | ulysses

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def seq_parallel(self) -> bool:
        return self.tp > 1 if self.sp < 0 else bool(self.sp)

    def resolve(self, gpus: int) -> Layout:
        """Fill ``dp_shard=-1`` from the GPU count; raises ValueError if it does not divide."""
        if self.dp_shard != -1:
            return self
        fixed = self.pp * self.dp_replicate * self.cp * self.tp
        if gpus % fixed:
            raise ValueError(f"gpus ({gpus}) is not divisible by pp*dp_replicate*cp*tp ({fixed})")
        return replace(self, dp_shard=gpus // fixed)

    def __str__(self) -> str:
        parts = [f"tp={self.tp}", f"cp={self.cp}", f"pp={self.pp}", f"dp_shard={self.dp_shard}",
                 f"dp_replicate={self.dp_replicate}", f"ep={self.ep}", f"zero_stage={self.zero_stage}",
                 f"ac={self.ac}", f"microbatch={self.microbatch}", f"pp_schedule={self.pp_schedule}",
                 f"pp_virtual_stages={self.pp_virtual_stages}"]
        if self.cp > 1 and self.cp_impl != "ring":
            parts.append(f"cp_impl={self.cp_impl}")
        if self.sp >= 0 and self.sp != (self.tp > 1):
            parts.append(f"sp={self.sp}")
        return ",".join(parts)

    def short(self) -> str:
        """Compact form for tables, e.g. ``TP8 PP16 DP64 z1 ac=none mb1 1f1b``."""
        axes = [f"{n}{getattr(self, k)}" for n, k in (("TP", "tp"), ("CP", "cp"), ("PP", "pp"),
                                                      ("EP", "ep")) if getattr(self, k) > 1]
        dp = f"DP{self.dp}" if self.dp_replicate == 1 else f"DP{self.dp_replicate}x{self.dp_shard}"
        v = self.pp_virtual_stages
        sched = f" {self.pp_schedule}" + (f"/v{v}" if v > 1 else "") if self.pp > 1 else ""
        return " ".join(axes + [dp]) + f" z{self.zero_stage} ac={self.ac} mb{self.microbatch}{sched}"


def parse_layout(text: str) -> Layout:
    """Parse ``"k=v,k=v"``; raises ValueError on unknown keys or bad values."""
    known = {f.name: f.type for f in fields(Layout)}
    aliases = {"mb": "microbatch", "zero": "zero_stage", "virtual_stages": "pp_virtual_stages",
               "v": "pp_virtual_stages", "schedule": "pp_schedule"}
    kw = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"layout item {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        key = aliases.get(key, key)
        if key not in known:
            raise ValueError(f"unknown layout key {key!r}; known: {', '.join(known)}")
        if key in ("ac", "pp_schedule", "cp_impl"):
            kw[key] = value
        else:
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"layout key {key!r} needs an integer, got {value!r}") from None
    return Layout(**kw)


def layout_assumptions(text: str, layout: Layout) -> list[str]:
    """What a ``--layout`` string left to defaults that changes the answer, stated: a data-parallel
    layout without ``zero_stage`` is planned as ndtrain's default, zero_stage=0 (plain DDP)."""
    keys = {item.split("=", 1)[0].strip() for item in text.split(",") if "=" in item}
    if keys & {"zero_stage", "zero"} or layout.dp_shard * layout.cp == 1:
        return []
    n = "the rest" if layout.dp_shard < 0 else f"dp_shard x cp = {layout.dp_shard * layout.cp}"
    msg = (f"zero_stage not given: assuming zero_stage=0 (ndtrain's default, plain DDP: weights, "
           f"gradients and optimizer state replicated over {n} ranks); give zero_stage=1, 2 or 3 to shard them")
    return [msg]


@dataclass(frozen=True)
class Workload:
    """What is trained: ``seq_len`` tokens per sequence T, ``global_batch_tokens`` per optimizer
    step, ``train_tokens`` in total; ``precision`` names the bytes-per-parameter convention of
    ``memory.PRECISIONS``; ``flash`` = FlashAttention (no T x T scores stored)."""

    seq_len: int = 4096
    global_batch_tokens: int = 4 * 2**20
    train_tokens: float = 1e12
    precision: str = "mixed"
    act_bytes: int = 2  # bytes per activation element (bf16)
    flash: bool = True

    @property
    def global_batch_seqs(self) -> int:
        return self.global_batch_tokens // self.seq_len


def ac_every(ac: str, n_layers: int) -> int:
    """The C of ``every:C`` (``sqrt``: C = round(sqrt(L))); 0 for the other policies."""
    return every_blocks(ac, n_layers)  # ndtrain.parallel.ac_policy: the one policy parser


def microbatches(layout: Layout, workload: Workload) -> int:
    """Microbatches per step per data-parallel rank m = global seqs / (dp * microbatch)."""
    return max(1, workload.global_batch_seqs // (layout.dp * layout.microbatch))


def check_layout(spec, gpus: int, workload: Workload, layout: Layout, gpus_per_node: int = 8) -> list[str]:
    """Divisibility and range rules; returns the violated rules (empty list = valid).

    The axis rules are the ones ``ndtrain.validate`` applies to a config (each axis's
    ``ndtrain/parallel/<axis>/rules.py``), so a layout the planner proposes passes validation and
    the other way round; the planner only allows what it models beyond ndtrain's runtime: the
    ``allgather`` CP of Llama 3 (cut like ring) and end pipeline chunks holding only the
    embedding / head."""
    errs = []
    lay = layout

    def need(ok, msg):
        if not ok:
            errs.append(msg)

    def rule(fn, *args, **kw):  # an axis rule: its ConfigError text becomes one violation
        try:
            fn(*args, **kw)
        except ConfigError as e:
            errs.append(str(e))

    for k in ("tp", "cp", "pp", "dp_shard", "dp_replicate", "ep", "microbatch", "pp_virtual_stages"):
        need(getattr(lay, k) >= 1, f"{k} ({getattr(lay, k)}) must be >= 1")
    if errs:
        return errs
    need(lay.world == gpus, f"pp*dp_replicate*dp_shard*cp*tp ({lay.world}) != gpus ({gpus})")
    need(lay.cp_impl in CP_IMPLS, f"cp_impl ({lay.cp_impl}) must be one of {CP_IMPLS}")
    rule(tp_rules.check, lay.tp, spec.n_heads, spec.n_kv_heads, spec.ffn_hidden, lay.seq_parallel)
    rule(cp_rules.check, lay.cp, workload.seq_len, "ulysses" if lay.cp_impl == "ulysses" else "ring",
         "auto", spec.n_heads, lay.tp, lay.seq_parallel)
    rule(pp_rules.check, lay.pp, spec.n_layers, lay.pp_schedule, lay.pp_virtual_stages,
         activation_checkpoint=lay.ac, end_stages_may_hold_no_block=True)
    rule(zero_rules.check, lay.zero_stage)
    rule(ep_rules.check, lay.ep, spec.n_experts if spec.is_moe else 0, lay.dp_shard, lay.cp)
    rule(check_activation_checkpoint, lay.ac, "ac")
    need(workload.global_batch_tokens % workload.seq_len == 0,
         f"global_batch_tokens ({workload.global_batch_tokens}) is not a multiple of seq_len "
         f"({workload.seq_len})")
    rule(dp_rules.check_batch, workload.global_batch_seqs, lay.dp, lay.microbatch)
    return errs
