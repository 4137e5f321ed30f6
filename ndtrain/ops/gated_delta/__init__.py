"""The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks:
Improving Mamba2 with Delta Rule"):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T     (S: K x V per head, a_t = exp(g_t))
    o_t = S_t^T q_t

``naive_gated_delta`` applies the matrix update token by token, ``chunk_gated_delta`` is the
chunked form with the UT / WY representation (Yang et al. 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length"), ``recurrent_gated_delta_step`` one decoding step.
"""
from ndtrain.ops.gated_delta.chunk import chunk_gated_delta
from ndtrain.ops.gated_delta.naive import naive_gated_delta
from ndtrain.ops.gated_delta.recurrent import recurrent_gated_delta_step

__all__ = ["chunk_gated_delta", "naive_gated_delta", "recurrent_gated_delta_step"]
