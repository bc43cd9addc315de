"""plait's MoE ops (grouped gated MLP, token permutation, combine) as ``torch.library`` custom ops:
``opcheck`` on small shapes, their registered backwards equal to eager autograd bit for bit, and a
routed MoE step under ``torch.compile(fullgraph=True)`` (inductor on CPU) equal to eager."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.ops import (
    combine_rows,
    gelu_and_mul,
    grouped_gated_mlp,
    permute_by_expert,
    permute_tokens,
    rms_norm,
    silu_and_mul,
)
from plait.kernels.ops.gated_activation import gated_activation_reference

# Without opcheck's "test_aot_dispatch_dynamic" (a compile per op, most of this file's CI time): the
# compiled tests below trace every op through dynamo and AOTAutograd.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _moe_inputs(rows=12, experts=4, hidden=16, inter=8, *, empty_expert=True):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts - (1 if empty_expert else 0), (rows,), generator=gen)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(rows, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w_down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    return x, counts, w_gate_up, w_down


def _routing(rows=10):
    token = torch.tensor([3, 0, 7, 1, 1, 9, 4, 0, 2, 8, 5, 6, 3][:rows])
    return token, torch.rand(token.shape[0], generator=torch.Generator().manual_seed(2))


def _grads_of(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.square().sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves if leaf.is_floating_point()]


def _assert_compiled_equals_eager(fn, *tensors, backend="inductor"):
    eager_out, eager_grads = _grads_of(fn, *tensors)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    compiled_out, compiled_grads = _grads_of(compiled, *tensors)
    assert torch.equal(compiled_out, eager_out)
    assert len(compiled_grads) == len(eager_grads)
    for got, want in zip(compiled_grads, eager_grads):
        assert torch.equal(got, want)


def test_grouped_gated_mlp_opcheck():
    x, counts, w_gate_up, w_down = _moe_inputs()
    args = (x.requires_grad_(), counts, w_gate_up.requires_grad_(), w_down.requires_grad_(), "gelu_tanh", "input",
            False)
    torch.library.opcheck(torch.ops.plait.grouped_gated_mlp.default, args, test_utils=OPCHECK_TESTS)


def test_grouped_gated_mlp_op_backward_equals_eager_autograd_bitwise():
    """The op's registered backward (gate_up recomputed) gives the autograd Function's bits."""
    x, counts, w_gate_up, w_down = _moe_inputs(rows=40, hidden=32, inter=16)
    eager_out, eager_grads = _grads_of(lambda *t: grouped_gated_mlp(t[0], counts, t[1], t[2]), x, w_gate_up, w_down)
    op_out, op_grads = _grads_of(
        lambda *t: torch.ops.plait.grouped_gated_mlp(t[0], counts, t[1], t[2], "silu", "input", False),
        x, w_gate_up, w_down)
    assert torch.equal(op_out, eager_out)
    for got, want in zip(op_grads, eager_grads):
        assert torch.equal(got, want)


def test_grouped_gated_mlp_op_refuses_counts_that_miss_rows():
    x, counts, w_gate_up, w_down = _moe_inputs()
    counts = counts.clone()
    counts[0] += 1
    with pytest.raises(ValueError, match="counts sum to 13 but x has 12 rows"):
        torch.ops.plait.grouped_gated_mlp(x, counts, w_gate_up, w_down, "silu", "input", False)


def test_moe_permutation_and_grouped_mlp_compile_into_one_graph():
    """Routing ids to the combined output (permute, grouped GEMMs, combine): one graph, no break, and
    inductor's outputs and gradients (x, both weights, routing weights) are eager's, bit for bit."""
    x, _, w_gate_up, w_down = _moe_inputs(rows=10)
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [2, 1], [0, 1], [1, 2], [0, 2], [2, 1], [0, 1]])
    weights = torch.rand(10, 2, generator=torch.Generator().manual_seed(1))

    def fn(x, w_gate_up, w_down, weights):
        order, counts = permute_by_expert(ids.reshape(-1), w_gate_up.shape[0])
        token = order // 2
        out = grouped_gated_mlp(permute_tokens(x, token), counts, w_gate_up, w_down)
        return combine_rows(out, token, weights.reshape(-1).index_select(0, order), x.shape[0])

    _assert_compiled_equals_eager(fn, x, w_gate_up, w_down, weights)


def test_grouped_gated_mlp_op_backward_bf16_serving_precision_equals_eager_bitwise():
    """precision="fp32" on bf16: the op's backward (no autograd inside it) gives eager's bits."""
    x, counts, w_gate_up, w_down = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _moe_inputs())
    eager_out, eager_grads = _grads_of(
        lambda *t: grouped_gated_mlp(t[0], counts, t[1], t[2], precision="fp32"), x, w_gate_up, w_down)
    op_out, op_grads = _grads_of(
        lambda *t: torch.ops.plait.grouped_gated_mlp(t[0], counts, t[1], t[2], "silu", "fp32", False),
        x, w_gate_up, w_down)
    assert torch.equal(op_out, eager_out)
    for got, want in zip(op_grads, eager_grads):
        assert torch.equal(got, want)


def test_permute_and_combine_opcheck():
    x, _, _, _ = _moe_inputs(rows=10)
    token, weights = _routing(13)
    rows = torch.randn(13, x.shape[1], generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.plait.permute_tokens.default, (x.requires_grad_(), token, False),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.plait.combine_rows.default,
                          (rows.requires_grad_(), token, weights.requires_grad_(), 10, False), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_combine_op_backwards_equal_eager_autograd_bitwise(dtype):
    """The ops' registered backwards (autograd's steps written out) give autograd's bits."""
    token, weights = _routing(13)
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    rows = torch.randn(13, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    pairs = [
        (lambda x: permute_tokens(x, token), lambda x: torch.ops.plait.permute_tokens(x, token, False), (x,)),
        (lambda r, w: combine_rows(r, token, w, 10),
         lambda r, w: torch.ops.plait.combine_rows(r, token, w, 10, False), (rows, weights)),
    ]
    for eager_fn, op_fn, inputs in pairs:
        eager_out, eager_grads = _grads_of(eager_fn, *inputs)
        op_out, op_grads = _grads_of(op_fn, *inputs)
        assert torch.equal(op_out, eager_out)
        for got, want in zip(op_grads, eager_grads, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_op_backward_equals_eager_autograd_bitwise(activation, dtype):
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    eager_out, (eager_grad,) = _grads_of(lambda x: gated_activation_reference(x, activation), x)
    op_out, (op_grad,) = _grads_of(lambda x: torch.ops.plait.gated_activation(x, activation, False), x)
    assert torch.equal(op_out, eager_out) and torch.equal(op_grad, eager_grad)


def test_gated_activation_opcheck_and_compiled_equals_eager():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    torch.library.opcheck(torch.ops.plait.gated_activation.default, (x.clone().requires_grad_(), "silu", False),
                          test_utils=OPCHECK_TESTS)
    _assert_compiled_equals_eager(lambda x: silu_and_mul(x) + gelu_and_mul(x, "tanh"), x, backend="aot_eager")


def test_ops_triton_branches_match_the_torch_branches(triton_backend):
    """Each op's Triton branch (the interpreter on CPU) and its registered Triton backward agree with
    the torch branch within fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 32, generator=gen)
    counts = torch.tensor([3, 0, 5, 4])
    w_gate_up, w_down = torch.randn(4, 32, 32, generator=gen) * 0.2, torch.randn(4, 32, 16, generator=gen) * 0.2
    token, weights = torch.tensor([0, 3, 3, 5, 1, 11, 2]), torch.rand(7, generator=gen)
    cases = {
        "grouped": (lambda t, x, a, b: torch.ops.plait.grouped_gated_mlp(x, counts, a, b, "silu", "input", t),
                    (x, w_gate_up, w_down)),
        "permute": (lambda t, x: torch.ops.plait.permute_tokens(x, token, t), (x,)),
        "combine": (lambda t, r, w: torch.ops.plait.combine_rows(r, token, w, 12, t), (x[:7], weights)),
        "gated": (lambda t, x: torch.ops.plait.gated_activation(x, "silu", t), (x,)),
        "rms_norm": (lambda t, x, w: torch.ops.plait.rms_norm(x, w, 1e-6, 0.0, t), (x, weights[:1].expand(32))),
        "fused_add_rms_norm": (lambda t, x, r, w: sum(torch.ops.plait.fused_add_rms_norm(x, r, w, 1e-6, 1.0, t)),
                               (x, x.flip(0), torch.rand(32, generator=gen))),
    }
    for name, (fn, inputs) in cases.items():
        moved = [t.to(triton_backend) for t in inputs]
        torch_out, torch_grads = _grads_of(lambda *ts, fn=fn: fn(False, *ts), *moved)
        triton_out, triton_grads = _grads_of(lambda *ts, fn=fn: fn(True, *ts), *moved)
        for got, want in zip([triton_out, *triton_grads], [torch_out, *torch_grads], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)])
def test_rms_norm_op_backward_equals_eager_autograd_bitwise(residual, dtype, weight_dtype):
    """Both outputs used (y and, with a residual, h): the op's backward gives autograd's bits."""
    gen = torch.Generator().manual_seed(8)
    x, res = (torch.randn(3, 4, 64, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.rand(64, generator=gen) + 0.5).to(weight_dtype)
    from plait.kernels.ops.rms_norm import rms_norm_reference

    if residual:
        def eager(x, r, w):
            return sum(rms_norm_reference(x, w, 1e-6, residual=r, offset=0.5))

        def op(x, r, w):
            return sum(torch.ops.plait.fused_add_rms_norm(x, r, w, 1e-6, 0.5, False))

        inputs = (x, res, weight)
    else:
        def eager(x, w):
            return rms_norm_reference(x, w, 1e-6)

        def op(x, w):
            return torch.ops.plait.rms_norm(x, w, 1e-6, 0.0, False)

        inputs = (x, weight)
    eager_out, eager_grads = _grads_of(eager, *inputs)
    op_out, op_grads = _grads_of(op, *inputs)
    assert torch.equal(op_out, eager_out)
    for got, want in zip(op_grads, eager_grads, strict=True):
        assert torch.equal(got, want)


def test_rms_norm_opcheck_and_compiled_equals_eager():
    gen = torch.Generator().manual_seed(9)
    x, res, weight = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen), torch.rand(32, generator=gen)
    torch.library.opcheck(torch.ops.plait.rms_norm.default,
                          (x.clone().requires_grad_(), weight.clone().requires_grad_(), 1e-6, 0.0, False),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.plait.fused_add_rms_norm.default,
                          (x.clone().requires_grad_(), res.clone().requires_grad_(), weight.clone().requires_grad_(),
                           1e-6, 0.0, False), test_utils=OPCHECK_TESTS)

    def fn(x, r, w):
        y, h = rms_norm(x, w, 1e-6, residual=r)
        return rms_norm(y + h, w, 1e-5)

    _assert_compiled_equals_eager(fn, x, res, weight, backend="aot_eager")
