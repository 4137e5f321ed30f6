"""Gradient bucket grouping (ndtrain.parallel.dp.buckets): the plain rule ZeRO-1/2 and the planner
share, and data parallel's PyTorch-DDP-like first bucket and lone large parameters."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.parallel.dp.buckets import group_into_buckets


def _named(sizes: list[int]) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def _names(groups) -> list[list[str]]:
    return [[name for name, _ in g] for g in groups]


def test_plain_rule_closes_at_the_size_in_reverse_order():
    # float32: 4 bytes an element; reversed order p4 p3 ...; a bucket closes at >= 64 bytes
    named = _named([40, 4, 4, 8, 8])
    assert _names(group_into_buckets(named, 64)) == [["p4", "p3"], ["p2", "p1", "p0"]]
    # the reduction dtype sets the byte count (float64: twice as many bytes)
    assert _names(group_into_buckets(named, 64, torch.float64)) == [["p4"], ["p3"], ["p2", "p1"], ["p0"]]


def test_first_bucket_and_lone_large_parameters():
    # an embedding-like p0 (64 KiB), four small layers, a head-like p5 (64 KiB)
    named = _named([16384, 256, 256, 256, 256, 16384])
    plain = _names(group_into_buckets(named, 96 * 1024))
    assert plain == [["p5", "p4", "p3", "p2", "p1", "p0"]]  # one bucket: nothing overlaps backward
    ddp = _names(group_into_buckets(named, 96 * 1024, first_bucket_bytes=1024, alone_bytes=24 * 1024))
    # the head goes out first on its own; the small layers do not wait for the embedding
    assert ddp == [["p5"], ["p4", "p3", "p2", "p1"], ["p0"]]
    # a first bucket smaller than one parameter closes right after it
    first = group_into_buckets(named, 96 * 1024, first_bucket_bytes=1)
    assert _names(first) == [["p5"], ["p4", "p3", "p2", "p1", "p0"]]
