"""Under torchrun, the plait strategies (Trainer and Fabric) join the process group restart-safely.

Lightning's strategies call torch's ``init_process_group``, which keeps its store keys under the
same names in every torchrun attempt; torchrun's agent store outlives a restart, so a restarted
rank could read the previous attempt's gloo address and fail. The plait strategies join through
``plait.kernels.collectives.init_process_group`` when torchrun's agent store is in use: each
attempt's keys go under ``plait/attempt-<n>/``. Checked in a fresh process standing in for a
restarted worker (``TORCHELASTIC_RESTART_COUNT=2``), with a stale address of an earlier attempt
already in the store: the group is joined, every new key carries the attempt's prefix, and the
strategy's timeout is the group's. (The whole restart under Lightning, with a rank SIGKILLed and
``fit(ckpt_path="last")``, is ``tests/test_reliability_lightning_restart.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from plait.kernels.testing import free_port

STALE = "default_pg/0//cpu//rank_0"
BUILD = {
    "trainer": ("from lightning.pytorch.accelerators import CPUAccelerator\n"
                "from plait.lightning import PlaitStrategy as Strategy\n", "setup_distributed"),
    "fabric": ("from lightning.fabric.accelerators import CPUAccelerator\n"
               "from plait.lightning import PlaitFabricStrategy as Strategy\n", "_setup_distributed"),
}


@pytest.mark.parametrize("kind", list(BUILD))
def test_a_restarted_worker_joins_under_its_attempts_prefix(kind):
    imports, setup = BUILD[kind]
    port = free_port()
    code = imports + textwrap.dedent(f"""
        import datetime
        import torch
        import torch.distributed as dist
        from lightning.fabric.plugins.environments import LightningEnvironment
        from plait.kernels import collectives
        agent = dist.TCPStore("127.0.0.1", {port}, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
        agent.set("{STALE}", "a stale address")   # what an earlier attempt left
        strategy = Strategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")],
                            cluster_environment=LightningEnvironment(), timeout=datetime.timedelta(seconds=17))
        strategy.{setup}()
        print(dist.get_world_size(), int(collectives.group_timeout().total_seconds()), *sorted(agent.list_keys()))
        dist.destroy_process_group()
    """)
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    world, timeout_s, *keys = done.stdout.strip().splitlines()[-1].split()
    assert (world, timeout_s) == ("1", "17")
    fresh = [key for key in keys if key != STALE]
    assert fresh and all(key.startswith("plait/attempt-2/") for key in fresh), keys
