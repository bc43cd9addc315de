"""A tiny random HF Llama fine-tuned through the Trainer: the shared run of the tests, the benchmark
and the README. Everything is built offline (no hub access): a ``LlamaConfig`` with random weights
and a fixed-seed token dataset.

``train(route, ...)`` runs one Trainer in the calling process (one rank of ``torchrun`` or of the
test harness) on one of the routes: ``"ddp"`` (the plain Trainer), ``"plait"`` (``with_plait``) or
``"deepspeed"`` (the Trainer's own ``deepspeed=`` route), and returns what it logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any

import torch

# Small enough for a 2-core CPU, real enough to exercise every module type of a Llama.
TINY_LLAMA: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What one Trainer run logged on this rank.

    Attributes:
        losses: the training loss of every optimizer step (``logging_steps=1``), in order.
        grad_norms: the logged gradient norms (empty when not clipping under plait).
        step_seconds: wall seconds of every optimizer step.
        peak_rss_bytes: the process's peak resident memory at the end.
        probe_logits: the trained model's logits on :func:`probe_ids` (``probe=True``), else ``None``.
        eval_loss: ``trainer.evaluate()``'s loss after training (``evaluate=True``), else ``None``.
        built_on_meta: with ``pretrained``: whether every parameter was on the meta device when
            the Trainer got the model (no rank held the whole model).
        placement: the class name of the ZeRO engine's state placement under plait (which
            offload, if any, actually ran), else ``None``.
        learning_rates: the learning rate logged at every optimizer step.
        skipped_steps: steps ZeRO's fp16 loss scaler skipped (overflow) under plait, else ``None``.
    """

    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    step_seconds: tuple[float, ...]
    peak_rss_bytes: int
    probe_logits: torch.Tensor | None = None
    eval_loss: float | None = None
    built_on_meta: bool | None = None
    placement: str | None = None
    learning_rates: tuple[float, ...] = ()
    skipped_steps: int | None = None


def probe_ids() -> torch.Tensor:
    """A fixed batch of token ids to compare trained models' logits on."""
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(99))


def tiny_llama_model(seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` (same weights on every rank for one seed).

    Args:
        seed: torch seed for the initialisation.
        **overrides: ``LlamaConfig`` fields over :data:`TINY_LLAMA`.
    """
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    return transformers.LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    """``count`` random token sequences (labels = inputs, the causal-LM setup), fixed by ``seed``.

    Args:
        count: number of sequences.
        seq_len: tokens per sequence.
        vocab_size: token ids are drawn below this.
        seed: generator seed.
    """

    def __init__(self, count: int = 64, seq_len: int = 32, vocab_size: int = TINY_LLAMA["vocab_size"],
                 seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (count, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def quiet() -> None:
    """Silence the Trainer's and DeepSpeed's per-step logging and warnings (rank processes)."""
    warnings.filterwarnings("ignore")
    for name in ("transformers", "accelerate", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def training_args(output_dir: str, **overrides: Any) -> Any:
    """``TrainingArguments`` for the tiny run: CPU, no reporting, a loss logged every step."""
    import transformers

    base: dict[str, Any] = dict(output_dir=output_dir, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                                weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[],
                                disable_tqdm=True, use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                                optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=1)
    base.update(overrides)
    return transformers.TrainingArguments(**base)


def _step_timer() -> Any:
    """A ``TrainerCallback`` recording the wall seconds of every optimizer step (in ``.seconds``)."""
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    return StepTimer()


def deepspeed_config(stage: int, *, offload: bool = False) -> dict[str, Any]:
    """The Trainer's DeepSpeed ZeRO config for the peer route ("auto" values filled by the Trainer)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "bf16": {"enabled": "auto"}}


def train(route: str, output_dir: str, *, plait: Any = None, deepspeed: dict | None = None,
          model_overrides: dict[str, Any] | None = None, dataset: Any = None, resume: str | bool | None = None,
          save_to: str | None = None, trainer_cls: Any = None, callbacks: tuple = (), probe: bool = False,
          evaluate: bool = False, pretrained: str | None = None, **args: Any) -> RunResult:
    """Train the tiny Llama through the Trainer on this rank.

    Args:
        route: ``"ddp"``, ``"plait"`` or ``"deepspeed"``.
        output_dir: the Trainer's output directory.
        plait: the plait config for ``route="plait"`` (a ``ZeroConfig``, ``PlaitConfig``, dict, path).
        deepspeed: the DeepSpeed config for ``route="deepspeed"``.
        model_overrides: ``LlamaConfig`` fields over :data:`TINY_LLAMA`.
        dataset: the training dataset (default :class:`TokenDataset`).
        resume: ``resume_from_checkpoint``.
        save_to: call ``trainer.save_model(save_to)`` after training.
        trainer_cls: the Trainer class to run (default ``transformers.Trainer``).
        callbacks: extra ``TrainerCallback`` objects.
        probe: compute the trained model's logits on :func:`probe_ids` (collective).
        evaluate: run ``trainer.evaluate()`` on a held-out :class:`TokenDataset` after training.
        pretrained: a ``save_pretrained`` directory to start from: ``from_pretrained`` for the peers,
            :func:`~plait.transformers.loading.sharded_from_pretrained` for plait.
        **args: ``TrainingArguments`` fields (see :func:`training_args`).

    Returns:
        The :class:`RunResult` of this rank.

    Raises:
        ValueError: an unknown route.
    """
    import resource

    import transformers

    from plait.transformers.loading import sharded_from_pretrained
    from plait.transformers.trainer import with_plait

    if route not in ("ddp", "plait", "deepspeed"):
        raise ValueError(f"route={route!r}; use 'ddp', 'plait' or 'deepspeed'.")
    quiet()
    transformers.logging.set_verbosity_error()
    base_cls = trainer_cls or transformers.Trainer
    cls = with_plait(base_cls, plait) if route == "plait" else base_cls
    if route == "deepspeed":
        args["deepspeed"] = deepspeed or deepspeed_config(3)
    targs = training_args(output_dir, **args)
    timer = _step_timer()
    if pretrained is None:
        model, on_meta = tiny_llama_model(**(model_overrides or {})), None
    elif route == "plait":
        model = sharded_from_pretrained(pretrained)
        on_meta = all(p.is_meta for p in model.parameters())
    else:
        model, on_meta = transformers.AutoModelForCausalLM.from_pretrained(pretrained), None
    trainer = cls(model=model, args=targs,
                  train_dataset=dataset if dataset is not None else TokenDataset(), callbacks=[timer, *callbacks],
                  eval_dataset=TokenDataset(16, seed=7) if evaluate else None)
    trainer.train(resume_from_checkpoint=resume)
    if save_to is not None:
        trainer.save_model(save_to)
    eval_loss = float(trainer.evaluate()["eval_loss"]) if evaluate else None
    logits = None
    if probe:
        with torch.no_grad():
            logits = trainer.model(input_ids=probe_ids()).logits.float()
    history = trainer.state.log_history
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = getattr(trainer.model, "zero_engine", None)
    return RunResult(losses=tuple(float(h["loss"]) for h in history if "loss" in h),
                     grad_norms=tuple(float(h["grad_norm"]) for h in history if h.get("grad_norm") is not None),
                     step_seconds=tuple(timer.seconds), peak_rss_bytes=int(peak), probe_logits=logits,
                     eval_loss=eval_loss, built_on_meta=on_meta,
                     placement=type(engine.placement).__name__ if engine is not None else None,
                     learning_rates=tuple(float(h["learning_rate"]) for h in history if "loss" in h),
                     skipped_steps=trainer.model.zero_optimizer.skipped_steps if engine is not None else None)
