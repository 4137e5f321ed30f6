"""Cross-field validation of a ``Config``: the rules every layout must satisfy.

Pure Python, no process groups, so ``ndtrain train`` rejects a bad layout before any process
starts. Each ``ConfigError`` names the rule that failed, with the numbers involved, e.g.
``"n_heads (6) is not divisible by n_kv_heads (4)"``. The layout rules of each parallel axis live
in that axis's ``ndtrain/parallel/<axis>/rules.py`` (``check``), shared with the planner's
feasibility check; this module holds the model / training rules and calls the axis checks.

Imports: ``ndtrain.errors`` and the axis rules (torch-free, so the planner imports this module
without torch; ``ndtrain.mesh`` is imported inside ``validate``), never ``ndtrain.config.load`` (which
calls ``validate`` from ``load_config``), so config, validate and mesh form no import cycle;
``cfg`` is typed by name only.
"""
from __future__ import annotations

import fnmatch
import importlib.util
import os
from dataclasses import dataclass

from ndtrain.errors import ConfigError, require
from ndtrain.mixer_spec import MixerFields, check_mixer_layout, check_mixers, non_softmax_mixers
from ndtrain.parallel.cp import rules as cp_rules
from ndtrain.parallel.dp import rules as dp_rules
from ndtrain.parallel.ep import hier_rules
from ndtrain.parallel.ep import rules as ep_rules
from ndtrain.parallel.muon import rules as muon_rules
from ndtrain.parallel.pp import rules as pp_rules
from ndtrain.parallel.rules import check_activation_checkpoint
from ndtrain.parallel.tp import rules as tp_rules
from ndtrain.parallel.zero import rules as zero_rules

__all__ = ["ConfigError", "ModelFacts", "check_activation_checkpoint", "check_axes", "validate"]

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
    _check(not (d.document_mask and m.mtp_depth),
           f"data.document_mask=true with model.mtp_depth ({m.mtp_depth}) > 0: multi-token prediction's "
           f"shifted targets would cross document boundaries (not built)")
    _check(m.rope_dim % 2 == 0 and m.rope_dim > 0,
           f"RoPE dims per head ({m.rope_dim}; head_dim = dim / n_heads, or mla_rope_dim) must be even and > 0")
    _check(d.seq_len >= 1, f"data.seq_len ({d.seq_len}) must be >= 1")
    _check(d.seq_len <= m.max_seq_len, seq_len_rule(d.seq_len, m.max_seq_len))
    _check(0.0 < d.val_fraction < 0.5, f"data.val_fraction ({d.val_fraction}) must be in (0, 0.5)")
    _check(d.format in ("text", "chat"), f"data.format ({d.format}) must be text|chat")
    _check(d.format != "chat" or d.tokenizer != "bpe", "data.format=chat needs data.tokenizer = a tokenizer.json "
           "(its folder's chat template) or bytes: a BPE is trained on text documents, not conversations")
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
    lg = cfg.logging
    _check(lg.progress in ("auto", "rich", "plain"), f"logging.progress ({lg.progress}) must be auto|rich|plain")
    _check(not lg.tensorboard or importlib.util.find_spec("tensorboard") is not None,
           "logging.tensorboard=true needs the tensorboard package (pip install 'ndtrain[tensorboard]')")
    parse_profile_steps(lg.profile_steps)  # "A:B" or ""
    cfg.eval.named_sets()  # "NAME=SOURCE;..." well formed, names unique
    check_mixers(m)  # before anything parses model.layer_pattern
    cp_rules.check_doc_balance(getattr(p, "cp_doc_balance", False), d.document_mask, p.cp, p.cp_impl,
                               cp_rules.resolve_layout(p.cp_impl, p.cp_layout, non_softmax_mixers(m)))
    _validate_block_options(m, cfg.parallel)
    _validate_finetune(cfg)
    _validate_axes(cfg, world_size)


def _validate_training(cfg) -> None:
    t = cfg.training
    _check(t.dtype in _DTYPES, f"training.dtype ({t.dtype}) must be one of {_DTYPES}")
    _check(t.device in ("auto", "cpu", "cuda"), f"training.device ({t.device}) must be auto|cpu|cuda")
    _check(t.steps >= 1, f"training.steps ({t.steps}) must be >= 1")
    _check(t.global_batch_size >= 1, f"training.global_batch_size ({t.global_batch_size}) must be >= 1")
    _check(t.micro_batch_size >= 0, f"training.micro_batch_size ({t.micro_batch_size}) must be >= 0")
    _check(t.schedule in ("cosine", "wsd", "constant"), f"training.schedule ({t.schedule}) unknown")
    _check(t.moe_routing in ("learned", "balanced"), f"training.moe_routing ({t.moe_routing}) must be learned|balanced")
    _check(t.moe_routing == "learned" or cfg.model.is_moe, "training.moe_routing=balanced needs an MoE model (model.moe_experts > 0)")
    _check(0.0 <= t.min_lr_ratio <= 1.0, f"training.min_lr_ratio ({t.min_lr_ratio}) must be in [0, 1]")
    _check(t.warmup_steps >= 0, f"training.warmup_steps ({t.warmup_steps}) must be >= 0")
    _check(t.lr > 0, f"training.lr ({t.lr}) must be > 0")
    _check(0 <= t.stop_at_step <= t.steps, f"training.stop_at_step ({t.stop_at_step}) must be in [0, "
           f"training.steps ({t.steps})]: it pauses the job before its last step (0 = run to the end)")
    _check(t.grad_clip >= 0, f"training.grad_clip ({t.grad_clip}) must be >= 0")
    check_activation_checkpoint(t.activation_checkpoint)
    muon_rules.check(t)
    muon_rules.check_model(cfg)
    _validate_fault(cfg)
    _validate_kernels(t)
    _validate_speed(cfg)
    if t.dtype == "float16":  # dynamic loss scaling (ndtrain.precision)
        _check(t.loss_scale_init > 0, f"training.loss_scale_init ({t.loss_scale_init}) must be > 0")
        _check(t.loss_scale_growth_interval >= 1,
               f"training.loss_scale_growth_interval ({t.loss_scale_growth_interval}) must be >= 1")


def _validate_fault(cfg) -> None:
    """Bad-step / spike rollback, collective timeout and DiLoCo fields (docs/fault_tolerance.md)."""
    t, p = cfg.training, cfg.parallel
    _check(t.max_bad_steps >= 0, f"training.max_bad_steps ({t.max_bad_steps}) must be >= 0")
    _check(t.spike_zscore >= 0, f"training.spike_zscore ({t.spike_zscore}) must be >= 0 (0 = off)")
    _check(t.spike_window >= 2, f"training.spike_window ({t.spike_window}) must be >= 2 (a std needs two losses)")
    _check(p.collective_timeout_s > 0, f"parallel.collective_timeout_s ({p.collective_timeout_s}) must be > 0")
    _check(p.flight_recorder_entries >= 0,
           f"parallel.flight_recorder_entries ({p.flight_recorder_entries}) must be >= 0")
    dp_rules.check_local_sgd(t.local_sgd_steps, p.dp_replicate, p.zero_stage, cfg.model.is_moe, t.outer_lr,
                             t.outer_momentum)


def _validate_kernels(t) -> None:
    """``training.kernels``: a known kind; ``triton`` needs the package and CUDA, or Triton's CPU
    interpreter (TRITON_INTERPRET=1); no float64 kernels."""
    _check(t.kernels in ("eager", "triton", "auto"), f"training.kernels ({t.kernels}) must be eager|triton|auto")
    if t.kernels != "triton":
        return
    _check(importlib.util.find_spec("triton") is not None,
           "training.kernels=triton needs the triton package (pip install 'ndtrain[kernels]')")
    _check(t.dtype != "float64", "training.kernels=triton has no float64 kernels (use kernels=eager)")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        import torch  # only for this rule: validation stays torch-free otherwise

        _check(t.device != "cpu" and torch.cuda.is_available(),
               "training.kernels=triton needs a CUDA device, or TRITON_INTERPRET=1 (Triton's CPU "
               "interpreter, slow: for tests); use kernels=auto to fall back to eager")


def _validate_speed(cfg) -> None:
    """``training.fused_loss`` / ``compile`` / ``fp8`` (``ndtrain.parallel.fused_head``,
    ``ndtrain.parallel.compile``): the fused head serves the main loss only, so no MTP; fp8 needs
    torchao and a CUDA GPU of compute capability >= 8.9, and no float64."""
    t, m = cfg.training, cfg.model
    _check(not (t.fused_loss and m.mtp_depth),
           f"training.fused_loss=true with model.mtp_depth ({m.mtp_depth}) > 0: the MTP depths would "
           "still materialise their logits through the head; use fused_loss=false with MTP")
    if t.compile and t.kernels == "triton" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ConfigError("training.compile=true with kernels=triton under TRITON_INTERPRET=1: Triton's "
                          "CPU interpreter cannot run inside compiled code; use kernels=eager")
    if t.fp8:
        _check(t.dtype in ("bfloat16", "float32"),
               f"training.fp8=true needs training.dtype bfloat16 or float32 (got {t.dtype})")
        from ndtrain.parallel.compile import fp8_support  # torch: only when fp8 is asked for

        why = fp8_support(t.device)
        _check(not why, why)


def _overlap_device(pp_overlap, device: str) -> str:
    """The device type ``parallel.pp_overlap=true`` is checked against: ``training.device``, with
    ``auto`` resolved as the ranks will resolve it (CUDA when present), so the rule fails here and
    not inside every rank. torch is imported only for ``true`` with ``auto``."""
    if device != "auto" or str(pp_overlap).lower() != "true":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _validate_axes(cfg, world_size: int | None) -> None:
    """Each axis's own ``check`` via ``check_axes`` (the planner calls the same), then the
    world-size rules."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    check_axes(ModelFacts.of_config(m), p, cfg.data.seq_len, t.activation_checkpoint)
    hier_rules.check(p, m, world_size)  # moe_dispatch, node_size, moe_max_nodes
    pp_rules.check_overlap(p.pp_overlap, p.pp, p.pp_schedule, p.tp, p.cp, p.zero_stage, t.activation_checkpoint,
                           t.compile, _overlap_device(p.pp_overlap, t.device))
    if world_size is not None:
        from ndtrain.mesh import ParallelDims  # torch: imported only when a world size is checked

        dims = ParallelDims.from_config(p, world_size)  # checks the degrees multiply to world_size
        dp_rules.check_batch(t.global_batch_size, dims.dp, t.micro_batch_size, p.pp, p.pp_microbatches)
        local = t.global_batch_size // dims.dp  # DualPipeV's ramps need >= 2 pp microbatches
        pp_rules.check_microbatches(p.pp, p.pp_schedule, p.pp_microbatches or local // (t.micro_batch_size or local))


@dataclass(frozen=True)
class ModelFacts:
    """What the layout rules read from a model: from a ``ModelConfig`` (``of_config``) or from the
    planner's ``ModelSpec`` (``ndtrain.planner.layout``), so both pass the same facts."""

    n_heads: int
    kv_heads: int
    ffn_dim: int
    n_layers: int
    moe_experts: int = 0
    mla: bool = False
    mtp_depth: int = 0
    seq_aux_loss: bool = False  # DeepSeek-V3 sequence-wise balance loss on
    capacity: bool = False  # MoE token dropping (capacity factor > 0)
    mixers: tuple[str, ...] = ()  # token mixers other than softmax attention (model.layer_pattern)
    cp_halo: int = 0  # tokens a cp rank takes from its predecessor (cp rules.left_context)
    mixer_fields: object = None  # mixer_spec.MixerFields (head counts the tp rules of the mixers read)
    moe_ffn: tuple[int, int] = (0, 0)  # (expert hidden, shared-experts hidden) of an MoE layer; 0 = unknown

    @classmethod
    def of_config(cls, m) -> ModelFacts:
        return cls(m.n_heads, m.kv_heads, m.ffn_dim, m.n_layers, m.moe_experts, m.attention == "mla",
                   m.mtp_depth, m.moe_seq_aux_loss_coef > 0, m.is_moe and m.moe_capacity_factor > 0,
                   non_softmax_mixers(m), cp_rules.left_context(m), MixerFields.from_model_config(m),
                   moe_ffn=(m.expert_ffn_dim, m.shared_ffn_dim) if m.is_moe else (0, 0))


def seq_len_rule(seq_len: int, max_seq_len: int) -> str:
    """The text of the rule ``data.seq_len <= model.max_seq_len`` (the planner states it too)."""
    return f"data.seq_len ({seq_len}) exceeds model.max_seq_len ({max_seq_len})"


def check_axes(f: ModelFacts, p, seq_len: int, activation_checkpoint: str = "none", dp: int | None = None,
               global_batch_size: int = 0, micro_batch_size: int = 0, runtime: bool = True) -> None:
    """The layout rules of every axis for model facts ``f`` and a ``ParallelConfig``-like ``p``
    (its field names); raises ``ConfigError`` naming the first rule that fails. ``dp`` given: the
    batch rules too. ``runtime=False`` keeps only the arithmetic every implementation needs
    (divisibility, ranges) and drops what ndtrain's runtime does not implement yet (MoE / MLA / MTP
    under tp or cp; ZeRO-3 with MTP; all-gather CP; DualPipeV's m >= 2 pp): the planner models
    such layouts and marks them. ``parallel.pp_layout`` (when ``p`` has it) is checked either way."""
    if runtime:  # linear / window / sparse mixers: their cp rule (mixer_spec), head counts over tp
        check_mixer_layout(f.mixers, p.cp)
        tp_rules.check_mixer_heads(p.tp, f.mixers, f.mixer_fields)
    moe, mla, mtp = (f.moe_experts > 0, f.mla, f.mtp_depth > 0) if runtime else (False, False, False)
    cp_impl, sched, v = p.cp_impl, p.pp_schedule, p.pp_virtual_stages
    if not runtime:
        cp_impl = "ring" if cp_impl == "allgather" else cp_impl  # cut like ring (Llama 3)
        sched, v = ("interleaved", 2) if sched == "dualpipev" else (sched, v)  # 2 chunks per rank
    zero_rules.check(p.zero_stage, f.mtp_depth if runtime else 0)
    tp_rules.check(p.tp, f.n_heads, f.kv_heads, f.ffn_dim, p.sequence_parallel, moe=moe, mla=mla, mtp=mtp)
    tp_rules.check_moe(p.tp, getattr(p, "expert_tp", 1), *f.moe_ffn, seq_len=seq_len if moe else 0, cp=p.cp)
    cp_rules.check(p.cp, seq_len, cp_impl, p.cp_layout, f.n_heads, p.tp, p.sequence_parallel, mla=mla,
                   mtp=mtp, seq_aux_loss=f.seq_aux_loss and runtime, capacity=f.capacity and runtime,
                   mixers=f.mixers, halo=f.cp_halo, moe=moe, cp_ulysses=getattr(p, "cp_ulysses", 1))
    pp_rules.check(p.pp, f.n_layers, sched, v, p.pp_microbatches, activation_checkpoint, moe=moe,
                   mtp=mtp, end_stages_may_hold_no_block=not runtime, layout=getattr(p, "pp_layout", ""),
                   mtp_depth=f.mtp_depth)
    dp_shard = None if p.dp_shard == -1 else p.dp_shard
    ep_rules.check(p.ep, f.moe_experts, dp_shard, p.cp, zero_stage=p.zero_stage if runtime else 0,
                   shared_overlap=runtime and getattr(p, "moe_shared_overlap", False), shared_ffn=f.moe_ffn[1],
                   tp=p.tp, expert_tp=getattr(p, "expert_tp", 1), edp=getattr(p, "edp", 0), pp=p.pp,
                   dp_replicate=p.dp_replicate)
    if dp is not None:
        dp_rules.check_batch(global_batch_size, dp, micro_batch_size, p.pp, p.pp_microbatches)
        if runtime:  # DualPipeV's ramps need >= 2 pp microbatches
            local = global_batch_size // dp
            pp_rules.check_microbatches(p.pp, sched, p.pp_microbatches or local // (micro_batch_size or local))


def _validate_moe_mla_mtp(cfg) -> None:
    """Rules for the MoE / MLA / MTP fields of ``cfg.model`` (see ``docs/moe.md``)."""
    m = cfg.model
    _check(m.moe_experts >= 0, f"model.moe_experts ({m.moe_experts}) must be >= 0")
    if m.is_moe:
        e, k = m.moe_experts, m.moe_top_k
        _check(1 <= k <= e, f"moe_top_k ({k}) must be in 1..moe_experts ({e})")
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


def _validate_block_options(m, p) -> None:
    """Rules of ``model.attn_head_dim``, ``qk_norm`` and ``block_ffn`` (the Qwen3 / Mamba-2 block
    shapes of ``ndtrain.hf.qwen3_moe`` / ``ndtrain.hf.mamba2``)."""
    _check(m.attn_head_dim >= 0, f"model.attn_head_dim ({m.attn_head_dim}) must be >= 0")
    if m.attn_head_dim or m.qk_norm:
        _check(m.attention == "mha", "model.attn_head_dim / qk_norm apply to attention: mha (MLA has "
                                     "its own head dims and latent norms)")
        odd = sorted(set(non_softmax_mixers(m)) & {"sliding_window", "dsa"})
        _check(not odd, f"model.attn_head_dim / qk_norm are built for full softmax attention only, "
                        f"not the layer_pattern's {odd}")
    # qk_norm / attn_output_gate / block_ffn false under tp: ndtrain.parallel.tp.plan (the
    # shared QK-norm gains' gradients summed over tp, wg split by heads, no feed-forward to split)
    # Qwen3-Next options (ndtrain.hf.qwen3_next)
    _check(not m.attn_output_gate or m.attention == "mha", "model.attn_output_gate needs attention: mha")
    _check(0.0 < m.rope_partial_factor <= 1.0, f"model.rope_partial_factor ({m.rope_partial_factor}) must be in (0, 1]")
    _check(m.moe_shared_ffn_hidden >= 0, f"model.moe_shared_ffn_hidden ({m.moe_shared_ffn_hidden}) must be >= 0")
    if not m.block_ffn:
        _check(not m.is_moe and m.mtp_depth == 0, "model.block_ffn false (mixer-only blocks) needs "
                                                  "moe_experts == 0 and mtp_depth == 0")


def _validate_finetune(cfg) -> None:
    """LoRA (``finetune.*``): the numbers, and the combinations the adapters are not built for."""
    f, t, p = cfg.finetune, cfg.training, cfg.parallel
    _check(f.lora_rank >= 0, f"finetune.lora_rank ({f.lora_rank}) must be >= 0 (0 = off)")
    if not f.lora_rank:
        return
    _check(f.lora_alpha > 0, f"finetune.lora_alpha ({f.lora_alpha}) must be > 0")
    _check(0.0 <= f.lora_dropout < 1.0, f"finetune.lora_dropout ({f.lora_dropout}) must be in [0, 1)")
    _check(any(x.strip() for x in f.lora_targets.split(",")),
           "finetune.lora_targets is empty: give module patterns such as *.wq,*.wv")
    _check(not (f.lora_dropout and p.tp > 1), f"finetune.lora_dropout > 0 needs tp == 1 (got tp={p.tp}): "
           "tp ranks would draw different masks for the same whole input")
    _check(t.optimizer == "adamw", f"finetune.lora_rank > 0 needs training.optimizer=adamw (got {t.optimizer})")
    _check(not t.fp8, "finetune.lora_rank > 0 excludes training.fp8 (the float8 linears replace the adapted ones)")
    _check(not t.local_sgd_steps, "finetune.lora_rank > 0 excludes training.local_sgd_steps (DiLoCo)")
    _check(not cfg.model.is_moe, "finetune.lora_rank > 0 is built for dense models (MoE experts are not linears)")
    targets = [x.strip() for x in f.lora_targets.split(",") if x.strip()]

    def hits(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, x) for x in targets)

    _check(p.tp == 1 or not hits("output"), f"finetune.lora_targets matches the output head, which tp ({p.tp}) "
           "splits by vocabulary: adapt the blocks' linears only")
    _check(not (t.fused_loss and hits("output")), "finetune.lora_targets matches the output head, which "
           "training.fused_loss computes without it: adapt the blocks' linears only")
    kv = cfg.model.kv_heads
    _check(p.tp == 1 or kv % p.tp == 0 or not (hits("layers.0.attention.wk") or hits("layers.0.attention.wv")),
           f"finetune.lora_targets matches wk / wv, which tp ({p.tp}) replicates (n_kv_heads {kv} < tp): "
           "drop *.wk / *.wv from the targets or lower tp")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B) with 1 <= A <= B; ``""`` -> None (profiling off).

    Raises ConfigError (naming ``logging.profile_steps``) for any other text."""
    if not text:
        return None
    parts = text.split(":")
    try:
        a, b = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (None, None)
    except ValueError:
        a = b = None
    if a is None or b is None or not 1 <= a <= b:
        raise ConfigError(
            f"logging.profile_steps ({text!r}) must be 'A:B' with 1 <= A <= B: the first and "
            "last optimizer step (inclusive) to trace, e.g. --profile-steps 3:5"
        )
    return a, b
