"""A layout (mesh degrees + per-run knobs) and a workload (sequence, batch, tokens, precision).

Layout strings look like ``"tp=8,cp=1,pp=16,dp_shard=64,dp_replicate=1,ep=1,zero_stage=3,ac=none,
microbatch=1,pp_schedule=1f1b,pp_virtual_stages=1"``; missing keys take defaults, ``dp_shard=-1``
takes the ranks left over. Field names are the config's (``parallel.pp_schedule``...); ``schedule``,
``v`` and ``virtual_stages`` are accepted as short aliases when parsing. Axis order outer to inner is ndtrain's mesh order ``pp, dp_replicate, dp_shard, cp, tp`` (TP
innermost, on the fastest link); ``ep`` borrows ranks from ``dp_shard x cp``, unless ``expert_tp``
>= 1 folds an expert mesh (edp, ep, expert_tp) over each stage's ranks, where ep may span tp ranks
(``fold_rules``, ``ndtrain.mesh.check_expert_mesh``). ``mode`` (compile | kernels | eager) is how the memory-bound ops run
(``exec_mode.py``); ``moe_dispatch`` (flat | hierarchical) how tokens reach remote experts
(``comm.moe_all_to_all``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ndtrain.config.schema import ParallelConfig
from ndtrain.config.validate import ModelFacts, check_axes, seq_len_rule
from ndtrain.errors import ConfigError
from ndtrain.mesh import expert_folded
from ndtrain.mixer_spec import non_softmax_mixers
from ndtrain.parallel.ac_policy import every_blocks
from ndtrain.parallel.cp import rules as cp_rules
from ndtrain.parallel.rules import check_activation_checkpoint
from ndtrain.planner.exec_mode import MODES

DEGREES = ("tp", "cp", "pp", "dp_shard", "dp_replicate", "ep", "microbatch", "pp_virtual_stages")  # each >= 1
CP_IMPLS = ("ring", "allgather", "ulysses")  # allgather (Llama 3): modelled, not in ndtrain's runtime


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_shard: int = -1  # -1: the ranks left over
    dp_replicate: int = 1
    ep: int = 1
    zero_stage: int = 0
    ac: str = "none"  # none | full | every:C | sqrt | selective | op | core_attn | deepseek
    microbatch: int = 1  # sequences per microbatch per rank
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble | dualpipev
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved)
    sp: int = -1  # sequence parallel with TP: 1 / 0; -1 = on when tp > 1
    cp_impl: str = "ring"  # ring | allgather (Llama 3) | ulysses
    mode: str = "compile"  # memory-bound ops: compile (fused) | kernels (Triton norm / SwiGLU) | eager
    # the folded expert mesh (parallel.expert_tp / parallel.edp): -1 = experts split by the attention
    # tp, ep borrowed from dp_shard x cp (the tied mesh); >= 1: each stage's ranks also form an
    # (edp, ep, expert_tp) mesh, expert_tp innermost, so ep may span tp, cp and dp ranks
    expert_tp: int = -1
    edp: int = 0  # expert data-parallel degree (0: derived, ranks per stage / (ep x expert_tp))
    moe_dispatch: str = "flat"  # flat | hierarchical: each token crosses to each remote node once
    # the dispatch under the shared experts' GEMMs: 1 / 0 (parallel.moe_shared_overlap); -1 = modelled
    # on wherever the model has shared experts (DeepSeek-V3 / Megatron runs), not set in the config
    moe_shared_overlap: int = -1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def folded(self) -> bool:
        return self.expert_tp >= 1

    @property
    def etp(self) -> int:
        """The experts' tensor-parallel degree (the attention tp on the tied mesh)."""
        return self.expert_tp if self.folded else self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard: edp (folded), else dp x cp / ep."""
        if self.folded:
            return self.edp or max(1, self.world // (self.pp * self.ep * self.expert_tp))
        return max(1, self.dp * self.cp // self.ep)

    @property
    def expert_shards(self) -> int:
        """ZeRO's shards of one expert shard (the trainer's ``edp_shard``, ``mesh.py``): expert_dp /
        dp_replicate where the trainer folds the expert mesh, else dp_shard x cp / ep."""
        if self.folded and expert_folded(self.ep, self.expert_tp, self.dp_shard, self.cp, self.tp):
            return max(1, self.expert_dp // self.dp_replicate)
        # whole experts (expert_tp 1) whose ep fits in dp_shard x cp: the trainer's tied mesh, the
        # tp ranks holding copies outside the shard group
        return max(1, self.dp_shard * self.cp // self.ep)

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
        if self.mode != "compile":
            parts.append(f"mode={self.mode}")
        if self.folded:
            parts += [f"expert_tp={self.expert_tp}"] + ([f"edp={self.edp}"] if self.edp else [])
        if self.moe_dispatch != "flat":
            parts.append(f"moe_dispatch={self.moe_dispatch}")
        if self.moe_shared_overlap >= 0:
            parts.append(f"moe_shared_overlap={self.moe_shared_overlap}")
        return ",".join(parts)

    def short(self) -> str:
        """Compact form for tables, e.g. ``TP8 PP16 DP64 z1 ac=none mb1 1f1b``."""
        axes = [f"{n}{getattr(self, k)}" for n, k in (("TP", "tp"), ("CP", "cp"), ("PP", "pp"),
                                                      ("EP", "ep")) if getattr(self, k) > 1]
        if self.folded:
            axes.append(f"ETP{self.expert_tp}")
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
        if key in kw:
            raise ValueError(f"layout key {key!r} given twice")
        if key in ("ac", "pp_schedule", "cp_impl", "mode", "moe_dispatch"):
            kw[key] = value
        else:
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"layout key {key!r} needs an integer, got {value!r}") from None
    if not kw:
        raise ValueError(f"empty layout {text!r}: give key=value items, e.g. \"tp=8,pp=4,zero_stage=1\"")
    for key in DEGREES:
        if kw.get(key, 1) < 1 and not (key == "dp_shard" and kw[key] == -1):  # -1: from the GPU count
            raise ValueError(f"{key} ({kw[key]}) must be >= 1" + (" (or -1: the rest of the GPUs)" if key == "dp_shard" else ""))
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
    ``memory.PRECISIONS``; ``flash`` = FlashAttention (no T x T scores stored).; ``moe_*``: expert
    all-to-all knobs (``comm.moe_all_to_all``); ``mttf_hours``, ``checkpoint_*``, ``restart_s``:
    the failure model (``goodput.goodput``); ``memory_model``: whose memory accounting
    (``memory.estimate_memory``)."""

    seq_len: int = 4096
    global_batch_tokens: int = 4 * 2**20
    train_tokens: float = 1e12
    precision: str = "mixed"
    act_bytes: int = 2  # bytes per activation element (bf16)
    flash: bool = True
    moe_max_nodes: int = 0  # node-limited routing: a token's experts span <= this many nodes (0: any)
    moe_fp8_dispatch: bool = False  # dispatch all-to-all in fp8 (1 byte + scales), combine in bf16
    moe_imbalance: float = 1.0  # tokens of the busiest expert rank / the mean (>= 1)
    mttf_hours: float = 0.0  # mean time to failure of one GPU, hours (0: Llama 3's record, goodput.py)
    checkpoint_save_s: float = 0.0  # seconds to save a checkpoint (0: modelled from its bytes)
    checkpoint_load_s: float = 0.0  # seconds to load it after a restart (0: modelled)
    restart_s: float = -1.0  # seconds from an interruption to the relaunched job (< 0: goodput.RESTART_S)
    memory_model: str = "fused"  # fused (fused-kernel GPU training) | trainer (ndtrain's eager modules: trainer_memory)
    fused_loss: bool = False  # training.fused_loss: chunked head + cross entropy, never the full logits

    @property
    def global_batch_seqs(self) -> int:
        return self.global_batch_tokens // self.seq_len


def ac_every(ac: str, n_layers: int) -> int:
    """The C of ``every:C`` (``sqrt``: C = round(sqrt(L))); 0 for the other policies."""
    return every_blocks(ac, n_layers)  # ndtrain.parallel.ac_policy: the one policy parser


def microbatches(layout: Layout, workload: Workload) -> int:
    """Microbatches per step per data-parallel rank m = global seqs / (dp * microbatch)."""
    return max(1, workload.global_batch_seqs // (layout.dp * layout.microbatch))


def model_facts(spec):
    """The facts the axis rules read (``ndtrain.config.validate.ModelFacts``) from a planner spec."""
    return ModelFacts(spec.n_heads, spec.n_kv_heads, spec.ffn_hidden, spec.n_layers,
                      spec.n_experts if spec.is_moe else 0, spec.kv_lora_rank > 0, spec.mtp_depth,
                      spec.moe_seq_aux_loss, spec.moe_capacity,
                      non_softmax_mixers(spec.mixers) if spec.mixers else (),
                      cp_rules.left_context(spec.mixers) if spec.mixers else 0, spec.mixers)


def _spans_tp(lay: Layout) -> bool:
    """The folded expert group reaches beyond dp_shard x cp (EP spans tp ranks, or edp is set)."""
    return lay.folded and (lay.edp > 0 or (lay.dp_shard * lay.cp) % lay.ep != 0)


def runtime_lacks(lay: Layout) -> list[str]:
    """Keys the layout needs that this ndtrain's ``ParallelConfig`` does not have yet: ``edp`` for an
    expert mesh folded over tp ranks, ``moe_dispatch`` for hierarchical dispatch."""
    have = {f.name for f in fields(ParallelConfig)}
    need = (["edp"] if _spans_tp(lay) else []) + (["moe_dispatch"] if lay.moe_dispatch != "flat" else [])
    return [k for k in need if k not in have]


def parallel_config(lay: Layout) -> ParallelConfig:
    """The ``parallel`` section of a config running ``lay`` (field names are the config's). An expert
    mesh over tp ranks a config without ``edp`` cannot express is checked with ep = 1 here; the tied
    mesh passes ``expert_tp = tp`` (experts split over the attention tp, as the planner costs them)."""
    have, lacks = {f.name for f in fields(ParallelConfig)}, runtime_lacks(lay)
    extra = {"expert_tp": lay.expert_tp if lay.folded else lay.tp}
    extra.update({k: getattr(lay, k) for k in ("edp", "moe_dispatch") if k in have and k not in lacks
                  and getattr(lay, k) != getattr(Layout, k)})
    ep = 1 if "edp" in lacks else lay.ep
    if lay.moe_shared_overlap >= 0:  # the trainer's own rule checks it (ep > 1, shared experts)
        extra["moe_shared_overlap"] = bool(lay.moe_shared_overlap)
    return ParallelConfig(dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp, tp=lay.tp,
                          pp=lay.pp, ep=ep, zero_stage=lay.zero_stage,
                          sequence_parallel=lay.seq_parallel, cp_impl=lay.cp_impl,
                          pp_schedule=lay.pp_schedule, pp_virtual_stages=lay.pp_virtual_stages, **extra)


def fold_rules(spec, lay: Layout) -> list[str]:
    """The arithmetic of the folded expert mesh and of the dispatch (empty: valid): ep x expert_tp x
    edp fill each stage's ranks, ep divides the experts and expert_tp their hidden width."""
    errs = []
    if lay.moe_dispatch not in ("flat", "hierarchical"):
        errs.append(f"moe_dispatch ({lay.moe_dispatch}) must be flat or hierarchical")
    if not lay.folded:
        return errs + ([f"edp ({lay.edp}) needs expert_tp >= 1 (the folded expert mesh)"] if lay.edp else [])
    if not spec.is_moe:
        errs.append("expert_tp (the folded expert mesh) needs a MoE model")
    elif spec.n_experts % lay.ep or spec.moe_ffn_hidden % lay.expert_tp:
        errs.append(f"ep ({lay.ep}) must divide the experts ({spec.n_experts}) and expert_tp ({lay.expert_tp}) "
                    f"their hidden width ({spec.moe_ffn_hidden})")
    # the mesh's own arithmetic (ep x expert_tp x edp = a stage's ranks) is the trainer's rule, run by
    # check_axes (ndtrain.mesh.check_expert_mesh)
    return errs


def config_overrides(lay: Layout, workload: Workload) -> dict:
    """Dotted config overrides (``--set key=value``) that make ``ndtrain train`` run ``lay`` on
    ``workload``: the parallel section, the batch in sequences, microbatch and checkpointing."""
    par = parallel_config(lay)
    out = {f"parallel.{f.name}": getattr(par, f.name) for f in fields(par)
           if getattr(par, f.name) != getattr(ParallelConfig, f.name, None)}
    if lay.mode == "kernels":  # ndtrain's Triton RMSNorm / SwiGLU (compile and eager: the run's own flags)
        out["training.kernels"] = "triton"
    out.update({"data.seq_len": workload.seq_len, "training.global_batch_size": workload.global_batch_seqs,
                "training.micro_batch_size": lay.microbatch, "training.activation_checkpoint": lay.ac})
    return out


def check_layout(spec, gpus: int, workload: Workload, layout: Layout, gpus_per_node: int = 8,
                 runtime: bool = True) -> list[str]:
    """The violated rules (empty list = valid): the degrees multiply to ``gpus``, then
    ``ndtrain.config.validate.check_axes`` -- the very function the trainer's validation calls -- with the
    model's MoE / MLA / MTP facts, so a layout that passes here passes ``ndtrain train``'s
    validation. ``runtime=False``: only the arithmetic rules (what the planner can model; see
    ``check_axes``); ``unsupported_rules`` names what such a layout lacks in ndtrain."""
    lay = layout
    for k in DEGREES:
        if getattr(lay, k) < 1:
            return [f"{k} ({getattr(lay, k)}) must be >= 1"]
    errs = []
    if lay.world != gpus:
        errs.append(f"pp*dp_replicate*dp_shard*cp*tp ({lay.world}) != gpus ({gpus})")
    if workload.global_batch_tokens % workload.seq_len:
        errs.append(f"global_batch_tokens ({workload.global_batch_tokens}) is not a multiple of seq_len "
                    f"({workload.seq_len})")
    if lay.pp_schedule == "dualpipev" and lay.pp_virtual_stages != 1:
        errs.append("pp_schedule=dualpipev holds 2 chunks per rank by construction: pp_virtual_stages must be 1")
    if runtime and spec.max_seq_len and workload.seq_len > spec.max_seq_len:  # the model can, the trainer will not
        errs.append(seq_len_rule(workload.seq_len, spec.max_seq_len))
    if lay.cp_impl not in CP_IMPLS:
        errs.append(f"cp_impl ({lay.cp_impl}) must be one of {CP_IMPLS}")
    if lay.mode not in MODES:
        errs.append(f"mode ({lay.mode}) must be one of {MODES}")
    errs += fold_rules(spec, lay)
    if runtime and runtime_lacks(lay):
        errs.append(f"parallel.{', parallel.'.join(runtime_lacks(lay))}: not in this ndtrain's config yet "
                    "(an expert mesh folded over tp ranks / hierarchical dispatch)")
    try:
        check_activation_checkpoint(lay.ac, "ac")
        check_axes(model_facts(spec), parallel_config(lay), workload.seq_len, lay.ac, dp=lay.dp,
                   global_batch_size=workload.global_batch_seqs, micro_batch_size=lay.microbatch,
                   runtime=runtime)
    except ConfigError as e:
        errs.append(str(e))
    return errs


def unsupported_rules(spec, gpus: int, workload: Workload, layout: Layout) -> list[str]:
    """For a layout the planner can model (``check_layout(..., runtime=False)`` passes): the rule
    of ``ndtrain train``'s validation it breaks (empty list: ndtrain runs it)."""
    return check_layout(spec, gpus, workload, layout, runtime=True)
