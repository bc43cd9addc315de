"""Fused MoE: reference against a per-expert float64 loop, Triton against the reference, errors.

The Triton path runs on CUDA when there is a GPU and otherwise under the Triton CPU interpreter
(``TRITON_INTERPRET=1`` with ``PLAIT_KERNEL_BACKEND=triton``). Shapes are small and odd (hidden
and intermediate sizes that are not multiples of the tiles, experts that receive no tokens) so
the masking and the block padding of the permutation are exercised.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from plait.inference_kernels import (
    FusedMoE,
    FusedMoEConfig,
    align_tokens_to_blocks,
    fused_experts,
    fused_experts_reference,
    fused_moe,
    topk_routing,
    topk_routing_reference,
)
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (tokens, hidden, intermediate, experts, top_k): odd sizes, an expert count above the tokens
# (experts with no rows), top_k 1 (no combine), and a token count over several row tiles.
SHAPES = ((7, 48, 40, 4, 2), (3, 33, 20, 8, 1), (37, 64, 24, 5, 3))
SHAPE_IDS = ("T7-H48-I40-E4-k2", "T3-H33-I20-E8-k1", "T37-H64-I24-E5-k3")




def _moe_inputs(shape, dtype, *, device="cpu", seed=0):
    tokens, hidden, inter, experts, top_k = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen) * 2
    cast = {"device": device, "dtype": dtype}
    return x.to(**cast), w_gate_up.to(**cast), w_down.to(**cast), logits.to(device)


def per_expert_loop(x, w_gate_up, w_down, weights, ids, activation="silu"):
    """The oracle: for each expert, pick its (token, slot) pairs and run the MLP in float64."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        h = x[token].double() @ w_gate_up[expert].double().T
        y = (act(h[:, :inter]) * h[:, inter:]) @ w_down[expert].double().T
        out.index_add_(0, token, y * weights[token, slot].double()[:, None])
    return out


@pytest.mark.parametrize("activation", ("silu", "gelu", "gelu_tanh"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_reference_matches_per_expert_loop(shape, dtype, activation):
    x, w_gate_up, w_down, logits = _moe_inputs(shape, dtype)
    weights, ids = topk_routing(logits, shape[4])
    out = fused_experts_reference(x, w_gate_up, w_down, weights, ids, activation)
    oracle = per_expert_loop(x, w_gate_up, w_down, weights, ids, activation)
    assert out.dtype == dtype and out.shape == x.shape
    tolerance("fused_moe_reference", dtype).assert_close(out, oracle.to(dtype), what=f"moe ref {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_triton_matches_reference(triton_backend, shape, dtype):
    x, w_gate_up, w_down, logits = _moe_inputs(shape, dtype, device=triton_backend)
    out = fused_moe(x, w_gate_up, w_down, logits, top_k=shape[4])
    weights, ids = topk_routing(logits, shape[4])
    expected = fused_experts_reference(x, w_gate_up, w_down, weights, ids)
    tolerance("fused_moe_fwd", dtype).assert_close(out, expected, what=f"moe triton {shape} {dtype}")


@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh"))
def test_triton_other_activations(triton_backend, activation):
    x, w_gate_up, w_down, logits = _moe_inputs(SHAPES[0], torch.float32, device=triton_backend)
    weights, ids = topk_routing(logits, 2, renormalize=False)
    out = fused_experts(x, w_gate_up, w_down, weights, ids, activation=activation)
    expected = fused_experts_reference(x, w_gate_up, w_down, weights, ids, activation)
    tolerance("fused_moe_fwd", torch.float32).assert_close(out, expected, what=activation)


def _strided(x, w_gate_up, w_down):
    """Same values, non-contiguous storage: a column slice, and weights stored transposed."""
    wide = torch.zeros(x.shape[0], x.shape[1] * 2, dtype=x.dtype, device=x.device)
    wide[:, ::2] = x
    w_gu_t = w_gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    w_d_t = w_down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not wide[:, ::2].is_contiguous() and not w_gu_t.is_contiguous()
    return wide[:, ::2], w_gu_t, w_d_t


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_non_contiguous_inputs(triton_backend, monkeypatch, dtype):
    x, w_gate_up, w_down, logits = _moe_inputs(SHAPES[2], dtype, device=triton_backend)
    weights, ids = topk_routing(logits, 3)
    ids_t = ids.T.contiguous().T  # non-contiguous ids and weights too
    weights_t = weights.T.contiguous().T
    expected = fused_experts_reference(x, w_gate_up, w_down, weights, ids)
    args = (*_strided(x, w_gate_up, w_down), weights_t, ids_t)
    out_triton = fused_experts(*args)
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    out_reference = fused_experts(*args)
    tolerance("fused_moe_fwd", dtype).assert_close(out_triton, expected, what="strided triton")
    torch.testing.assert_close(out_reference, expected, atol=0, rtol=0)


def test_topk_routing_softmax_and_renormalisation():
    logits = torch.randn(9, 6, dtype=torch.bfloat16)
    weights, ids = topk_routing(logits, 2)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    assert torch.equal(ids.long(), probs.topk(2).indices)
    raw, _ = topk_routing(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, probs.gather(1, ids.long()))


@pytest.mark.parametrize("renormalize", (True, False), ids=("renorm", "raw"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), ((1, 8, 2), (19, 5, 3), (33, 60, 4), (7, 130, 1)))
def test_triton_routing_matches_reference(triton_backend, tokens, experts, top_k, dtype, renormalize):
    gen = torch.Generator().manual_seed(tokens)
    wide = (torch.randn(experts * 2, tokens, generator=gen) * 3).to(device=triton_backend, dtype=dtype)
    logits = wide[::2].T  # non-contiguous [T, E] view
    weights, ids = topk_routing(logits, top_k, renormalize=renormalize)
    ref_weights, ref_ids = topk_routing_reference(logits, top_k, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, top_k)
    # bf16/fp16 logits tie often; between equal probabilities either expert is a correct pick, so
    # compare the probabilities the ids select (and that no expert is picked twice).
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()))
    assert all(len(set(row)) == top_k for row in ids.tolist())
    tolerance("topk_routing_fwd", dtype).assert_close(weights, ref_weights, what=f"routing {experts} {dtype}")


@pytest.mark.parametrize("block_m", (1, 4, 16))
def test_alignment_invariants(block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 2]], dtype=torch.int32)
    a = align_tokens_to_blocks(ids, 6, block_m)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat.long(), minlength=6)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(a.num_padded) == padded and padded % block_m == 0
    real = a.sorted_ids[:padded]
    assert sorted(real[real < flat.numel()].tolist()) == list(range(flat.numel()))  # each row once
    assert torch.all(a.sorted_ids[padded:] == flat.numel())
    for block in range(padded // block_m):
        rows = real[block * block_m:(block + 1) * block_m]
        rows = rows[rows < flat.numel()]
        assert rows.numel() > 0 and torch.all(flat[rows.long()] == a.block_experts[block])
        assert torch.equal(rows, rows.sort().values)  # stable: original order inside an expert


def _mixtral_like_loop(x, gates, ups, downs, router, top_k):
    """HF Mixtral's sparse MoE block, written out: per expert, index the routed tokens, run w1/w3/w2."""
    probs = torch.softmax(router(x).float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(len(gates)):
        token, slot = torch.where(ids == e)
        h = F.silu(x[token] @ gates[e].T) * (x[token] @ ups[e].T)
        out.index_add_(0, token, (h @ downs[e].T) * weights[token, slot, None])
    return out


def test_module_loads_experts_and_matches_mixtral_loop():
    cfg = FusedMoEConfig(num_experts=4, hidden_size=24, intermediate_size=12, top_k=2)
    layer = FusedMoE(cfg)
    gen = torch.Generator().manual_seed(3)
    gates = [torch.randn(12, 24, generator=gen) / 5 for _ in range(4)]
    ups = [torch.randn(12, 24, generator=gen) / 5 for _ in range(4)]
    downs = [torch.randn(24, 12, generator=gen) / 4 for _ in range(4)]
    layer.load_experts(gates, ups, downs)
    x = torch.randn(2, 5, 24, generator=gen)
    with torch.no_grad():
        out = layer(x)
        expected = _mixtral_like_loop(x.reshape(-1, 24), gates, ups, downs, layer.gate, 2).view(2, 5, 24)
    assert out.shape == x.shape
    tolerance("fused_moe_reference", torch.float32).assert_close(out, expected, what="module vs mixtral loop")
    with pytest.raises(ValueError, match="expected \\(12, 24\\)"):
        layer.load_experts(gates, ups[:3] + [torch.zeros(24, 12)], downs)
    with pytest.raises(ValueError, match="last dimension|expects"):
        layer(torch.zeros(3, 23))


def test_gradients_flow_through_the_triton_backward_kernels(triton_backend):
    """With gradients the op units run one by one on their Triton forward and backward kernels."""
    x, w_gate_up, w_down, logits = _moe_inputs(SHAPES[0], torch.float32, device=triton_backend)
    params = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down)]
    fused_moe(*params, logits, top_k=2).square().sum().backward()
    weights, ids = topk_routing(logits, 2)
    oracle_in = [t.double().requires_grad_() for t in (x, w_gate_up, w_down)]
    per_expert_loop(*oracle_in, weights, ids).square().sum().backward()
    for got, want in zip(params, oracle_in, strict=True):
        torch.testing.assert_close(got.grad, want.grad.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_serving_numerics_are_the_shared_op_units_with_fp32_activation(dtype):
    """The CPU path is plait-kernels' permutation, grouped GEMM and combine (the op units training
    uses) with ``precision="fp32"``, bitwise; training's ``"input"`` precision gives other bits."""
    from plait.kernels.ops import combine_rows, grouped_gated_mlp, permute_by_expert, permute_tokens

    x, w_gate_up, w_down, logits = _moe_inputs(SHAPES[2], dtype)
    weights, ids = topk_routing(logits, 3)
    order, counts = permute_by_expert(ids.reshape(-1), w_gate_up.shape[0])
    token = order // 3
    rows = permute_tokens(x, token)
    route_w = weights.reshape(-1)[order]
    served, trained = (combine_rows(grouped_gated_mlp(rows, counts, w_gate_up, w_down, precision=p), token,
                                    route_w, x.shape[0]) for p in ("fp32", "input"))
    out = fused_experts_reference(x, w_gate_up, w_down, weights, ids)
    assert torch.equal(out, served) and not torch.equal(out, trained)


def test_no_tokens(triton_backend):
    x, w_gate_up, w_down, logits = _moe_inputs((0, 16, 8, 3, 2), torch.float32, device=triton_backend)
    assert fused_moe(x, w_gate_up, w_down, logits, top_k=2).shape == (0, 16)


def _bad(**overrides):
    x, w_gate_up, w_down, logits = _moe_inputs(SHAPES[0], torch.float32)
    weights, ids = topk_routing(logits, 2)
    args = {"hidden": x, "w_gate_up": w_gate_up, "w_down": w_down, "topk_weights": weights, "topk_ids": ids}
    args.update(overrides)
    activation = args.pop("activation", "silu")
    return lambda: fused_experts(**args, activation=activation)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden": torch.zeros(7, 48, dtype=torch.float64)}, "hidden has dtype torch.float64"),
    ({"hidden": torch.zeros(7, 48, dtype=torch.int32)}, "supported dtypes"),
    ({"w_down": torch.zeros(4, 48, 40, dtype=torch.float16)}, "share one dtype"),
    ({"w_gate_up": torch.zeros(4, 79, 48)}, "must be \\[E, 2\\*I, H\\]"),
    ({"w_down": torch.zeros(4, 48, 41)}, "w_down has shape"),
    ({"topk_ids": torch.zeros(7, 2)}, "torch.int32 or torch.int64"),
    ({"topk_ids": torch.full((7, 2), 4, dtype=torch.int32)}, "must lie in \\[0, 4\\)"),
    ({"topk_ids": torch.zeros(6, 2, dtype=torch.int32)}, "T=7"),
    ({"activation": "relu"}, "activation='relu' is not supported"),
])
def test_bad_input_is_refused_before_launch(triton_backend, overrides, message):
    with pytest.raises(ValueError, match=message):
        _bad(**overrides)()


def test_bad_routing_and_config_are_refused():
    with pytest.raises(ValueError, match="top_k=5 must be an int in \\[1, 4\\]"):
        topk_routing(torch.zeros(3, 4), 5)
    x, w_gate_up, w_down, _ = _moe_inputs(SHAPES[0], torch.float32)
    with pytest.raises(ValueError, match="router_logits has shape"):
        fused_moe(x, w_gate_up, w_down, torch.zeros(7, 5), top_k=2)
    with pytest.raises(ValueError, match="FusedMoEConfig.top_k=3"):
        FusedMoEConfig(num_experts=2, hidden_size=8, intermediate_size=8, top_k=3)
    with pytest.raises(ValueError, match="FusedMoEConfig.hidden_size=0"):
        FusedMoEConfig(num_experts=2, hidden_size=0, intermediate_size=8, top_k=1)
    with pytest.raises(ValueError, match="FusedMoEConfig.activation"):
        FusedMoEConfig(num_experts=2, hidden_size=8, intermediate_size=8, top_k=1, activation="tanh")


def test_package_import_needs_neither_triton_nor_transformers():
    code = ("import sys, plait.inference_kernels, plait.inference_kernels.benchmarks.suite; "
            "print('triton' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "False"]
