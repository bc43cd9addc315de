"""Paged decode attention and the fused rotary + KV-cache write.

Oracles: dense attention on each sequence's gathered cache with the softmax in float64, and a
float64 complex-number rotation for RoPE. The Triton paths run on CUDA when there is a GPU and
otherwise under the Triton CPU interpreter. Caches use shuffled block tables whose unused entries
are garbage (-1), odd lengths (0, 1, a partial last block, a full table) and GQA group sizes
1 (MHA), 4 and 8 (MQA).
"""

from __future__ import annotations

import math

import pytest
import torch

from plait.inference_kernels import (
    paged_decode_attention,
    paged_decode_attention_reference,
    write_kv_rotary,
    write_kv_rotary_reference,
)
from plait.kernels.tolerances import tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (q heads, kv heads, head size, block size, seq lens)
CASES = (
    (8, 2, 80, 8, (1, 37, 0)),
    (4, 4, 32, 4, (17, 40)),
    (8, 1, 64, 16, (64, 5, 33, 2)),
)
CASE_IDS = ("G4-D80-bs8", "MHA-D32-bs4", "MQA-D64-bs16")




def _paged_inputs(case, dtype, *, device="cpu", seed=0, spare_blocks=3):
    q_heads, kv_heads, head_dim, block_size, lens = case
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare column of garbage
    num_blocks = len(lens) * max_blocks + spare_blocks
    cast = {"device": device, "dtype": dtype}
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen).to(**cast)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(**cast)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(**cast)
    perm = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    used = torch.arange(max_blocks) * block_size < torch.tensor(lens)[:, None]
    tables = torch.where(used, perm, -1).to(device=device, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens


def dense_oracle(q, k_cache, v_cache, tables, seq_lens, scale):
    """Per sequence: gather its tokens, expand kv heads for GQA, softmax in float64."""
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        token = torch.arange(n)
        blocks = tables[b].long().cpu()[token // block_size]
        k = k_cache.cpu()[blocks, token % block_size].double().repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache.cpu()[blocks, token % block_size].double().repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_matches_dense_attention_on_gathered_cache(case, dtype):
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(case, dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    scale = 1 / math.sqrt(case[2])
    oracle = dense_oracle(q, k_cache, v_cache, tables, seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance("paged_decode_attention_reference", dtype).assert_close(out, oracle.to(dtype), what=f"{case}")


@pytest.mark.parametrize("num_splits", (1, 3, None), ids=("one-split", "three-splits", "auto"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_triton_matches_reference(triton_backend, case, dtype, num_splits):
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(case, dtype, device=triton_backend)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.3, num_splits=num_splits)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, 0.3)
    tolerance("paged_decode_attention_fwd", dtype).assert_close(out, expected, what=f"{case} splits={num_splits}")
    assert torch.all(out[seq_lens == 0] == 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_non_contiguous_inputs(triton_backend, monkeypatch, dtype):
    case = CASES[0]
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(case, dtype, device=triton_backend)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, 0.1)
    # q as the first half of a fused projection, k/v as views into one [blocks, 2, ...] kv tensor,
    # the block table transposed in storage.
    q_wide = torch.cat((q, torch.zeros_like(q)), dim=-1)[..., : case[2]]
    kv = torch.stack((k_cache, v_cache), dim=1)
    tables_t = tables.long().T.contiguous().T  # int64 indices, transposed storage
    args = (q_wide, kv[:, 0], kv[:, 1], tables_t, seq_lens.long())
    assert not (q_wide.is_contiguous() or kv[:, 0].is_contiguous() or tables_t.is_contiguous())
    tolerance("paged_decode_attention_fwd", dtype).assert_close(
        paged_decode_attention(*args, scale=0.1, num_splits=2), expected, what="strided triton")
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    torch.testing.assert_close(paged_decode_attention(*args, scale=0.1), expected, atol=0, rtol=0)


def test_gradients_take_the_differentiable_reference(triton_backend):
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(CASES[1], torch.float32, device=triton_backend)
    q = q.requires_grad_()
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens).square().sum().backward()
    q_ref = q.detach().clone().requires_grad_()
    expected = paged_decode_attention_reference(q_ref, k_cache, v_cache, tables, seq_lens, 1 / math.sqrt(32))
    expected.square().sum().backward()
    torch.testing.assert_close(q.grad, q_ref.grad)


def _rope_table(max_positions, rot_dim, base=10000.0):
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _complex_rotation(x, positions, rot_dim, is_neox, base=10000.0):
    """Float64 oracle: rotate channel pairs as complex numbers by position * inv_freq."""
    x = x.double()
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    rotor = torch.polar(torch.ones(1, dtype=torch.float64), positions.double()[:, None] * inv_freq)[:, None]
    head = x[..., :rot_dim]
    if is_neox:
        z = torch.complex(head[..., : rot_dim // 2], head[..., rot_dim // 2:]) * rotor
        rotated = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(head[..., 0::2], head[..., 1::2]) * rotor
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot_dim:]), dim=-1)


def _kv_write_inputs(dtype, device, *, kv_heads=2, q_heads=6, head_dim=64, block_size=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = 5
    # q, k, v as views of one fused qkv projection output: non-contiguous, as in a real model.
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv.split((q_heads, kv_heads, kv_heads), dim=1)
    positions = torch.tensor([0, 7, 300, 31, 2], device=device)
    slots = torch.tensor([3, -1, 17, 40, 8], device=device)
    caches = [torch.randn(6, block_size, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
              for _ in range(2)]
    return q, k, v, positions, slots, caches


@pytest.mark.parametrize("rot_dim", (64, 32), ids=("full-rotary", "partial-rotary"))
@pytest.mark.parametrize("is_neox", (True, False), ids=("neox", "gptj"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_write_kv_rotary_triton_and_reference(triton_backend, monkeypatch, dtype, is_neox, rot_dim):
    q, k, v, positions, slots, (k_cache, v_cache) = _kv_write_inputs(dtype, triton_backend)
    table = _rope_table(512, rot_dim).to(triton_backend)
    caches_triton = (k_cache.clone(), v_cache.clone())
    caches_ref = (k_cache.clone(), v_cache.clone())
    q_triton = write_kv_rotary(k, v, positions, table, *caches_triton, slots, q=q, is_neox=is_neox)
    q_ref = write_kv_rotary_reference(k, v, positions, table, *caches_ref, slots, q, is_neox)
    tol = tolerance("write_kv_rotary_fwd", dtype)
    tol.assert_close(q_triton, q_ref, what="q")
    tol.assert_close(caches_triton[0], caches_ref[0], what="k cache")
    assert torch.equal(caches_triton[1], caches_ref[1])  # v is copied, never rounded
    # Skipped slot (-1) and untouched slots keep their old contents.
    written = torch.zeros(6 * 8, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = ~written.view(6, 8)
    assert torch.equal(caches_triton[0][untouched], k_cache[untouched])
    # The reference against float64 complex rotation.
    keep = (slots >= 0).cpu()
    oracle_k = _complex_rotation(k.cpu(), positions.cpu(), rot_dim, is_neox)[keep]
    stored_k = caches_ref[0].cpu().view(-1, 2, 64)[slots.cpu()[keep]]
    tolerance("write_kv_rotary_fwd", dtype).assert_close(stored_k, oracle_k.to(dtype), what="k vs complex")
    tol.assert_close(q_ref.cpu(), _complex_rotation(q.cpu(), positions.cpu(), rot_dim, is_neox).to(dtype),
                     what="q vs complex")


def test_write_kv_rotary_many_heads_and_cache_views(triton_backend, monkeypatch):
    """More q heads than one head tile (20 > 16), block size 4, caches as views of a kv tensor."""
    q, k, v, positions, slots, _ = _kv_write_inputs(torch.bfloat16, triton_backend, kv_heads=4, q_heads=20,
                                                    head_dim=32, block_size=4)
    table = _rope_table(512, 32).to(triton_backend)
    results = []
    for backend in ("triton", "reference"):
        monkeypatch.setenv("PLAIT_KERNEL_BACKEND", backend)
        kv = torch.zeros(12, 2, 4, 4, 32, dtype=torch.bfloat16, device=triton_backend)
        q_rot = write_kv_rotary(k, v, positions, table, kv[:, 0], kv[:, 1], slots, q=q, is_neox=False)
        results.append((q_rot, kv))
    tol = tolerance("write_kv_rotary_fwd", torch.bfloat16)
    tol.assert_close(results[0][0], results[1][0], what="q, 20 heads")
    tol.assert_close(results[0][1], results[1][1], what="kv cache views")


def test_write_kv_rotary_without_q_and_empty(triton_backend):
    q, k, v, positions, slots, (k_cache, v_cache) = _kv_write_inputs(torch.float32, triton_backend)
    table = _rope_table(512, 64).to(triton_backend)
    assert write_kv_rotary(k, v, positions, table, k_cache, v_cache, slots) is None
    assert torch.equal(v_cache.view(-1, 2, 64)[17], v[2])
    empty = write_kv_rotary(k[:0], v[:0], positions[:0], table, k_cache, v_cache, slots[:0], q=q[:0])
    assert empty.shape == (0, 6, 64)


def test_decode_step_end_to_end(triton_backend):
    """Write a history with write_kv_rotary, attend with the paged kernel: equals dense RoPE attention."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, q_heads, head_dim, block_size, n = 2, 4, 32, 4, 11
    table = _rope_table(64, head_dim).to(triton_backend)
    k_cache = torch.zeros(8, block_size, kv_heads, head_dim, device=triton_backend)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([5, 0, 6], device=triton_backend)
    positions = torch.arange(n, device=triton_backend)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(triton_backend)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(triton_backend)
    q = torch.randn(n, q_heads, head_dim, generator=gen).to(triton_backend)
    q_rot = write_kv_rotary(k, v, positions, table, k_cache, v_cache, slots, q=q)
    out = paged_decode_attention(q_rot[-1:], k_cache, v_cache, blocks[None].int(), torch.tensor([n]).int()
                                 .to(triton_backend))
    k_rot = _complex_rotation(k.cpu(), positions.cpu(), head_dim, True).repeat_interleave(2, dim=1)
    q_last = _complex_rotation(q.cpu(), positions.cpu(), head_dim, True)[-1]
    probs = torch.softmax(torch.einsum("hd,thd->ht", q_last, k_rot) / math.sqrt(head_dim), dim=-1)
    dense = torch.einsum("ht,thd->hd", probs, v.cpu().double().repeat_interleave(2, dim=1))
    tolerance("paged_decode_attention_reference", torch.float32).assert_close(out[0].cpu(), dense.float())


def _attention_args(**overrides):
    q, k_cache, v_cache, tables, seq_lens = _paged_inputs(CASES[0], torch.float32)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "seq_lens": seq_lens}
    args.update(overrides)
    return args


@pytest.mark.parametrize(("overrides", "message"), [
    ({"k_cache": torch.zeros(10, 12, 2, 80), "v_cache": torch.zeros(10, 12, 2, 80)}, "block_size=12 .* power of two"),
    ({"q": torch.zeros(3, 8, 48), "k_cache": torch.zeros(10, 8, 2, 48), "v_cache": torch.zeros(10, 8, 2, 48)},
     "head size 48 .* not supported; supported head sizes are 32, 64, 80"),
    ({"q": torch.zeros(3, 6, 80), "k_cache": torch.zeros(10, 8, 4, 80), "v_cache": torch.zeros(10, 8, 4, 80)},
     "num_q_heads % num_kv_heads"),
    ({"q": torch.zeros(3, 8, 80, dtype=torch.bfloat16)}, "share one dtype"),
    ({"k_cache": torch.zeros(10, 8, 2, 80, dtype=torch.float64)}, "k_cache has dtype torch.float64"),
    ({"v_cache": torch.zeros(10, 8, 2, 80, dtype=torch.uint8)}, "supported dtypes"),
    ({"seq_lens": torch.tensor([1, 49, 0], dtype=torch.int32)}, "seq_lens holds values in \\[0, 49\\]"),
    ({"block_tables": torch.full((3, 6), 99, dtype=torch.int32)}, "block_tables \\(used entries\\)"),
    ({"block_tables": torch.zeros(3, 6)}, "torch.int32 or torch.int64"),
    ({"seq_lens": torch.tensor([1, 2], dtype=torch.int32)}, "one row per sequence"),
    ({"scale": -1.0}, "scale=-1.0 must be a positive"),
    ({"num_splits": 0}, "num_splits=0"),
])
def test_bad_attention_input_is_refused_before_launch(triton_backend, overrides, message):
    args = _attention_args(**overrides)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


@pytest.mark.parametrize(("change", "message"), [
    ("odd_rot", "cos_sin_cache has 31 columns"),
    ("long_rot", "cos_sin_cache has 66 columns"),
    ("slot", "slot_mapping holds values in \\[-1, 48\\]"),
    ("position", "positions holds values in \\[0, 300\\]"),
    ("k_shape", "must both be \\[T, num_kv_heads, head_size\\]"),
    ("q_dtype", "share one dtype"),
])
def test_bad_kv_write_input_is_refused_before_launch(triton_backend, change, message):
    q, k, v, positions, slots, (k_cache, v_cache) = _kv_write_inputs(torch.float32, triton_backend)
    table = _rope_table(512, 64)
    if change == "odd_rot":
        table = table[:, :31]
    elif change == "long_rot":
        table = torch.zeros(512, 66)
    elif change == "slot":
        slots = slots.clone()
        slots[0] = 48
    elif change == "position":
        table = table[:300]
    elif change == "k_shape":
        k = k[:, :1]
    elif change == "q_dtype":
        q = q.half()
    before = k_cache.clone()
    with pytest.raises(ValueError, match=message):
        write_kv_rotary(k, v, positions, table, k_cache, v_cache, slots, q=q)
    assert torch.equal(k_cache, before)  # refused before anything was written
