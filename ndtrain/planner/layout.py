"""A layout (mesh degrees + per-run knobs) and a workload (sequence, batch, tokens, precision).

Layout strings look like ``"tp=8,cp=1,pp=16,dp_shard=64,dp_replicate=1,ep=1,zero_stage=3,ac=none,
microbatch=1,schedule=1f1b,v=1"``; missing keys take defaults, ``dp_shard=-1`` takes the ranks left
over. Axis order outer to inner is ndtrain's mesh order ``pp, dp_replicate, dp_shard, cp, tp`` (TP
innermost, on the fastest link); ``ep`` borrows ranks from ``dp_shard x cp``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
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
    schedule: str = "1f1b"
    v: int = 1  # virtual stages per rank (interleaved)
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
                 f"ac={self.ac}", f"microbatch={self.microbatch}", f"schedule={self.schedule}",
                 f"v={self.v}"]
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
        sched = f" {self.schedule}" + (f"/v{self.v}" if self.v > 1 else "") if self.pp > 1 else ""
        return " ".join(axes + [dp]) + f" z{self.zero_stage} ac={self.ac} mb{self.microbatch}{sched}"


def parse_layout(text: str) -> Layout:
    """Parse ``"k=v,k=v"``; raises ValueError on unknown keys or bad values."""
    known = {f.name: f.type for f in fields(Layout)}
    aliases = {"mb": "microbatch", "zero": "zero_stage", "virtual_stages": "v", "pp_schedule": "schedule"}
    kw = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"layout item {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        key = aliases.get(key, key)
        if key not in known:
            raise ValueError(f"unknown layout key {key!r}; known: {', '.join(known)}")
        if key in ("ac", "schedule", "cp_impl"):
            kw[key] = value
        else:
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"layout key {key!r} needs an integer, got {value!r}") from None
    return Layout(**kw)


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
    if ac == "sqrt":
        return max(1, round(math.sqrt(n_layers)))
    if ac.startswith("every:"):
        return int(ac[6:])
    return 0


def microbatches(layout: Layout, workload: Workload) -> int:
    """Microbatches per step per data-parallel rank m = global seqs / (dp * microbatch)."""
    return max(1, workload.global_batch_seqs // (layout.dp * layout.microbatch))


def check_layout(spec, gpus: int, workload: Workload, layout: Layout, gpus_per_node: int = 8) -> list[str]:
    """Divisibility and range rules; returns the violated rules (empty list = valid)."""
    errs = []
    lay = layout

    def need(ok, msg):
        if not ok:
            errs.append(msg)

    for k in ("tp", "cp", "pp", "dp_shard", "dp_replicate", "ep", "microbatch", "v"):
        need(getattr(lay, k) >= 1, f"{k} ({getattr(lay, k)}) must be >= 1")
    if errs:
        return errs
    need(lay.world == gpus, f"pp*dp_replicate*dp_shard*cp*tp ({lay.world}) != gpus ({gpus})")
    need(spec.n_heads % lay.tp == 0, f"n_heads ({spec.n_heads}) is not divisible by tp ({lay.tp})")
    g = spec.n_kv_heads
    need(g % lay.tp == 0 or lay.tp % g == 0, f"kv heads ({g}) and tp ({lay.tp}) do not divide")
    need(spec.ffn_hidden % lay.tp == 0, f"ffn_hidden ({spec.ffn_hidden}) is not divisible by tp ({lay.tp})")
    need(lay.cp == 1 or workload.seq_len % (2 * lay.cp) == 0,
         f"seq_len ({workload.seq_len}) is not divisible by 2*cp ({2 * lay.cp}) (load-balanced CP)")
    need(lay.pp <= spec.n_layers, f"pp ({lay.pp}) exceeds n_layers ({spec.n_layers})")
    need(lay.schedule in SCHEDULES, f"schedule ({lay.schedule}) must be one of {SCHEDULES}")
    need(lay.cp_impl in CP_IMPLS, f"cp_impl ({lay.cp_impl}) must be one of {CP_IMPLS}")
    if lay.schedule == "interleaved" and lay.pp > 1:
        # every chunk holds a block, except that the first may hold only the embedding and the
        # last only the head (Llama 3: 126 blocks in 16 x 8 chunks)
        need(lay.pp * lay.v <= spec.n_layers + 2,
             f"pp*v ({lay.pp * lay.v}) exceeds n_layers + 2 ({spec.n_layers + 2})")
    else:
        need(lay.v == 1, f"v ({lay.v}) > 1 needs schedule=interleaved and pp > 1")
    need(lay.zero_stage in (0, 1, 2, 3), f"zero_stage ({lay.zero_stage}) must be 0..3")
    ac = lay.ac
    need(ac in ("none", "full", "sqrt", "selective") or (ac.startswith("every:") and ac[6:].isdigit()
                                                         and int(ac[6:]) >= 1),
         f"ac ({ac}) must be none|full|every:C|sqrt|selective")
    need(workload.global_batch_tokens % workload.seq_len == 0,
         f"global_batch_tokens ({workload.global_batch_tokens}) is not a multiple of seq_len "
         f"({workload.seq_len})")
    seqs = workload.global_batch_seqs
    need(seqs % lay.dp == 0, f"global batch ({seqs} sequences) is not divisible by dp ({lay.dp})")
    need(seqs % lay.dp != 0 or (seqs // lay.dp) % lay.microbatch == 0,
         f"local batch ({seqs // max(lay.dp, 1)}) is not divisible by microbatch ({lay.microbatch})")
    need((lay.dp_shard * lay.cp) % lay.ep == 0,
         f"dp_shard*cp ({lay.dp_shard * lay.cp}) is not divisible by ep ({lay.ep})")
    if lay.ep > 1:
        need(spec.is_moe and spec.n_experts % lay.ep == 0,
             f"ep ({lay.ep}) needs a MoE model whose experts ({spec.n_experts}) it divides")
    need(not lay.seq_parallel or lay.tp > 1, "sequence parallel needs tp > 1")
    return errs
