"""plait-onebit-optim with plait-lightning: ``plait_zero1`` / ``plait_zero2`` take a 1-bit Adam
(and ``plait_zero2`` a 1-bit LAMB and a 0/1 Adam) instance from ``configure_optimizers`` with no
other change. The strategies rebuild the optimizer from its class, groups and defaults; the three
optimizers keep their config (as ``onebit_config``) and masks there, so the freeze step
survives, and ``zero_shard`` composes it (:mod:`plait.onebit_optim.under_zero.exchange`). ZeRO-1 and ZeRO-2
give the same losses bit for bit.

Lightning's own ``strategy="ddp"`` takes them too, with plait-lightning's callback in the Trainer
(:mod:`plait.lightning.onebit_ddp`, opt-in): it turns DDP's gradient all-reduce off with a communication hook,
so the optimizer exchanges alone; the run is bitwise the same optimizer in a plain torch loop
without DDP, for all three (1-bit Adam's also differs from one under DDP without the hook); a
checkpoint saved after warm-up carries every rank's error feedback and resumes bit for bit; what
the optimizer cannot honour on local gradients is refused naming the fix."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.lightning.demo import TinyLlamaModule
from plait.onebit_optim import (
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "lightning" / "tests"))
STEPS, FREEZE, RESUME_AT = 8, 3, 5


class OnebitModule(TinyLlamaModule):
    """The demo module with 1-bit Adam (warm-up of 3 steps) and no scheduler."""

    def configure_optimizers(self) -> Any:
        """A 1-bit Adam instance, as a user would write it."""
        return OnebitAdam(self.parameters(), lr=self.hparams.lr, weight_decay=0.01,
                          config=OnebitAdamConfig(freeze_step=FREEZE))


class OnebitLambModule(TinyLlamaModule):
    """The demo module with 1-bit LAMB (warm-up of 3 steps) and no scheduler."""

    def configure_optimizers(self) -> Any:
        """A 1-bit LAMB instance, as a user would write it."""
        return OnebitLamb(self.parameters(), lr=self.hparams.lr, weight_decay=0.01,
                          config=OnebitLambConfig(freeze_step=FREEZE))


class ZeroOneModule(TinyLlamaModule):
    """The demo module with 0/1 Adam: variance frozen after step 3, then local steps synchronised
    at steps 4, 5, 6 and 8 (the run ends on a synchronisation)."""

    def configure_optimizers(self) -> Any:
        """A 0/1 Adam instance, as a user would write it."""
        return ZeroOneAdam(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, config=ZeroOneAdamConfig(
            var_freeze_step=FREEZE, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2))


def session() -> dict[str, Any]:
    """Both strategies on this rank (module level: run_distributed imports it in each rank)."""
    from test_lightning_distributed import _fit, _quiet

    _quiet()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for strategy, module_cls in (("plait_zero1", OnebitModule), ("plait_zero2", OnebitModule),
                                 ("plait_zero2_lamb", OnebitLambModule), ("plait_zero2_zero_one", ZeroOneModule)):
        name = strategy.removesuffix("_lamb").removesuffix("_zero_one")
        losses, module = _fit(name, devices=2, steps=STEPS, module_cls=module_cls)
        optimizer = module.trainer.strategy.optimizers[0]
        exchange = optimizer.engine.reducer
        config = exchange.config
        kept = getattr(config, "freeze_step", None) or getattr(config, "var_freeze_step", None)
        out[strategy] = (losses, type(optimizer.inner).__name__, kept, int(exchange.steps[0]))
    return out


@pytest.mark.timeout(600)
def test_plait_zero1_and_zero2_take_the_onebit_optimizers_from_configure_optimizers() -> None:
    for result in run_distributed(session, 2, timeout=540):
        zero1, zero2 = result["plait_zero1"], result["plait_zero2"]
        assert zero1[1:] == ("OnebitAdam", FREEZE, STEPS)  # composed, freeze step kept, past warm-up
        assert zero1[0] == zero2[0]
        losses = [zero1[0][i] for i in range(STEPS)]
        assert losses[-1] < losses[0]
        lamb = result["plait_zero2_lamb"]
        assert lamb[1:] == ("OnebitLamb", FREEZE, STEPS)
        assert lamb[0][STEPS - 1] < lamb[0][0]
        zero_one = result["plait_zero2_zero_one"]
        assert zero_one[1:] == ("ZeroOneAdam", FREEZE, STEPS)  # composed as 0/1 Adam under ZeRO-2
        curve = [zero_one[0][i] for i in range(STEPS)]
        # Falls over the variance steps; the local steps after a 3-step variance phase are not asked
        # to converge (they do not on this model: plait bench onebit-optim-quality), only to run.
        assert curve[FREEZE - 1] < curve[0] and all(math.isfinite(x) for x in curve)


def _plain_torch_loop(wrap_in_ddp: bool,
                      module_cls: type = OnebitModule) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Lightning run's model, optimizer and batches in a plain torch loop: no DDP (the 1-bit
    optimizer's own use), or under DDP with its gradient all-reduce left on (the double exchange)."""
    import lightning as L
    from test_lightning_distributed import RESUME_TOTAL

    from plait.lightning.demo import TEST_MODEL

    L.seed_everything(0, verbose=False)
    module = module_cls(TEST_MODEL, batch_size=4, seq_len=32, warmup=2, total_steps=RESUME_TOTAL)
    net = torch.nn.parallel.DistributedDataParallel(module) if wrap_in_ddp else module
    optimizer = module.configure_optimizers()
    losses = []
    for step in range(STEPS):
        batch = rank_slice(global_batch(step, 4, 32, seed=0), dist.get_rank(), dist.get_world_size())
        loss = net(batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # as the module's self.log(..., sync_dist=True): the rank mean
        losses.append(float(mean / dist.get_world_size()))
    return losses, _weights(module)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _refusal(**trainer_extra: Any) -> str:
    from test_lightning_distributed import _fit

    from plait.lightning.onebit_ddp import OptimizerOwnsExchange

    try:
        _fit(trainer_extra.pop("strategy", "ddp"), devices=2, steps=2, module_cls=OnebitModule,
             callbacks=(OptimizerOwnsExchange(),), **trainer_extra)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def ddp_session(root: str) -> dict[str, Any]:
    """Lightning's ``ddp`` with 1-bit Adam (its plain-torch reference and control, a checkpoint saved
    after warm-up and resumed), with 1-bit LAMB and 0/1 Adam against theirs, and the refusals."""
    from lightning.pytorch.strategies import DDPStrategy
    from test_lightning_distributed import _fit, _quiet
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from plait.lightning.onebit_ddp import OptimizerOwnsExchange

    _quiet()
    torch.set_num_threads(1)
    # The callback is opt-in: a Trainer gets it only when the script lists it.
    _, without = _fit("ddp", devices=2, steps=1, module_cls=OnebitModule)
    unasked = [c for c in without.trainer.callbacks if isinstance(c, OptimizerOwnsExchange)]
    recorded, module = _fit("ddp", devices=2, steps=STEPS, module_cls=OnebitModule,
                            callbacks=(OptimizerOwnsExchange(),))
    (callback,) = [c for c in module.trainer.callbacks if isinstance(c, OptimizerOwnsExchange)]
    optimizer = module.trainer.optimizers[0]
    others = {}
    for module_cls in (OnebitLambModule, ZeroOneModule):  # the other two, against their plain loops
        other_losses, other = _fit("ddp", devices=2, steps=STEPS, module_cls=module_cls,
                                   callbacks=(OptimizerOwnsExchange(),))
        others[module_cls.__name__] = ([other_losses[i] for i in range(STEPS)], _weights(other),
                                       _plain_torch_loop(False, module_cls))
    path = f"{root}/step{RESUME_AT}.ckpt"
    _, first = _fit("ddp", devices=2, steps=RESUME_AT, module_cls=OnebitModule, callbacks=(OptimizerOwnsExchange(),))
    first.trainer.save_checkpoint(path)
    resumed, again = _fit("ddp", devices=2, steps=STEPS, module_cls=OnebitModule, ckpt_path=path,
                          callbacks=(OptimizerOwnsExchange(),))
    return {
        "others": others, "unasked": len(unasked),
        "resumed": (resumed, _weights(again)),
        "lightning": ([recorded[i] for i in range(STEPS)], _weights(module)),
        "hooked": callback.hooked, "past_warmup": optimizer.step_count, "exchanges": sum(
            e is not None for e in optimizer.exchanges),
        "plain": _plain_torch_loop(False), "ddp_without_hook": _plain_torch_loop(True),
        "clip": _refusal(gradient_clip_val=1.0),
        "own_hook": _refusal(strategy=DDPStrategy(ddp_comm_hook=default_hooks.allreduce_hook)),
    }


@pytest.mark.timeout(600)
def test_lightning_ddp_takes_a_onebit_optimizer_bitwise_its_plain_torch_use(tmp_path) -> None:
    for result in run_distributed(ddp_session, 2, str(tmp_path), timeout=540):
        losses, weights = result["lightning"]
        assert result["hooked"] == ("OnebitAdam",) and result["past_warmup"] == STEPS and result["exchanges"] == 1
        assert result["unasked"] == 0  # installing plait-lightning adds nothing to a Trainer by itself
        plain_losses, plain_weights = result["plain"]
        # DDP communicated nothing in backward: bitwise the optimizer used without DDP, compressed steps included.
        assert losses == plain_losses and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
        # Control: DDP's all-reduce left on feeds the 1-bit exchange averaged gradients (at two ranks the
        # warm-up averages are the same, x + x = 2x exactly; the compressed steps are not).
        control_losses, control_weights = result["ddp_without_hook"]
        assert control_losses[:FREEZE + 1] == plain_losses[:FREEZE + 1]
        assert any(not torch.equal(control_weights[k], plain_weights[k]) for k in weights)
        # Saved at step 5 (after warm-up: error feedback on every rank) and resumed: the steps after it
        # and the final weights bitwise the uninterrupted run's.
        resumed_losses, resumed_weights = result["resumed"]
        assert sorted(resumed_losses) == list(range(RESUME_AT, STEPS))
        assert [resumed_losses[i] for i in range(RESUME_AT, STEPS)] == losses[RESUME_AT:]
        assert all(torch.equal(resumed_weights[k], weights[k]) for k in weights)
        # 1-bit LAMB and 0/1 Adam (its variance, 1-bit and local steps) likewise: bitwise their plain loops.
        for name, (other_losses, other_weights, (plain_other, plain_other_weights)) in result["others"].items():
            assert other_losses == plain_other, name
            assert all(torch.equal(other_weights[k], plain_other_weights[k]) for k in other_weights), name
        assert "gradient_clip_val=1.0" in result["clip"] and "plait_zero1" in result["clip"]
        assert "max_grad_norm" in result["clip"]  # the optimizer's own clipping, on the exchanged gradient
        assert "ddp_comm_hook" in result["own_hook"]


def fabric_session() -> dict[str, Any]:
    """Fabric's ``ddp`` with 1-bit Adam and ``fabric_owns_exchange``, beside the plain torch loop."""
    import lightning as L
    from test_lightning_distributed import RESUME_TOTAL, _quiet

    from plait.lightning.demo import TEST_MODEL
    from plait.lightning.onebit_ddp import fabric_owns_exchange

    _quiet()
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    L.seed_everything(0, verbose=False)
    module = OnebitModule(TEST_MODEL, batch_size=4, seq_len=32, warmup=2, total_steps=RESUME_TOTAL)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    hooked = fabric_owns_exchange(model, optimizer)
    losses = []
    for step in range(STEPS):
        batch = rank_slice(global_batch(step, 4, 32, seed=0), fabric.global_rank, fabric.world_size)
        loss = model(batch["input_ids"], labels=batch["labels"]).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    second = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    try:
        fabric_owns_exchange(model, optimizer, second)
        mixed = "accepted"
    except ValueError as exc:
        mixed = str(exc)
    return {"hooked": hooked, "fabric": (losses, _weights(module)), "plain": _plain_torch_loop(False),
            "mixed": mixed}


@pytest.mark.timeout(300)
def test_fabric_ddp_with_fabric_owns_exchange_is_bitwise_the_plain_torch_use() -> None:
    for result in run_distributed(fabric_session, 2, timeout=240):
        assert result["hooked"] == ("OnebitAdam",)
        losses, weights = result["fabric"]
        plain_losses, plain_weights = result["plain"]
        assert losses == plain_losses  # compressed steps included: DDP communicated nothing in backward
        assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
        assert "1 other optimizer(s)" in result["mixed"] and "plait_zero1" in result["mixed"]
