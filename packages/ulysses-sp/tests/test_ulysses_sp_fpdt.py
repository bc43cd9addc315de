"""FPDT's chunked attention (``plait.ulysses_sp.fpdt``) against ``F.scaled_dot_product_attention`` on
the whole sequence: outputs and q/k/v gradients, causal and not, boolean masks, GQA/MQA, chunk
sizes that do not divide the length; no block larger than a chunk x chunk; bad input refused.
Under Ulysses with HF models it is checked in ``test_ulysses_sp_hf.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels.testing.distributed import run_distributed
from plait.kernels.tolerances import tolerance
from plait.ulysses_sp import DistributedAttention
from plait.ulysses_sp.fpdt import HostChunks, chunked_attention

TOL = tolerance("tiled_recompute", torch.float32)


def _reference(q, k, v, mask, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if causal and mask is not None:
        mask = mask & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def _grads(fn, q, k, v, g):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("seq", "chunk"), [(13, 4), (16, 16), (20, 7), (9, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_attention_equals_sdpa(causal, kv_heads, seq, chunk, masked):
    gen = torch.Generator().manual_seed(seq * 10 + kv_heads)
    q = torch.randn(2, 4, seq, 8, generator=gen)
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=gen) for _ in range(2))
    g = torch.randn(2, 4, seq, 8, generator=gen)
    mask = None
    if masked:  # random padding-like holes; every query keeps itself (as global_mask guarantees)
        mask = (torch.rand(2, 1, seq, seq, generator=gen) > 0.3) | torch.eye(seq, dtype=torch.bool)
    want = _grads(lambda a, b, c: _reference(a, b, c, mask, causal), q, k, v, g)
    got = _grads(lambda a, b, c: chunked_attention(a, b, c, mask, is_causal=causal, chunk=chunk), q, k, v, g)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        TOL.assert_close(x, y, what=f"chunked attention {name} causal={causal} kv={kv_heads} seq={seq} chunk={chunk}")


def test_chunked_attention_float64_is_exact_to_rounding_and_bf16_runs_in_fp32():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out = chunked_attention(q, k, v, is_causal=True, chunk=3)
    torch.testing.assert_close(out, _reference(q, k, v, None, True), rtol=1e-12, atol=1e-12)
    half = chunked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, chunk=3)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), out, rtol=0.02, atol=0.02)


def test_no_score_block_larger_than_a_chunk(monkeypatch):
    shapes = []
    real = torch.Tensor.exp_

    def spy(self):
        shapes.append(tuple(self.shape[-2:]))
        return real(self)

    monkeypatch.setattr(torch.Tensor, "exp_", spy)
    q = torch.randn(1, 2, 24, 4, requires_grad=True)
    chunked_attention(q, q, q, is_causal=True, chunk=5).sum().backward()
    blocks = [s for s in shapes if len(s) == 2 and s[0] > 1]
    assert blocks and max(max(s) for s in blocks) <= 5, blocks


def test_host_chunks_on_cpu_are_views_not_copies():
    t = torch.randn(1, 2, 10, 4)
    chunks = HostChunks(t, [4, 3, 3])
    chunks.prefetch(1)
    assert len(chunks) == 3 and chunks.get(1).data_ptr() == t[:, :, 4:].data_ptr()


def _distributed_fpdt() -> float:
    import functools

    import torch.distributed as dist

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 10, 8, generator=gen) for _ in range(3))
    want = _reference(q, k, v, None, True)
    rank = dist.get_rank()
    local = [t[:, :, 5 * rank:5 * rank + 5] for t in (q, k, v)]
    attn = DistributedAttention(functools.partial(chunked_attention, chunk=3))
    TOL.assert_close(attn(*local, is_causal=True), want[:, :, 5 * rank:5 * rank + 5], what="sp=2 fpdt")
    return 1.0


def test_chunked_attention_as_distributed_attentions_callable_sp2():
    assert run_distributed(_distributed_fpdt, 2, timeout=120) == [1.0, 1.0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"chunk": 0}, "chunk"),
    ({"attn_mask": torch.zeros(6, 6)}, "boolean"),
    ({"window": 3}, "unsupported"),
])
def test_bad_input_is_refused(kwargs, match):
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=match):
        chunked_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        chunked_attention(torch.randn(1, 3, 6, 4), q, q)


def test_inside_an_offloaded_checkpoint_the_recompute_skips_the_attention_blocks(monkeypatch):
    from plait.ulysses_sp import fpdt, offloaded_checkpoint

    runs = []
    real = fpdt._forward_blocks
    monkeypatch.setattr(fpdt, "_forward_blocks", lambda *a: runs.append(1) or real(*a))
    torch.manual_seed(6)
    proj = torch.nn.Linear(8, 24)

    def layer(x, attention):
        q, k, v = proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)  # 3 x [B, 2 heads, S, 4]
        return torch.tanh(attention(q, k, v)).transpose(1, 2).flatten(2)

    x = torch.randn(2, 11, 8)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    layer(x1, lambda q, k, v: _reference(q, k, v, None, True)).sum().backward()
    want = (x1.grad, proj.weight.grad.clone())
    proj.zero_grad()
    out = offloaded_checkpoint(lambda t: layer(t, lambda q, k, v: chunked_attention(q, k, v, is_causal=True, chunk=4)),
                               x2)
    out.sum().backward()
    assert runs == [1]  # the checkpoint's forward only: its recompute reuses the output and log-sum-exp
    TOL.assert_close(x2.grad, want[0], what="dx through checkpointed FPDT")
    TOL.assert_close(proj.weight.grad, want[1], what="dW through checkpointed FPDT")
