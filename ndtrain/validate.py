"""Cross-field validation of a ``Config``: the rules every layout must satisfy.

Pure Python, no process groups, so ``ndtrain train`` rejects a bad layout before any process
starts. Each ``ConfigError`` names the rule that failed, with the numbers involved, e.g.
``"n_heads (6) is not divisible by n_kv_heads (4)"``.
"""
from __future__ import annotations

from ndtrain.config import Config, ConfigError


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


_DTYPES = ("float64", "float32", "bfloat16", "float16")
_AC = ("none", "full", "sqrt", "selective")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks; raises ConfigError naming the failed rule. Pure Python, no processes."""
    m, d, t, p = cfg.model, cfg.data, cfg.training, cfg.parallel
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
    _check(t.dtype in _DTYPES, f"training.dtype ({t.dtype}) must be one of {_DTYPES}")
    _check(t.device in ("auto", "cpu", "cuda"), f"training.device ({t.device}) must be auto|cpu|cuda")
    _check(t.steps >= 1, f"training.steps ({t.steps}) must be >= 1")
    _check(t.global_batch_size >= 1, f"training.global_batch_size ({t.global_batch_size}) must be >= 1")
    _check(t.micro_batch_size >= 0, f"training.micro_batch_size ({t.micro_batch_size}) must be >= 0")
    _check(t.schedule in ("cosine", "wsd", "constant"), f"training.schedule ({t.schedule}) unknown")
    _check(0.0 <= t.min_lr_ratio <= 1.0, f"training.min_lr_ratio ({t.min_lr_ratio}) must be in [0, 1]")
    _check(t.warmup_steps >= 0, f"training.warmup_steps ({t.warmup_steps}) must be >= 0")
    _check(t.grad_clip >= 0, f"training.grad_clip ({t.grad_clip}) must be >= 0")
    ac = t.activation_checkpoint
    ok_ac = ac in _AC or (ac.startswith("every:") and ac[6:].isdigit() and int(ac[6:]) >= 1)
    _check(ok_ac, f"training.activation_checkpoint ({ac}) must be none|full|every:C|sqrt|selective")
    _check(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage ({p.zero_stage}) must be 0, 1, 2 or 3")
    _validate_zero(cfg)
    _check(p.cp_impl in ("ring", "ulysses"), f"parallel.cp_impl ({p.cp_impl}) must be ring|ulysses")
    _check(p.pp_schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble"),
           f"parallel.pp_schedule ({p.pp_schedule}) must be gpipe|1f1b|interleaved|zero_bubble")
    _check(p.grad_reduce_dtype in ("float32", "bfloat16"),
           f"parallel.grad_reduce_dtype ({p.grad_reduce_dtype}) must be float32|bfloat16")
    _check(p.bucket_size_bytes > 0, f"parallel.bucket_size_bytes ({p.bucket_size_bytes}) must be > 0")
    _check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last ({cfg.checkpoint.keep_last}) must be >= 1")
    _check(cfg.logging.log_every >= 1, f"logging.log_every ({cfg.logging.log_every}) must be >= 1")
    _validate_tp_cp(cfg)
    _validate_pp(cfg)
    if p.ep > 1:
        _check(m.is_moe, f"parallel.ep ({p.ep}) > 1 needs an MoE model (model.moe_experts > 0)")
        _check(m.moe_experts % p.ep == 0,
               f"moe_experts ({m.moe_experts}) is not divisible by ep ({p.ep})")
    if world_size is not None:
        from ndtrain.mesh import ParallelDims  # local import: mesh imports config

        dims = ParallelDims.from_config(p, world_size)
        dp = dims.dp
        _check(t.global_batch_size % dp == 0,
               f"global_batch_size ({t.global_batch_size}) is not divisible by the data-parallel "
               f"degree dp_replicate*dp_shard ({dp})")
        local = t.global_batch_size // dp
        mb = t.micro_batch_size or local
        _check(local % mb == 0, f"local batch ({local} = global_batch_size / dp) is not divisible by "
                                f"micro_batch_size ({mb})")
        n_micro = p.pp_microbatches or local // mb
        _check(p.pp == 1 or n_micro <= local,
               f"pp_microbatches ({n_micro}) exceeds the local batch ({local} sequences = "
               f"global_batch_size / dp): every microbatch needs >= 1 sequence")


def _validate_zero(cfg: Config) -> None:
    """Rules for ZeRO / FSDP and mixed precision (see ``docs/sharded_data_parallel.md``)."""
    t = cfg.training
    # tp / cp compose (tests/parallel/test_3d.py): TP shards are what ZeRO shards; pp composes
    # (tests/parallel/test_4d.py): each stage shards its own parameters over dp_shard x cp
    if t.dtype == "float16":
        _check(t.loss_scale_init > 0, f"training.loss_scale_init ({t.loss_scale_init}) must be > 0")
        _check(t.loss_scale_growth_interval >= 1,
               f"training.loss_scale_growth_interval ({t.loss_scale_growth_interval}) must be >= 1")


def _validate_moe_mla_mtp(cfg: Config) -> None:
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
    p = cfg.parallel  # combinations not implemented yet: rejected rather than silently wrong
    _check(not (m.is_moe and p.tp > 1), f"MoE layers with tp ({p.tp}) > 1 are not implemented "
                                        "(experts are not tensor-parallel)")
    _check(not (m.attention == "mla" and (p.tp > 1 or p.cp > 1)),
           f"attention=mla with tp ({p.tp}) or cp ({p.cp}) > 1 is not implemented")
    _check(not (m.mtp_depth and (p.tp > 1 or p.cp > 1)),
           f"mtp_depth > 0 with tp ({p.tp}) or cp ({p.cp}) > 1 is not implemented")
    _check(not (m.moe_seq_aux_loss_coef > 0 and p.cp > 1),
           f"moe_seq_aux_loss_coef > 0 with cp ({p.cp}) > 1 is not implemented (a cp rank sees part of "
           "each sequence; the per-sequence loads would need a cp all-reduce)")
    _check(not ((m.is_moe or m.mtp_depth) and p.pp > 1),
           f"MoE / MTP models with pp ({p.pp}) > 1 are not implemented (aux / MTP losses of every stage)")
    _check(not (p.ep > 1 and p.zero_stage > 0),
           f"parallel.ep ({p.ep}) > 1 with zero_stage ({p.zero_stage}) > 0 is not implemented")


def _validate_pp(cfg: Config) -> None:
    """Rules for pipeline parallel (see ``docs/pipeline_parallel.md``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    v = p.pp_virtual_stages
    _check(p.pp_microbatches >= 0, f"parallel.pp_microbatches ({p.pp_microbatches}) must be >= 0")
    _check(v >= 1, f"parallel.pp_virtual_stages ({v}) must be >= 1")
    if p.pp_schedule == "interleaved":
        _check(v >= 2, f"pp_schedule=interleaved needs pp_virtual_stages >= 2 (got {v})")
    else:
        _check(v == 1, f"pp_virtual_stages ({v}) > 1 needs pp_schedule=interleaved (got {p.pp_schedule})")
    if p.pp > 1:
        _check(m.n_layers >= p.pp * v, f"n_layers ({m.n_layers}) < pp * pp_virtual_stages ({p.pp * v}): "
                                       "every pipeline stage needs at least one block")
        _check(not m.is_moe and not m.mtp_depth,
               "pipeline parallel supports dense models without mtp_depth (MoE auxiliary losses and "
               "MTP heads are not carried across stages yet)")
        if p.pp_schedule == "zero_bubble":
            _check(t.activation_checkpoint == "none",
                   "pp_schedule=zero_bubble needs activation_checkpoint=none (its W pass reuses the "
                   "activations its B pass kept)")


def _validate_tp_cp(cfg: Config) -> None:
    """Rules for tensor / sequence / context parallel (see ``docs/tensor_parallel.md`` and
    ``docs/context_parallel.md``)."""
    m, p, T = cfg.model, cfg.parallel, cfg.data.seq_len
    _check(p.cp_layout in ("auto", "load_balanced", "contiguous"),
           f"parallel.cp_layout ({p.cp_layout}) must be auto|load_balanced|contiguous")
    if p.tp > 1:
        _check(m.n_heads % p.tp == 0, f"n_heads ({m.n_heads}) is not divisible by tp ({p.tp})")
        _check(m.kv_heads % p.tp == 0 or p.tp % m.kv_heads == 0,
               f"n_kv_heads ({m.kv_heads}) and tp ({p.tp}): one must divide the other (kv heads are "
               "split when n_kv_heads % tp == 0, replicated when tp % n_kv_heads == 0)")
        _check(m.ffn_dim % p.tp == 0, f"ffn hidden ({m.ffn_dim}) is not divisible by tp ({p.tp})")
    _check(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel needs tp > 1")
    layout = p.cp_layout
    if layout == "auto":
        layout = "load_balanced" if p.cp_impl == "ring" else "contiguous"
    chunks = 2 * p.cp if layout == "load_balanced" else p.cp
    if p.cp > 1:
        _check(p.cp_impl == "ring" or layout == "contiguous",
               "parallel.cp_impl=ulysses needs cp_layout contiguous (or auto)")
        _check(T % chunks == 0, f"seq_len ({T}) is not divisible by the {chunks} chunks of the {layout} "
                                f"cp layout (cp={p.cp})")
        if p.cp_impl == "ulysses":
            _check((m.n_heads // p.tp) % p.cp == 0,
                   f"Ulysses: heads per tp rank (n_heads / tp = {m.n_heads // p.tp}) are not divisible "
                   f"by cp ({p.cp})")
    if p.sequence_parallel:
        _check(T % (p.cp * p.tp) == 0,
               f"sequence parallel: tokens per cp rank (seq_len / cp = {T // p.cp}) are not divisible "
               f"by tp ({p.tp})")
