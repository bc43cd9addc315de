"""DeepSpeed's offload keys in a ``ds_config``, read by plait-zero-sharding's DeepSpeed translator.

plait-zero-sharding owns the translator (:mod:`plait.zero_sharding.deepspeed`) and never imports
this package; without plait-offload-io its registry refuses every offload key, naming the install.
With it installed, the ``plait.deepspeed_keys`` entry point calls :func:`register`, which replaces
those placeholders with the rows below and adds the ``"offload"`` extension: an
:class:`~plait.offload_io.OffloadConfig` built from ``zero_optimization.offload_optimizer``,
``zero_optimization.offload_param``, ``zero_optimization.sub_group_size`` and the ``aio`` block.
``plait.zero_sharding.deepspeed.initialize``, ``PlaitStrategy.from_deepspeed`` and the HF
Trainer's ``--deepspeed`` route pass it on as the ZeRO placement.

How DeepSpeed's settings land (DeepSpeed's defaults in brackets where they differ from plait's):

* ``offload_optimizer.device`` ``cpu``/``nvme`` -> ``OffloadConfig.device``; ``none`` is no offload.
* ``offload_param.device`` (stage 3) -> ``OffloadConfig.param_device``. Offloading parameters
  without the optimizer state is refused: plait offloads parameters as a part of its offload
  placement, which always moves the optimizer state too.
* ``nvme_path`` of either block -> ``OffloadConfig.path`` (one directory; two different ones are
  refused).
* ``offload_optimizer.buffer_count`` -> ``OffloadConfig.slots``; ``ratio`` -> ``offload_ratio``;
  ``pipeline_read``/``pipeline_write`` -> ``overlap_io`` (either one on).
* ``sub_group_size`` [1e9] -> ``OffloadConfig.sub_group_size`` when offload is on (it bounds the
  NVMe store's memory: about ``slots x sub_group_size x 12`` bytes for AdamW).
* ``aio.block_size``, ``aio.queue_depth``, ``aio.thread_count`` (or ``intra_op_parallelism``) ->
  ``IOConfig.block_size``, ``queue_depth``, ``workers``.
"""

from __future__ import annotations

from typing import Any

from plait.offload_io.config import IOConfig, OffloadConfig

OWNER = "plait-offload-io"
_OPT = "zero_optimization.offload_optimizer"
_PARAM = "zero_optimization.offload_param"
_PINNED = "plait pins its host buffers itself where CUDA is present (IOConfig.pinned='auto')"
_PARAM_BUFFERS = "plait reads each parameter shard back ahead of its gather into a buffer of that shard's size"


def _keys() -> list[Any]:
    from plait.zero_sharding.deepspeed.keys import Key

    def key(path: str, action: str, effect: str, check: Any = None) -> Any:
        return Key(path=path, action=action, effect=effect, check=check, owner=OWNER)

    return [
        key(f"{_OPT}.device", "mapped", "OffloadConfig.device ('none': no offload)"),
        key(f"{_OPT}.nvme_path", "mapped", "OffloadConfig.path"),
        key(f"{_OPT}.pin_memory", "accepted", _PINNED),
        key(f"{_OPT}.buffer_count", "mapped", "OffloadConfig.slots (NVMe sub-groups held in memory at once)"),
        key(f"{_OPT}.ratio", "mapped", "OffloadConfig.offload_ratio (Twin-Flow)"),
        key(f"{_OPT}.pipeline_read", "mapped", "OffloadConfig.overlap_io (on when pipeline_read or pipeline_write)"),
        key(f"{_OPT}.pipeline_write", "mapped", "OffloadConfig.overlap_io (on when pipeline_read or pipeline_write)"),
        key(f"{_OPT}.pipeline", "mapped", "OffloadConfig.overlap_io (DeepSpeed's older name)"),
        key(f"{_OPT}.fast_init", "accepted", "plait creates the offloaded state in place; nothing to speed up"),
        key(f"{_OPT}.*", "refused", "not a DeepSpeed offload_optimizer key: remove it"),
        key(f"{_PARAM}.device", "mapped", "OffloadConfig.param_device (stage 3; needs offload_optimizer too)"),
        key(f"{_PARAM}.nvme_path", "mapped", "OffloadConfig.path (the same directory as offload_optimizer's)"),
        key(f"{_PARAM}.pin_memory", "accepted", _PINNED),
        key(f"{_PARAM}.buffer_count", "accepted", _PARAM_BUFFERS),
        key(f"{_PARAM}.buffer_size", "accepted", _PARAM_BUFFERS),
        key(f"{_PARAM}.max_in_cpu", "accepted", "plait keeps no CPU cache of NVMe parameter shards"),
        key(f"{_PARAM}.*", "refused", "not a DeepSpeed offload_param key: remove it"),
        key("zero_optimization.sub_group_size", "mapped",
            "OffloadConfig.sub_group_size when offload is on; without offload plait steps one unit partition at "
            "a time already"),
        key("aio.block_size", "mapped", "IOConfig.block_size"),
        key("aio.queue_depth", "mapped", "IOConfig.queue_depth"),
        key("aio.thread_count", "mapped", "IOConfig.workers"),
        key("aio.intra_op_parallelism", "mapped", "IOConfig.workers (DeepSpeed's newer name for thread_count)"),
        key("aio.single_submit", "accepted", "libaio submission detail; plait's I/O workers submit their own"),
        key("aio.overlap_events", "accepted", "libaio completion detail; plait's I/O workers overlap already"),
        key("aio.use_gds", "accepted", "false only: GPUDirect Storage is not in plait",
            check=lambda value: "GPUDirect Storage is not in plait; remove it or set it to false" if value else None),
        key("aio.*", "refused", "not a DeepSpeed aio key: remove it"),
    ]


def _device(block: dict[str, Any], path: str) -> str:
    device = str(block.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"{path}.device={block.get('device')!r}: use 'cpu', 'nvme' or 'none'.")
    return device


def _nvme_path(opt: dict[str, Any], param: dict[str, Any]) -> str | None:
    paths = {p for p in (opt.get("nvme_path"), param.get("nvme_path")) if p}
    if len(paths) > 1:
        raise ValueError(f"{_OPT}.nvme_path={opt['nvme_path']!r} and {_PARAM}.nvme_path={param['nvme_path']!r} "
                         "differ: plait keeps the optimizer state and the parameter shards in one directory; set "
                         "both to the same path.")
    return paths.pop() if paths else None


def _io(aio: dict[str, Any]) -> IOConfig:
    fields: dict[str, Any] = {}
    if "block_size" in aio:
        fields["block_size"] = int(aio["block_size"])
    if "queue_depth" in aio:
        fields["queue_depth"] = int(aio["queue_depth"])
    workers = aio.get("intra_op_parallelism", aio.get("thread_count"))
    if workers is not None:
        fields["workers"] = int(workers)
    try:
        return IOConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"the aio block {aio} does not make a valid plait IOConfig: {exc}") from exc


def offload_from_deepspeed(tree: dict[str, Any]) -> OffloadConfig | None:
    """The :class:`OffloadConfig` a ``ds_config`` asks for, or ``None`` when it offloads nothing.

    Args:
        tree: the whole ``ds_config`` (its ``zero_optimization`` and ``aio`` blocks are read).

    Returns:
        The offload settings, or ``None`` (no block, or ``device: "none"`` in both).

    Raises:
        ValueError: a setting plait cannot run, named by its dotted path with what to do.
    """
    zero = tree.get("zero_optimization") or {}
    opt, param = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
    device, param_device = _device(opt, _OPT), _device(param, _PARAM)
    if device == "none":
        if param_device != "none":
            raise ValueError(f"{_PARAM}.device={param_device!r} without {_OPT}: plait offloads parameter shards as "
                             f"part of its offload placement, which moves the optimizer state too; set {_OPT}.device "
                             f"to {param_device!r} as well (or 'cpu').")
        return None
    stage = zero.get("stage")
    if stage not in (2, 3):
        raise ValueError(f"{_OPT}.device={device!r} with zero_optimization.stage={stage!r}: plait offloads with the "
                         "partitioned gradients of stage 2 or 3; set the stage to 2 or 3.")
    if param_device != "none" and stage != 3:
        raise ValueError(f"{_PARAM}.device={param_device!r} with zero_optimization.stage={stage}: parameters are "
                         "partitioned (and so offloadable) at stage 3 only; set the stage to 3 or remove "
                         "offload_param.")
    fields: dict[str, Any] = {"device": device, "param_device": param_device, "io": _io(tree.get("aio") or {})}
    path = _nvme_path(opt, param)
    if path is not None:
        fields["path"] = str(path)
    if "sub_group_size" in zero:
        fields["sub_group_size"] = int(float(zero["sub_group_size"]))
    if "buffer_count" in opt:
        fields["slots"] = int(opt["buffer_count"])
    if "ratio" in opt:
        fields["offload_ratio"] = float(opt["ratio"])
    pipelined = [opt[name] for name in ("pipeline_read", "pipeline_write", "pipeline") if name in opt]
    if pipelined:
        fields["overlap_io"] = any(bool(v) for v in pipelined)
    try:
        return OffloadConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"{_OPT} / {_PARAM}: {exc}") from exc


def register() -> None:
    """The ``plait.deepspeed_keys`` entry point: register the offload keys and the extension."""
    from plait.zero_sharding.deepspeed.keys import register_extension, register_keys

    register_keys(_keys())
    register_extension("offload", offload_from_deepspeed)


def key_rows() -> list[Any]:
    """The keys :func:`register` adds (for the offload-io README's key table)."""
    return _keys()


__all__ = ["key_rows", "offload_from_deepspeed", "register"]
