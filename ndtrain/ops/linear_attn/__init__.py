"""Linear attention with an optional per-head scalar decay (Katharopoulos 2020; with the decay it is
the state-space duality form of Mamba-2, Dao & Gu 2024):

    S_t = exp(g_t) * S_{t-1} + k_t v_t^T        (S: K x V per head)
    o_t = S_t^T q_t

``naive_linear_attn`` loops over tokens, ``chunk_linear_attn`` is the chunked parallel form used for
training, ``recurrent_linear_attn_step`` is one decoding step.
"""
from ndtrain.ops.linear_attn.chunk import chunk_linear_attn
from ndtrain.ops.linear_attn.naive import naive_linear_attn
from ndtrain.ops.linear_attn.recurrent import recurrent_linear_attn_step

__all__ = ["chunk_linear_attn", "naive_linear_attn", "recurrent_linear_attn_step"]
