"""Tiled MLP, tiled logits + cross-entropy and the offloaded checkpoint against their untiled torch
references: outputs and gradients (input and parameters), on a standard torch MLP and an HF
Llama MLP; the tiled loss never builds the full logits; gradient hooks fire once per backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.tolerances import tolerance
from plait.ulysses_sp import (
    TiledMLP,
    offloaded_checkpoint,
    tile_lm_head,
    tile_mlp,
    tiled_cross_entropy,
    untile_mlp,
)
from plait.ulysses_sp.tiled import chunk_sizes

TOL = tolerance("tiled_recompute", torch.float32)


def _swiglu_mlp(hidden: int = 16, inner: int = 40) -> nn.Module:
    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.Linear(inner, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    return SwiGLU()


def _grads(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    out = module(x)
    (out * weight).sum().backward()
    return (out.detach(), x.grad, *(p.grad for p in module.parameters()))


@pytest.mark.parametrize("chunks", [1, 3, 7, 64])
def test_tiled_mlp_equals_untiled(chunks):
    mlp = _swiglu_mlp()
    x = torch.randn(2, 23, 16)  # 23 tokens: uneven chunks; 64 chunks > 23 tokens -> one token each
    weight = torch.randn(2, 23, 16)
    want = _grads(copy.deepcopy(mlp), x, weight)
    got = _grads(TiledMLP(mlp, chunks=chunks), x, weight)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        TOL.assert_close(g, w, what=f"tiled mlp chunks={chunks} tensor {i}")


def test_tile_mlp_on_hf_llama_mlp_in_place_and_reversible():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=32, intermediate_size=88, hidden_act="silu"))
    names = [n for n, _ in mlp.named_parameters()]
    x, weight = torch.randn(1, 17, 32), torch.randn(1, 17, 32)
    want = _grads(copy.deepcopy(mlp), x, weight)
    tile_mlp(mlp, chunks=4)
    assert [n for n, _ in mlp.named_parameters()] == names  # state dict keys unchanged
    for i, (g, w) in enumerate(zip(_grads(mlp, x, weight), want, strict=True)):
        TOL.assert_close(g, w, what=f"llama mlp tensor {i}")
    untile_mlp(mlp)
    assert "forward" not in vars(mlp)


def test_tiled_mlp_parameter_hooks_fire_once_per_backward():
    mlp = _swiglu_mlp()
    calls = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    TiledMLP(mlp, chunks=5)(torch.randn(1, 20, 16)).sum().backward()
    assert len(calls) == len(list(mlp.parameters()))


@pytest.mark.parametrize("bias", [False, True])
def test_tiled_cross_entropy_equals_full_logits(bias):
    torch.manual_seed(1)
    head = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(2, 19, 16)
    labels = torch.randint(0, 50, (2, 19))
    labels[0, :5] = -100
    labels[1, -1] = -100

    h1 = hidden.clone().requires_grad_(True)
    ref = F.cross_entropy(head(h1).float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()
    want = (ref.detach(), h1.grad, head.weight.grad.clone(), *([head.bias.grad.clone()] if bias else []))
    head.zero_grad()

    h2 = hidden.clone().requires_grad_(True)
    got_loss = tiled_cross_entropy(h2, head.weight, labels, chunks=4, bias=head.bias)
    got_loss.backward()
    got = (got_loss.detach(), h2.grad, head.weight.grad, *([head.bias.grad] if bias else []))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        TOL.assert_close(g, w, what=f"tiled loss tensor {i}")


@pytest.mark.parametrize("seed", [0, 1])
def test_tiled_cross_entropy_bf16_head_matches_autograd_in_bf16(seed):
    """The gradients built in forward follow autograd's bf16 path: fp32 softmax, bf16 matmuls."""
    torch.manual_seed(seed)
    head = nn.Linear(64, 500, bias=True).to(torch.bfloat16)
    hidden = torch.randn(2, 37, 64).to(torch.bfloat16)
    labels = torch.randint(0, 500, (2, 37))
    labels[0, :5] = -100
    h1 = hidden.clone().requires_grad_(True)
    ref = F.cross_entropy(head(h1).float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()
    want = (h1.grad, head.weight.grad.clone(), head.bias.grad.clone())
    head.zero_grad()
    h2 = hidden.clone().requires_grad_(True)
    loss = tiled_cross_entropy(h2, head.weight, labels, chunks=4, bias=head.bias)
    (2 * loss).backward()  # the incoming gradient scales what forward built
    tol = tolerance("tiled_recompute", torch.bfloat16)
    tol.assert_close(loss.detach() / ref.detach(), torch.tensor(1.0), what="bf16 tiled loss / reference")
    for name, got, ref_grad in zip(("hidden", "weight", "bias"), (h2.grad, head.weight.grad, head.bias.grad), want,
                                   strict=True):
        assert got.dtype == torch.bfloat16, (name, got.dtype)
        scale = 2 * ref_grad.float().abs().max()
        tol.assert_close(got.float() / scale, 2 * ref_grad.float() / scale, what=f"bf16 tiled loss d{name} / max")


def test_tiled_cross_entropy_backward_runs_once():
    hidden = torch.randn(1, 6, 8, requires_grad=True)
    loss = tiled_cross_entropy(hidden, torch.randn(11, 8, requires_grad=True), torch.randint(0, 11, (1, 6)), chunks=2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


def test_tiled_cross_entropy_never_builds_full_logits(monkeypatch):
    seen = []
    real = torch.log_softmax

    def spy(logits, *args, **kwargs):
        seen.append(logits.shape[:-1].numel())  # tokens in this logits tensor
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    head = nn.Linear(8, 30, bias=False)
    hidden = torch.randn(1, 40, 8, requires_grad=True)
    tiled_cross_entropy(hidden, head.weight, torch.randint(0, 30, (1, 40)), chunks=8).backward()
    assert seen and max(seen) == 5 and len(seen) == 8  # 40 tokens / 8 chunks, in forward only: no recompute


@pytest.mark.parametrize("bias", [False, True])
def test_tile_lm_head_equals_full_logits_and_recomputes_chunks(bias, monkeypatch):
    """head(hidden, labels): the mean loss and every gradient of the untiled loss; logits only a
    chunk at a time, in forward and again in backward; head(hidden) still the logits."""
    torch.manual_seed(2)
    head = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(2, 19, 16)
    labels = torch.randint(0, 50, (2, 19))
    labels[0, :5] = -100
    h1 = hidden.clone().requires_grad_(True)
    ref = F.cross_entropy(head(h1).float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    want = (ref.detach(), h1.grad, head.weight.grad.clone(), *([head.bias.grad.clone()] if bias else []))
    head.zero_grad()
    tile_lm_head(head, chunks=4)
    seen = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.shape[:-1].numel()) or real(x, *a))
    h2 = hidden.clone().requires_grad_(True)
    loss = head(h2, labels)
    loss.backward()
    got = (loss.detach(), h2.grad, head.weight.grad, *([head.bias.grad] if bias else []))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        TOL.assert_close(g, w, what=f"tiled head loss tensor {i}")
    assert max(seen) == 10 and len(seen) == 8, seen  # 4 chunks of <= 5 tokens x 2, forward and backward
    assert head(hidden).shape == (2, 19, 50)
    untile_mlp(head)
    assert "forward" not in vars(head)


def test_tile_lm_head_bad_input():
    with pytest.raises(ValueError, match="nn.Linear"):
        tile_lm_head(nn.Embedding(3, 4), chunks=2)
    with pytest.raises(ValueError, match="chunks"):
        tile_lm_head(nn.Linear(4, 3), chunks=0)
    head = nn.Linear(4, 3)
    tile_lm_head(head, chunks=2)
    with pytest.raises(ValueError, match="labels"):
        head(torch.randn(1, 5, 4), torch.zeros(1, 4, dtype=torch.long))


def test_chunk_sizes_and_bad_input():
    assert chunk_sizes(10, 3) == [4, 3, 3]
    assert chunk_sizes(2, 5) == [1, 1]
    with pytest.raises(ValueError, match="chunks"):
        TiledMLP(nn.Identity(), chunks=0)
    with pytest.raises(ValueError, match="labels"):
        tiled_cross_entropy(torch.randn(1, 4, 8), torch.randn(3, 8), torch.zeros(1, 5, dtype=torch.long), chunks=2)


def test_offloaded_checkpoint_equals_plain_backward_and_keeps_a_host_copy():
    torch.manual_seed(2)
    layer = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 16))
    x, weight = torch.randn(3, 9, 16), torch.randn(3, 9, 16)
    ref_layer = copy.deepcopy(layer)

    torch.manual_seed(5)
    x1 = x.clone().requires_grad_(True)
    (ref_layer(x1) * weight).sum().backward()

    torch.manual_seed(5)  # same dropout mask, replayed by the recompute
    x2 = x.clone().requires_grad_(True)
    out = offloaded_checkpoint(layer, x2)
    assert out.grad_fn is not None and out.grad_fn.host_input.data_ptr() != x2.data_ptr()
    (out * weight).sum().backward()
    TOL.assert_close(x2.grad, x1.grad, what="offloaded checkpoint dx")
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters(), strict=True):
        TOL.assert_close(p.grad, q.grad, what=f"offloaded checkpoint d{name}")


class _Layer(nn.Module):
    """A pre-norm residual layer whose MLP is tiled, and an op after it that reads the MLP's value."""

    def __init__(self, chunks: int | None) -> None:
        super().__init__()
        self.norm, self.mlp, self.post = nn.LayerNorm(16), _swiglu_mlp(), nn.Linear(16, 16)
        if chunks:
            tile_mlp(self.mlp, chunks=chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.post(x + self.mlp(self.norm(x))))


@pytest.mark.parametrize("chunks", [1, 3])
def test_tiled_mlp_in_offloaded_checkpoint_runs_twice_and_equals_untiled(chunks):
    torch.manual_seed(3)
    x, weight = torch.randn(2, 11, 16), torch.randn(2, 11, 16)
    ref, layer = _Layer(None), _Layer(chunks)
    layer.load_state_dict(ref.state_dict())
    calls = []
    layer.mlp.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[1]))
    layer.mlp.gate.register_forward_pre_hook(lambda _m, args: calls.append(-args[0].shape[1]))

    x1 = x.clone().requires_grad_(True)
    (ref(x1) * weight).sum().backward()
    x2 = x.clone().requires_grad_(True)
    out = offloaded_checkpoint(layer, x2)
    (out * weight).sum().backward()

    gate_runs = [-n for n in calls if n < 0]
    # forward: every chunk once; the checkpoint's recompute: none (the output is replayed); backward: every chunk
    assert gate_runs == chunk_sizes(11, chunks) * 2, gate_runs
    TOL.assert_close(x2.grad, x1.grad, what="dx through the checkpointed tiled MLP")
    for (name, p), q in zip(layer.named_parameters(), ref.parameters(), strict=True):
        TOL.assert_close(p.grad, q.grad, what=f"d{name} through the checkpointed tiled MLP")
