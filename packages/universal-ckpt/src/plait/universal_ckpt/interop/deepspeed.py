"""Import a DeepSpeed ZeRO checkpoint (stages 1, 2, 3; fp32, bf16 and fp16 runs) as written by 0.19.8.

What DeepSpeed writes in ``<dir>/<tag>/`` (``<dir>/latest`` names the tag):

* ``mp_rank_00_model_states.pt`` (stages 1/2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  (stage 3): ``module`` (the low-precision weights at 1/2, empty placeholders at 3; buffers),
  ``param_shapes`` (one ordered name -> shape map per parameter group), ``global_steps``,
  ``skipped_steps``, ``lr_scheduler``, ``dp_world_size``, ``ds_config``.
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: ``optimizer_state_dict`` with, per group,
  rank R's fp32 partition (``single_partition_of_fp32_groups`` at 1/2, ``fp32_flat_groups`` at 3)
  and the base optimizer's state for that partition (``exp_avg``, ``exp_avg_sq``, ``step``).
* Stage 1/2 partitions split the flat group (all parameters back to back) into equal parts, the
  last one stored without its padding (``group_paddings``). Stage 3 partitions every parameter
  on its own into ``ceil(numel / world)`` elements per rank, padded at the end; a rank's flat
  group is its pieces of each parameter in order.

The files are pickles that name DeepSpeed classes (``ZeroStageEnum``, ``fragment_address``); they
are read with a restricted unpickler that maps those to inert stand-ins (DeepSpeed need not be
installed) and refuses any other global outside torch's ``weights_only`` set, naming it and the file.
The result uses plait.zero_sharding's names (``model.<p>``, ``optim.exp_avg.<p>``,
``optim.exp_avg_sq.<p>``, ``optim.step.<p>``, ``zero.loss_scaler``) under one state-dict key, so a
DeepSpeed run continues under plait with ``load({"model": zero_model}, dst)``. Tensor- and
pipeline-parallel checkpoints (``mp_rank_01``, ``layer_*`` files) are detected and handed to
:mod:`plait.universal_ckpt.interop.deepspeed_mp`; the result has the same names.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from plait.universal_ckpt.interop import deepspeed_mp, restricted
from plait.universal_ckpt.manifest import Layout
from plait.universal_ckpt.offline import write_offline


def _load(path: Path) -> dict[str, Any]:
    # restricted: DeepSpeed classes become inert stand-ins, any other unknown global is refused;
    # mmap: tensors are views of the page cache, copied once, into the tensor that is written
    return restricted.load(path, ("deepspeed",))


def _tag_dir(src: Path, tag: str | None) -> Path:
    if tag is None and (src / "latest").is_file():
        tag = (src / "latest").read_text().strip()
    path = src / tag if tag else src
    if not any(path.glob("*_optim_states.pt")):
        raise CheckpointNotFoundError(f"{path} is not a DeepSpeed ZeRO checkpoint (no *_optim_states.pt files).")
    return path


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def _concat_flat(parts: list[torch.Tensor], paddings: list[int], total: int, what: str) -> torch.Tensor:
    if len(parts) == 1 and parts[0].numel() == total:
        return parts[0]
    flat = torch.cat(parts)
    if flat.numel() == total:
        return flat
    if flat.numel() == total + sum(paddings):
        return torch.cat([p[:p.numel() - pad] for p, pad in zip(parts, paddings)])
    raise CheckpointFormatError(f"DeepSpeed {what}: partitions hold {flat.numel()} elements, "
                                f"the parameters {total}; unsupported layout.")


def _fields(state: dict | list, group: int) -> list[str]:
    """The base optimizer's state names for ``group``; none before its first step (every step so far
    skipped by fp16 overflows): the import then holds no moments, and a target that keeps them
    names each missing one when it loads."""
    if isinstance(state, dict):
        return list(state.get(group, {}))
    return list(state[group]) if group < len(state) else []


def _stage12(optims: list[dict], shapes: list[dict], copy: bool = True) -> Iterator[tuple[str, str, torch.Tensor]]:
    for group, names in enumerate(shapes):
        total = sum(math.prod(s) for s in names.values())
        pads = [int(o.get("group_paddings", [0] * len(shapes))[group]) for o in optims]
        flats = {"model": _concat_flat([o["single_partition_of_fp32_groups"][group] for o in optims], pads, total,
                                       "fp32 partitions")}
        for field in _fields(optims[0]["base_optimizer_state"]["state"], group):
            values = [o["base_optimizer_state"]["state"][group][field] for o in optims]
            if values[0].dim() == 0:
                flats[f"optim.{field}"] = values[0]
            else:
                flats[f"optim.{field}"] = _concat_flat(values, pads, total, field)
        yield from _split(flats, names, copy)


def _stage3(optims: list[dict], shapes: list[dict]) -> Iterator[tuple[str, str, torch.Tensor]]:
    world = len(optims)
    for group, names in enumerate(shapes):
        flats = {"model": [o["fp32_flat_groups"][group] for o in optims]}
        for field in _fields(optims[0]["optimizer_state_dict"]["state"], group):
            flats[f"optim.{field}"] = [o["optimizer_state_dict"]["state"][group][field] for o in optims]
        offset = 0
        for name, shape in names.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            for prefix, per_rank in flats.items():
                if per_rank[0].dim() == 0:
                    yield prefix, name, per_rank[0].clone()
                    continue
                whole = torch.cat([r[offset:offset + part] for r in per_rank])[:numel]
                yield prefix, name, whole.reshape(shape).clone()
            offset += part
        if offset != flats["model"][0].numel():
            raise CheckpointFormatError(f"DeepSpeed stage 3 group {group}: parameters take {offset} elements per "
                                        f"rank, the partition has {flats['model'][0].numel()}.")


def _split(flats: dict[str, torch.Tensor], names: dict, copy: bool = True) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Each parameter's slice of the flat groups: copies, or views of them (``copy=False``)."""
    offset = 0
    for name, shape in names.items():
        numel = math.prod(shape)
        for prefix, flat in flats.items():
            if flat.dim() == 0:
                yield prefix, name, flat.clone()
            else:
                view = flat[offset:offset + numel].reshape(shape)
                yield prefix, name, view.clone() if copy else view
        offset += numel


def _loss_scaler(scaler: Any, skipped_steps: Any) -> torch.Tensor:
    """DeepSpeed's pickled loss scaler as plait's ``zero.loss_scaler`` row.

    The row is ``[scale, good_steps, hysteresis_left, skipped_steps]``. DeepSpeed's dynamic scaler
    keeps ``cur_iter`` and ``last_overflow_iter`` and grows the scale on a step that follows a
    positive multiple of ``scale_window`` good steps since the last overflow; plait grows on the step
    that completes ``loss_scale_window`` good steps. ``good_steps`` is set so that plait's next growth
    falls on the step DeepSpeed's would (``-1`` right after an overflow: DeepSpeed waits one step
    longer there); the growths after it follow every window, as DeepSpeed's do, and with
    ``ZeroConfig.loss_scale_window_offset=1`` (what the DeepSpeed config translator sets) so do those
    after later overflows. A static or absent scaler gives its scale, no good steps and no hysteresis.
    """
    state = scaler if isinstance(scaler, dict) else getattr(scaler, "state", None)
    state = state if isinstance(state, dict) else {}
    scale = float(state.get("cur_scale", 1.0))
    good, hysteresis = 0.0, 0.0
    if state.get("dynamic") and "cur_iter" in state and "last_overflow_iter" in state:
        done = int(state["cur_iter"]) - int(state["last_overflow_iter"]) - 1  # good steps since the last overflow
        good = float(-1 if done == 0 else (done - 1) % int(state["scale_window"]))
        hysteresis = float(state.get("cur_hysteresis", 1))
    return torch.tensor([scale, good, hysteresis, float(skipped_steps or 0)], dtype=torch.float64)


def import_deepspeed(src: str | os.PathLike, dst_root: str | os.PathLike, *, tag: str | None = None,
                     key: str = "model", progress: Callable[[int], None] | None = None) -> Path:
    """Convert a DeepSpeed ZeRO checkpoint into a universal checkpoint.

    Args:
        src: the DeepSpeed save directory (with ``latest``) or a tag directory.
        dst_root: the universal checkpoint root; the result is ``dst_root/step-<global_steps>``.
        tag: the DeepSpeed tag (default: the one ``latest`` names).
        key: the state-dict key to put the tensors under.
        progress: called with the bytes of each tensor written.

    Returns:
        The committed checkpoint directory.

    Raises:
        CheckpointNotFoundError: ``src`` is not a DeepSpeed checkpoint.
        CheckpointFormatError: a layout this importer does not understand (ZeRO-3 or pipeline x
            tensor parallelism, partitions that do not add up) or a missing model-parallel file
            (named with its tensors and the fix, before anything is written).
    """
    path = _tag_dir(Path(src), tag)
    if deepspeed_mp.is_model_parallel(path):
        return deepspeed_mp.import_model_parallel(path, Path(dst_root), key=key, load=_load, split=_stage12,
                                                  loss_scaler=_loss_scaler, progress=progress)
    optim_files = sorted(path.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    optims = [_load(f)["optimizer_state_dict"] for f in optim_files]
    model_file = path / "mp_rank_00_model_states.pt"
    if not model_file.exists():
        model_file = path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model_state = _load(model_file)
    stage = int(optims[0]["zero_stage"])
    shapes = [{n: tuple(s) for n, s in group.items()} for group in model_state["param_shapes"]]
    pieces = _stage3(optims, shapes) if stage == 3 else _stage12(optims, shapes)
    scaler = _loss_scaler(optims[0].get("loss_scaler"), model_state.get("skipped_steps"))

    def tensors() -> Iterator[tuple[str, str, str, torch.Tensor]]:
        for prefix, name, tensor in pieces:
            if prefix == "model":
                yield key, f"model.{name}", "parameter", tensor
            else:
                yield key, f"{prefix}.{name}", "optimizer_state", tensor
        for name in model_state.get("buffer_names") or []:
            yield key, f"buffer.{name}", "buffer", model_state["module"][name].clone()
        yield key, "zero.loss_scaler", "other", scaler

    base = optims[0].get("base_optimizer_state") or optims[0].get("optimizer_state_dict") or {}
    objects = {0: {"deepspeed": {"global_steps": model_state.get("global_steps"),
                                 "global_samples": model_state.get("global_samples"),
                                 "lr_scheduler": model_state.get("lr_scheduler"),
                                 "param_groups": base.get("param_groups"),
                                 "ds_config": model_state.get("ds_config"),
                                 "ds_version": model_state.get("ds_version")}}}
    step = int(model_state.get("global_steps") or 0)
    layout = Layout(world_size=len(optims), zero_stage=stage, mesh={"dp": len(optims)})
    return write_offline(dst_root, step=step, tensors=tensors(), objects=objects, layout=layout,
                         user_meta={"imported_from": f"deepspeed {model_state.get('ds_version')}", "source": str(path)},
                         progress=progress)
