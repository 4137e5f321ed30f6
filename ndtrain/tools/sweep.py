"""Configuration sweep: model features x ZeRO stage x layout x activation checkpointing x dtype x
fused loss.

Each combination (``Combo``) is first validated the way ``ndtrain train`` validates it
(``load_config("debug", overrides, world_size)``, no processes). A rejected combination records the
rule (the ``ConfigError`` text). A validated one is trained for ``STEPS`` steps on a tiny model with
fixed batches (``global_batch``) and its per-step losses are compared with the single-process run
of the same model config (``sweep_groups.reference``): in float64 they must agree to ``RTOL`` relative, in
float32 to ``TOLERANCE["float32"]``; bf16 / fp16 can only be checked for running with a finite loss
(their roundoff, ~1e-3 to 1e-2 here, is as large as the faults the sweep looks for).
``ndtrain.tools.sweep_groups`` runs the combinations on gloo process groups and judges them
(``compare``); ``scripts/sweep.py`` writes ``docs/compatibility.md``.

Tolerance ``RTOL = 1e-9`` (float64): a layout only reorders floating-point sums (all-reduces,
reduce-scatters, split matmuls, online-softmax merges), each term off by ~1e-16 relative, so 2 steps
stay near 1e-14 (``tests/parallel/layout_parity.py`` sees ~1e-13 after 10 steps); a real fault (a
missed reduction, a wrong scale, a misrouted token, a wrong mask) moves the loss or the gradient norm
by far more than 1e-6. The gradient norm before clipping is compared too, and so are the MoE
auxiliary and MTP losses, so a wrong gradient shows up at step 1 already. float32 (unit roundoff
6e-8): the full sweep saw at most 3e-7 over every float32 combination that composes, so 1e-5 keeps a
30x margin and still catches the smallest fault found (5e-3).
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import asdict, dataclass

import torch

from ndtrain.config import Config, ConfigError, apply_overrides, load_config, validate
from ndtrain.parallel.ac_policy import example_policies
from ndtrain.tools.sweep_folded import FOLDED, folded_name
from ndtrain.tools.sweep_layouts import expert_tp_layouts, hierarchical_layouts
from ndtrain.tools.sweep_subset import SUBSET  # the default suite's share (re-exported)

STEPS = 2  # optimizer steps per combination
V, T, G = 65, 16, 4  # vocab (odd: tp pads it), tokens per sequence, global batch (sequences)
RTOL = 1e-9  # float64 parity (see module docstring)
TOLERANCE = {"float64": RTOL, "float32": 1e-5}  # dtypes checked against the reference, relative
COMPARED = ("loss", "grad_norm", "aux_loss", "mtp_loss")  # per-step values checked against the reference

# Tiny model shared by every feature: GQA (4 query, 2 kv heads), 4 blocks so pp4 and interleaved pp2
# have a block per stage. Each feature changes only what it names (bias update, aux and z losses on:
# their global statistics are what layouts get wrong).
BASE_MODEL = {"vocab_size": V, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48,
              "max_seq_len": 64, "rope_theta": 10000.0, "tie_embeddings": False, "moe_experts": 0,
              "attention": "mha", "mtp_depth": 0, "layer_pattern": ""}
_MLA = {"attention": "mla", "mla_q_rank": 16, "mla_kv_rank": 16, "mla_rope_dim": 4, "mla_nope_dim": 8,
        "mla_v_dim": 8}
_MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_ffn_hidden": 16, "moe_aux_loss_coef": 0.01,
        "moe_z_loss_coef": 0.001, "moe_bias_update_rate": 0.01}
FEATURES: dict[str, dict] = {
    "dense": {}, "tied": {"tie_embeddings": True}, "moe": _MOE, "mla": _MLA, "mtp": {"mtp_depth": 1},
    # one layer of each linear-family mixer, then softmax attention: linear (elu+1, Katharopoulos
    # 2020), Mamba-2 (Dao & Gu 2024; 2 B / C groups so tp2 splits them), Gated DeltaNet (Yang et al.
    # 2024; 2 key, 4 value heads); chunk 3 divides neither the 8 nor the 4 tokens of a cp rank, so
    # chunk and cp boundaries disagree (state passing must not care). Sliding-window and DSA layers
    # are not in the sweep (tests/parallel/test_mixers_cp.py covers the window under cp)
    "hybrid": {"layer_pattern": "LMGA", "linear_chunk_size": 3, "linear_heads": 2, "linear_key_head_dim": 8,
               "linear_value_heads": 4, "linear_value_head_dim": 8, "mamba_state_dim": 8, "mamba_head_dim": 8,
               "mamba_groups": 2},
    # DeepSeek-V3's combination (MLA + MoE + MTP: the MTP depth's MoE layer under cp masks its padded
    # tail); its parts have the full product, the combination only the representative layouts
    "deepseek": {**_MLA, **_MOE, "mtp_depth": 1},
    # a shared expert beside the routed ones (DeepSeekMoE); its expert-parallel layouts run again
    # with the shared expert under the dispatch all-to-all (parallel.moe_shared_overlap)
    "moe_shared": {**_MOE, "moe_shared_experts": 1},
    "moe_balanced": {**_MOE, "training.moe_routing": "balanced"},  # benchmark routing: by position, any layout
    "lora": {"finetune.lora_rank": 4, "finetune.lora_targets": "*.wq,*.wk,*.wv,*.wo,*.w1,*.w2,*.w3"},  # base frozen
    "muon": {"training.optimizer": "muon"},  # Muon on the hidden matrices (ndtrain.parallel.muon)
}
# packed documents (``global_documents``): sliding window, Mamba-2, Gated DeltaNet and softmax layers
FEATURES["packed"] = {**FEATURES["hybrid"], "layer_pattern": "SMGA", "swa_window": 3}
FEATURE_DATA: dict[str, dict] = {"packed": {"document_mask": True}}  # data.* overrides of a feature
# features crossed with every layout of the layout tier; the others only with REPRESENTATIVE there
FULL_PRODUCT = ("dense", "tied", "moe", "mla", "mtp", "hybrid")
# micro batch 1: every layout cuts the global batch into the same microbatches (the MoE Switch loss
# is computed per microbatch); clipping at 0.05 is active, so the global gradient norm matters
TRAINING = {"steps": STEPS, "global_batch_size": G, "micro_batch_size": 1, "lr": 1e-2, "warmup_steps": 1,
            "grad_clip": 0.05}
ZERO_STAGES = (0, 1, 2, 3)
AC_POLICIES = example_policies()  # ndtrain.parallel.ac_policy: the one list
DTYPES = ("float64", "float32", "bfloat16", "float16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev")
# uneven pp_layouts on pp2 (4 blocks): the embedding alone (1F1B); embedding and head alone (Llama 3)
PP_LAYOUTS = ({"pp_schedule": "1f1b", "pp_virtual_stages": 1, "pp_layout": "E|t*4,L"},
              {"pp_schedule": "interleaved", "pp_virtual_stages": 2, "pp_layout": "E|t*3|t|L"})


@dataclass(frozen=True)
class Combo:
    """One point of the sweep. ``par``: the parallel overrides (degrees, cp_impl, sp, schedule)."""

    feature: str
    layout: str  # readable name of ``par`` (``layout_name``)
    world: int
    par: tuple = ()  # sorted (key, value) pairs of parallel.* overrides
    zero: int = 0
    ac: str = "none"
    dtype: str = "float64"
    tier: str = "layout"  # which part of the sweep generated it (see ``enumerate_combos``)
    fused: bool = False  # training.fused_loss (output head + cross-entropy, chunked)
    extra: tuple = ()  # sorted ("section.key", value) overrides beyond the above (resume sweep)

    @property
    def key(self) -> str:
        return (f"{self.feature} | {self.layout} | zero{self.zero} | ac={self.ac} | {self.dtype}"
                + (" | fused_loss" if self.fused else "")
                + "".join(f" | {k.split('.', 1)[1]}={_fmt(v)}" for k, v in self.extra))

    def overrides(self) -> dict:
        """``section.key`` overrides of the ``debug`` preset for this combination."""
        out = {k if "." in k else f"model.{k}": v for k, v in {**BASE_MODEL, **FEATURES[self.feature]}.items()}
        out.update({f"training.{k}": v for k, v in TRAINING.items()})
        out.update({"training.dtype": self.dtype, "training.activation_checkpoint": self.ac,
                    "training.fused_loss": self.fused, "data.seq_len": T, "parallel.zero_stage": self.zero,
                    "parallel.dp_shard": -1, "parallel.bucket_size_bytes": 4096})
        out.update({f"parallel.{k}": v for k, v in self.par})
        out.update({f"data.{k}": v for k, v in FEATURE_DATA.get(self.feature, {}).items()})
        out.update(dict(self.extra))
        return out

    def command(self) -> str:
        """The ``ndtrain train`` command line of this combination (debug preset's corpus)."""
        extra = {"model.n_layers": BASE_MODEL["n_layers"],  # the debug preset has 2: too few for pp4
                 **{k if "." in k else f"model.{k}": v for k, v in FEATURES[self.feature].items()},
                 **{f"parallel.{k}": v for k, v in self.par},
                 **{f"data.{k}": v for k, v in FEATURE_DATA.get(self.feature, {}).items()}, **dict(self.extra)}
        if self.zero:
            extra["parallel.zero_stage"] = self.zero
        if self.ac != "none":
            extra["training.activation_checkpoint"] = self.ac
        if self.dtype != "float32":  # the debug preset's dtype
            extra["training.dtype"] = self.dtype
        if self.fused:
            extra["training.fused_loss"] = True
        args = " ".join(f"--{k}={_fmt(v)}" for k, v in extra.items())
        return f"ndtrain train --config debug --nproc {self.world} {args}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Combo:
        """Inverse of ``to_dict`` after a JSON round trip (lists back to tuples)."""
        return cls(**{**d, "par": tuple(tuple(p) for p in d["par"]),
                      "extra": tuple(tuple(p) for p in d.get("extra", ()))})


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@functools.lru_cache(maxsize=1)
def _debug_preset() -> Config:
    return load_config("debug")


def build_config(combo: Combo) -> Config:
    """Validate and return the config of ``combo``; raises ConfigError naming the failed rule.

    The same steps as ``load_config("debug", combo.overrides(), combo.world)`` (what ``ndtrain
    train`` runs before starting any process), with the preset's YAML parsed once: parsing is most
    of the cost of validating thousands of combinations."""
    cfg = copy.deepcopy(_debug_preset())
    apply_overrides(cfg, combo.overrides())
    validate(cfg, combo.world)
    return cfg


def check(combo: Combo) -> str | None:
    """None if ``combo`` passes validation, else the rule that rejected it."""
    try:
        build_config(combo)
    except ConfigError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# layouts


def _variants(deg: dict[str, int]) -> list[dict]:
    """Every implementation choice of a set of degrees: cp ring / ulysses (/ hybrid 2 x 2 at cp 4), tp with / without SP,
    each pp schedule (interleaved with 2 virtual stages), ep dividing dp_shard x cp."""
    cp_opts = [{}] if deg["cp"] == 1 else [{"cp_impl": "ring"}, {"cp_impl": "ulysses"}] + [
        {"cp_impl": "hybrid", "cp_ulysses": 2}] * (deg["cp"] == 4)  # hybrid: all-to-all in pairs, ring across
    tp_opts = [{}] if deg["tp"] == 1 else [{"sequence_parallel": False}, {"sequence_parallel": True}]
    # gpipe runs the 1f1b schedule's operations in another order: crossed with one other axis only
    scheds = PP_SCHEDULES if sum(v > 1 for v in deg.values()) == 1 and deg["pp"] == 2 else PP_SCHEDULES[1:]
    pp_opts = [{}] if deg["pp"] == 1 else [
        {"pp_schedule": s, "pp_virtual_stages": 2 if s == "interleaved" else 1} for s in scheds]
    pp_opts += list(PP_LAYOUTS) if deg["pp"] > 1 and scheds is PP_SCHEDULES else []  # pp2 alone
    borrow = deg["dp_shard"] * deg["cp"]
    ep_opts = [{}] + [{"ep": e} for e in (2, 4) if e <= borrow and borrow % e == 0]
    out = []
    for a, b, c, e in itertools.product(cp_opts, tp_opts, pp_opts, ep_opts):
        out.append({**{k: v for k, v in deg.items() if v > 1}, **a, **b, **c, **e})
    return out


def layout_name(par: dict) -> str:
    """``{"dp_shard": 2, "tp": 2, "sequence_parallel": True}`` -> ``"dp_shard2 x tp2+sp"``; ``+etp``:
    ``expert_tp`` = tp (every expert's hidden split over tp)."""
    parts = []
    for ax in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
        if par.get(ax, 1) > 1:
            s = f"{ax}{par[ax]}"
            if ax == "pp":  # v > 1, and a pp_layout with '/' for '|' (the name is a table cell)
                v, lay = par["pp_virtual_stages"], par.get("pp_layout", "").replace("|", "/")
                s += f":{par['pp_schedule']}" + (f"(v{v})" if v > 1 else "") + (f"[{lay}]" if lay else "")
            tags = (("cp_layout", ""), ("cp_ulysses", "u"))  # e.g. cp2:ring(contiguous), cp4:hybrid(u2)
            s += f":{par['cp_impl']}" + "".join(f"({t}{par[k]})" for k, t in tags if k in par) if ax == "cp" else ""
            s += "+sp" if ax == "tp" and par.get("sequence_parallel") else ""
            etp = par.get("expert_tp", 1) if ax == "tp" else 1
            s += ("+etp" if etp == par[ax] else f"+etp{etp}") if etp > 1 else ""
            s += "+overlap" if ax == "ep" and par.get("moe_shared_overlap") else ""
            s += "+hier" if ax == "ep" and par.get("moe_dispatch") == "hierarchical" else ""  # 1-rank nodes
            parts.append(s)
    return " x ".join(parts + folded_name(par)) or "single"


# world 8 (a few, zero 0 and 3 only: 8 ranks on a small machine are slow): the README's 3-D
# example and 3-axis products the 4-rank grid cannot reach
_PP1 = {"pp": 2, "pp_virtual_stages": 1}
WORLD8 = (
    {**_PP1, "pp_schedule": "1f1b", "dp_shard": 2, "tp": 2, "sequence_parallel": True},
    {"pp": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 2, "dp_shard": 2, "tp": 2},
    {**_PP1, "pp_schedule": "zero_bubble", "dp_shard": 2, "cp": 2, "cp_impl": "ring"},
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": True},
    {"dp_shard": 2, "cp": 2, "cp_impl": "ring", "tp": 2},
    {"dp_shard": 2, "cp": 2, "cp_impl": "ulysses", "tp": 2, "sequence_parallel": True},
    {"dp_replicate": 2, "dp_shard": 4, "ep": 4},
    {"dp_shard": 4, "cp": 2, "cp_impl": "ring", "ep": 4},
)
# the layouts crossed with activation checkpointing and with the other dtypes: one per axis / kind
REPRESENTATIVE = (
    (1, {}), (2, {"dp_shard": 2}), (2, {"dp_replicate": 2}), (2, {"cp": 2, "cp_impl": "ring"}),
    (2, {"cp": 2, "cp_impl": "ulysses"}), (2, {"tp": 2, "sequence_parallel": True}),
    (2, {"pp": 2, "pp_schedule": "1f1b", "pp_virtual_stages": 1}),
    (2, {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 1}), (2, {"dp_shard": 2, "ep": 2}),
)


def enumerate_layouts(max_world: int = 4) -> list[tuple[int, dict]]:
    """(world, parallel overrides) for every assignment of degrees in {1, 2, 4} to pp, dp_replicate,
    dp_shard, cp, tp with product <= ``max_world``, times ``_variants`` (every pp schedule on pp2
    alone; gpipe, the 1f1b schedule in another order, is left out of pp4 and of pp x other axes)."""
    axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    out = []
    for degs in itertools.product((1, 2, 4), repeat=len(axes)):
        world = math.prod(degs)
        if world <= max_world:
            out += [(world, v) for v in _variants(dict(zip(axes, degs)))]
    return sorted(out, key=lambda wv: (wv[0], layout_name(wv[1])))


def feature_layouts(feature: str) -> list[tuple[int, dict]]:
    """The layouts of the layout tier for ``feature``: ``enumerate_layouts`` for ``FULL_PRODUCT``,
    else ``REPRESENTATIVE``; MoE features add their ``expert_tp_layouts`` and ``FOLDED``, and with
    shared experts their ep layouts again with ``moe_shared_overlap``; ``moe`` adds
    ``hierarchical_layouts`` of the unfolded ones."""
    out = enumerate_layouts() if feature in FULL_PRODUCT else list(REPRESENTATIVE)
    base = list(out)
    if FEATURES[feature].get("moe_experts", 0):
        out += expert_tp_layouts(out) + list(FOLDED)
    if FEATURES[feature].get("moe_shared_experts", 0):
        folded = [par for _, par in FOLDED]  # the overlap is run on the borrowed ep layouts
        out += [(w, {**par, "moe_shared_overlap": True}) for w, par in out
                if par.get("ep", 1) > 1 and par not in folded]
    if feature == "moe":
        out += hierarchical_layouts(base)
    return out


TIERS = ("layout", "ac", "dtype", "fused")


def layout_zeros(world: int, par: dict) -> tuple[int, ...]:
    """ZeRO stages a layout of the layout tier is crossed with: 0-3 on 1 and 2 ranks, and on 4 ranks
    where ZeRO-1/2 shard over two groups (expert parallel: experts over edp, the rest over dp;
    HSDP: dp_replicate x dp_shard); {0, 3} on the other 4-rank layouts (ZeRO-1/2 then shard like
    on 2 ranks, and 4 ranks cost about twice as much as 2 on a small machine)."""
    if world <= 2 or "ep" in par or ("dp_replicate" in par and "dp_shard" in par):
        return ZERO_STAGES
    return (0, 3)


def enumerate_combos(tiers: tuple[str, ...] = TIERS) -> list[Combo]:
    """The sweep's product, as the union of four parts (``tier``):

    * ``layout``: every feature of ``FULL_PRODUCT`` x every layout of ``enumerate_layouts`` (world
      1, 2, 4; MoE also with expert_tp = tp) x ``layout_zeros``, plus x ``WORLD8`` x ZeRO {0, 3};
      the other features (combinations of those) x ``REPRESENTATIVE`` x ZeRO 0-3; float64, no
      activation checkpointing;
    * ``ac``: every ``FULL_PRODUCT`` feature x ``REPRESENTATIVE`` x each checkpointing policy x
      ZeRO {0, 3}; float64;
    * ``dtype``: the same features x ``REPRESENTATIVE`` x float32 / bfloat16 / float16 x ZeRO {0, 3};
    * ``fused``: the same features x ``REPRESENTATIVE`` x ZeRO {0, 3} with ``training.fused_loss``;
      float64.
    """
    out = []
    for f in FEATURES:
        if "layout" in tiers:
            out += [make_combo(f, w, par, zero=z) for w, par in feature_layouts(f)
                    for z in (layout_zeros(w, par) if f in FULL_PRODUCT else ZERO_STAGES)]
            if f in FULL_PRODUCT:
                out += [make_combo(f, 8, par, zero=z) for par in WORLD8 for z in (0, 3)]
        if f not in FULL_PRODUCT:
            continue
        for w, par in REPRESENTATIVE:
            if "ac" in tiers:
                out += [make_combo(f, w, par, "ac", zero=z, ac=a) for a in AC_POLICIES[1:] for z in (0, 3)]
            if "dtype" in tiers:
                out += [make_combo(f, w, par, "dtype", zero=z, dtype=d) for d in DTYPES[1:] for z in (0, 3)]
            if "fused" in tiers:
                out += [make_combo(f, w, par, "fused", zero=z, fused=True) for z in (0, 3)]
    return out


def subset_combos() -> list[Combo]:
    return [make_combo(f, w, par, "subset", **kw) for f, w, par, kw in SUBSET]


def make_combo(feature: str, world: int, par: dict, tier: str = "layout", **kw) -> Combo:
    return Combo(feature, layout_name(par), world, tuple(sorted(par.items())), tier=tier, **kw)


# ---------------------------------------------------------------------------------------------
# training one combination (runs inside a rank of a gloo process group, or in one process)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed (G, T) inputs and shifted labels of step ``step``; about a quarter of the labels masked."""
    g = torch.Generator().manual_seed(7000 + step)
    seq = torch.randint(0, V, (G, T + 1), generator=g)
    inputs, labels = seq[:, :-1], seq[:, 1:].clone()
    labels[torch.rand(G, T, generator=g) < 0.25] = -100
    return inputs, labels


def global_documents(step: int) -> torch.Tensor:
    """Fixed (G, T) int32 document ids of step ``step`` (a document starts at ~1 token in 5)."""
    starts = torch.rand(G, T, generator=torch.Generator().manual_seed(9000 + step)) < 0.2
    return (starts & (torch.arange(T) > 0)).cumsum(1, dtype=torch.int32)


def train_steps(cfg: Config, world: int) -> list[dict[str, float]]:
    """Build the layout of ``cfg`` on ``world`` ranks (the process group must exist when world > 1),
    train ``STEPS`` steps on this rank's slice of ``global_batch``; return the per-step values of
    ``COMPARED`` (as this rank sees them)."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.loop import Trainer

    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = dims.build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    dp_rank, local = mesh.group("dp").rank, G // dims.dp
    rows = []
    for s in range(STEPS):
        x, y = global_batch(s)
        sl = slice(dp_rank * local, (dp_rank + 1) * local)
        d = tr.step(x[sl], y[sl], global_documents(s)[sl] if cfg.data.document_mask else None)
        rows.append({k: float(d[k]) for k in COMPARED if k in d})
    return rows
