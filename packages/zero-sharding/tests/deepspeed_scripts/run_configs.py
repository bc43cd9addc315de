"""Runs train_cifar_style.py once per DeepSpeed config in one process (one launch serves all configs).

Usage (under torchrun): ``run_configs.py OUT_PREFIX STEPS CONFIG.json...``. With ``PATCH_DS_SHM=1``
(real DeepSpeed) DeepSpeed's shared-memory op build is skipped: the transport is gloo either way.
"""

import json
import os
import runpy
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_cifar_style.py")


def main():
    out, steps, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
    if os.environ.get("PATCH_DS_SHM") == "1":
        import deepspeed  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    for index, config in enumerate(configs):
        sys.argv = [SCRIPT, "--deepspeed", "--deepspeed_config", config, "--steps", steps, "--out", f"{out}.{index}"]
        runpy.run_path(SCRIPT, run_name="__main__")
    loaded = sorted(name for name in sys.modules if name.startswith("deepspeed.runtime"))
    rank = os.environ.get("RANK", "0")
    with open(f"{out}.modules.rank{rank}.json", "w") as handle:
        json.dump(loaded, handle)


if __name__ == "__main__":
    main()
