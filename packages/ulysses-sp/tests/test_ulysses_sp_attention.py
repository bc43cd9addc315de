"""DistributedAttention against single-process SDPA on the whole sequence, forward and backward, at
sp 2 and 4 on gloo: even and uneven heads, GQA/MQA with fewer kv heads than ranks, causal and
padding masks, odd sequence lengths; and the ledger's all-to-all bytes against the formula."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing.distributed import run_distributed
from plait.kernels.tolerances import tolerance
from plait.ulysses_sp import DistributedAttention, HeadLayout, shard_sequence, sp_group

# (name, q heads, kv heads, seq, causal, padded): seq 13 and 11 are odd, so shard_sequence pads.
CASES = [
    ("mha", 4, 4, 16, True, False),
    ("uneven_heads", 6, 6, 13, True, False),
    ("gqa_kv2", 8, 2, 12, True, False),
    ("mqa_kv1", 4, 1, 11, True, True),
    ("noncausal_padded", 5, 5, 10, False, True),
]
HEAD_DIM, BATCH = 8, 2


def _inputs(q_heads: int, kv_heads: int, seq: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(q_heads * 100 + kv_heads * 10 + seq)
    q = torch.randn(BATCH, q_heads, seq, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=gen)
    weight = torch.randn(BATCH, q_heads, seq, HEAD_DIM, generator=gen)
    lengths = torch.tensor([seq, seq - 3])  # sample 1 is right-padded by 3 tokens
    # The loss ignores padded positions (as a masked LM loss does): their outputs are weighted 0.
    weight = weight * (torch.arange(seq)[None, :] < lengths[:, None])[:, None, :, None]
    return q, k, v, weight, lengths


def _reference(q, k, v, weight, lengths, causal: bool, padded: bool):
    """Per sample, SDPA on its real tokens only (kv heads repeated): an oracle that knows no masks."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(BATCH):
        n = int(lengths[b]) if padded else q.shape[2]
        kk = k[b:b + 1, :, :n].repeat_interleave(group, 1)
        vv = v[b:b + 1, :, :n].repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q[b:b + 1, :, :n], kk, vv, is_causal=causal)
        outs.append(F.pad(out, (0, 0, 0, q.shape[2] - n)))
    out = torch.cat(outs)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _check_cases() -> dict[str, int]:
    sp = sp_group(None)
    attn = DistributedAttention()
    sent = {}
    for name, q_heads, kv_heads, seq, causal, padded in CASES:
        q, k, v, weight, lengths = _inputs(q_heads, kv_heads, seq)
        ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, weight, lengths, causal, padded)
        local = [shard_sequence(t, sp, dim=2).clone().requires_grad_(True) for t in (q, k, v)]
        w_local = shard_sequence(weight, sp, dim=2)
        mask = None
        if padded:
            total = local[0].shape[2] * sp.size
            mask = torch.arange(total)[None, :] < lengths[:, None]
        with ByteLedger() as ledger:
            out = attn(*local, is_causal=causal, key_padding_mask=mask)
            forward_bytes = ledger.total(op="all_to_all")
            (out * w_local).sum().backward()
        layout = HeadLayout.build(sp=sp.size, q_heads=q_heads, kv_heads=kv_heads)
        formula = layout.bytes_per_layer(batch=BATCH, seq=local[0].shape[2] * sp.size, head_dim=HEAD_DIM, itemsize=4,
                                         rank=sp.rank)
        assert forward_bytes == formula, (name, forward_bytes, formula)
        backward = layout.bytes_per_layer(batch=BATCH, seq=local[0].shape[2] * sp.size, head_dim=HEAD_DIM,
                                          itemsize=4, rank=sp.rank, backward=True)
        assert ledger.total(op="all_to_all") == formula + backward, (name, ledger.total(op="all_to_all"), backward)
        tol = tolerance("ulysses_attention", torch.float32)
        real = lengths if padded else torch.full((BATCH,), seq)
        keep = torch.arange(local[0].shape[2] * sp.size)[None, :] < real[:, None]
        keep_local = shard_sequence(keep, sp)[:, None, :, None]
        for what, got, want in (("out", out, ref_out), ("dq", local[0].grad, ref_dq), ("dk", local[1].grad, ref_dk),
                                ("dv", local[2].grad, ref_dv)):
            want_local = shard_sequence(want, sp, dim=2)
            tol.assert_close(got.detach() * keep_local, want_local * keep_local, what=f"{name} {what} sp={sp.size}")
        sent[name] = forward_bytes
    return sent


def test_distributed_attention_sp2_equals_single_process():
    sent = run_distributed(_check_cases, 2, timeout=120)
    assert all(set(s) == {case[0] for case in CASES} for s in sent)
    assert sent[0]["mha"] == sent[1]["mha"] and sent[0]["noncausal_padded"] != sent[1]["noncausal_padded"]


def test_distributed_attention_sp4_equals_single_process():
    sent = run_distributed(_check_cases, 4, timeout=150)
    assert all(set(s) == {case[0] for case in CASES} for s in sent)


def test_bytes_per_layer_is_4nh_over_p_and_constant_when_n_and_p_grow_together():
    # Multi-head attention: 4 N h / P x itemsize, the Ulysses paper's per-link volume.
    for sp, seq in ((2, 1024), (4, 2048), (8, 4096)):
        layout = HeadLayout.build(sp=sp, q_heads=8, kv_heads=8)
        for rank in range(sp):
            for backward in (False, True):
                got = layout.bytes_per_layer(batch=1, seq=seq, head_dim=64, itemsize=2, rank=rank, backward=backward)
                assert got == 4 * seq * (8 * 64) // sp * 2 == 4 * 512 * 512 * 2
    # MQA with kv=1 < sp=4: the single kv head goes to every rank (replicated, not an error).
    mqa = HeadLayout.build(sp=4, q_heads=4, kv_heads=1)
    assert mqa.kv_index == ((0,), (0,), (0,), (0,))
    # Uneven heads: 6 over 4 ranks -> 2, 2, 1, 1.
    assert HeadLayout.build(sp=4, q_heads=6, kv_heads=6).q_splits == (2, 2, 1, 1)
