"""Cross-field validation of a ``Config``: the rules every layout must satisfy.

Pure Python, no process groups, so ``ndtrain train`` rejects a bad layout before any process
starts. Each ``ConfigError`` names the rule that failed, with the numbers involved, e.g.
``"n_heads (6) is not divisible by n_kv_heads (4)"``. The layout rules of each parallel axis live
in that axis's ``ndtrain/parallel/<axis>/rules.py`` (``check``), shared with the planner's
feasibility check; this module holds the model / training rules and calls the axis checks.

Imports: ``ndtrain.errors`` and ``ndtrain.mesh`` only, never ``ndtrain.config`` (which calls
``validate`` from ``load_config``), so config, validate and mesh form no import cycle; ``cfg`` is
typed by name only.
"""
from __future__ import annotations

from ndtrain.errors import ConfigError, require
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.cp import rules as cp_rules
from ndtrain.parallel.dp import rules as dp_rules
from ndtrain.parallel.ep import rules as ep_rules
from ndtrain.parallel.pp import rules as pp_rules
from ndtrain.parallel.rules import check_activation_checkpoint
from ndtrain.parallel.tp import rules as tp_rules
from ndtrain.parallel.zero import rules as zero_rules

__all__ = ["ConfigError", "check_activation_checkpoint", "validate"]

_check = require
_DTYPES = ("float64", "float32", "bfloat16", "float16")


def validate(cfg: Config, world_size: int | None = None) -> None:  # noqa: F821 (typed by name)
    """Cross-field checks; raises ConfigError naming the failed rule. Pure Python, no processes."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    for name in ("vocab_size", "dim", "n_layers", "n_heads"):
        _check(getattr(m, name) > 0, f"model.{name} ({getattr(m, name)}) must be positive")
    _check(m.dim % m.n_heads == 0, f"dim ({m.dim}) is not divisible by n_heads ({m.n_heads})")
    _check(m.n_kv_heads >= 0, f"n_kv_heads ({m.n_kv_heads}) must be >= 0")
    _check(m.n_heads % m.kv_heads == 0,
           f"n_heads ({m.n_heads}) is not divisible by n_kv_heads ({m.kv_heads})")
    _validate_moe_mla_mtp(cfg)
    _check(m.rope_dim % 2 == 0 and m.rope_dim > 0,
           f"RoPE dims per head ({m.rope_dim}; head_dim = dim / n_heads, or mla_rope_dim) must be even and > 0")
    _check(d.seq_len >= 1, f"data.seq_len ({d.seq_len}) must be >= 1")
    _check(d.seq_len <= m.max_seq_len,
           f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    _check(0.0 < d.val_fraction < 0.5, f"data.val_fraction ({d.val_fraction}) must be in (0, 0.5)")
    _validate_training(cfg)
    _check(p.grad_reduce_dtype in ("float32", "bfloat16"),
           f"parallel.grad_reduce_dtype ({p.grad_reduce_dtype}) must be float32|bfloat16")
    _check(p.bucket_size_bytes > 0, f"parallel.bucket_size_bytes ({p.bucket_size_bytes}) must be > 0")
    c = cfg.checkpoint
    _check(c.keep_last >= 1, f"checkpoint.keep_last ({c.keep_last}) must be >= 1")
    _check(not (c.load_from and c.init_weights_from),
           "checkpoint.load_from (resume another run: weights, optimizer, schedule, step) and "
           "checkpoint.init_weights_from (weights only, step 0) exclude each other")
    _check(cfg.logging.log_every >= 1, f"logging.log_every ({cfg.logging.log_every}) must be >= 1")
    _validate_axes(cfg, world_size)


def _validate_training(cfg) -> None:
    t = cfg.training
    _check(t.dtype in _DTYPES, f"training.dtype ({t.dtype}) must be one of {_DTYPES}")
    _check(t.device in ("auto", "cpu", "cuda"), f"training.device ({t.device}) must be auto|cpu|cuda")
    _check(t.steps >= 1, f"training.steps ({t.steps}) must be >= 1")
    _check(t.global_batch_size >= 1, f"training.global_batch_size ({t.global_batch_size}) must be >= 1")
    _check(t.micro_batch_size >= 0, f"training.micro_batch_size ({t.micro_batch_size}) must be >= 0")
    _check(t.schedule in ("cosine", "wsd", "constant"), f"training.schedule ({t.schedule}) unknown")
    _check(0.0 <= t.min_lr_ratio <= 1.0, f"training.min_lr_ratio ({t.min_lr_ratio}) must be in [0, 1]")
    _check(t.warmup_steps >= 0, f"training.warmup_steps ({t.warmup_steps}) must be >= 0")
    _check(t.grad_clip >= 0, f"training.grad_clip ({t.grad_clip}) must be >= 0")
    check_activation_checkpoint(t.activation_checkpoint)
    if t.dtype == "float16":  # dynamic loss scaling (ndtrain.precision)
        _check(t.loss_scale_init > 0, f"training.loss_scale_init ({t.loss_scale_init}) must be > 0")
        _check(t.loss_scale_growth_interval >= 1,
               f"training.loss_scale_growth_interval ({t.loss_scale_growth_interval}) must be >= 1")


def _validate_axes(cfg, world_size: int | None) -> None:
    """Each axis's own ``check`` (``ndtrain/parallel/<axis>/rules.py``), then the world-size rules."""
    m, p, t, T = cfg.model, cfg.parallel, cfg.training, cfg.data.seq_len
    zero_rules.check(p.zero_stage, m.mtp_depth)
    tp_rules.check(p.tp, m.n_heads, m.kv_heads, m.ffn_dim, p.sequence_parallel, moe=m.is_moe,
                   mla=m.attention == "mla", mtp=m.mtp_depth > 0)
    cp_rules.check(p.cp, T, p.cp_impl, p.cp_layout, m.n_heads, p.tp, p.sequence_parallel,
                   mla=m.attention == "mla", mtp=m.mtp_depth > 0, seq_aux_loss=m.moe_seq_aux_loss_coef > 0,
                   capacity=m.is_moe and m.moe_capacity_factor > 0)
    pp_rules.check(p.pp, m.n_layers, p.pp_schedule, p.pp_virtual_stages, p.pp_microbatches,
                   t.activation_checkpoint, moe=m.is_moe, mtp=m.mtp_depth > 0)
    ep_rules.check(p.ep, m.moe_experts, zero_stage=p.zero_stage)
    if world_size is not None:
        dims = ParallelDims.from_config(p, world_size)  # checks the degrees multiply to world_size
        dp_rules.check_batch(t.global_batch_size, dims.dp, t.micro_batch_size, p.pp, p.pp_microbatches)


def _validate_moe_mla_mtp(cfg) -> None:
    """Rules for the MoE / MLA / MTP fields of ``cfg.model`` (see ``docs/moe.md``)."""
    m = cfg.model
    _check(m.moe_experts >= 0, f"model.moe_experts ({m.moe_experts}) must be >= 0")
    if m.is_moe:
        e, k = m.moe_experts, m.moe_top_k
        _check(1 <= k <= min(8, e), f"moe_top_k ({k}) must be in 1..min(8, moe_experts={e})")
        _check(m.moe_score in ("softmax", "sigmoid"), f"moe_score ({m.moe_score}) must be softmax|sigmoid")
        _check(m.moe_shared_experts >= 0, f"moe_shared_experts ({m.moe_shared_experts}) must be >= 0")
        _check(m.moe_ffn_hidden >= 0, f"moe_ffn_hidden ({m.moe_ffn_hidden}) must be >= 0")
        _check(m.moe_capacity_factor >= 0, f"moe_capacity_factor ({m.moe_capacity_factor}) must be >= 0")
        for name in ("moe_aux_loss_coef", "moe_seq_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate"):
            _check(getattr(m, name) >= 0, f"model.{name} ({getattr(m, name)}) must be >= 0")
        _check(m.moe_aux_scope in ("microbatch", "global"),
               f"moe_aux_scope ({m.moe_aux_scope}) must be microbatch|global")
        g, tg = m.moe_n_groups, m.moe_topk_groups
        _check(g >= 1 and e % g == 0, f"moe_experts ({e}) is not divisible by moe_n_groups ({g})")
        _check(1 <= tg <= g, f"moe_topk_groups ({tg}) must be in 1..moe_n_groups ({g})")
        _check(k <= tg * (e // g), f"moe_top_k ({k}) exceeds the experts in moe_topk_groups groups "
                                   f"({tg} x {e // g})")
        _check(0 <= m.moe_layer_start < m.n_layers,
               f"moe_layer_start ({m.moe_layer_start}) must be in 0..n_layers-1 ({m.n_layers - 1})")
        _check(m.moe_layer_interleave >= 1, f"moe_layer_interleave ({m.moe_layer_interleave}) must be >= 1")
    _check(m.attention in ("mha", "mla"), f"model.attention ({m.attention}) must be mha|mla")
    if m.attention == "mla":
        _check(m.mla_kv_rank > 0, f"attention=mla needs mla_kv_rank > 0 (got {m.mla_kv_rank})")
        for name in ("mla_q_rank", "mla_nope_dim", "mla_v_dim"):
            _check(getattr(m, name) >= 0, f"model.{name} ({getattr(m, name)}) must be >= 0")
    _check(m.mtp_depth >= 0, f"model.mtp_depth ({m.mtp_depth}) must be >= 0")
    _check(m.mtp_loss_weight >= 0, f"model.mtp_loss_weight ({m.mtp_loss_weight}) must be >= 0")
    _check(m.mtp_depth < cfg.data.seq_len,
           f"mtp_depth ({m.mtp_depth}) must be < data.seq_len ({cfg.data.seq_len})")
