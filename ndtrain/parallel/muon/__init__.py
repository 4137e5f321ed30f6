"""Muon on every axis: each matrix orthogonalised whole, once per shard group (``sharded.py``)."""
