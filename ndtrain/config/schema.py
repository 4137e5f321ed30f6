"""The config schema: one dataclass per section (``model``, ``data``, ``training``, ``parallel``,
``checkpoint``, ``logging``, ``eval``). Each field's trailing comment documents it (``ndtrain config keys``
prints them); units live in field names. Loading, overrides and validation are in ``ndtrain.config.load``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import yaml


@dataclass
class ModelConfig:
    name: str = "llama"  # family, informational
    vocab_size: int = 4096  # rows of the embedding; a tokenizer must fit in it
    dim: int = 256  # model width C
    n_layers: int = 4  # decoder blocks L
    n_heads: int = 8  # query heads H
    n_kv_heads: int = 0  # kv heads G (0 = n_heads, i.e. MHA); grouped-query attention when < H
    ffn_hidden: int = 0  # SwiGLU hidden size; 0 = Llama rule from multiple_of / ffn_dim_multiplier
    multiple_of: int = 256  # Llama rule: hidden rounded up to a multiple of this
    ffn_dim_multiplier: float = 1.0  # Llama rule: scales 8/3 * dim before rounding
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 500000.0  # RoPE base
    rope_scaling: bool = False  # Llama 3.1 frequency scaling of RoPE
    rope_scaling_factor: float = 8.0  # Llama 3.1: factor
    rope_low_freq_factor: float = 1.0  # Llama 3.1: low_freq_factor
    rope_high_freq_factor: float = 4.0  # Llama 3.1: high_freq_factor
    rope_original_max_seq_len: int = 8192  # Llama 3.1: original_max_position_embeddings
    max_seq_len: int = 2048  # longest position the RoPE table covers
    tie_embeddings: bool = False  # output head shares the token embedding
    init_std: float = 0.02  # std of the normal init of linear / embedding weights
    attn_head_dim: int = 0  # softmax-attention head dim D (0 = dim / n_heads); Qwen3 uses 128 at dim 2048, 32 heads
    qk_norm: bool = False  # RMSNorm (weight of head_dim, eps norm_eps) on each q / k head before RoPE (Qwen3)
    block_ffn: bool = True  # false: blocks are norm + token mixer only, no ffn_norm / feed_forward (Mamba-2)
    attn_output_gate: bool = False  # gated attention: heads' output times sigmoid(wg x) per channel before wo (Qwen3-Next)
    rope_partial_factor: float = 1.0  # RoPE rotates the first int(head_dim * f) dims of each head, the rest pass (Qwen3-Next 0.25)
    # --- Mixture of Experts (ndtrain.model.moe); moe_experts == 0 keeps every layer dense ---
    moe_experts: int = 0  # routed experts E per MoE layer (0 = dense model)
    moe_top_k: int = 2  # routed experts per token, 1..8
    moe_shared_experts: int = 0  # always-on experts per MoE layer, each moe_ffn_hidden wide (DeepSeekMoE)
    moe_ffn_hidden: int = 0  # SwiGLU hidden of one expert (0 = ffn_dim; smaller = fine-grained experts)
    moe_shared_ffn_hidden: int = 0  # SwiGLU hidden of the shared experts together (0 = moe_shared_experts * moe_ffn_hidden; Qwen3-Next's own size)
    moe_shared_gate: bool = False  # shared-expert output times sigmoid(x w_g), one scalar per token (Qwen3-Next shared_expert_gate)
    moe_score: str = "softmax"  # softmax | sigmoid: router score function (sigmoid: DeepSeek-V3)
    moe_renormalize: bool = True  # rescale the selected top-k scores to sum to 1
    moe_route_scale: float = 1.0  # multiplies the routed weights (DeepSeek-V3 routed_scaling_factor)
    moe_n_groups: int = 1  # group-limited routing: experts split into groups (DeepSeek-V3 n_group)
    moe_topk_groups: int = 1  # ... and tokens pick experts only within their best groups (topk_group)
    moe_max_nodes: int = 0  # node-limited routing: a token's experts lie on at most this many nodes of the ep group (DeepSeek-V3; 0 = off)
    moe_capacity_factor: float = 0.0  # expert capacity = ceil(cf * tokens * k / E) per microbatch (0 = dropless)
    moe_aux_loss_coef: float = 0.0  # Switch Transformer load-balancing loss weight (Fedus 2021)
    moe_seq_aux_loss_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss weight
    moe_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE, Zoph 2022)
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing: bias step per optimizer step (0 = off)
    moe_aux_scope: str = "microbatch"  # microbatch | global: over which tokens Switch-loss loads are counted
    moe_layer_start: int = 0  # layers before this stay dense (DeepSeek first_k_dense_replace)
    moe_layer_interleave: int = 1  # from moe_layer_start, every k-th layer is MoE
    # --- attention kind; "mha" covers MHA / GQA / MQA via n_kv_heads ---
    attention: str = "mha"  # mha | mla (DeepSeek-V2 Multi-head Latent Attention)
    mla_q_rank: int = 0  # MLA query latent rank (0 = full-rank query projection)
    mla_kv_rank: int = 0  # MLA key/value latent rank d_c (what the KV cache stores per token)
    mla_rope_dim: int = 0  # MLA decoupled RoPE dims per head (the shared RoPE key is cached too)
    mla_nope_dim: int = 0  # MLA non-RoPE query/key dims per head (0 = head_dim)
    mla_v_dim: int = 0  # MLA value dims per head (0 = head_dim)
    # --- multi-token prediction (DeepSeek-V3) ---
    mtp_depth: int = 0  # D extra sequential modules, module k predicts token t+k+1 (0 = off)
    mtp_loss_weight: float = 0.3  # lambda: loss += lambda * mean over depths of the MTP losses
    # --- token mixer per layer (ndtrain.mixer_spec, docs/attention_alternatives.md) ---
    layer_pattern: str = ""  # letters repeated over layers: A attention, L linear, M mamba2, G gated_deltanet, S sliding_window, D dsa; or a comma list of names ("" = all A)
    linear_chunk_size: int = 64  # tokens per chunk of the chunked linear-mixer form (training / prefill)
    linear_heads: int = 0  # gated_deltanet key (q / k) heads (0 = n_heads)
    linear_key_head_dim: int = 0  # gated_deltanet key head dim K (0 = head_dim)
    linear_value_heads: int = 0  # gated_deltanet value heads, a multiple of linear_heads (0 = linear_heads)
    linear_value_head_dim: int = 0  # gated_deltanet value head dim V (0 = linear_key_head_dim)
    linear_conv_kernel: int = 4  # short causal depthwise convolution width (mamba2, gated_deltanet)
    linear_norm_eps: float = 1e-6  # gated_deltanet output (gated) RMSNorm epsilon (Qwen3-Next: rms_norm_eps)
    mamba_state_dim: int = 16  # mamba2 SSM state size N per head
    mamba_head_dim: int = 0  # mamba2 head dim P (0 = head_dim)
    mamba_expand: int = 2  # mamba2 inner width = mamba_expand * dim
    mamba_groups: int = 1  # mamba2 B / C groups (HF n_groups): heads share B, C and the gated-norm group per group
    swa_window: int = 0  # sliding_window: each query sees itself and the previous swa_window - 1 tokens
    dsa_top_k: int = 0  # dsa: keys each query attends to (chosen by the indexer)
    dsa_index_heads: int = 4  # dsa: indexer heads (head dim = head_dim)

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """True if decoder block ``layer`` (0-based) has an MoE feed-forward."""
        return (self.is_moe and layer >= self.moe_layer_start
                and (layer - self.moe_layer_start) % self.moe_layer_interleave == 0)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_hidden or self.ffn_dim

    @property
    def shared_ffn_dim(self) -> int:
        """SwiGLU hidden of an MoE layer's shared experts together (0 without shared experts)."""
        if not self.moe_shared_experts:
            return 0
        return self.moe_shared_ffn_hidden or self.moe_shared_experts * self.expert_ffn_dim

    @property
    def rope_dim(self) -> int:
        """Dims per head that RoPE rotates: head_dim (its first ``rope_partial_factor`` share), or
        MLA's decoupled slice."""
        return self.mla_rope_dim if self.attention == "mla" else int(self.head_dim * self.rope_partial_factor)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib" (this interpreter's standard library) or a path / glob / comma list
    text_field: str = "text"  # JSONL / parquet column holding the text
    tokenizer: str = "bpe"  # "bpe" (trained on the corpus, cached), "bytes", or a tokenizer.json path
    seq_len: int = 256  # tokens per sequence T (inputs; labels are shifted by one)
    val_fraction: float = 0.02  # share of the token stream held out for validation
    max_corpus_bytes: int = 0  # cap on text read from the source (0 = no cap)
    cache_dir: str = ""  # where tokenizers and token shards are cached ("" = ~/.cache/ndtrain)
    eos_id: int = -1  # EOS id for a tokenizer.json with no known EOS token (-1 = none: error)
    format: str = "text"  # text (documents of text_field) | chat (JSONL "messages" conversations, loss on the assistant turns only; docs/sft.md)
    chat_template: str = ""  # format=chat: "" (the tokenizer's own, tokenizer_config.json), a built-in (chatml) or a .jinja file
    sources: str = ""  # weighted mixture (replaces source): YAML list of {kind, path, weight | budget_tokens, ...}, its JSON, or "KIND:PATH@WEIGHT;..." (kinds text | tokens | megatron | hf; docs/data.md)
    document_mask: bool = False  # packed documents never see each other: attention, state and conv stop at each EOS, positions restart, the EOS token takes no loss (docs/packed_documents.md)


@dataclass
class TrainingConfig:
    steps: int = 100  # optimizer steps (the LR schedule spans these)
    stop_at_step: int = 0  # end this job early at this step, schedule unchanged (0 = run to steps)
    seed: int = 0  # seeds the weights, the data order and dropout
    dtype: str = "float32"  # float64 | float32 | bfloat16 | float16 (autocast over fp32 master weights)
    loss_scale_init: float = 65536.0  # float16: initial dynamic loss scale
    loss_scale_growth_interval: int = 2000  # float16: finite steps in a row before the scale doubles
    device: str = "auto"  # auto | cpu | cuda
    global_batch_size: int = 8  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 0  # sequences per microbatch per rank (0 = the whole local batch)
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of lr
    warmup_steps: int = 10  # linear warmup length
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    decay_fraction: float = 0.2  # wsd: share of steps spent in the final decay
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not applied to norms / biases)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # global gradient-norm threshold (0 = no clipping)
    # --- optimizer (ndtrain.optim: AdamW; ndtrain.optim.muon + ndtrain.parallel.muon: Muon; docs/optimizers.md) ---
    optimizer: str = "adamw"  # adamw | muon (Muon for the hidden matrices, AdamW for embeddings, head, routers, norms, biases)
    muon_lr: float = 0.0  # Muon groups' peak learning rate (0 = training.lr, right for muon_scale=moonlight; ~0.02 for original)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update (quintic, Jordan et al. 2024)
    muon_scale: str = "moonlight"  # moonlight (0.2 sqrt(max(m, n)): AdamW's update RMS) | original (sqrt(max(1, m / n)))
    muon_adamw_patterns: str = "tok_embeddings.*,output.*,*.router.*,*.conv1d.*"  # comma-separated fnmatch names kept on AdamW (besides 1-D params)
    qk_clip: float = 0.0  # QK-clip threshold tau (MuonClip, Kimi K2; muon only): after each step, scale wq / wk of every head whose max logit exceeded tau (0 = off)
    mup_base_width: int = 0  # muP-style transfer: hidden-matrix LRs and init std scaled from this base model.dim to the run's (0 = off; docs/optimizers.md)
    activation_checkpoint: str = "none"  # none | full | every:C | sqrt | selective | op | core_attn | deepseek
    kernels: str = "eager"  # eager | triton | auto: op implementations (ndtrain.model.kernels; auto = triton with CUDA)
    fused_loss: bool = False  # output head + cross-entropy fused, chunked, never the (B, T, V) logits (Triton with kernels=triton, else PyTorch; ndtrain.parallel.fused_head)
    compile: bool = False  # torch.compile each transformer block's forward (hooks, checkpointing and ZeRO stay eager; ndtrain.parallel.compile)
    fp8: bool = False  # torchao float8 training of the blocks' linear layers (CUDA sm89+, pip install 'ndtrain[fp8]'); MFU then uses the fp8 peak
    eval_every: int = 0  # steps between validation passes (0 = only at the end)
    eval_batches: int = 4  # global batches per validation pass
    sample_every: int = 0  # steps between generated samples (0 = only at the end)
    sample_tokens: int = 64  # tokens generated per sample (0 = no sample: nothing generated or printed)
    sample_prompt: str = "def "  # prompt of the printed sample
    sample_temperature: float = 0.8  # 0 = greedy
    sample_top_k: int = 40  # 0 = no top-k filter
    # --- bad steps and rollback (ndtrain.fault.bad_steps, docs/fault_tolerance.md) ---
    max_bad_steps: int = 5  # consecutive non-finite steps (skipped on every rank) before a rollback to the last checkpoint
    spike_zscore: float = 0.0  # roll back when the loss z-score over the last spike_window steps exceeds this (0 = off)
    spike_window: int = 50  # steps of loss history the spike z-score uses
    # --- DiLoCo / local SGD over dp_replicate (Douillard et al. 2023; ndtrain.parallel.dp.diloco) ---
    local_sgd_steps: int = 0  # H: inner steps per outer step (0 = off: synchronous data parallel)
    outer_lr: float = 0.7  # outer SGD learning rate on the averaged parameter delta
    outer_momentum: float = 0.9  # outer Nesterov momentum (0 = plain SGD)
    # --- MoE benchmarking (docs/moe.md, "Honest MoE figures") ---
    moe_routing: str = "learned"  # learned (the router's top-k) | balanced (round-robin by sequence position, for benchmarks only; marked in the console and every metrics row)


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # replicas (HSDP outer axis)
    dp_shard: int = -1  # shards (-1 takes the ranks left over)
    cp: int = 1  # context parallel degree
    tp: int = 1  # tensor parallel degree
    pp: int = 1  # pipeline parallel degree
    ep: int = 1  # expert parallel degree (borrows ranks from dp_shard x cp when it divides it, else folded over the stage's dp x cp x tp ranks)
    edp: int = 0  # expert data parallel degree, 0 = derived (world / (pp * ep * expert_tp)); given: checked against it
    zero_stage: int = 0  # 0 = plain data parallel (DDP), 1, 2, 3 (sharded over dp_shard x cp)
    reshard_after_forward: bool = True  # zero_stage 3: free gathered params after each unit's forward
    keep_last_unit_gathered: bool = True  # zero_stage 3: the last unit stays gathered into backward
    sequence_parallel: bool = False  # Megatron SP (needs tp > 1)
    expert_tp: int = 1  # MoE experts' hidden split: 1 = whole experts (per tp rank), tp = split over the attention tp, other = folded expert mesh (split over its own expert_tp ranks)
    moe_dispatch: str = "flat"  # flat | hierarchical: hierarchical sends a token once per remote node, the node forwards it to its experts (DeepSeek-V3)
    node_size: int = 0  # ranks per node for moe_dispatch / model.moe_max_nodes (0 = torchrun's LOCAL_WORLD_SIZE, else the launch's processes)
    moe_shared_overlap: bool = False  # ep > 1: run the shared experts while the MoE dispatch all-to-all is in flight (Megatron moe_shared_expert_overlap)
    cp_impl: str = "ring"  # ring | ulysses | hybrid (Ulysses all-to-all inside cp_ulysses ranks, ring across)
    cp_ulysses: int = 1  # cp_impl=hybrid: ranks of one all-to-all group (divides cp and n_heads / tp); ring over cp / cp_ulysses
    cp_doc_balance: bool = False  # data.document_mask with ring / hybrid cp: assign sequence chunks to cp ranks by attention work (sum of squared document lengths) instead of the fixed mirror layout
    cp_layout: str = "auto"  # auto | load_balanced | contiguous (auto: load_balanced for ring, contiguous for ulysses)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble | dualpipev (2 chunks per rank in a V)
    pp_microbatches: int = 0  # 0 = from global_batch_size / (micro_batch_size * dp)
    pp_virtual_stages: int = 1  # interleaved schedule: model chunks per rank
    pp_layout: str = ""  # what each virtual stage holds, Megatron's --pipeline-model-parallel-layout syntax ("E|(t|)*126,L": E embedding, t block, m MTP depth, L head + loss, '|' between stages, *N repeats); empty = balanced by per-layer costs
    pp_overlap: str = "auto"  # auto | true | false: DualPipeV runs each F&B pair's backward in a thread beside its forward, so one microbatch's EP all-to-all waits under the other's compute (auto: an MoE model with ep > 1, where pp/rules.overlap_blockers allow; CPU)
    bucket_size_bytes: int = 25 * 2**20  # data-parallel gradient bucket size
    grad_reduce_dtype: str = "float32"  # float32 | bfloat16: dtype of gradient reductions
    backend: str = "auto"  # auto (gloo on CPU, nccl on GPU) | gloo | nccl
    collective_timeout_s: float = 600.0  # a collective / p2p not done in this time fails naming rank, axis and op
    flight_recorder_entries: int = 256  # last collectives each rank keeps for RUN_DIR/flight_recorder/ (0 = off)


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between saves (0 = never)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a new one is complete)
    resume: bool = True  # resume from the newest complete checkpoint in the run directory (wins over load_from)
    load_from: str = ""  # resume another run's checkpoint (any layout) when this run has none of its own
    init_weights_from: str = ""  # fine-tune: weights only (ndtrain checkpoint of any layout or HF folder), step 0
    async_save: bool = False  # DCP async_save: the loop waits only for the copy to host memory (events.jsonl: block_s)


@dataclass
class LoggingConfig:
    log_every: int = 10  # steps between metrics lines
    plot: bool = True  # write RUN_DIR/loss.png (loss, val loss, LR, MFU) at every checkpoint and evaluation, at the end and after Ctrl-C
    peak_flops_per_s: float = 0.0  # override the accelerator peak used for MFU (0 = table / bench)
    progress: str = "auto"  # auto | rich | plain (auto: rich live bar on a terminal; plain lines off a TTY or under CI)
    tensorboard: bool = False  # also write every metric to RUN_DIR/tensorboard (needs the tensorboard package)
    profile_steps: str = ""  # "A:B": torch.profiler Chrome trace of steps A..B to RUN_DIR/profile/ ("" = off; ndtrain.train.profiling)


@dataclass
class FinetuneConfig:
    lora_rank: int = 0  # LoRA (Hu et al. 2021) adapter rank r on each target linear; 0 = off (train every weight)
    lora_alpha: float = 16.0  # LoRA scaling numerator: the adapter's output is multiplied by lora_alpha / lora_rank
    lora_targets: str = "*.wq,*.wk,*.wv,*.wo"  # comma-separated fnmatch patterns over module names (e.g. layers.0.attention.wq); each match must be a linear
    lora_dropout: float = 0.0  # dropout on the adapter's input (training only; needs tp == 1)


@dataclass
class EvalConfig:
    sets: str = ""  # named validation sets evaluated every training.eval_every steps, "NAME=SOURCE;NAME=SOURCE" (SOURCE: a path / glob / comma list as data.source, tokenized with the run's tokenizer and cached; or val = the held-out slice); each logged as val_loss/NAME

    def named_sets(self) -> list[tuple[str, str]]:
        """``[(name, source), ...]`` of ``sets`` in order. Raises ConfigError for an entry that is
        not ``NAME=SOURCE``, a name outside ``[A-Za-z0-9_.-]`` or a name given twice."""
        import re

        from ndtrain.errors import ConfigError

        out: list[tuple[str, str]] = []
        for entry in (e.strip() for e in self.sets.split(";")):
            if not entry:
                continue
            name, eq, source = (part.strip() for part in entry.partition("="))
            if not eq or not source or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"eval.sets entry {entry!r}: expected NAME=SOURCE with NAME of letters, "
                                  "digits, '_', '.', '-' (entries separated by ';')")
            if name in (n for n, _ in out):
                raise ConfigError(f"eval.sets: the name {name!r} is given twice")
            out.append((name, source))
        return out


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
