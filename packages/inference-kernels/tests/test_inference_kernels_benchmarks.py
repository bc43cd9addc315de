"""The benchmark suite's own correctness: the peers compute the same thing as the ops, and the
GPU rows' code path runs end to end (on CPU, tiny sizes, a wall-clock timer, reference backend)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from plait.inference_kernels import fused_moe, paged_decode_attention, write_kv_rotary
from plait.inference_kernels.benchmarks.gpu import GpuPlan, gpu_rows
from plait.inference_kernels.benchmarks.peers import (
    EagerMixtralMoE,
    dense_sdpa_on_gathered_cache,
    eager_rotary_then_cache_write,
)
from plait.inference_kernels.benchmarks.suite import _checked_row, _paged_case
from plait.kernels.tolerances import tolerance


def test_eager_mixtral_peer_matches_fused_moe():
    torch.manual_seed(0)
    peer = EagerMixtralMoE(32, 24, 6, 2)
    w_gate_up, w_down = peer.stacked_weights()
    x = torch.randn(19, 32)
    with torch.no_grad():
        out = fused_moe(x, w_gate_up, w_down, peer.gate(x), top_k=2)
        tolerance("fused_moe_reference", torch.float32).assert_close(out, peer(x))


def test_dense_sdpa_peer_matches_paged_attention():
    args = _paged_case(3, 40, 8, 2, 64, 8)
    scale = 1 / math.sqrt(64)
    tolerance("paged_decode_attention_reference", torch.float32).assert_close(
        paged_decode_attention(*args, scale=scale), dense_sdpa_on_gathered_cache(*args, scale))


def test_eager_rotary_peer_matches_write_kv_rotary():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 5, 2, 32, generator=gen)
    q = torch.randn(5, 4, 32, generator=gen)
    positions, slots = torch.tensor([0, 3, 9, 2, 7]), torch.tensor([4, 0, 13, 31, 8])
    angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(0, 32, 2).float() / 32)
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    caches = [torch.zeros(4, 8, 2, 32) for _ in range(4)]
    q_ours = write_kv_rotary(k, v, positions, table, caches[0], caches[1], slots, q=q)
    q_peer = eager_rotary_then_cache_write(k, v, positions, table, caches[2], caches[3], slots, q)
    tol = tolerance("write_kv_rotary_fwd", torch.float32)
    tol.assert_close(q_ours, q_peer)
    tol.assert_close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


def test_checked_row_fails_on_mismatch_instead_of_timing():
    row = _checked_row("x", lambda: torch.ones(3), lambda: torch.zeros(3), "peer", "fused_moe_reference", steps=1)
    assert row.passed is False and "outputs differ" in row.note
    row = _checked_row("x", lambda: torch.ones(3), lambda: torch.ones(3), "peer", "fused_moe_reference", steps=2)
    assert row.ratio is not None and row.peer_value is not None


def _wall_clock(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_gpu_rows_code_path_runs_on_cpu():
    plan = GpuPlan(moe=(("tiny", 64, 32, 4, 2),), moe_tokens=(3,), paged=((2, 64, 4, 2, 32, 16),),
                   kv_write_tokens=(5,), rounds=2, copy_bytes=1 << 20, gemm_size=64, use_compile=False)
    rows = gpu_rows(True, device="cpu", timer=_wall_clock, plan=plan)
    names = [row.benchmark for row in rows]
    assert names[0].startswith("device copy bandwidth") and rows[0].ours > 0
    assert any(n.startswith("fused_moe tiny T=3") for n in names)
    assert any(n.startswith("paged_decode B=2") for n in names)
    assert any(n.startswith("write_kv_rotary T=5") for n in names)
    assert not any("CHECK FAILED" in n for n in names)
    liger = [row for row in rows if row.peer == "Liger-Kernel"]
    assert liger and all(row.passed is None for row in liger if row.peer_value is None)
    assert all(row.ours > 0 for row in rows if row.figure == "fraction of copy BW")


def test_transformers_peers_compute_what_the_ops_compute():
    """The HF peers are transformers' own modules and functions, and agree with plait's ops."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from plait.inference_kernels.benchmarks import hf_peers

    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(2))
    for impl in ("eager", "grouped_mm"):
        block = hf_peers.mixtral_block(32, 24, 6, 2, experts_implementation=impl)
        assert type(block) is MixtralSparseMoeBlock
        with torch.no_grad():
            ours = fused_moe(x, block.experts.gate_up_proj, block.experts.down_proj,
                             hf_peers.router_logits(block, x), top_k=2)
            tolerance("fused_moe_reference", torch.float32).assert_close(ours, block(x[None])[0])
    args = _paged_case(3, 40, 8, 2, 64, 8)
    tolerance("paged_decode_attention_reference", torch.float32).assert_close(
        paged_decode_attention(*args, scale=0.125), hf_peers.sdpa_on_gathered_cache(*args, 0.125))
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 5, 2, 32, generator=gen)
    q = torch.randn(5, 4, 32, generator=gen)
    positions, slots = torch.tensor([0, 3, 9, 2, 7]), torch.tensor([4, 0, 13, 31, 8])
    angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(0, 32, 2).float() / 32)
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    caches = [torch.zeros(4, 8, 2, 32) for _ in range(4)]
    q_ours = write_kv_rotary(k, v, positions, table, caches[0], caches[1], slots, q=q)
    q_hf = hf_peers.rotary_then_cache_write(k, v, positions, table, caches[2], caches[3], slots, q)
    tol = tolerance("write_kv_rotary_fwd", torch.float32)
    tol.assert_close(q_ours, q_hf)
    tol.assert_close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


def test_suite_rows_name_transformers_peers_or_say_why_not(monkeypatch):
    from plait.inference_kernels.benchmarks import hf_peers, suite

    rows = suite.paged_rows(True, steps=1) + suite.kv_write_rows(True, steps=1)
    if hf_peers.transformers_version() is not None:
        assert all(row.peer.startswith("transformers ") and row.peer_value is not None for row in rows)
    monkeypatch.setattr(hf_peers, "transformers_version", lambda: None)
    rows = suite.paged_rows(True, steps=1) + suite.kv_write_rows(True, steps=1)
    assert rows and all(row.peer_value is None and "transformers not installed" in row.note for row in rows)


def test_patching_rows_time_transformers_own_modules():
    pytest.importorskip("transformers")
    from plait.inference_kernels.patching import benchmark

    rows = benchmark.module_rows(True, steps=1)
    assert {row.peer for row in rows} == {"transformers LlamaRMSNorm (unpatched)", "transformers LlamaMLP (unpatched)"}
    assert all(row.peer_value is not None and row.ratio is not None for row in rows)
