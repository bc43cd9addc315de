"""R2 of reliability.md: the disk fills during a write.

A child process caps its own file size with ``RLIMIT_FSIZE`` (no privileges or loop devices
needed) and ignores SIGXFSZ, so a write past the cap fails with EFBIG exactly as a full disk
fails with ENOSPC. Checked: a typed error naming the file within the timeout, files written
before untouched, nothing lost, and the next write succeeding once the cap is lifted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE/SIGXFSZ semantics are Linux's")

PRELUDE = textwrap.dedent("""
    import errno, json, resource, signal, sys
    import torch
    from plait.offload_io import AsyncIOEngine, IOConfig, OffloadDiskFullError, OffloadedOptimizer
    torch.set_num_threads(1)
    directory = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then returns EFBIG instead of killing us
    SOFT, HARD = resource.getrlimit(resource.RLIMIT_FSIZE)
    def cap(nbytes):
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, HARD))
    def uncap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))
    out = {}
""")

ENGINE_CHILD = PRELUDE + textwrap.dedent("""
    engine = AsyncIOEngine(IOConfig(block_size=65536, queue_depth=4, workers=2))
    previous = torch.randint(0, 256, (300_001,), dtype=torch.uint8)
    engine.write(previous, directory + "/previous.bin").wait()
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    cap(1 << 20)
    try:
        engine.write(big, directory + "/new.bin").wait(timeout=60)
    except OffloadDiskFullError as exc:
        out["error"] = {"errno": exc.errno, "path": exc.path, "nbytes": exc.nbytes, "message": str(exc),
                        "is_oserror": isinstance(exc, OSError)}
    back = torch.empty_like(previous)
    engine.read_into(back, directory + "/previous.bin").wait()
    out["previous_intact"] = bool(torch.equal(back, previous))
    uncap()
    engine.write(big, directory + "/new.bin").wait(timeout=60)
    again = torch.empty_like(big)
    engine.read_into(again, directory + "/new.bin").wait()
    out["retry_ok"] = bool(torch.equal(again, big))
    engine.close()
    print(json.dumps(out))
""")

OPTIMIZER_CHILD = PRELUDE + textwrap.dedent("""
    from plait.kernels.testing import global_batch, tiny_llama

    def model():
        torch.manual_seed(0)
        return tiny_llama(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=96)

    def step(m, opt, k):
        data = global_batch(k, 2, 16)
        m(data["input_ids"], labels=data["labels"]).loss.backward()
        try:
            opt.step()
            return None
        except OffloadDiskFullError as exc:
            return {"errno": exc.errno, "path": exc.path, "message": str(exc)}
        finally:
            opt.zero_grad()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    ref_model, our_model = model(), model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ours = OffloadedOptimizer(our_model.parameters(), device="nvme", path=directory, sub_group_size=20_000,
                              master_weights=sys.argv[2],
                              io=IOConfig(block_size=65536, queue_depth=4, workers=2), lr=1e-2)
    for k in range(2):
        step(ref_model, ref, k)
        assert step(our_model, ours, k) is None
    cap(16 << 10)  # the group files are larger than this, so every rewrite runs into the cap
    step(ref_model, ref, 2)
    out["error"] = step(our_model, ours, 2)
    out["step_applied_to_all"] = same(ref_model, our_model)
    try:
        ours.flush()
        out["flush_while_full"] = "succeeded"
    except OffloadDiskFullError:
        out["flush_while_full"] = "raised"
    uncap()
    ours.flush()
    for k in range(3, 5):
        step(ref_model, ref, k)
        out.setdefault("later_errors", []).append(step(our_model, ours, k))
    out["equal_after_recovery"] = same(ref_model, our_model)
    mine, theirs = ours.state_dict()["state"], ref.state_dict()["state"]
    out["state_equal"] = all(torch.equal(mine[i][k], v) for i, e in theirs.items() for k, v in e.items())
    ours.close()
    print(json.dumps(out))
""")


def _run_child(code: str, directory: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code, directory, *args], capture_output=True, text=True, timeout=180,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(200)
def test_engine_disk_full_is_a_typed_error_and_recoverable(tmp_path):
    out = _run_child(ENGINE_CHILD, str(tmp_path))
    error = out["error"]
    assert error["errno"] == 27 and error["is_oserror"]  # EFBIG
    assert error["path"].endswith("new.bin") and error["nbytes"] == 3 << 20
    assert "Free space on that filesystem" in error["message"] and "new.bin" in error["message"]
    assert out["previous_intact"] and out["retry_ok"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("master_weights", ["auto", "on"])  # "on": fp32 masters on disk as well
def test_optimizer_disk_full_loses_nothing_and_recovers(tmp_path, master_weights):
    out = _run_child(OPTIMIZER_CHILD, str(tmp_path), master_weights)
    assert out["error"] is not None and out["error"]["errno"] == 27
    assert "group-" in out["error"]["path"]
    assert out["step_applied_to_all"]  # the step finished every sub-group; only durability failed
    assert out["flush_while_full"] == "raised"
    assert out["later_errors"] == [None, None]
    assert out["equal_after_recovery"] and out["state_equal"]
