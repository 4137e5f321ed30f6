"""Tensor + sequence parallel (Megatron-LM, Shoeybi et al. 2019; SP, Korthikanti et al. 2022).

Each block's two halves become one tensor-parallel region each: the projections that make
per-head (or per-hidden-unit) quantities are column-parallel, the output projection row-parallel,
and each rank runs its own heads. Megatron's f / g sit at the region boundaries: f is the region's
``tp_input`` child, g its row-parallel linear's output. Without SP f is identity (backward
all-reduce) and g an all-reduce; with SP the residual stream stays split along T, f all-gathers
and g reduce-scatters, and the norm gains (used on different tokens by each rank) get their
gradients summed over tp. The embedding and head split the vocabulary, padded to
``tp * ceil(V / tp)`` and masked inside the vocab-parallel loss. GQA kv heads split when
``G % tp == 0``, else (``tp % G == 0``) stay whole, each rank using the one its query heads read.
The linear mixers' recurrent states are per head: no extra communication. Weight-gradient
all-reduces of this axis run in ``parallel.grad_reduce_dtype``; activations in the compute dtype.

Files:
  plan.py          TP_PLAN, the one table (module-name pattern -> style), and the loop applying it
  styles.py        what a row does: the slice (``TPContext.shard``) and the module it installs
  layers.py        the installed modules (``print(model)`` shows each one's sharding)
  moe_layers.py    MoE under tp: the layer, whole / split experts (inside expert parallel's exchange)
  tensor_parallel.py  ``apply_tp``; whole tensors from the splits (``tp_full_tensor``, ``tp_specs``)
  collectives.py   f / g and the other autograd collectives;  vocab_loss.py  vocab-parallel CE
  sp_linear.py     under SP the column linears save the T/tp shard and re-gather it in backward
  rules.py         layout rules, torch-free (validation, the planner and ``apply_tp`` call them)
  state.py         checkpoint state under global names and shapes (gather / scatter over tp)

From the validated config to a split weight with ``--parallel.tp=2``, 5 files:
``parallel/parallelize.py`` (``_apply_axes`` calls ``apply_tp``) -> ``tp/tensor_parallel.py``
(``apply_tp``: checks, then ``apply_plan(model, TP_PLAN, ctx)``) -> ``tp/plan.py`` (the row of
each module; ``style.apply``) -> ``tp/styles.py`` (``Colwise.apply`` cuts the slice with
``TPContext.shard``) -> ``tp/layers.py`` (``ColumnParallelLinear`` holds it). On the way the
checks read ``tp/rules.py`` and the mesh gives the group (``mesh.group("tp")``).
"""
