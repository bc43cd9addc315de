"""grouped_gated_mlp: every torch method (the CPU segments path with its hand-written backward,
torch's grouped_mm, the padded bmm) and the Triton kernels (forward and backward; the interpreter on
CPU) against the per-expert loop and a float64 per-row formula, forward and gradients, balanced,
skewed and empty loads; the two precisions pinned to their formulas; bad input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels.ops import grouped_gated_mlp, grouped_gated_mlp_reference, permute_by_expert
from plait.kernels.ops.moe_grouped import gate_product, gate_product_backward, grouped_gated_mlp_torch
from plait.kernels.tolerances import tolerance

EXPERTS, HIDDEN, INTER = 4, 12, 10
# (H, I): 16 x 12 fp32 rows meet torch grouped_mm's 16-byte stride rule; 12 x 10 do not (I * 4 = 40).
DIMS = {"grouped_mm": (16, 12), "padded_bmm": (12, 10)}
# (torch method, dims): None is the public function's default (the segments path on CPU).
METHODS = [(None, "padded_bmm"), ("segments", "padded_bmm"), ("segments", "grouped_mm"),
           ("grouped_mm", "grouped_mm"), ("padded_bmm", "padded_bmm")]


@pytest.fixture(params=METHODS, ids=lambda p: f"{p[0] or 'default'}-{p[1]}")
def method(request):
    """Run the test with each torch method at its (H, I) (the helpers read the module's HIDDEN / INTER)."""
    global HIDDEN, INTER
    HIDDEN, INTER = DIMS[request.param[1]]
    yield request.param[0]
    HIDDEN, INTER = DIMS["padded_bmm"]


def _run(method, x, counts, w_gate_up, w_down, activation="silu"):
    if method is None:
        return grouped_gated_mlp(x, counts, w_gate_up, w_down, activation=activation)
    return grouped_gated_mlp_torch(x, counts, w_gate_up, w_down, activation, method=method)


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
def test_grouped_equals_loop_and_formula_fp32(load: str, activation: str, method: str | None) -> None:
    counts = torch.tensor(LOADS[load])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w_gate_up, w_down = _weights(torch.float32)
    out = _run(method, x, counts, w_gate_up, w_down, activation)
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


def test_grouped_bf16_close_to_loop(method: str | None) -> None:
    counts = torch.tensor(LOADS["skewed"])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    w_gate_up, w_down = _weights(torch.bfloat16)
    with torch.no_grad():
        out = _run(method, x, counts, w_gate_up, w_down)
        ref = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down)
    tol = tolerance("moe_grouped_fwd", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=tol.atol, rtol=tol.rtol)


# Experts on both sides of ONEDNN_MIN_ROWS (32): weight gradients by torch mm and by oneDNN.
BACKWARD_LOADS = {"skewed": LOADS["skewed"], "straddling": [40, 0, 31, 33]}


@pytest.mark.parametrize("load", BACKWARD_LOADS)
@pytest.mark.parametrize("precision", ["input", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_segments_backward_matches_autograd_of_the_loop(dtype: torch.dtype, precision: str, load: str) -> None:
    """The CPU path's hand-written backward against autograd of the loop reference, both precisions.

    Not bitwise: the same GEMMs on differently aligned row slices may take other BLAS kernels."""
    counts = torch.tensor(BACKWARD_LOADS[load])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    x.requires_grad_()
    w_gate_up, w_down = _weights(dtype)
    out = grouped_gated_mlp_torch(x, counts, w_gate_up, w_down, "silu", precision, method="segments")
    ref = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, "silu", precision)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = torch.autograd.grad((out * probe).sum(), (x, w_gate_up, w_down))
    ref_grads = torch.autograd.grad((ref * probe).sum(), (x, w_gate_up, w_down))
    tolerance("moe_grouped_fwd", dtype).assert_close(out, ref, what=f"segments {precision}")
    with torch.no_grad():  # the inference form (no autograd node, SiLU in place on the GEMM output,
        # so the down GEMM reads a strided operand: BLAS may round the fp32 sums differently)
        inference = grouped_gated_mlp_torch(x, counts, w_gate_up, w_down, "silu", precision, method="segments")
    tolerance("moe_grouped_fwd", dtype).assert_close(inference, out, what=f"segments no-grad {precision}")
    for name, got, want in zip(("dx", "dw_gate_up", "dw_down"), grads, ref_grads):
        # bf16 gradients: the Triton entry's bound (same rounding points, fp32 sums in another order).
        op = "moe_grouped_bwd" if dtype == torch.float32 else "moe_grouped_triton_bwd"
        tolerance(op, dtype).assert_close(got, want, what=f"segments {name} {precision}")


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


# ---- precision: the one argument by which training ("input") and serving ("fp32") differ.

def _eager_loop(x, counts, w_gate_up, w_down, fp32_activation: bool):
    """The two numerics written out as eager torch: HF's experts, and the serving fp32 activation."""
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        gate_up = x[start:start + count] @ w_gate_up[expert].T
        gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
        act = (F.silu(gate.float()) * up.float()).to(x.dtype) if fp32_activation else F.silu(gate) * up
        outputs.append(act @ w_down[expert].T)
        start += count
    return torch.cat(outputs)


def test_precision_pins_training_and_serving_numerics() -> None:
    """Reference loop with ``precision="input"`` is bitwise HF's eager bf16 expert, ``"fp32"`` bitwise
    the serving formula; the two differ in bf16 (so the argument matters) and agree in fp32."""
    counts = torch.tensor(LOADS["skewed"])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    w_gate_up, w_down = (w.detach() for w in _weights(torch.bfloat16))
    with torch.no_grad():
        trained = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, "silu", "input")
        served = grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, "silu", "fp32")
        assert torch.equal(trained, _eager_loop(x, counts, w_gate_up, w_down, fp32_activation=False))
        assert torch.equal(served, _eager_loop(x, counts, w_gate_up, w_down, fp32_activation=True))
        assert not torch.equal(trained, served)
        x32, gu32, d32 = x.float(), w_gate_up.float(), w_down.float()
        assert torch.equal(grouped_gated_mlp_reference(x32, counts, gu32, d32, "silu", "input"),
                           grouped_gated_mlp_reference(x32, counts, gu32, d32, "silu", "fp32"))
    with pytest.raises(ValueError, match="precision='bf16' is not supported"):
        grouped_gated_mlp(x, counts, w_gate_up, w_down, precision="bf16")


@pytest.mark.parametrize("precision", ["input", "fp32"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_product_backward_is_bitwise_autograd(dtype: torch.dtype, activation: str, precision: str) -> None:
    """The CPU backward's hand-written activation derivative gives autograd's bits (same ops)."""
    gen = torch.Generator().manual_seed(6)
    gate_up = torch.randn(9, 2 * INTER, generator=gen).to(dtype)
    d_act = torch.randn(9, INTER, generator=gen).to(dtype)
    leaf = gate_up.clone().requires_grad_()
    act = gate_product(leaf, activation, precision)
    (want,) = torch.autograd.grad(act, leaf, d_act)
    got_act, got = gate_product_backward(gate_up, d_act, activation, precision)
    assert torch.equal(got_act, act.detach()) and torch.equal(got, want)


# ---- Triton path (CUDA, or the interpreter on CPU): forward and backward kernels.

TRITON_LOADS = {"skewed": [5, 0, 17, 3], "all_empty": [0, 0, 0, 0], "one_expert": [0, 0, 0, 21]}


@pytest.mark.parametrize("precision", ["input", "fp32"])
@pytest.mark.parametrize("load", sorted(TRITON_LOADS))
def test_triton_forward_and_backward_fp32(triton_backend, load: str, precision: str) -> None:
    """Forward and all three gradients of the Triton kernels against the float64 reference."""
    hidden, inter = 48, 40  # not multiples of the tiles: masking exercised
    counts = torch.tensor(TRITON_LOADS[load], device=triton_backend)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(int(counts.sum()), hidden, generator=gen)
    w_gate_up = torch.randn(4, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(4, hidden, inter, generator=gen) / inter**0.5
    ours = [t.to(triton_backend).requires_grad_() for t in (x, w_gate_up, w_down)]
    oracle = [t.double().requires_grad_() for t in (x, w_gate_up, w_down)]
    out = grouped_gated_mlp(*ours[:1], counts, *ours[1:], precision=precision)
    expected = grouped_gated_mlp_reference(oracle[0], counts.cpu(), *oracle[1:], "silu", precision)
    probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out.cpu().double() * probe).sum(), ours)
    want = torch.autograd.grad((expected * probe).sum(), oracle)
    tolerance("moe_grouped_triton_fwd", torch.float32).assert_close(out.cpu(), expected.float(), what=load)
    for name, got, ref in zip(("dx", "dw_gate_up", "dw_down"), grads, want):
        tolerance("moe_grouped_triton_bwd", torch.float32).assert_close(got.cpu(), ref.float(), what=name)
    for expert in (e for e, c in enumerate(TRITON_LOADS[load]) if c == 0):
        assert not grads[1][expert].any() and not grads[2][expert].any()


@pytest.mark.parametrize("precision", ["input", "fp32"])
def test_triton_bf16_close_to_reference(triton_backend, precision: str) -> None:
    """bf16 forward and gradients of the kernels against the same-precision torch reference."""
    hidden, inter = 48, 40
    counts = torch.tensor(TRITON_LOADS["skewed"], device=triton_backend)
    gen = torch.Generator().manual_seed(6)
    base = (torch.randn(25, hidden, generator=gen), torch.randn(4, 2 * inter, hidden, generator=gen) / hidden**0.5,
            torch.randn(4, hidden, inter, generator=gen) / inter**0.5)
    ours = [t.to(triton_backend, torch.bfloat16).requires_grad_() for t in base]
    refs = [t.to(torch.bfloat16).requires_grad_() for t in base]
    out = grouped_gated_mlp(ours[0], counts, *ours[1:], precision=precision)
    ref = grouped_gated_mlp_reference(refs[0], counts.cpu(), *refs[1:], "silu", precision)
    probe = torch.randn(out.shape, generator=gen).bfloat16()
    grads = torch.autograd.grad((out.cpu() * probe).sum(), ours)
    want = torch.autograd.grad((ref * probe).sum(), refs)
    tolerance("moe_grouped_triton_fwd", torch.bfloat16).assert_close(out.cpu(), ref, what=precision)
    for name, got, exp in zip(("dx", "dw_gate_up", "dw_down"), grads, want):
        tolerance("moe_grouped_triton_bwd", torch.bfloat16).assert_close(got.cpu(), exp, what=name)


# ---- the CPU path's GEMM: oneDNN for fp32 (MKL's fp32 sgemm runs AVX2 code on non-Intel CPUs).

def test_cpu_gemm_is_onednn_for_fp32_and_matmul_when_mkldnn_is_off():
    from plait.kernels.ops import moe_grouped

    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 16, generator=gen), torch.randn(5, 16, generator=gen)
    assert (moe_grouped._ONEDNN_LINEAR is not None) == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(moe_grouped.linear_nt(a, b), a @ b.t())
    # Transposed operands: the backward's weight-gradient form.
    c = torch.randn(7, 5, generator=gen)
    torch.testing.assert_close(moe_grouped.linear_nt(a.t(), c.t()), a.t() @ c)
    assert moe_grouped.linear_nt(a[:0], b).shape == (0, 5)
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(moe_grouped.linear_nt(a, b), a @ b.t())
    assert torch.equal(moe_grouped.linear_nt(a.double(), b.double()), a.double() @ b.double().t())
