"""Triton path of paged decode attention and of the fused rotary + KV-cache write.

Decode attention (``_paged_decode_kernel``). Grid ``(B, Hkv, num_splits)``: one program per
(sequence, kv head, token range). The program loads the whole GQA group of ``Hq / Hkv`` query
heads at once, so each cached k/v row is read from HBM once per group instead of once per query
head - the point of GQA at decode time. It walks its token range ``BLOCK_N`` tokens at a time,
translating token ``t`` to ``block_tables[b, t // block_size]`` and slot ``t % block_size`` (a
shift and a mask because block_size is a power of two, which is why the op insists on it), and
keeps an online softmax (running max ``m``, running sum ``l``, rescaled accumulator) in fp32, so
no score row is ever materialised. With one split it writes the normalised output directly; with
several (flash-decoding, for batches too small to fill the GPU) each split writes its normalised
partial output and log-sum-exp, and :func:`combine_splits` merges them in fp32.

Constants: the group is padded to at least 16 rows because ``tl.dot`` needs M >= 16 (the padding
rows are masked and cost tensor-core cycles only, which a memory-bound decode has to spare);
``BLOCK_N`` = 64 tokens keeps one k and one v tile of 128-wide bf16 heads (16 KiB each) in
registers/shared memory; the head dimension is padded to a power of two and masked. Splits
target two waves of programs over the SMs. (Reasoned, not tuned: written without a GPU.) Under the
interpreter ``BLOCK_N`` is 16 and operands are upcast to fp32 before ``tl.dot`` (the interpreter's
bf16 dot is wrong in Triton 3.x).

Rotary + cache write (``_write_kv_rotary_kernel``). Grid ``(T, ceil(max(Hq, Hkv) / BLOCK_H))``:
one program per token and head tile; it reads the token's cos/sin row once, rotates k (and q when
given) in fp32 and stores rotated k and v straight into the cache slot - so rotated k never makes
a round trip through HBM before the cache write. Rotation is done per element with a gathered
partner element and a sign, which covers both the NeoX (halves) and GPT-J (interleaved pairs)
layouts and partial rotary (dims past ``rot_dim`` pass through).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.inference_kernels.input_checks import next_power_of_two
from plait.inference_kernels.triton_matmul import mma as _mma
from plait.kernels.dispatch import check_triton_launch_mode


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale, tokens_per_split,
    s_qb, s_qh, s_qd,
    s_kn, s_ks, s_kh, s_kd,
    s_vn, s_vs, s_vh, s_vd,
    s_tb, s_tn,
    s_ob, s_oh, s_os, s_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
    WRITE_LSE: tl.constexpr,  # noqa: N803
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)  # int32 or int64 input: one loop-bound type
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    k_head = k_ptr + kv_head * s_kh
    v_head = v_ptr + kv_head * s_vh
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < end
        block = tl.load(tables_ptr + b * s_tb + (offs_t // BLOCK_SIZE) * s_tn, mask=t_ok, other=0)
        block = block.to(tl.int64)
        slot = offs_t % BLOCK_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + block[:, None] * s_kn + slot[:, None] * s_ks + offs_d[None, :] * s_kd,
                    mask=kv_mask, other=0.0)
        scores = _mma(q, tl.trans(k), tl.zeros((GROUP_PAD, BLOCK_N), dtype=tl.float32), UPCAST, IEEE)
        scores = tl.where(t_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + block[:, None] * s_vn + slot[:, None] * s_vs + offs_d[None, :] * s_vd,
                    mask=kv_mask, other=0.0)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
        m = m_new

    has_tokens = l_sum > 0.0
    out = acc / tl.where(has_tokens, l_sum, 1.0)[:, None]
    out_ptrs = out_ptr + b * s_ob + heads[:, None] * s_oh + split * s_os + offs_d[None, :] * s_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_tokens, m + tl.log(tl.where(has_tokens, l_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split,
                 lse, mask=g_ok)


def decode_tiles(head_dim: int, *, interpret: bool) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_D)`` for a head size (see the module comment)."""
    block_d = max(16, next_power_of_two(head_dim))
    if interpret:
        return 16, block_d
    return (32 if block_d > 128 else 64), block_d


def auto_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits so that about two waves of programs cover the GPU, each split >= 4 token tiles.

    Sized from the block table's capacity (a static upper bound), never from ``seq_lens``
    values, so choosing it needs no device sync.
    """
    if device.type != "cuda":
        return 1
    programs = batch * kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    wanted = -(-2 * sms // programs)
    return max(1, min(wanted, max_tokens // (4 * block_n)))


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge per-split normalised outputs ``[B, Hq, S, D]`` with their log-sum-exps ``[B, Hq, S]``.

    A split with no tokens has ``lse = -inf`` and weight 0; a sequence with no tokens gives zeros.
    """
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)
    total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return ((partial * weights.unsqueeze(-1)).sum(dim=2) / total)


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits):
    """Launch the decode kernel (inputs already validated); returns ``[B, Hq, D]`` in q's dtype."""
    check_triton_launch_mode(_paged_decode_kernel, q, op="paged decode attention")
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    interpret = not q.is_cuda
    block_n, block_d = decode_tiles(head_dim, interpret=interpret)
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = auto_num_splits(batch, kv_heads, max_tokens, block_n, q.device)
    per_split = -(-max(max_tokens, 1) // num_splits)
    per_split = -(-per_split // block_n) * block_n
    group = q_heads // kv_heads
    if num_splits == 1:
        out = torch.empty(batch, q_heads, 1, head_dim, dtype=q.dtype, device=q.device)
        lse = out  # unused placeholder pointer: WRITE_LSE is off
    else:
        out = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, lse,
        scale, per_split,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=max(16, next_power_of_two(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        UPCAST=interpret and q.dtype != torch.float32, IEEE=q.dtype == torch.float32,
        WRITE_LSE=num_splits > 1, num_warps=4, num_stages=2,
    )
    if num_splits == 1:
        return out.view(batch, q_heads, head_dim)
    return combine_splits(out, lse).to(q.dtype)


@triton.jit
def _rotate_tile(ptr, s_t, s_h, s_d, t, offs_h, h_ok, offs_d, partner, sign, cos, sin, HEAD_DIM: tl.constexpr):  # noqa: N803
    base = ptr + t * s_t + offs_h[:, None] * s_h
    mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(base + offs_d[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(base + partner[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    return x * cos[None, :] + sign[None, :] * x_partner * sin[None, :], mask


@triton.jit
def _write_kv_rotary_kernel(
    k_ptr, v_ptr, q_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    kv_heads, q_heads,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
    s_kcn, s_kcs, s_kch, s_kcd, s_vcn, s_vcs, s_vch, s_vcd, s_cs,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,  # noqa: N803
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HAS_Q: tl.constexpr,  # noqa: N803
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    half = ROT_DIM // 2
    if IS_NEOX:
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        cs_index = tl.where(first, offs_d, offs_d - half)
    else:
        first = offs_d % 2 == 0
        partner = tl.where(first, offs_d + 1, offs_d - 1)
        cs_index = offs_d // 2
    rotated = offs_d < ROT_DIM
    partner = tl.where(rotated, partner, offs_d)
    sign = tl.where(first, -1.0, 1.0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # Past rot_dim: cos = 1, sin = 0, so the pass-through dims go through the same formula.
    cos = tl.load(cos_sin_ptr + pos * s_cs + cs_index, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * s_cs + half + cs_index, mask=rotated, other=0.0).to(tl.float32)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kv_ok = (offs_h < kv_heads) & ((offs_h * 0 + slot) >= 0)
    k_rot, mask = _rotate_tile(k_ptr, s_kt, s_kh, s_kd, t, offs_h, kv_ok, offs_d, partner, sign, cos, sin,
                               HEAD_DIM)
    kc = k_cache_ptr + block * s_kcn + offset * s_kcs + offs_h[:, None] * s_kch + offs_d[None, :] * s_kcd
    tl.store(kc, k_rot.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :] * s_vd, mask=mask, other=0.0)
    vc = v_cache_ptr + block * s_vcn + offset * s_vcs + offs_h[:, None] * s_vch + offs_d[None, :] * s_vcd
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_Q:
        q_rot, q_mask = _rotate_tile(q_ptr, s_qt, s_qh, s_qd, t, offs_h, offs_h < q_heads, offs_d, partner,
                                     sign, cos, sin, HEAD_DIM)
        qo = q_out_ptr + t * s_ot + offs_h[:, None] * s_oh + offs_d[None, :] * s_od
        tl.store(qo, q_rot.to(q_out_ptr.dtype.element_ty), mask=q_mask)


def write_kv_rotary_triton(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q, is_neox):
    """Launch the rotary + cache-write kernel (inputs already validated); returns rotated q or None."""
    check_triton_launch_mode(_write_kv_rotary_kernel, k, op="write_kv_rotary")
    num_tokens, kv_heads, head_dim = k.shape
    if cos_sin_cache.stride(1) != 1:
        # The kernel indexes a cos/sin row with unit stride; copy only the rare strided cache.
        cos_sin_cache = cos_sin_cache.contiguous()
    q_heads = q.shape[1] if q is not None else 0
    q_out = torch.empty_like(q) if q is not None else None
    q_arg, q_out_arg = (q, q_out) if q is not None else (k, k)
    block_h = min(16, next_power_of_two(max(kv_heads, q_heads)))
    grid = (num_tokens, triton.cdiv(max(kv_heads, q_heads), block_h))
    _write_kv_rotary_kernel[grid](
        k, v, q_arg, q_out_arg, k_cache, v_cache, positions, cos_sin_cache, slot_mapping,
        kv_heads, q_heads,
        *k.stride(), *v.stride(), *q_arg.stride(), *q_out_arg.stride(),
        *k_cache.stride(), *v_cache.stride(), cos_sin_cache.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_two(head_dim), ROT_DIM=cos_sin_cache.shape[1],
        IS_NEOX=is_neox, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, HAS_Q=q is not None,
        num_warps=4,
    )
    return q_out


