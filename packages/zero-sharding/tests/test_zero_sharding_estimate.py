"""``plait estimate``: the table's rows are the formulas the memory ledger is tested against
(``test_zero_sharding_bytes_memory.py`` checks :func:`zero_formula_bytes` and the estimate's rows
without offload against the measured :func:`model_state_bytes` at W=2 and W=4; the cross-package
``tests/test_estimate_offload_ledger.py`` checks the offload rows against a run with plait-offload-io),
the offload split adds up, counts parse, an HF config is counted on the meta device, and bad input
is refused by name."""

from __future__ import annotations

import argparse

import pytest
import torch

from plait.zero_sharding.estimate import count_hf_parameters, estimate, parse_count, register, run, table
from plait.zero_sharding.memory import zero_formula_bytes


@pytest.mark.parametrize(("text", "count"), [("7B", 7 * 10**9), ("1.3b", 1_300_000_000), ("350M", 350 * 10**6),
                                             ("7e9", 7 * 10**9), ("124439808", 124_439_808), ("2K", 2000)])
def test_counts_parse(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["7Q", "", "-3B", "0"])
def test_bad_counts_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--params"):
        parse_count(text)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_without_offload_are_the_ledgers_formula(dtype: torch.dtype) -> None:
    psi = 1_234_567
    for row in estimate(psi, world_sizes=[1, 2, 8], dtype=dtype):
        if row.offload == "none":
            assert row.host_bytes == 0
            assert row.device_bytes == zero_formula_bytes(psi, stage=row.stage, world_size=row.world_size,
                                                          compute_dtype=dtype, grad_dtype=dtype,
                                                          optimizer_state_bytes=8)


def test_offload_moves_master_optimizer_and_gradient_shard_to_the_host() -> None:
    psi, world = 8_000_000, 4
    rows = {(r.stage, r.offload): r for r in estimate(psi, world_sizes=[world], dtype=torch.bfloat16)}
    assert (1, "optimizer") not in rows and (2, "all") not in rows  # plait offloads at stages 2/3; params at 3
    shard = psi / world
    assert rows[2, "optimizer"].device_bytes == 2 * psi
    assert rows[3, "optimizer"].device_bytes == 2 * shard
    assert rows[2, "optimizer"].host_bytes == rows[3, "optimizer"].host_bytes == (4 + 8 + 2) * shard
    assert rows[3, "all"].device_bytes == 0 and rows[3, "all"].host_bytes == (4 + 8 + 2 + 2) * shard
    # ZeRO-3 in bf16 with AdamW: the paper's 16 bytes per parameter over the ranks, however it is split.
    assert rows[3, "none"].device_bytes == rows[3, "all"].host_bytes == 16 * shard


def test_hf_config_is_counted_on_the_meta_device(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    config.save_pretrained(tmp_path)
    real = transformers.AutoModelForCausalLM.from_config(config)
    assert count_hf_parameters(str(tmp_path / "config.json")) == sum(p.numel() for p in real.parameters())
    assert count_hf_parameters(str(tmp_path)) == sum(p.numel() for p in real.parameters())
    with pytest.raises(ValueError, match="--hf-config"):
        count_hf_parameters(str(tmp_path / "missing"))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["estimate", *argv])


def test_command_prints_the_table_and_refuses_bad_input(capsys) -> None:
    assert run(_parse(["--params", "7B", "--nodes", "1", "2"])) == 0
    out = capsys.readouterr().out
    assert "| 16 | 2 | 3 | optimizer |" in out and out.count("\n| 8 | 1 |") == 6
    assert run(_parse(["--params", "7B", "--ranks-per-node", "0"])) == 2
    assert "--ranks-per-node" in capsys.readouterr().out


def test_table_shows_host_memory_per_node() -> None:
    rows = estimate(8 * 10**9, world_sizes=[16])
    text = table(rows, num_params=8 * 10**9, ranks_per_node=8)
    row = next(r for r in rows if (r.stage, r.offload) == (3, "optimizer"))
    assert f"| {row.host_bytes * 8 / (1 << 30):.3g} |" in text
