"""``plait bench parallel-3d`` (plait.zero_sharding.benchmarks.parallel_3d): its pieces in CI, its
distributed runs opt-in.

In CI (well under a second): the decoder's pipeline stages compose to the whole decoder; the exact
rows fail when any rank's bytes differ from the formula; the README's summary rows are the
committed results file's, verbatim. The runs themselves (W=4 and W=8 ranks on gloo: minutes on two
cores) are what the benchmark does; ``PLAIT_PARALLEL_3D=1`` runs the W=8 ``dp2 x pp2 x tp2``
layout for 3 steps here: losses within 1e-5 relative of one process, bytes per mesh dimension and
model-state bytes exactly the 3-D formula's on every rank.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from plait.kernels.cli.bench import results_markdown
from plait.kernels.testing import run_distributed
from plait.kernels.testing.readme_tables import assert_results_summary
from plait.zero_sharding.benchmarks import parallel_3d
from plait.zero_sharding.benchmarks import parallel_3d_model as m

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pipeline_stages_compose_to_the_whole_decoder() -> None:
    shape = m.DecoderShape(**parallel_3d.SHAPE)
    ids = torch.randint(0, shape.vocab, (2, shape.seq), generator=torch.Generator().manual_seed(0))
    whole = m.build_stage(shape)(ids)
    first, last = m.build_stage(shape, 0, 2), m.build_stage(shape, 1, 2)
    assert first.head is None and last.embed is None and len(first.blocks) == len(last.blocks) == 2
    torch.testing.assert_close(last(first(ids)), whole, rtol=0, atol=0)
    replicated, split = m.tp_split_numel(m.build_stage(shape))
    assert replicated + split == sum(p.numel() for p in m.build_stage(shape).parameters())


def test_exact_rows_fail_when_any_rank_differs_from_the_formula() -> None:
    exact = {"state": 10, "dp": 8, "tp": 4, "pp": 0}
    ranks = [{"counted": {**exact, "other": 16}, "formula": dict(exact)} for _ in range(2)]
    rows = parallel_3d.exact_rows("t", ranks)
    assert [row.figure for row in rows] == ["model-state bytes/rank", "dp bytes/step", "tp bytes/step"]
    assert all(row.passed for row in rows)
    ranks[1]["counted"]["tp"] = 5
    assert [row.passed for row in parallel_3d.exact_rows("t", ranks)] == [True, True, False]


def test_readme_table_is_the_committed_results() -> None:
    readme, results = ROOT / "README.md", ROOT / "benchmarks" / "results" / "parallel-3d.json"
    if not readme.is_file() or not results.is_file():
        pytest.skip("not a source checkout")
    assert_results_summary(readme.read_text(), results_markdown(results), "README parallel-3d summary")


@pytest.mark.skipif(os.environ.get("PLAIT_PARALLEL_3D") != "1",
                    reason="8 gloo ranks, minutes on 2 cores; PLAIT_PARALLEL_3D=1 runs it (so does the bench)")
@pytest.mark.timeout(900)
def test_dp2_pp2_tp2_at_w8_equals_one_process_and_the_formulas() -> None:
    spec = dict(parallel_3d.QUICK, steps=3, warmup=1, count_step=2)
    label = "W=8 dp2 x pp2 x tp2"
    per_rank = [r[label] for r in run_distributed(parallel_3d._layout_session, 8, {label: parallel_3d.LAYOUTS[label]},
                                                  spec, timeout=840)]
    reference = parallel_3d.reference_losses(spec)
    for row in parallel_3d.loss_rows(label, per_rank, reference) + parallel_3d.exact_rows(label, per_rank):
        assert row.passed, row
