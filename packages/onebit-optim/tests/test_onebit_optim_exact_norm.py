"""The exact per-tensor norms of LAMB's trust ratio (:mod:`plait.onebit_optim.rules.lamb`): the
pieces of a tensor, cut anywhere and added in any order, give the whole tensor's norm bit for bit
(what lets 1-bit LAMB under ZeRO equal the plain optimizer at any world size), and that norm is
the L2 norm (float64 reference)."""

from __future__ import annotations

import math

import pytest
import torch

from plait.onebit_optim.rules.lamb import exact_norm, norm_exponent, norm_from_limbs, square_limbs


def _tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, as a real update has: 1e-30 .. 1e3
    return torch.randn(10_007, generator=g) * torch.logspace(-30, 3, 10_007)[torch.randperm(10_007, generator=g)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_cut_into_pieces_gives_the_whole_tensors_norm_bitwise(seed: int) -> None:
    x = _tensor(seed)
    whole = exact_norm(x)
    exponent = norm_exponent(float(x.abs().max()))
    g = torch.Generator().manual_seed(100 + seed)
    for pieces in (2, 3, 4, 7, 64):
        cuts = sorted(torch.randperm(x.numel() - 1, generator=g)[:pieces - 1].add(1).tolist())
        parts = [x[a:b] for a, b in zip([0, *cuts], [*cuts, x.numel()])]
        order = torch.randperm(len(parts), generator=g).tolist()
        limbs = sum((square_limbs(parts[i], exponent) for i in order), torch.zeros(2, dtype=torch.int64))
        assert norm_from_limbs(limbs, exponent) == whole
    reference = math.sqrt(sum(v * v for v in x.double().tolist()))
    assert abs(whole - reference) <= 1e-12 * reference


def test_zero_and_non_finite_tensors() -> None:
    assert exact_norm(torch.zeros(5)) == 0.0
    assert exact_norm(torch.tensor([])) == 0.0
    assert exact_norm(torch.tensor([1.0, float("inf")])) == math.inf
    assert math.isnan(exact_norm(torch.tensor([1.0, float("nan")])))
    assert exact_norm(torch.tensor([3.0, 4.0])) == 5.0
    big = torch.full((4,), 3e38)  # near float32's largest: no overflow in the fixed point
    assert exact_norm(big) == pytest.approx(2 * float(big[0]), rel=1e-12)
