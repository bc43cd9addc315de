"""The HF Trainer with ``PlaitConfig(tp_size=2)``: a tiny random Llama split by its own ``tp_plan``
(transformers' styles) over tp, plait ZeRO-3 over dp, dp 2 x tp 2 on 4 gloo processes, against one
process (the plain Trainer on the whole global batch) in the test's own process.

One 4-rank session trains 3 steps with a checkpoint at step 2 and ``save_model()`` at the end, then
resumes from the checkpoint. Losses and gradient norms follow one process; the resumed step is
bitwise the uninterrupted one; the saved model loads with ``from_pretrained`` and gives one
process's logits.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from plait.kernels.testing import run_distributed
from plait.transformers.demo import probe_ids, train

pytest.importorskip("transformers")

STEPS, SAVE_AT, PER_RANK = 3, 2, 2
# fp32, the same data and seed; the TP halves of row-parallel matmuls and the dp gradient sums add
# in another order than one process (measured max 9e-8 relative on the losses).
TOL = 1e-5


def _tp_session(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from plait.transformers import PlaitConfig
    from plait.zero_sharding import ZeroConfig

    config = PlaitConfig(zero=ZeroConfig(stage=3), tp_size=2)
    full = train("plait", f"{tmp}/tp", plait=config, per_device_train_batch_size=PER_RANK, max_steps=STEPS,
                 save_strategy="steps", save_steps=SAVE_AT, save_to=f"{tmp}/final")
    resumed = train("plait", f"{tmp}/resumed", plait=config, per_device_train_batch_size=PER_RANK, max_steps=STEPS,
                    resume=f"{tmp}/tp/checkpoint-{SAVE_AT}")
    from plait.transformers.demo import tiny_llama_model
    from plait.transformers.tensor_parallel import apply_tp_plan, build_mesh

    model = tiny_llama_model()
    apply_tp_plan(model, build_mesh(2, dist.get_world_size(), "cpu"))
    placements = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})
    return {"full": full, "resumed": resumed, "placements": placements}


@pytest.mark.timeout(300)
def test_trainer_tp2_follows_one_process_and_resumes(tmp_path) -> None:
    import transformers

    results = run_distributed(_tp_session, 4, str(tmp_path), timeout=270)
    # One process, the whole global batch: the dp ranks' micro-batches are consecutive batches of the
    # same shuffled order (the tp ranks of a group share theirs).
    one = train("ddp", str(tmp_path / "one"), per_device_train_batch_size=2 * PER_RANK, max_steps=STEPS, probe=True)
    for result in results:
        assert result["placements"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"], result["placements"]
        full, resumed = result["full"], result["resumed"]
        assert len(full.losses) == STEPS and len(full.grad_norms) == STEPS
        for ours, reference in ((full.losses, one.losses), (full.grad_norms, one.grad_norms)):
            assert all(math.isclose(a, b, rel_tol=TOL) for a, b in zip(ours, reference)), (ours, reference)
        # the resumed run's log holds the checkpoint's history, then its own step: bitwise the uninterrupted one
        assert resumed.losses[SAVE_AT:] == full.losses[SAVE_AT:], (resumed.losses, full.losses)
        assert resumed.grad_norms[-1] == full.grad_norms[-1], (resumed.grad_norms, full.grad_norms)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        logits = loaded(input_ids=probe_ids()).logits.float()
    torch.testing.assert_close(logits, one.probe_logits, rtol=TOL, atol=TOL)


def test_bad_tp_settings_are_refused() -> None:
    from plait.transformers import PlaitConfig
    from plait.transformers.demo import tiny_llama_model
    from plait.transformers.tensor_parallel import check_model, check_world_size

    with pytest.raises(ValueError, match=r"PlaitConfig.tp_size=0 must be a positive int"):
        PlaitConfig(tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size=2 with sp_size=2.*does not compose"):
        PlaitConfig(tp_size=2, sp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the launcher's 4 processes; use one of \[1, 2"):
        check_world_size(3, 4)
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide the model's num_key_value_heads=2"):
        check_model(tiny_llama_model(), 4)
    bare = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Linear has no tensor-parallel plan"):
        check_model(bare, 2)
