"""permute_by_expert and grouped_gated_mlp: the batched-GEMM path against the per-expert loop and
against a float64 per-row formula, forward and gradients, balanced, skewed and empty loads; bad
input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels.ops import grouped_gated_mlp, grouped_gated_mlp_reference, permute_by_expert
from plait.kernels.tolerances import tolerance

EXPERTS, HIDDEN, INTER = 4, 12, 10
# (H, I): 16 x 12 fp32 rows meet torch grouped_mm's 16-byte stride rule; 12 x 10 do not (I * 4 = 40)
# and take the zero-padded bmm path. Both are checked against the same oracles.
DIMS = {"grouped_mm": (16, 12), "padded_bmm": (12, 10)}


@pytest.fixture(params=sorted(DIMS))
def dims(request):
    """Run the test at each (H, I) of DIMS (the helpers read the module's HIDDEN / INTER)."""
    global HIDDEN, INTER
    HIDDEN, INTER = DIMS[request.param]
    yield request.param
    HIDDEN, INTER = DIMS["padded_bmm"]


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3).to(dtype)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3).to(dtype)
    return w_gate_up.requires_grad_(), w_down.requires_grad_()


LOADS = {
    "balanced": [3, 3, 3, 3],
    "skewed": [1, 0, 6, 2],  # an empty expert in the middle
    "all_empty": [0, 0, 0, 0],
    "one_expert": [0, 0, 0, 9],  # padding would be 4x the rows: the loop fallback runs
}


def _per_row_formula(x, counts, w_gate_up, w_down, activation):
    """float64, one row at a time: down_e(act(gate_e x) * up_e x)."""
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(counts))
    rows = []
    for row, expert in zip(x.double(), expert_of_row.tolist()):
        gate = w_gate_up[expert, :INTER].double() @ row
        up = w_gate_up[expert, INTER:].double() @ row
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh" if activation == "gelu_tanh"
                                                                 else "none")
        rows.append(w_down[expert].double() @ (act * up))
    return torch.stack(rows) if rows else torch.zeros(0, HIDDEN, dtype=torch.float64)


@pytest.mark.parametrize("load", sorted(LOADS))
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_grouped_equals_loop_and_formula_fp32(load: str, activation: str, dims: str) -> None:
    counts = torch.tensor(LOADS[load])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w_gate_up, w_down = _weights(torch.float32)
    out = grouped_gated_mlp(x, counts, w_gate_up, w_down, activation=activation)
    tol = tolerance("moe_grouped_fwd", torch.float32)
    expected = _per_row_formula(x.detach(), LOADS[load], w_gate_up.detach(), w_down.detach(), activation)
    torch.testing.assert_close(out.double(), expected, atol=tol.atol, rtol=tol.rtol)
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (x, w_gate_up, w_down))
    ref = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, activation)
    ref_grads = torch.autograd.grad((ref * probe).sum(), (x, w_gate_up, w_down))
    btol = tolerance("moe_grouped_bwd", torch.float32)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=btol.atol, rtol=btol.rtol)
    # An expert without rows gets an all-zero weight gradient, never None (see the module doc).
    empty = [e for e, c in enumerate(LOADS[load]) if c == 0]
    for expert in empty:
        assert not grads[1][expert].any() and not grads[2][expert].any()


def test_grouped_bf16_close_to_loop(dims: str) -> None:
    counts = torch.tensor(LOADS["skewed"])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    w_gate_up, w_down = _weights(torch.bfloat16)
    with torch.no_grad():
        out = grouped_gated_mlp(x, counts, w_gate_up, w_down)
        ref = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down)
    tol = tolerance("moe_grouped_fwd", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=tol.atol, rtol=tol.rtol)


def test_permute_by_expert_is_stable_and_counts_empty_experts() -> None:
    ids = torch.tensor([2, 0, 2, 3, 0, 2])
    order, counts = permute_by_expert(ids, 5)
    assert order.tolist() == [1, 4, 0, 2, 5, 3]
    assert counts.tolist() == [2, 0, 3, 1, 0]


def test_bad_input_refused() -> None:
    w_gate_up, w_down = _weights(torch.float32)
    x = torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="counts sum to 4"):
        grouped_gated_mlp(x, torch.tensor([1, 1, 1, 1]), w_gate_up, w_down)
    with pytest.raises(ValueError, match=r"counts must be \[E=4\]"):
        grouped_gated_mlp(x, torch.tensor([5]), w_gate_up, w_down)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_gated_mlp(torch.randn(5, HIDDEN + 1), torch.tensor([5, 0, 0, 0]), w_gate_up, w_down)
    with pytest.raises(ValueError, match="activation='relu'"):
        grouped_gated_mlp(x, torch.tensor([5, 0, 0, 0]), w_gate_up, w_down, activation="relu")
    with pytest.raises(ValueError, match="1-D integer"):
        permute_by_expert(torch.tensor([0.5]), 2)
