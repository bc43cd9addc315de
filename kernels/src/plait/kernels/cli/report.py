"""``plait report``: versions, devices, which backend each op takes, and what plait has installed."""

from __future__ import annotations

import argparse
import platform
import sys

from plait.kernels.cli.registry import plait_distributions


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plait report``."""
    parser = subparsers.add_parser(
        "report", help="what is installed, what each piece registers, which kernels run where")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; always exits 0 (missing pieces are reported, not fatal)."""
    for title, lines in (("versions", _versions()), ("devices", _devices()), ("kernels", _kernels()),
                         ("plait distributions", _distributions())):
        print(f"== {title}")
        for line in lines:
            print(f"  {line}")
    return 0


def _versions() -> list[str]:
    import torch

    lines = [f"python {platform.python_version()} ({sys.executable})", f"torch {torch.__version__}",
             f"cuda (torch build) {torch.version.cuda or 'none (CPU build)'}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton not installed (Triton kernels unavailable; references run everywhere)")
    return lines


def _devices() -> list[str]:
    import torch

    lines = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"torch: cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("torch: no CUDA device; running on CPU")
    lines.extend(_nvml_lines())
    return lines


def _nvml_lines() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return ["nvml: nvidia-ml-py not installed (pip install nvidia-ml-py to see driver-level GPU details)"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [f"nvml: no NVIDIA driver or GPU ({exc})"]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        lines = [f"nvml: driver {driver}"]
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            lines.append(f"nvml: gpu {index} {pynvml.nvmlDeviceGetName(handle)}, "
                         f"{memory.used / 2**30:.1f}/{memory.total / 2**30:.1f} GiB used")
        return lines
    finally:
        pynvml.nvmlShutdown()


def _kernels() -> list[str]:
    import torch

    from plait.kernels import dispatch, settings  # torch: only when the report runs

    try:
        forced = settings.kernel_backend()
    except ValueError as exc:
        return [f"PLAIT_KERNEL_BACKEND is invalid: {exc}"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = torch.empty(1, device=device)
    try:
        backend = dispatch.select_backend(probe)
    except ValueError as exc:
        backend = f"error: {exc}"
    lines = [f"PLAIT_KERNEL_BACKEND={forced}; triton importable: {dispatch.triton_available()}"]
    lines += [f"{op:22s} on {device}: {backend}" for op in _public_ops()]
    return lines


def _public_ops() -> list[str]:
    """The dispatching ops plait.kernels.ops exports (functions, not their references or modules)."""
    from plait.kernels import ops

    return [name for name in ops.__all__
            if name[0].islower() and not name.endswith("_reference") and callable(getattr(ops, name))]


def _distributions() -> list[str]:
    dists = plait_distributions()
    if not dists:
        return ["none installed (running from a source tree?)"]
    lines = []
    for dist in dists:
        lines.append(f"{dist.name} {dist.version} (import {dist.import_name})")
        for ep in sorted(dist.entry_points, key=lambda e: (e.group, e.name)):
            if ep.group != "console_scripts":
                lines.append(f"    registers {ep.group}: {ep.name} -> {ep.value}")
    return lines
