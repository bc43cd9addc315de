"""ZeRO-3 and ZeRO++ on two nodes, launched as ``torchrun --nnodes 2 --nproc-per-node 2``.

Two torchrun agents, one per "node", rendezvous on localhost; ZeRO++ takes the node layout from
what torchrun sets (``GROUP_RANK``), as on two machines. Checks: plain ZeRO-3 equals one process;
ZeRO++ (``ZeroConfig(zeropp=True)``: qwZ int8, qgZ int4 in two hops, hpZ sized to the node)
stays within its quantization bounds of it; hpZ's groups and qgZ's hops are the launcher's
nodes; a ZeRO++ checkpoint written at two nodes resumes at two nodes (same losses) and at one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("plait.universal_ckpt")

JOB = Path(__file__).with_name("zeropp_two_node_job.py")
LAUNCH_TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, out: Path, nodes: int) -> list[dict]:
    """Start one torchrun agent per node, wait for all (killing every process group on timeout)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = []
    for node in range(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "2",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--max-restarts", "0", str(JOB), mode, str(out)]
        agents.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=LAUNCH_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: the torchrun agents did not finish in {LAUNCH_TIMEOUT} s")
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"{mode}: node {node}'s agent exited {agent.returncode}:\n{logs[node][-4000:]}"
    world = 2 * nodes
    return [json.loads((out / f"{mode}-w{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_zeropp_two_nodes_parity_groups_and_resume(tmp_path):
    trained = _launch("train", tmp_path, nodes=2)
    first = trained[0]
    reference, zero3, zeropp = first["reference"], first["zero3"], first["zeropp"]
    print(f"\nreference {reference}\nZeRO-3    {zero3}\nZeRO++    {zeropp}\nZeRO++ bytes by group "
          f"{first['zeropp_by_group']}")
    # Plain ZeRO-3 across two nodes is the one-process run, up to fp32 summation order.
    for got, want in zip(zero3, reference):
        assert abs(got - want) <= 1e-4 * abs(want), (zero3, reference)
    # ZeRO++ quantizes weights (int8) and gradients (int4, twice in two hops): it may drift a
    # little from the exact run, within a few percent, and must learn as it does.
    for got, want in zip(zeropp, reference):
        assert abs(got - want) <= 0.03 * abs(want), (zeropp, reference)
    assert zeropp[-1] < zeropp[0] - 0.1
    # The launcher's nodes are ranks {0,1} and {2,3}: hpZ's group and qgZ's hops follow them.
    for rank, result in enumerate(trained):
        groups = result["groups"]
        assert groups["gatherer"] == "HierarchicalParamGatherer" and groups["hpz_partition"] == 2, groups
        assert groups["hpz_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1], (rank, groups)
        assert groups["reducer"] == "QuantizedGradientReducer" and groups["qgz_node_size"] == 2, groups
    # Backward gathers stay inside the node: rank 0 sends bytes on its node group.
    assert "ranks[0,1]" in first["zeropp_by_group"], first["zeropp_by_group"]

    again = _launch("resume", tmp_path, nodes=2)
    # Same layout, same bits: resuming continues the curve exactly.
    assert again[0]["resumed"] == pytest.approx(zeropp[3:], rel=1e-6), (again[0]["resumed"], zeropp)

    one_node = _launch("resume", tmp_path, nodes=1)
    # One node: hpZ has nothing to keep inside a node and qgZ one hop; the curve goes on from the
    # same weights and optimizer state, within the quantization bounds.
    groups = one_node[0]["groups"]
    assert groups["gatherer"] == "QuantizedParamGatherer" and groups["qgz_node_size"] is None, groups
    for got, want in zip(one_node[0]["resumed"], zeropp[3:]):
        assert abs(got - want) <= 0.03 * abs(want), (one_node[0]["resumed"], zeropp)
