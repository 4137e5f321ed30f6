"""Newton-Schulz orthogonalisation: singular values in the quintic's band, exactly the scalar map
of the input's, for square, tall and wide matrices; batches, zeros, FLOP count."""
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.ops.newton_schulz import newton_schulz, ns_flops, ns_scalar_map
from ndtrain.ops.newton_schulz.naive import NS_EPS

BAND = (0.68, 1.135)  # f^5 over normalised singular values in [0.01, 1] (the reference's band)


def _matrix(m: int, n: int, seed: int, s_min: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, torch.log10(torch.tensor(s_min)).item(), k, dtype=torch.float64) * 3.0
    return u @ torch.diag(s) @ v.T, s


def test_band_of_the_scalar_map():
    s = torch.linspace(0.01, 1.0, 100_001, dtype=torch.float64)
    f = ns_scalar_map(s)
    assert BAND[0] <= f.min().item() < BAND[0] + 0.01 and BAND[1] - 0.01 < f.max().item() <= BAND[1]


@pytest.mark.parametrize("m,n", [(32, 32), (48, 16), (16, 48)])
def test_singular_values_in_band_square_tall_wide(m, n):
    g, s = _matrix(m, n, seed=m * 100 + n)
    o = newton_schulz(g, 5)
    assert o.shape == g.shape and o.dtype == torch.float64
    sv = torch.linalg.svdvals(o)
    want = ns_scalar_map(s / (s.norm() + NS_EPS)).sort(descending=True).values  # U f^5(S / ||G||_F) V^T
    assert (sv.sort(descending=True).values - want).abs().max() < 1e-10
    assert BAND[0] <= sv.min() and sv.max() <= BAND[1]
    # the same singular vectors as the polar factor U V^T: O = U f(S) V^T, so U^T O V is diagonal
    uu, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = uu.T @ o @ vh.T
    assert (d - torch.diag(torch.diagonal(d))).abs().max() < 1e-10


def test_each_step_lifts_the_small_singular_values_and_five_is_the_default():
    g, _ = _matrix(24, 40, seed=3, s_min=0.004)  # normalised smallest ~0.002
    low = [torch.linalg.svdvals(newton_schulz(g, k)).min().item() for k in range(6)]
    assert all(a < b for a, b in itertools.pairwise(low)) and low[-1] >= BAND[0] > low[-2]
    assert torch.equal(newton_schulz(g), newton_schulz(g, 5))


def test_batched_is_per_matrix_and_zero_stays_zero():
    g = torch.randn(3, 8, 12, dtype=torch.float64)
    g[1] = 0.0  # a padding expert
    o = newton_schulz(g, 5)
    for e in range(3):
        assert torch.allclose(o[e], newton_schulz(g[e], 5), rtol=0, atol=1e-13)
    assert torch.count_nonzero(o[1]) == 0 and torch.isfinite(o).all()


def test_bf16_compute_is_close_and_keeps_the_dtype():
    g, _ = _matrix(32, 64, seed=7)
    o = newton_schulz(g.float(), 5, dtype=torch.bfloat16)
    assert o.dtype == torch.float32
    assert (o.double() - newton_schulz(g, 5)).abs().max() < 0.05


def test_rejects_a_vector():
    with pytest.raises(ValueError, match=r"newton_schulz needs a matrix \(\.\.\., m, n\), got shape \(5,\)"):
        newton_schulz(torch.ones(5))


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (2, 8, 8)])
def test_ns_flops_counts_the_matmuls(shape):
    g = torch.randn(*shape)
    with FlopCounterMode(display=False) as fc:
        newton_schulz(g, 5)
    batch = shape[0] if len(shape) == 3 else 1
    assert fc.get_total_flops() == ns_flops(shape[-2], shape[-1], 5, batch)
