"""ZeroConfig: every option of the ZeRO engine, frozen and validated before anything is allocated."""

from __future__ import annotations

import dataclasses
import math

import torch

from plait.zero_sharding.zeropp.config import ZeroPPConfig

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _as_dtype(field: str, value: object, *, allow_none: bool) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.lower() in _DTYPES:
        value = _DTYPES[value.lower()]
    if value not in COMPUTE_DTYPES:
        raise ValueError(
            f"ZeroConfig.{field}={value!r} is not supported; use torch.float32, torch.bfloat16 or "
            f"torch.float16 (or the strings 'fp32', 'bf16', 'fp16')."
        )
    return value  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How :func:`plait.zero_sharding.zero_shard` partitions a model and its optimizer.

    Attributes:
        stage: 1 partitions fp32 master weights and optimizer state; 2 also reduce-scatters
            gradients into each rank's partition during backward; 3 also partitions the
            parameters and gathers them just in time around each module group.
        reduce_bucket_elements: stages 1/2: parameters are packed into flat buckets of about this
            many elements (a larger parameter gets a bucket of its own); a bucket is the unit
            of reduce-scatter and of the post-step all-gather. Stage 2 launches a bucket's
            reduce-scatter as soon as its gradients are all there, so buckets much smaller
            than the model are what lets communication overlap backward: with one bucket for
            the whole model (the former 25M default on a 25M model) stage 2 waited for the
            whole backward and stepped slower than stage 3. 5M elements is the bucket
            DeepSpeed's benchmarks here use (20 MB fp32, near DDP's 25 MiB).
        prefetch: stage 3: how many module groups ahead (forward order, reversed in backward)
            to start gathering while the current one computes. 0 disables prefetch.
        param_persistence_threshold: stage 3: parameters with fewer elements than this stay
            resident (full on every rank, handled like stage 2) instead of being gathered each
            time; norms and biases are the usual case. 0 shards every parameter.
        unit_classes: stage 3: class names of the modules that form one gather unit each
            (e.g. ``("Block",)``). Empty means: every child of an ``nn.ModuleList``; the
            remaining parameters form the root unit.
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward
            (gather again for backward). ``False`` keeps them until backward ends.
        compute_dtype: dtype of the model's parameters during forward/backward. fp32 masters
            are kept separately when this is bf16/fp16.
        reduce_dtype: dtype gradients are reduced in; ``None`` means ``compute_dtype``.
        overlap_comm: stage 2/3: launch each bucket's reduce-scatter as soon as its gradients
            are ready during backward (otherwise at the end of backward).
        max_grad_norm: clip the global gradient norm (across all shards) to this value inside
            ``optimizer.step()``; ``None`` disables automatic clipping.
        loss_scale: fp16 only: a fixed loss scale, or 0 for dynamic loss scaling.
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: good steps before the scale grows by ``growth_factor``.
        loss_scale_window_offset: extra good steps the start and every overflow cost before the
            first growth: 0 grows after ``loss_scale_window`` good steps, then every window
            (``torch.amp.GradScaler``'s rule); 1 grows after ``loss_scale_window + 1``, then every
            window (DeepSpeed's ``DynamicLossScaler``; the DeepSpeed config translator sets it).
        growth_factor: multiplier when the scale grows.
        backoff_factor: multiplier applied on overflow.
        hysteresis: overflowing steps tolerated before the scale backs off (each one is still
            skipped); reset on growth.
        min_loss_scale: the scale never backs off below this.
        check_replicas_every: every this many steps compare a digest of every replicated tensor
            across ranks and raise on a mismatch (flipped bits, diverged replicas); 0 disables.
        elementwise_optimizer: ``None``: accept only optimizers known to update each element
            independently (flat partitions are exact only for those); ``True``: trust that the
            given optimizer is elementwise.
        shard_dims: when a multi-dimensional ``DeviceMesh`` is given, the dimensions ZeRO shards
            over (flattened into one group), e.g. ``("dp", "sp")``. ``None``: ``dp`` and ``sp``,
            those of them the mesh has. Every other dimension of the mesh is replicated over,
            HSDP-style: each shard's gradients are all-reduced over it before the step. An
            explicit name the mesh does not have is an error.
        zeropp: ZeRO++ (:class:`~plait.zero_sharding.zeropp.ZeroPPConfig`: quantized weight
            gathers, quantized gradient reduction, hierarchical partition); ``True`` for its
            defaults, a dict of its fields (a JSON config), ``None``/``False``: off. qwZ and hpZ
            act on stage 3's parameter gathers, so they need ``stage=3``; qgZ alone also runs at
            stage 2. A ``reducer=``/``gatherer=`` given to ``zero_shard`` as well is refused.
        master_dtype: dtype of the master weights the optimizer updates: fp32 (default) or bf16.
            bf16 needs ``compute_dtype`` bf16: the master is then the compute shard itself (no
            separate copy), updated through :mod:`plait.zero_sharding.low_precision`.
        master_rounding: how an fp32 update is written into a bf16 master: ``"compensated"``
            (default: a bf16 compensation buffer keeps the rounding residual, Kahan-style, so
            small updates accumulate; 2 more bytes per parameter) or ``"stochastic"`` (rounds
            up with probability equal to the discarded fraction, from a counter-based hash of
            ``stochastic_seed``, the step and each element's parameter name and index, so runs
            are reproducible at any world size). Only with ``master_dtype`` bf16.
        optimizer_state_dtype: dtype the optimizer's per-element states are stored in between
            steps: fp32 (default), bf16 (round to nearest) or int8 (blockwise: ``state_block_size``
            elements share one fp32 absmax scale; 1 byte per element on a logarithmic map, see
            :mod:`plait.zero_sharding.low_precision`). A parameter group may override it with
            its ``zero_state_dtype`` key. Which optimizers take which dtype:
            :data:`plait.zero_sharding.low_precision.STATE_KINDS`.
        state_block_size: elements per int8 block; shards are padded to whole blocks.
        stochastic_seed: seed of stochastic rounding (``master_rounding="stochastic"``).
        two_hop_reduce: stage 3 without ZeRO++: when the sharding group spans several nodes of
            more than one rank each, reduce-scatter gradients in two exact hops (inside the node,
            then across; :class:`~plait.zero_sharding.zeropp.HierarchicalReducer`), which sends
            ``1 / ranks_per_node`` of the bucket across the slow link instead of gloo's ``~3x``.
            The sums are the same, added in another order (fp32 rounding). ``False``: always the
            one-hop collective. On one node both are the same collective. (ZeRO++ chooses its own
            reducers, see ``ZeroPPConfig``.)
        ranks_per_node: how many consecutive ranks of the sharding group share a node, for the
            two-hop reduction (and for ZeRO++ when its own ``ranks_per_node`` is ``"auto"``).
            ``"auto"`` (default): read from the launcher, checked to be several equal nodes
            (torchrun's ``GROUP_RANK`` or ``LOCAL_WORLD_SIZE < WORLD_SIZE``, Lightning's
            ``NODE_RANK``, SLURM's ``SLURM_NODEID``, else the host name; see
            :mod:`plait.zero_sharding.zeropp.nodes`). An int is trusted as given: the Lightning
            strategies pass ``devices`` when ``num_nodes > 1``, and a test emulates nodes with it.
    """

    stage: int = 3
    reduce_bucket_elements: int = 5_000_000
    prefetch: int = 1
    param_persistence_threshold: int = 1024
    unit_classes: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    compute_dtype: torch.dtype | str = torch.float32
    reduce_dtype: torch.dtype | str | None = None
    overlap_comm: bool = True
    max_grad_norm: float | None = None
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    loss_scale_window_offset: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    check_replicas_every: int = 0
    elementwise_optimizer: bool | None = None
    shard_dims: tuple[str, ...] | None = None
    zeropp: ZeroPPConfig | None = None
    master_dtype: torch.dtype | str = torch.float32
    master_rounding: str | None = None
    optimizer_state_dtype: str = "fp32"
    state_block_size: int = 256
    stochastic_seed: int = 0
    two_hop_reduce: bool = True
    ranks_per_node: int | str = "auto"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroConfig.stage={self.stage!r} is unknown; use 1, 2 or 3.")
        self._positive_int("reduce_bucket_elements", minimum=1, hint="e.g. 5_000_000 elements")
        self._positive_int("prefetch", minimum=0, hint="0 disables prefetch, 1 is typical")
        self._positive_int("param_persistence_threshold", minimum=0, hint="0 shards every parameter")
        self._positive_int("initial_scale_power", minimum=0, hint="16 is typical")
        self._positive_int("loss_scale_window", minimum=1, hint="1000 is typical")
        self._positive_int("loss_scale_window_offset", minimum=0, hint="0 (torch's rule) or 1 (DeepSpeed's)")
        self._positive_int("hysteresis", minimum=1, hint="2 is typical")
        self._positive_int("check_replicas_every", minimum=0, hint="0 disables the check")
        object.__setattr__(self, "compute_dtype", _as_dtype("compute_dtype", self.compute_dtype, allow_none=False))
        object.__setattr__(self, "reduce_dtype", _as_dtype("reduce_dtype", self.reduce_dtype, allow_none=True))
        object.__setattr__(self, "unit_classes", tuple(self.unit_classes))
        if self.shard_dims is not None:
            if isinstance(self.shard_dims, str) or not all(isinstance(d, str) for d in self.shard_dims) \
                    or not self.shard_dims:
                raise ValueError(f"ZeroConfig.shard_dims={self.shard_dims!r} must be a non-empty tuple of mesh "
                                 "dimension names, e.g. ('dp', 'sp'), or None.")
            object.__setattr__(self, "shard_dims", tuple(self.shard_dims))
        if self.max_grad_norm is not None and not (_finite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"ZeroConfig.max_grad_norm={self.max_grad_norm!r} must be a positive number or None.")
        if not (_finite(self.loss_scale) and self.loss_scale >= 0):
            raise ValueError(f"ZeroConfig.loss_scale={self.loss_scale!r} must be >= 0 (0 = dynamic scaling).")
        if not (_finite(self.growth_factor) and self.growth_factor > 1):
            raise ValueError(f"ZeroConfig.growth_factor={self.growth_factor!r} must be > 1, e.g. 2.0.")
        if not (_finite(self.backoff_factor) and 0 < self.backoff_factor < 1):
            raise ValueError(f"ZeroConfig.backoff_factor={self.backoff_factor!r} must be in (0, 1), e.g. 0.5.")
        if not (_finite(self.min_loss_scale) and self.min_loss_scale > 0):
            raise ValueError(f"ZeroConfig.min_loss_scale={self.min_loss_scale!r} must be > 0, e.g. 1.0.")
        if self.stage != 3 and self.unit_classes:
            raise ValueError(
                f"ZeroConfig.unit_classes={self.unit_classes} only applies to stage 3 (stage={self.stage}); "
                "remove it or use stage=3."
            )
        self._check_zeropp()
        self._check_nodes()
        self._check_state_precision()
        if self.elementwise_optimizer not in (None, True):
            raise ValueError(
                f"ZeroConfig.elementwise_optimizer={self.elementwise_optimizer!r}; use None (known optimizers "
                "only) or True (trust that the optimizer updates each element independently)."
            )

    def _check_zeropp(self) -> None:
        value = self.zeropp
        if value is True:
            value = ZeroPPConfig()
        elif value is False:
            value = None
        elif isinstance(value, dict):
            try:
                value = ZeroPPConfig(**value)
            except TypeError as exc:
                known = [f.name for f in dataclasses.fields(ZeroPPConfig)]
                raise ValueError(f"ZeroConfig.zeropp={value!r}: {exc}; ZeroPPConfig's fields are {known}.") from exc
        if value is not None and not isinstance(value, ZeroPPConfig):
            raise ValueError(f"ZeroConfig.zeropp={value!r} must be a ZeroPPConfig, True (ZeRO++ defaults), a dict of "
                             "ZeroPPConfig fields, or None (off).")
        if value is not None and self.stage != 3 and value.partitions_weights:
            raise ValueError(
                f"ZeroConfig.zeropp: quantized_weights (qwZ) and hierarchical_partition_size (hpZ) act on stage 3's "
                f"parameter gathers, but stage={self.stage}; use stage=3, or ZeroPPConfig(quantized_weights=False, "
                f"hierarchical_partition_size=None) for qgZ alone.")
        object.__setattr__(self, "zeropp", value)

    def _check_nodes(self) -> None:
        if not isinstance(self.two_hop_reduce, bool):
            raise ValueError(f"ZeroConfig.two_hop_reduce={self.two_hop_reduce!r} must be True (two hops across "
                             "nodes, the default) or False (always the one-hop reduce-scatter).")
        value = self.ranks_per_node
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"ZeroConfig.ranks_per_node={value!r} must be 'auto' (from the launcher) or a positive "
                             "int, the ranks each node runs, e.g. 8.")

    def _check_state_precision(self) -> None:
        master = _as_dtype("master_dtype", self.master_dtype, allow_none=False)
        if master not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ZeroConfig.master_dtype={self.master_dtype!r} is not supported; use 'fp32' or 'bf16'.")
        if master == torch.bfloat16 and self.compute_dtype != torch.bfloat16:
            raise ValueError("ZeroConfig.master_dtype='bf16' needs compute_dtype='bf16' (the bf16 master is the "
                             f"compute shard), got compute_dtype={self.compute_dtype}; set compute_dtype='bf16' or "
                             "master_dtype='fp32'.")
        object.__setattr__(self, "master_dtype", master)
        rounding = self.master_rounding
        if rounding is not None and master != torch.bfloat16:
            raise ValueError(f"ZeroConfig.master_rounding={rounding!r} applies to bf16 masters only; set "
                             "master_dtype='bf16' or leave master_rounding=None.")
        if master == torch.bfloat16:
            rounding = "compensated" if rounding is None else rounding
            if rounding not in ("compensated", "stochastic"):
                raise ValueError(f"ZeroConfig.master_rounding={rounding!r} is unknown; use 'compensated' or "
                                 "'stochastic'.")
        object.__setattr__(self, "master_rounding", rounding)
        object.__setattr__(self, "optimizer_state_dtype", state_dtype_name("optimizer_state_dtype",
                                                                             self.optimizer_state_dtype))
        self._positive_int("state_block_size", minimum=1, hint="256 elements is typical")
        if not isinstance(self.stochastic_seed, int) or isinstance(self.stochastic_seed, bool) \
                or not 0 <= self.stochastic_seed < 2 ** 31:
            raise ValueError(f"ZeroConfig.stochastic_seed={self.stochastic_seed!r} must be an integer in [0, 2**31).")

    @property
    def low_precision_state(self) -> bool:
        """Whether masters or optimizer states are kept below fp32 (engine-wide settings)."""
        return self.master_dtype != torch.float32 or self.optimizer_state_dtype != "fp32"

    @property
    def fp32_masters(self) -> bool:
        """Whether fp32 masters are kept apart from lower-precision compute shards."""
        return self.mixed_precision and self.master_dtype == torch.float32

    def _positive_int(self, field: str, *, minimum: int, hint: str) -> None:
        value = getattr(self, field)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
            object.__setattr__(self, field, value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"ZeroConfig.{field}={value!r} must be an integer >= {minimum} ({hint}).")

    @property
    def effective_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in."""
        return self.reduce_dtype or self.compute_dtype  # type: ignore[return-value]

    @property
    def mixed_precision(self) -> bool:
        """Whether fp32 masters are kept apart from lower-precision compute parameters."""
        return self.compute_dtype != torch.float32

    def fingerprint(self) -> dict[str, str]:
        """Field -> printable value, compared across ranks to refuse mismatched configs."""
        return {f.name: repr(getattr(self, f.name)) for f in dataclasses.fields(self)}


STATE_DTYPES = ("fp32", "bf16", "int8")


def state_dtype_name(field: str, value: object) -> str:
    """``value`` as one of :data:`STATE_DTYPES` (torch dtypes and their aliases accepted).

    Raises:
        ValueError: naming ``field`` and the accepted values.
    """
    aliases = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8", "float32": "fp32",
               "bfloat16": "bf16", "8bit": "int8"}
    name = aliases.get(value.lower() if isinstance(value, str) else value, value)  # type: ignore[arg-type]
    if name not in STATE_DTYPES:
        raise ValueError(f"{field}={value!r} is not a supported optimizer-state dtype; use 'fp32', 'bf16' or 'int8'.")
    return name  # type: ignore[return-value]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
