"""The two-node benchmark's parts that need no root: refusal, launch command, figures, table."""

import pathlib

import pytest

from plait.kernels.bench import BenchRow
from plait.kernels.benchmarks import netem
from plait.zero_sharding.benchmarks import two_node, two_node_worker

ONE_HOP_ZERO3 = two_node_worker.ZERO3_ONE_HOP
SPEC = {**two_node.spec_for(True), "modes": ["DDP", ONE_HOP_ZERO3, "plait ZeRO-3", "plait hpZ", "plait ZeRO++"]}


def test_without_root_it_says_why_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as raised:
        two_node.run(True)
    assert "not root" in str(raised.value.code) and "zero-sharding-nodes" in str(raised.value.code)

    from plait.kernels.cli.main import main

    with pytest.raises(SystemExit) as raised:  # the command line ends the same way: a reason, no traceback
        main(["bench", "zero-sharding-nodes", "--quick"])
    assert raised.value.code != 0 and "network namespaces" in str(raised.value.code)


def test_torchrun_runs_one_agent_per_namespace_on_node_zero_address():
    nodes = netem.plan(2, "pzs1", 21)
    argv = two_node.torchrun_argv(nodes, 1, 29500, "/tmp/spec.json")
    assert argv[:4] == ["ip", "netns", "exec", nodes.namespaces[1]]
    joined = " ".join(argv)
    for part in ("torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank 1", "--rdzv-backend static",
                 f"--master-addr {nodes.addresses[0]} --master-port 29500",
                 "-m plait.zero_sharding.benchmarks.two_node_worker /tmp/spec.json"):
        assert part in joined


def test_modes_map_to_zeropp_parts():
    assert two_node_worker.zeropp_settings("plait ZeRO-3", 2) is None
    assert two_node_worker.zeropp_settings(ONE_HOP_ZERO3, 2) is None
    assert two_node.REFERENCE_BYTES == ONE_HOP_ZERO3  # ZeRO++'s cuts are against DeepSpeed's one-hop ZeRO-3
    hpz = two_node_worker.zeropp_settings("plait hpZ", 2)
    assert hpz["quantized_weights"] is False and hpz["quantized_gradients"] is False
    assert hpz["hierarchical_partition_size"] in ("auto", 2)  # the launcher's node size where the config reads it
    assert two_node_worker.zeropp_settings("plait qwZ+qgZ", 2)["hierarchical_partition_size"] is None
    assert two_node_worker.zeropp_settings("plait ZeRO++", 4)["hierarchical_partition_size"] in ("auto", 4)
    assert set(two_node.spec_for(False)["modes"]) == set(two_node_worker.MODES)
    assert two_node.spec_for(False)["steps"] == 5 and two_node.spec_for(False)["model"] == {}


def _rank(node, reader, sent, overhead, losses):
    modes = list(sent)
    return {"node": node, "reader": reader, "sent": sent, "overhead": overhead, "losses": losses,
            "retransmitted": {m: [0] * len(sent[m]) for m in modes}, "ledger": {m: {} for m in modes}}


def test_combine_adds_both_nodes_takes_the_barrier_off_and_averages_losses():
    sent = {"DDP": [1000, 1100], "plait ZeRO-3": [2000, 2000]}
    everyone = [
        _rank(0, True, sent, [10, 12, 10], {"DDP": [5.0, 4.0], "plait ZeRO-3": [5.0, 3.0]}),
        _rank(0, False, {m: [0, 0] for m in sent}, [0, 0, 0], {"DDP": [7.0, 6.0], "plait ZeRO-3": [7.0, 5.0]}),
        _rank(1, True, sent, [10, 10, 12], {"DDP": [5.0, 4.0], "plait ZeRO-3": [5.0, 3.0]}),
        _rank(1, False, {m: [0, 0] for m in sent}, [0, 0, 0], {"DDP": [7.0, 6.0], "plait ZeRO-3": [7.0, 5.0]}),
    ]
    spec = {"modes": ["DDP", "plait ZeRO-3", "plait hpZ"]}
    out = two_node_worker._combine(everyone, spec, {"plait hpZ": "ValueError: no"}, {},
                                   {"DDP": [0.1, 0.2], "plait ZeRO-3": [0.3, 0.3]})
    assert out["barrier_bytes"] == 22  # median over the three barrier-only brackets of both nodes' sums
    assert out["modes"]["DDP"]["crossing_bytes"] == [1978, 2178]
    assert out["modes"]["DDP"]["first_loss"] == 6.0 and out["modes"]["DDP"]["final_loss"] == 5.0
    assert out["modes"]["plait hpZ"] == {"error": "ValueError: no"}


def _result(nbytes, fast, slow):
    def mode(b, s):
        return {"crossing_bytes": [b, b + 10, b - 10], "seconds": [s, s * 1.1, s * 0.9], "first_loss": 8.3,
                "final_loss": 7.9, "route": "r", "tcp_retransmitted": [0, 0, 0]}

    return {"unthrottled": {"modes": {m: mode(b, fast[m]) for m, b in nbytes.items()}},
            "1gbit": {"modes": {m: mode(b, slow[m]) for m, b in nbytes.items()}}}


def test_rows_table_and_targets():
    nbytes = {"DDP": 107e6, ONE_HOP_ZERO3: 200e6, "plait ZeRO-3": 128e6, "plait hpZ": 130e6, "plait ZeRO++": 18e6}
    fast = {"DDP": 0.4, ONE_HOP_ZERO3: 0.6, "plait ZeRO-3": 0.6, "plait hpZ": 0.6, "plait ZeRO++": 0.6}
    slow = {"DDP": 0.8, ONE_HOP_ZERO3: 1.4, "plait ZeRO-3": 1.3, "plait hpZ": 1.0, "plait ZeRO++": 0.7}
    rows = two_node.rows_from(_result(nbytes, fast, slow), SPEC)
    got = {(r.benchmark, r.figure): r for r in rows}
    assert got[("plait ZeRO++", two_node.BYTES_FIGURE)].ratio == pytest.approx(0.09)
    assert got[("plait ZeRO++", two_node.BYTES_FIGURE)].passed is True
    assert got[("plait hpZ", two_node.BYTES_FIGURE)].passed is True  # 0.65 <= 0.70
    assert got[("plait ZeRO-3", two_node.BYTES_FIGURE)].ratio == pytest.approx(0.64)  # two hops, no target
    assert got[("plait ZeRO-3", two_node.BYTES_FIGURE)].peer == ONE_HOP_ZERO3
    step = got[("plait ZeRO++", "step at 1 Gbit/s (ms)")]
    assert step.ours == pytest.approx(700) and step.ratio == pytest.approx(0.875) and step.passed is False
    assert got[("DDP", "step unthrottled (ms)")].target == ""
    table = two_node.summary_table(rows)
    assert "| plait ZeRO++ | 18.0 MB | 0.09x | 600 ms | 700 ms | 0.88x | 7.9000 |" in table
    assert "| plait ZeRO++: step at 1 Gbit/s (ms) <= 0.8 x DDP | 0.875x DDP | FAIL |" in table
    assert table.count("PASS") == 2


def test_a_mode_that_failed_is_a_row_saying_why():
    results = {"unthrottled": {"modes": {"DDP": {"error": "RuntimeError: gloo"}}}}
    rows = two_node.rows_from(results, {**SPEC, "modes": ["DDP"]})
    assert len(rows) == 1 and "could not run: RuntimeError: gloo" in rows[0].note
    assert "could not run" in two_node.summary_table(rows)
    launch_failed = {"unthrottled": {"error": "timed out after 1200 s", "modes": {}}}
    assert "timed out" in two_node.rows_from(launch_failed, {**SPEC, "modes": ["DDP"]})[0].note


def test_tcp_retransmitted_reads_this_namespace():
    assert two_node_worker.tcp_retransmitted() >= 0


def test_summary_table_from_a_results_file(tmp_path, capsys):
    from plait.kernels.bench import write_json

    path = write_json([BenchRow(benchmark="DDP", figure=two_node.BYTES_FIGURE, ours=1e8, peer="plait ZeRO-3",
                                peer_value=2e8, ratio=0.5)], tmp_path / "r.json", meta={"date": "d", "command": "c"})
    assert two_node.main([str(path)]) == 0
    assert "| DDP | 100.0 MB | 0.50x |" in capsys.readouterr().out
    assert two_node.main([]) == 2


def test_readme_summary_is_the_committed_results_summary():
    """The README's two-node summary is `python -m plait.zero_sharding.benchmarks.two_node` of the
    committed results file, verbatim (every README table comes from a committed file)."""
    from plait.kernels.bench import read_json

    root = pathlib.Path(__file__).resolve().parents[1]
    readme, results = root / "README.md", root / "benchmarks" / "results" / "zero-sharding-nodes.json"
    if not readme.is_file() or not results.is_file():
        pytest.skip("not a source checkout")
    rows, _ = read_json(results)
    assert two_node.summary_table(rows) in readme.read_text(), (
        "regenerate the README's summary with: python -m plait.zero_sharding.benchmarks.two_node "
        "benchmarks/results/zero-sharding-nodes.json")
