"""Import model-parallel DeepSpeed checkpoints: AutoTP tensor parallelism and ``PipelineModule`` stages.

What DeepSpeed 0.19.8 writes for a model-parallel run (``mp`` = model-parallel rank, ``dp`` = its
data-parallel rank; ZeRO-1/2):

* ``mp_rank_MM_model_states.pt`` per model-parallel rank: ``param_shapes`` (this rank's local
  shapes, in flat-group order), ``mp_world_size``, ``dp_world_size``,
  ``checkpoint_parallel_dimensions`` (``tp_degree``, ``pp_degree``) and, for AutoTP,
  ``universal_checkpoint_info``: regex lists (row-parallel, TP-replicated, vocabulary, sub-parameter
  patterns, ``original_vocab_size``) and an ``affine_map`` giving, per parameter and TP rank, the
  pieces of its shard as strided boxes: ``shape``, ``source`` ``[offset, strides]`` into the
  consolidated tensor, ``dest`` ``[offset, strides]`` into the shard, ``locations`` (the ranks
  holding that piece: several for a replicated one) and an optional ``scale``.
* ``zero_pp_rank_D_mp_rank_MM_optim_states.pt``: rank (D, MM)'s ZeRO partition of the fp32 flat
  group and its moments; the DP ranks of one MM together hold that model-parallel rank's local
  tensors, exactly as in a data-parallel-only run.
* ``PipelineModule`` runs add ``layer_LL-model_states.pt`` (the low-precision weights and buffers
  of layer LL, names relative to the layer); the optimizer's names are already global
  (``<layer index>.<param>``), MM being the stage.

Consolidation: a TP-split tensor is rebuilt from its affine map when the checkpoint has one (the
map is geometry, so fused sub-parameters and row/column splits need no special cases), else from
the regex lists (replicated: the first rank's copy, checked equal; row-parallel: concatenated on
dim 1; vocabulary: on dim 0 with the padding cut at ``original_vocab_size``; anything else: dim 0).
Replicated copies that differ are refused, as DeepSpeed's own converter does. Pipeline stages
hold disjoint names and are merged as they are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from plait.universal_ckpt.errors import CheckpointFormatError
from plait.universal_ckpt.layouts import TensorLayout
from plait.universal_ckpt.manifest import Layout
from plait.universal_ckpt.offline import write_offline

_FIX = ("copy it from the training run's save directory (every model-parallel rank's model and optimizer "
        "files are needed), or convert a complete checkpoint tag")


def is_model_parallel(path: Path) -> bool:
    """Whether the DeepSpeed tag directory ``path`` holds a tensor- or pipeline-parallel checkpoint."""
    return any(path.glob("*mp_rank_01*")) or any(path.glob("layer_*-model_states.pt"))


def _mp_rank(path: Path) -> int:
    return int(re.search(r"mp_rank_(\d+)", path.name).group(1))


def _optim_file(path: Path, dp: int, mp: int) -> Path | None:
    for prefix in ("", "bf16_"):
        candidate = path / f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
        if candidate.exists():
            return candidate
    return None


def _held_by(states: dict[int, dict], mp: int, tp: int) -> str:
    """Names of the tensors model-parallel rank ``mp`` holds pieces of, for an error message."""
    if mp in states:
        names = [n for group in states[mp]["param_shapes"] for n in group]
    elif tp > 1 and states:
        info = next(iter(states.values())).get("universal_checkpoint_info") or {}
        replicated = info.get("tp_replicated_parameter_patterns", [])
        names = [n for group in next(iter(states.values()))["param_shapes"] for n in group
                 if not any(re.match(p, n) for p in replicated)]
    else:
        return f"the tensors of model-parallel rank {mp} (their names are in the missing file)"
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} tensors)" if len(names) > 4 else "")
    return f"tensor {shown}" if names else f"no tensors of model-parallel rank {mp}"


def _read_sources(path: Path, load: Callable[[Path], dict]) -> tuple[dict[int, dict], dict[int, list[dict]], dict]:
    """Every model-parallel rank's model states and its DP ranks' optimizer states, all checked present."""
    present = sorted(path.glob("mp_rank_*_model_states.pt"), key=_mp_rank)
    if not present:
        raise CheckpointFormatError(f"{path}: no mp_rank_*_model_states.pt file; {_FIX}.")
    states = {_mp_rank(f): load(f) for f in present}
    first = states[min(states)]
    mp_world, dp_world = int(first.get("mp_world_size") or 1), int(first.get("dp_world_size") or 1)
    dims = first.get("checkpoint_parallel_dimensions") or {}
    tp = int(dims.get("tp_degree", mp_world if not any(path.glob("layer_*")) else 1))
    for mp in range(mp_world):
        missing = [] if mp in states else [path / f"mp_rank_{mp:02d}_model_states.pt"]
        missing += [path / f"zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt" for d in range(dp_world)
                    if _optim_file(path, d, mp) is None]
        if missing:
            raise CheckpointFormatError(
                f"DeepSpeed checkpoint {path} (mp_world_size={mp_world}, dp_world_size={dp_world}) is missing "
                f"{missing[0].name}, which holds model-parallel rank {mp}'s part of {_held_by(states, mp, tp)}; "
                f"{_FIX}. Nothing was written.")
    optims = {mp: [load(_optim_file(path, d, mp))["optimizer_state_dict"] for d in range(dp_world)]
              for mp in range(mp_world)}
    return states, optims, first


def _local_tensors(optims: list[dict], state: dict, split: Callable) -> dict[str, dict[str, torch.Tensor]]:
    """One model-parallel rank's tensors: name -> {"model" | "optim.<field>": tensor}."""
    if int(optims[0]["zero_stage"]) == 3:
        raise CheckpointFormatError("DeepSpeed ZeRO-3 with tensor/pipeline parallelism is not supported; "
                                    "save the run with ZeRO-1 or ZeRO-2.")
    shapes = [{n: tuple(s) for n, s in group.items()} for group in state["param_shapes"]]
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, name, tensor in split(optims, shapes, copy=False):  # views: consolidation copies once
        tensors.setdefault(name, {})[prefix] = tensor
    return tensors


def _matching(patterns: Any, name: str) -> Any:
    hits = [p for p in patterns if re.match(p, name)]
    if len(hits) > 1:
        raise CheckpointFormatError(f"DeepSpeed universal_checkpoint_info: tensor {name} matches several "
                                    f"patterns {hits}; the checkpoint's metadata is ambiguous.")
    return hits[0] if hits else None


def _affine_plan(name: str, amap: dict, world: int) -> list[tuple[int, dict, bool]]:
    """Check that a map's pieces tile the tensor (replicated ones agreeing in place); the copy plan.

    Returns:
        (rank, piece, whether another rank already placed it) per piece, ranks in order.
    """
    numel = math.prod(amap["logical_shape"])
    seen = torch.zeros(numel, dtype=torch.bool)
    plan = []
    for rank, spec in sorted(amap["ranks"].items(), key=lambda item: int(item[0])):
        if not 0 <= int(rank) < world:
            raise CheckpointFormatError(f"tensor {name}: the affine map names TP rank {rank} of {world}.")
        for piece in spec["pieces"]:
            if float(piece.get("scale", 1.0)) != 1.0:
                raise CheckpointFormatError(f"tensor {name}: scaled affine-map pieces are not supported; convert "
                                            "with DeepSpeed's ds_to_universal.")
            src_off, src_strides = piece["source"]
            mask = seen.as_strided(piece["shape"], src_strides, src_off)
            placed = bool(mask.all())
            if not placed and bool(mask.any()):
                raise CheckpointFormatError(f"tensor {name}: affine-map pieces overlap; the map is corrupt.")
            mask.fill_(True)
            plan.append((int(rank), piece, placed))
    if not bool(seen.all()):
        raise CheckpointFormatError(f"tensor {name}: the affine map leaves {int((~seen).sum())} elements uncovered.")
    return plan


def _rebuild_affine(name: str, amap: dict, shards: list[torch.Tensor],
                    plan: list[tuple[int, dict, bool]] | None = None) -> torch.Tensor:
    """Place every rank's strided pieces into the consolidated tensor; replicated pieces must agree."""
    plan = plan if plan is not None else _affine_plan(name, amap, len(shards))
    full = torch.empty(math.prod(amap["logical_shape"]), dtype=shards[0].dtype)
    for rank, spec in amap["ranks"].items():
        held, described = shards[int(rank)].numel(), math.prod(spec["shard_shape"])
        if held != described:
            raise CheckpointFormatError(f"tensor {name}: TP rank {rank} holds {held} elements, its affine map "
                                        f"{described}; the checkpoint is inconsistent.")
    for rank, piece, placed in plan:
        (src_off, src_strides), (dst_off, dst_strides) = piece["source"], piece["dest"]
        shard = shards[rank].reshape(-1)  # often a view of the flat partition: as_strided counts from its storage
        source = shard.as_strided(piece["shape"], dst_strides, shard.storage_offset() + dst_off)
        target = full.as_strided(piece["shape"], src_strides, src_off)
        if not placed:
            target.copy_(source)
        elif not torch.equal(target, source):
            raise CheckpointFormatError(
                f"tensor {name}: TP ranks {piece['locations']} hold different copies of a replicated "
                "piece (drifted replicas); DeepSpeed refuses these too. Resave from a consistent run.")
    return full.view(tuple(amap["logical_shape"]))


def _affine_pattern(amap: dict) -> dict:
    shape = amap["logical_shape"]
    shard = next(iter(amap["ranks"].values()))["shard_shape"]
    dims = [d for d, (a, b) in enumerate(zip(shape, shard)) if a != b]
    pieces = max(len(spec["pieces"]) for spec in amap["ranks"].values())
    if not dims:
        return TensorLayout(dim=None, group="tp").to_json()
    if pieces > 1:  # fused sub-parameters: each split separately
        widths = [p["shape"][dims[0]] for p in next(iter(amap["ranks"].values()))["pieces"]]
        ranks = len(amap["ranks"])
        return TensorLayout(dim=dims[0], group="tp", parts=tuple(w * ranks for w in widths)).to_json()
    return TensorLayout(dim=dims[0], group="tp").to_json()


def _merge_by_patterns(name: str, info: dict, shards: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Consolidate one TP-split tensor from DeepSpeed's regex lists (no affine map)."""
    if shards[0].dim() == 0:
        return shards[0], TensorLayout(dim=None, group="tp").to_json()
    if _matching(info.get("tp_replicated_parameter_patterns", []), name):
        if any(not torch.equal(shards[0], s) for s in shards[1:]):
            raise CheckpointFormatError(f"tensor {name}: TP-replicated copies differ between ranks (drifted "
                                        "replicas); resave from a consistent run.")
        return shards[0], TensorLayout(dim=None, group="tp").to_json()
    if _matching(info.get("parameter_to_average_patterns", []), name):
        return sum(shards) / len(shards), TensorLayout(dim=None, group="tp", average=True).to_json()
    if _matching(info.get("parameter_with_2_sub_params_cat_dim_0", []), name):
        halves = [s.chunk(2, 0) for s in shards]
        merged = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        return merged, TensorLayout(dim=0, group="tp", parts=(merged.shape[0] // 2,) * 2).to_json()
    if info.get("parameter_with_sub_params") and any(
            _matching(sub.get("patterns", []), name) for sub in info["parameter_with_sub_params"]):
        raise CheckpointFormatError(f"tensor {name}: sub-parameter patterns without an affine map are not "
                                    "supported; convert with DeepSpeed 0.19.8's ds_to_universal.")
    dim = 1 if _matching(info.get("parameter_with_row_parallelism_patterns", []), name) and shards[0].dim() > 1 else 0
    merged = torch.cat(shards, dim)
    if dim == 0 and _matching(info.get("vocabulary_parameter_patterns", []), name) and info.get("original_vocab_size"):
        vocab = int(info["original_vocab_size"])
        return merged[:vocab].clone(), TensorLayout(dim=0, group="tp", padded_size=merged.shape[0],
                                                    vocab_size=vocab).to_json()
    return merged, TensorLayout(dim=dim, group="tp").to_json()


def _merge_tp(name: str, info: dict, shards: list[torch.Tensor], scalar: bool,
              plans: dict[str, list]) -> tuple[torch.Tensor, dict | None]:
    """One tensor consolidated over TP; ``plans`` caches each map's checked plan (the same for every field)."""
    if scalar:
        return shards[0].clone(), None
    params = (info.get("affine_map") or {}).get("params") or {}
    pattern = _matching(params, name)
    if pattern is not None:
        if name not in plans:
            plans[name] = _affine_plan(name, params[pattern], len(shards))
        return _rebuild_affine(name, params[pattern], shards, plans[name]), _affine_pattern(params[pattern])
    return _merge_by_patterns(name, info, shards)


def model_parallel_tensors(path: Path, load: Callable[[Path], dict], split: Callable
                           ) -> tuple[Iterator[tuple[str, str, torch.Tensor, dict | None]], dict, Layout, list]:
    """Read a model-parallel DeepSpeed tag directory; yields (prefix, name, tensor, pattern) lazily.

    Every file is checked present and loaded before the first tensor is produced, so a broken
    checkpoint raises before anything is written.

    Returns:
        (tensors, the first model-states dict, the producer's layout, the first rank's optimizer states).
    """
    states, optims, first = _read_sources(path, load)
    dims = first.get("checkpoint_parallel_dimensions") or {}
    mp_world = len(optims)
    pipeline = any(path.glob("layer_*-model_states.pt"))
    pp = int(dims.get("pp_degree", mp_world if pipeline else 1))
    tp = int(dims.get("tp_degree", 1 if pipeline else mp_world))
    if pp * tp != mp_world:
        raise CheckpointFormatError(f"{path}: pp_degree={pp} x tp_degree={tp} != mp_world_size={mp_world}; "
                                    "the checkpoint's metadata is inconsistent.")
    locals_ = [_local_tensors(optims[mp], states[mp], split) for mp in range(mp_world)]
    stage = int(optims[0][0]["zero_stage"])
    dp = len(optims[0])
    layout = Layout(world_size=mp_world * dp, zero_stage=stage, mesh={"tp": tp, "pp": pp, "dp": dp})
    if tp > 1 and not any(states[mp].get("universal_checkpoint_info") for mp in range(mp_world)):
        raise CheckpointFormatError(
            f"{path}: a tensor-parallel checkpoint (tp={tp}) without universal_checkpoint_info: which tensors are "
            "row-parallel or replicated is not recorded. Save with DeepSpeed AutoTP (it records it) or pass "
            "client_state={'universal_checkpoint_info': {...patterns...}} to save_checkpoint.")

    def tensors() -> Iterator[tuple[str, str, torch.Tensor, dict | None]]:
        seen: dict[str, torch.Tensor] = {}
        plans: dict[str, list] = {}
        for pipe in range(pp):  # DeepSpeed's model-parallel rank is pipe stage * tp + tp rank
            ranks = [locals_[pipe * tp + t] for t in range(tp)]
            info = states[pipe * tp].get("universal_checkpoint_info") or {}
            for name, fields in ranks[0].items():
                merged = {prefix: _merge_tp(name, info, [rank[name][prefix] for rank in ranks], tensor.dim() == 0,
                                            plans) if tp > 1 else (tensor, None) for prefix, tensor in fields.items()}
                if name in seen:  # a tied layer: each stage holding it must agree
                    if not torch.equal(seen[name], merged["model"][0]):
                        raise CheckpointFormatError(f"tensor {name}: stages hold different copies of a tied "
                                                    "parameter; resave from a consistent run.")
                    continue
                seen[name] = merged["model"][0]
                for prefix, (tensor, pattern) in merged.items():
                    # pipeline placement: the stage that held it (tied layers: the first)
                    yield prefix, name, tensor, {**(pattern or {}), "stages": [pipe]} if pp > 1 else pattern

    return tensors(), first, layout, optims[0]


def pipeline_buffers(path: Path, load: Callable[[Path], dict],
                     param_names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers of a ``PipelineModule`` checkpoint: entries of ``layer_LL-model_states.pt`` that are not parameters."""
    for file in sorted(path.glob("layer_*-model_states.pt")):
        if re.search(r"-model_(\d+)-", file.name) and not re.search(r"-model_0+-", file.name):
            continue  # Megatron-DeepSpeed 3-D: buffers are taken from tensor-parallel rank 0's files
        index = int(re.search(r"layer_(\d+)", file.name).group(1))
        for local, tensor in load(file).items():
            name = f"{index}.{local}"
            if name not in param_names and isinstance(tensor, torch.Tensor):
                yield name, tensor.clone()


def import_model_parallel(path: Path, dst_root: Path, *, key: str, load: Callable[[Path], dict], split: Callable,
                          loss_scaler: Callable[[Any, Any], torch.Tensor],
                          progress: Callable[[int], None] | None) -> Path:
    """Convert a DeepSpeed AutoTP or ``PipelineModule`` tag directory into a universal checkpoint."""
    pieces, first, layout, rank0_optims = model_parallel_tensors(path, load, split)
    scaler = loss_scaler(rank0_optims[0].get("loss_scaler"), first.get("skipped_steps"))
    param_names = {n for group in first["param_shapes"] for n in group}

    def tensors() -> Iterator[tuple[str, str, str, torch.Tensor, dict | None]]:
        names: set[str] = set()
        for prefix, name, tensor, pattern in pieces:
            names.add(name)
            if prefix == "model":
                yield key, f"model.{name}", "parameter", tensor, pattern
            else:
                yield key, f"{prefix}.{name}", "optimizer_state", tensor, pattern
        if layout.mesh["pp"] > 1:
            for name, tensor in pipeline_buffers(path, load, names | param_names):
                yield key, f"buffer.{name}", "buffer", tensor, None
        else:
            for name in first.get("buffer_names") or []:
                yield key, f"buffer.{name}", "buffer", first["module"][name].clone(), None
        yield key, "zero.loss_scaler", "other", scaler, None

    base = rank0_optims[0].get("base_optimizer_state") or {}
    info = dict(first.get("universal_checkpoint_info") or {})
    info.pop("affine_map", None)  # geometry already applied; the manifest's patterns say it per tensor
    objects = {0: {"deepspeed": {"global_steps": first.get("global_steps"),
                                 "global_samples": first.get("global_samples"),
                                 "lr_scheduler": first.get("lr_scheduler"),
                                 "param_groups": base.get("param_groups"),
                                 "ds_config": first.get("ds_config"), "ds_version": first.get("ds_version"),
                                 "universal_checkpoint_info": info,
                                 # tied aliases (lm_head -> embed_tokens): stored once, under the optimizer's name
                                 "shared_params": first.get("shared_params")}}}
    step = int(first.get("global_steps") or 0)
    return write_offline(dst_root, step=step, tensors=tensors(), objects=objects, layout=layout,
                         user_meta={"imported_from": f"deepspeed {first.get('ds_version')}", "source": str(path),
                                    "model_parallel": dict(layout.mesh)},
                         progress=progress)
