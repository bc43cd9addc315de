"""``plait estimate``: model-state memory per rank for each ZeRO stage and offload setting, before a run.

The first question of a DeepSpeed user ("how much memory per GPU for this model at stage N, with
offload?") answered from the formulas the memory ledger checks (:func:`~plait.zero_sharding.
memory.zero_formula_bytes`, tested against :func:`~plait.zero_sharding.memory.model_state_bytes`).
The model is a parameter count (``--params 7B``) or an HF config (a ``config.json`` path or a
model name in the local HF cache; the model is built on the meta device to count its parameters).

What a rank holds, for ``Psi`` parameters over ``N`` ranks, ``p`` bytes per compute-dtype element,
``g`` per reduced gradient element, ``k`` bytes of optimizer state per parameter, and a 4-byte fp32
master unless the compute dtype is fp32:

* no offload: the ZeRO formula (stage 1: ``2p Psi + (master + k) Psi/N``; stage 2:
  ``p Psi + (g + master + k) Psi/N``; stage 3: ``(p + g + master + k) Psi/N``), all on the device.
* ``optimizer`` (plait-offload-io, ``OffloadConfig(device="cpu")``, stages 2 and 3): the device
  keeps the parameters (``p Psi``, or ``p Psi/N`` at stage 3); the host keeps the fp32 master
  (always 4 bytes: a separate copy, since the parameters live on the device), the optimizer state
  and the reduced gradient shard, which the engine copies to the host as soon as its
  reduce-scatter is done: ``(4 + k + g) Psi/N``.
* ``all`` (stage 3, ``param_device="cpu"`` too): the parameter shards live on the host as well
  (``p Psi/N`` more there); between gathers the device holds no model state.

The offloaded step turns one sub-group of gradients at a time into fp32 (``sub_group_size``
elements): working memory, like activations, the gathered units of stage 3 in flight,
communication buckets and the allocator's slack, which are not model state and are not counted:
leave room for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch

from plait.zero_sharding.memory import zero_formula_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OFFLOADS = ("none", "optimizer", "all")
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateRow:
    """Model-state bytes for one setting.

    Attributes:
        stage: ZeRO stage (1, 2 or 3).
        offload: ``"none"``, ``"optimizer"`` or ``"all"`` (see the module docstring).
        world_size: ranks sharing the state.
        device_bytes: per rank, on its accelerator.
        host_bytes: per rank, in host memory (a node holds ``ranks per node`` times this).
    """

    stage: int
    offload: str
    world_size: int
    device_bytes: float
    host_bytes: float


def parse_count(text: str) -> int:
    """A parameter count from ``"7B"``, ``"1.3b"``, ``"350M"``, ``"7e9"`` or ``"124439808"``.

    Raises:
        ValueError: not a count, naming the forms taken.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgtKMBGT]?)\s*", text)
    if not match:
        raise ValueError(f"--params {text!r}: give a count such as 7B, 1.3B, 350M or 124439808.")
    count = int(round(float(match.group(1)) * _SUFFIX[match.group(2).upper()]))
    if count < 1:
        raise ValueError(f"--params {text!r} must be at least 1.")
    return count


def count_hf_parameters(name_or_path: str) -> int:
    """Parameters of the causal LM an HF config describes, counted on the meta device (no weights).

    Args:
        name_or_path: a ``config.json`` file, a directory holding one, or a model name in the HF cache.

    Raises:
        ImportError: transformers is not installed (with the pip line).
        ValueError: the config cannot be read, naming it.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError("--hf-config needs transformers: pip install transformers (or give --params)") from exc
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--hf-config {name_or_path!r} could not be read as an HF config: {exc}") from exc
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def estimate(num_params: int, *, world_sizes: list[int], dtype: torch.dtype = torch.bfloat16,
             optimizer_state_bytes: int = 8) -> list[EstimateRow]:
    """Every stage x offload x world size that plait runs, with its bytes per rank.

    Args:
        num_params: ``Psi``.
        world_sizes: the ranks to tabulate.
        dtype: the compute dtype (gradients are reduced in it, as ``ZeroConfig``'s default).
        optimizer_state_bytes: ``k`` (8 for Adam/AdamW, 4 for SGD with momentum).

    Returns:
        The rows (stage 1 has no offload: plait offloads with the partitioned gradients of 2/3).
    """
    p = torch.empty((), dtype=dtype).element_size()
    rows = []
    for world in world_sizes:
        shard = num_params / world
        for stage in (1, 2, 3):
            plain = zero_formula_bytes(num_params, stage=stage, world_size=world, compute_dtype=dtype,
                                       grad_dtype=dtype, optimizer_state_bytes=optimizer_state_bytes)
            rows.append(EstimateRow(stage=stage, offload="none", world_size=world, device_bytes=plain, host_bytes=0))
            if stage == 1:
                continue
            params = p * (num_params if stage == 2 else shard)
            host = (4 + optimizer_state_bytes + p) * shard  # master, state, gradient shard (compute dtype)
            rows.append(EstimateRow(stage=stage, offload="optimizer", world_size=world, device_bytes=params,
                                    host_bytes=host))
            if stage == 3:
                rows.append(EstimateRow(stage=stage, offload="all", world_size=world, device_bytes=0,
                                        host_bytes=host + p * shard))
    return rows


def _gib(nbytes: float) -> str:
    return "0" if nbytes == 0 else f"{nbytes / GIB:.3g}"


def table(rows: list[EstimateRow], *, num_params: int, ranks_per_node: int) -> str:
    """The rows as a markdown table in GiB, with host memory per node."""
    lines = [f"model states for {num_params:,} parameters (activations and buffers not included)", "",
             "| ranks | nodes | stage | offload | device GiB per rank | host GiB per rank | host GiB per node |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        nodes = max(1, -(-row.world_size // ranks_per_node))
        per_node = row.host_bytes * min(row.world_size, ranks_per_node)
        lines.append(f"| {row.world_size} | {nodes} | {row.stage} | {row.offload} | {_gib(row.device_bytes)} "
                     f"| {_gib(row.host_bytes)} | {_gib(per_node)} |")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait estimate`` to the ``plait`` command.

    Args:
        subparsers: the ``plait`` command's subparsers.
    """
    parser = subparsers.add_parser("estimate", help="model-state memory per rank for each ZeRO stage and offload")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", help="parameter count, e.g. 7B, 1.3B, 350M")
    source.add_argument("--hf-config", help="an HF config.json, a directory holding one, or a cached model name")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="accelerators per node (default 8)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1],
                        help="node counts to tabulate (default 1); ranks = nodes x ranks per node")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--optimizer-state-bytes", type=int, default=8,
                        help="bytes of optimizer state per parameter (8: Adam/AdamW, the default; 4: SGD momentum)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table for the parsed ``plait estimate`` arguments; 2 on bad input (named)."""
    try:
        if args.ranks_per_node < 1 or any(n < 1 for n in args.nodes):
            raise ValueError("--ranks-per-node and --nodes must be positive.")
        if args.optimizer_state_bytes < 0:
            raise ValueError("--optimizer-state-bytes must be >= 0.")
        num_params = parse_count(args.params) if args.params else count_hf_parameters(args.hf_config)
    except (ValueError, ImportError) as exc:
        print(f"plait estimate: {exc}")
        return 2
    worlds = sorted({n * args.ranks_per_node for n in args.nodes})
    rows = estimate(num_params, world_sizes=worlds, dtype=DTYPES[args.dtype],
                    optimizer_state_bytes=args.optimizer_state_bytes)
    print(table(rows, num_params=num_params, ranks_per_node=args.ranks_per_node))
    return 0


__all__ = ["EstimateRow", "count_hf_parameters", "estimate", "parse_count", "register", "run", "table"]
