"""Compute kernels, one folder per op: ``naive.py`` (the reference, written from the paper's
equations), the fast twin (``chunk.py`` / ``triton.py``) and, for recurrent ops, ``recurrent.py``
(one decoding step with a fixed-size state). Model code picks the form; ``tests/ops/`` pins the fast
form to the naive one on outputs, final states and every gradient.
"""
