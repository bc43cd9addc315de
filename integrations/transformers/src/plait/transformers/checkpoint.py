"""Checkpoints of a plait Trainer, inside the Trainer's own ``checkpoint-N/`` directories.

``save_steps`` writes ``checkpoint-N/plait/`` (a plait-universal-ckpt root: the sharded model with
its fp32 masters and optimizer moments, plus the optimizer's options and step count) next to the
Trainer's ``scheduler.pt``, RNG states and ``trainer_state.json``; ``resume_from_checkpoint`` loads
it at any world size and ZeRO stage. ``save_total_limit`` keeps working because everything lives
inside ``checkpoint-N/``. ``Trainer.save_model()`` writes consolidated safetensors and a
``config.json`` naming the model's own class, which ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import universal_ckpt
from plait.zero_sharding import ZeroModule

STATE_DIR = "plait"
SCHEDULER_NAME = "scheduler.pt"
WEIGHTS_NAME = "model.safetensors"
PRODUCER = "plait.transformers"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class OptimizerOptions:
    """The ZeroOptimizer's small replicated state: group options (lr, betas, weight decay) and its
    step count. Its moments and masters travel with the sharded model.

    Args:
        optimizer: the ZeroOptimizer.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """Options of every parameter group and the step count."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"param_groups": groups, "steps_taken": int(self.optimizer.steps_taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint has a different number of parameter groups.
        """
        saved = state["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer parameter groups, this Trainer's optimizer "
                             f"{len(self.optimizer.param_groups)}; resume with the same optim/weight_decay setup.")
        for group, options in zip(self.optimizer.param_groups, saved):
            group.update(options)
        self.optimizer.steps_taken = int(state["steps_taken"])


def _state(model: ZeroModule, optimizer: Any) -> dict[str, Any]:
    # The sharded model is a ShardedStateful itself (parameters, masters, moments, loss scale).
    return {"model": model, "optimizer": OptimizerOptions(optimizer)}


def has_training_state(checkpoint: str | os.PathLike) -> bool:
    """Whether ``checkpoint`` (an HF ``checkpoint-N`` directory) holds a committed plait checkpoint."""
    root = Path(checkpoint, STATE_DIR)
    return root.is_dir() and universal_ckpt.latest(root) is not None


def save_training_state(output_dir: str | os.PathLike, model: ZeroModule, optimizer: Any, *, step: int) -> Path:
    """Save the sharded training state into ``output_dir/plait/``. Collective: every rank calls it.

    Returns:
        The committed universal-checkpoint directory.

    Raises:
        plait.universal_ckpt.CheckpointExistsError: ``output_dir`` already holds this step
            (nothing a user saved is overwritten).
    """
    handle = universal_ckpt.save(_state(model, optimizer), Path(output_dir, STATE_DIR), step=int(step),
                                 user_meta={"producer": PRODUCER})
    committed = handle.wait()
    if _rank() == 0:
        pretrained_config(model).save_pretrained(output_dir)
    return committed


def load_training_state(checkpoint: str | os.PathLike, model: ZeroModule, optimizer: Any, *,
                        verify: bool = True) -> universal_ckpt.Manifest:
    """Load ``checkpoint/plait/`` into the sharded model and optimizer (any saved world size or stage).

    Raises:
        plait.universal_ckpt.CheckpointError: missing, damaged or incompatible checkpoint.
    """
    return universal_ckpt.load(_state(model, optimizer), Path(checkpoint, STATE_DIR), verify=verify)


def deepspeed_tag(checkpoint: str | os.PathLike) -> Path | None:
    """The DeepSpeed tag directory inside a ``checkpoint-N/`` written by the Trainer under DeepSpeed
    (its ``latest`` file names it), or ``None``."""
    from plait.zero_sharding.deepspeed.ds_resume import deepspeed_tag_dir

    return deepspeed_tag_dir(checkpoint, None)


def load_deepspeed_state(tag_dir: Path, model: ZeroModule, optimizer: Any) -> dict[str, Any]:
    """Continue a DeepSpeed run: its checkpoint's weights, fp32 masters and Adam moments into the
    shards (converted once by plait-universal-ckpt's DeepSpeed importer), its step count into the
    optimizer. Collective.

    Returns:
        DeepSpeed's saved counters and scheduler state (see
        :func:`plait.zero_sharding.deepspeed.ds_resume.load_into_module`).
    """
    from plait.zero_sharding.deepspeed.ds_resume import load_into_module

    saved = load_into_module(model, tag_dir)
    optimizer.steps_taken = int(saved.get("global_steps") or 0)
    return saved


def base_class(model: ZeroModule) -> type:
    """The model's own class (``LlamaForCausalLM``), not the dynamic ZeRO subclass it became."""
    return model.zero_base_class


def pretrained_config(model: ZeroModule) -> Any:
    """A copy of the model's HF config whose ``architectures`` names its own class."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [base_class(model).__name__]
    return config


def rename_safetensors(path: str | os.PathLike, names: dict[str, str]) -> None:
    """Rename tensors of a safetensors file in place: only its JSON header changes, the data is
    copied in chunks after the new header (no tensor is loaded).

    Args:
        path: the file.
        names: old name -> new name (names not in the file are ignored).
    """
    path = Path(path)
    with path.open("rb") as src:
        size = int.from_bytes(src.read(8), "little")
        header = json.loads(src.read(size))
        renamed = {names.get(k, k): v for k, v in header.items()}
        raw = json.dumps(renamed, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors writes it
        tmp = path.with_suffix(".renaming")
        with tmp.open("wb") as dst:
            dst.write(len(raw).to_bytes(8, "little") + raw)
            shutil.copyfileobj(src, dst, 16 << 20)
    os.replace(tmp, path)


def export_pretrained(output_dir: str | os.PathLike, model: ZeroModule, processing_class: Any = None, *,
                      args: Any = None, dtype: torch.dtype | None = None,
                      rename: dict[str, str] | None = None) -> Path:
    """Write what ``from_pretrained`` loads: consolidated ``model.safetensors`` (streamed, tensor by
    tensor), ``config.json`` naming the model's own class, the generation config, the tokenizer or
    processor, and the training arguments. Collective: every rank calls it; rank 0 writes.

    Args:
        output_dir: the directory (created).
        model: the sharded model.
        processing_class: the Trainer's tokenizer/processor, or ``None``.
        args: ``TrainingArguments`` to store as ``training_args.bin`` (rank 0), or ``None``.
        dtype: weights' dtype in the file (default: the config's ``dtype`` if set, else fp32).
        rename: parameter name -> name in the file (HF MoE blocks converted to plait layers under
            ``ep_size``: their HF names, so ``from_pretrained`` finds them).

    Returns:
        ``output_dir``.
    """
    out = Path(output_dir)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    config = pretrained_config(model)
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model.export_full_weights(out / WEIGHTS_NAME, dtype=dtype if isinstance(dtype, torch.dtype) else None)
    if _rank() == 0:
        if rename:
            rename_safetensors(out / WEIGHTS_NAME, rename)
        config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(out)
        if processing_class is not None:
            processing_class.save_pretrained(out)
        if args is not None:
            torch.save(args, out / "training_args.bin")
    if dist.is_initialized():
        dist.barrier()
    return out
