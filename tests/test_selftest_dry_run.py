"""``plait selftest``'s CPU dry run, in every CI run, so the GPU script cannot rot unnoticed: the
real command in a subprocess (Triton interpreter where Triton imports, tiny shapes, gloo), its
checks found by import name as on a machine where plait is not installed, every row PASS or a SKIP
that says why, and its first line saying it is a dry run. Plus the framework's
own rules: caps, filters, no committed results from a dry run.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from plait.kernels.cli.main import main
from plait.kernels.selftest import core
from plait.kernels.selftest.core import (
    FAIL,
    PASS,
    SKIP,
    Check,
    Outcome,
    SelftestContext,
    Skip,
    run_all,
    run_one,
    selected,
)

PROVIDERS = {"kernels", "inference_kernels", "zero_sharding", "offload_io"}


@pytest.mark.timeout(200)
def test_dry_run_command_passes_every_row(tmp_path):
    out = tmp_path / "selftest.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PLAIT_KERNEL_BACKEND")}
    start = time.monotonic()
    # --discovery import-names: how the command finds its checks on a lent GPU machine, where plait
    # runs from the source tree with no installed metadata
    proc = subprocess.run([sys.executable, "-m", "plait.kernels.cli.main", "selftest", "--device", "cpu",
                           "--discovery", "import-names", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env)
    seconds = time.monotonic() - start
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert lines[0].startswith("dry run: no GPU"), lines[:2]
    assert lines[1].startswith("checks from import names"), lines[1]
    assert {name.strip() for name in lines[1].split(": ", 1)[1].split(";")[0].split(",")} >= PROVIDERS, lines[1]
    assert lines[1].split(": ", 1)[1].startswith("kernels,"), lines[1]
    assert seconds < 180, seconds  # the bound for the dry run on two busy cores
    payload = json.loads(out.read_text())
    assert payload["meta"]["dry_run"] is True and payload["meta"]["driver"] == "n/a"
    assert payload["meta"]["discovery"].startswith("import names")
    assert payload["meta"]["command"].endswith("--json selftest.json")  # no machine path in a results file
    rows = payload["rows"]
    names = {row["benchmark"] for row in rows}
    assert {"kernels/rms_norm", "kernels/grouped_mlp", "inference-kernels/paged_decode_attention",
            "inference-kernels/hf llama", "zero-sharding/zero3", "zero-sharding/zero3-world2",
            "offload-io/zero3 nvme offload"} <= names
    for row in rows:
        if row["passed"] is None:  # a SKIP must give its reason
            assert row["note"].startswith("SKIP") and len(row["note"]) > len("SKIP, 0.0 s; ") + 10, row
        else:
            assert row["passed"] is True and row["note"].startswith("PASS"), row
        if row["figure"] == "share of copy BW":  # never presented as a GPU figure
            assert "not a GPU figure" in row["note"], row
    accuracy = [row for row in rows if row["figure"] == "max err / bound"]
    assert len(accuracy) >= 10 and all(0 <= row["ours"] <= 1 for row in accuracy)
    # a package README's table: the rows of its own checks only
    table = subprocess.run([sys.executable, "-m", "plait.kernels.cli.main", "selftest", "--table", str(out),
                            "--only", "zero-sharding/"], capture_output=True, text=True, timeout=60, env=env).stdout
    assert "zero-sharding/zero3-world2" in table and "kernels/rms_norm" not in table, table


def test_update_results_is_refused_on_a_dry_run(capsys):
    assert main(["selftest", "--device", "cpu", "--update-results"]) == 2
    assert "refused on a dry run" in capsys.readouterr().out


def test_only_and_skip_filters():
    checks = [Check(name, lambda ctx: Outcome(PASS)) for name in ("kernels/rms_norm", "kernels/bw rms_norm",
                                                                   "zero-sharding/zero3")]
    assert [c.name for c in selected(checks, ["kernels/*"], ["*bw*"])] == ["kernels/rms_norm"]
    assert [c.name for c in selected(checks, ["zero"], [])] == ["zero-sharding/zero3"]
    assert len(selected(checks, [], [])) == 3


def test_cap_skip_and_error_become_rows():
    ctx = SelftestContext(device=torch.device("cpu"), dry_run=True)

    def slow(ctx):
        time.sleep(0.05)
        ctx.deadline.check("case 2")
        return Outcome(PASS)

    def skipped(ctx):
        raise Skip("needs a GPU")

    def broken(ctx):
        raise RuntimeError("boom\nsecond line")

    capped = run_one(Check("x/slow", slow, cap_s=0.01), ctx)
    assert capped.outcome.status == FAIL and "time cap reached before case 2" in capped.outcome.note
    assert run_one(Check("x/skip", skipped), ctx).outcome == Outcome(SKIP, note="needs a GPU")
    assert run_one(Check("x/err", broken), ctx).outcome.note == "RuntimeError: boom"


def test_budget_cuts_caps_and_skips_what_is_left(monkeypatch):
    monkeypatch.setattr(core, "MIN_LEFT_S", 0.2)
    ctx = SelftestContext(device=torch.device("cpu"), dry_run=True)

    def slow(ctx):
        while True:
            time.sleep(0.02)
            ctx.deadline.check("the next case")

    rows = run_all([Check("x/slow", slow, cap_s=60), Check("x/after", lambda ctx: Outcome(PASS))], ctx,
                   budget_s=0.4, out=io.StringIO())
    assert rows[0].outcome.status == FAIL and rows[0].seconds < 5  # capped at the budget, not at 60 s
    assert rows[1].outcome.status == SKIP and "--only 'x/after'" in rows[1].outcome.note


def test_entry_point_discovery_and_a_broken_provider(monkeypatch):
    from importlib import metadata

    from plait.kernels.cli import registry
    from plait.kernels.selftest.discover import all_checks, discover

    declared = {"kernels": metadata.EntryPoint("kernels", "plait.kernels.selftest:checks", "plait.selftest"),
                "broken": metadata.EntryPoint("broken", "plait.no_such_package.selftest:checks", "plait.selftest")}
    monkeypatch.setattr(registry, "entry_points", lambda group: dict(declared) if group == "plait.selftest" else {})
    found = discover("auto")
    assert found.how.startswith("entry points") and list(found.providers) == ["kernels", "broken"]
    ctx = SelftestContext(device=torch.device("cpu"), dry_run=True)
    checks = all_checks(found, ctx)
    assert checks[0].name == "kernels/rms_norm"
    row = run_one(checks[-1], ctx)
    assert checks[-1].name == "broken/import" and row.outcome.status == FAIL
    assert "plait.no_such_package.selftest:checks failed to import: ModuleNotFoundError" in row.outcome.note
