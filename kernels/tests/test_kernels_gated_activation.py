"""silu_and_mul / gelu_and_mul: the Triton kernel (under the interpreter) against the reference,
forward and backward, over dtypes and odd / non-contiguous shapes; the reference against the
textbook formula; and bad input refused before launch."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from plait.kernels.ops.gated_activation import gated_activation_reference, gelu_and_mul, silu_and_mul
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu": lambda x: gelu_and_mul(x, approximate="none"),
    "gelu_tanh": lambda x: gelu_and_mul(x, approximate="tanh"),
}


def _input(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Inputs of the shapes the tests cover; values ~N(0, 2) so the activations' bends are hit."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 2).to(dtype)

    if kind == "row":
        return randn(2)  # d = 1, a single element per half
    if kind == "odd":
        return randn(3, 5, 2 * 37)  # d = 37: not a power of two, masked tail
    if kind == "wide":
        return randn(2, 2 * 1100)  # d > 1024: two column blocks per row
    if kind == "row_strided":
        return randn(4, 3 * 2 * 24)[:, 8 : 8 + 2 * 24]  # a slice: unit last stride, row stride 144
    if kind == "transposed":
        return randn(2 * 10, 6).t()  # last dim has stride 6: forces the contiguous copy
    if kind == "empty":
        return randn(0, 2 * 8)
    raise AssertionError(kind)


SHAPES = ("row", "odd", "wide", "row_strided", "transposed", "empty")




@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", SHAPES)
def test_triton_matches_reference_forward_and_backward(triton_backend, activation, dtype, kind):
    x = _input(kind, dtype)
    d = x.shape[-1] // 2
    grad_out = (torch.randn(*x.shape[:-1], d, generator=torch.Generator().manual_seed(1))).to(dtype)

    x_kernel = x.detach().clone().requires_grad_()
    y_kernel = ACTIVATIONS[activation](x_kernel)
    y_kernel.backward(grad_out)

    x_ref = x.detach().clone().requires_grad_()
    y_ref = gated_activation_reference(x_ref, activation)
    y_ref.backward(grad_out)

    assert y_kernel.shape == (*x.shape[:-1], d) and y_kernel.dtype == dtype
    what = f"{activation} {kind} {dtype}"
    tolerance("gated_activation_fwd", dtype).assert_close(y_kernel, y_ref, what=what + " fwd")
    tolerance("gated_activation_bwd", dtype).assert_close(x_kernel.grad, x_ref.grad, what=what + " dx")


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_triton_inference_path_needs_no_grad(triton_backend, activation):
    x = _input("odd", torch.float32)
    with torch.no_grad():
        y = ACTIVATIONS[activation](x)
    tolerance("gated_activation_fwd", torch.float32).assert_close(y, gated_activation_reference(x, activation))
    assert not y.requires_grad


def test_reference_is_the_textbook_formula():
    x = _input("odd", torch.float32)
    gate, up = x.chunk(2, dim=-1)
    # fp32 in, fp32 compute: the reference must be bit-identical to HF's act_fn(gate) * up.
    assert torch.equal(silu_and_mul(x), F.silu(gate) * up)
    assert torch.equal(gelu_and_mul(x), F.gelu(gate) * up)
    assert torch.equal(gelu_and_mul(x, "tanh"), F.gelu(gate, approximate="tanh") * up)


def test_cpu_auto_backend_is_the_reference(monkeypatch):
    monkeypatch.delenv("PLAIT_KERNEL_BACKEND", raising=False)
    x = _input("odd", torch.bfloat16).requires_grad_()
    y = silu_and_mul(x)
    assert torch.equal(y, gated_activation_reference(x, "silu"))
    y.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_reference_gradient_matches_finite_differences():
    x = _input("odd", torch.float64)[:1, :2].detach().requires_grad_()
    # float64 is outside the supported dtypes of the public op, so check the reference directly.
    for activation in ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda t, a=activation: gated_activation_reference(t, a), (x,))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(3, 5), "odd"),
        (torch.zeros(3, 4, dtype=torch.float64), "dtype"),
        (torch.zeros(3, 4, dtype=torch.int32), "dtype"),
        (torch.tensor(1.0), "scalar"),
    ],
)
def test_bad_input_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        silu_and_mul(bad)
    with pytest.raises(ValueError, match=message):
        gelu_and_mul(bad)


def test_bad_input_is_refused_on_the_triton_path_before_launch(triton_backend):
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul(torch.zeros(2, 7))


def test_unknown_gelu_approximation_and_non_tensor():
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(torch.zeros(2, 4), approximate="sigmoid")
    with pytest.raises(TypeError, match="torch.Tensor"):
        silu_and_mul([1.0, 2.0])


def test_forcing_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        silu_and_mul(torch.zeros(2, 4))


def test_module_forms():
    from plait.kernels.ops import GeluAndMul, SiluAndMul

    x = _input("odd", torch.float32)
    assert torch.equal(SiluAndMul()(x), silu_and_mul(x))
    assert torch.equal(GeluAndMul("tanh")(x), gelu_and_mul(x, "tanh"))
    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("fast")
