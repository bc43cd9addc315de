"""plait-vllm's environment variables, read in this one place (all prefixed ``PLAIT_``).

* ``PLAIT_VLLM``: ``1`` (default) registers plait's ops and loader when vLLM loads its plugins;
  ``0`` registers nothing. vLLM's own ``VLLM_PLUGINS=<names>`` filter works too (this plugin's
  entry-point name is ``plait``).
* ``PLAIT_VLLM_CPU_PATH``: which implementation plait's ops run on vLLM's CPU platform:
  ``auto`` (default: per op, whichever measured faster on CPU, see ``ops.CPU_PATH``), ``plait``
  (plait's torch reference for every op) or ``vllm`` (vLLM's own CPU path for every op).
* ``PLAIT_VLLM_QUANT_CPU_KERNEL``: whose CPU kernels run ``quantization="plait_weight_only"``
  Linears: ``torch`` (default: torch's weight-packed matmuls) or ``plait`` (plait's own AVX2
  kernels, ``QuantizeConfig.cpu_kernel="plait"``; built on first use, which needs a C++ compiler).
"""

from __future__ import annotations

import os

CPU_PATHS = ("auto", "plait", "vllm")
QUANT_CPU_KERNELS = ("torch", "plait")


def plugin_enabled() -> bool:
    """Whether ``PLAIT_VLLM`` allows registering (anything but ``0``/``false``/``off``/``no``).

    Raises:
        ValueError: ``PLAIT_VLLM`` is set to something that is not a yes/no word.
    """
    raw = os.environ.get("PLAIT_VLLM", "1").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"PLAIT_VLLM={raw!r} is not understood; set PLAIT_VLLM=1 (register plait's ops and "
                     "loader in vLLM) or PLAIT_VLLM=0 (register nothing).")


def _choice(name: str, choices: tuple[str, ...], default: str, unset: str) -> str:
    """The lower-cased value of environment variable ``name`` (``default`` when unset or empty),
    refused unless it is one of ``choices``; ``unset`` says what leaving it unset gives."""
    raw = os.environ.get(name, default).strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}; unset it for {unset}.")
    return raw


def cpu_path() -> str:
    """The ``PLAIT_VLLM_CPU_PATH`` choice: ``auto``, ``plait`` or ``vllm``.

    Raises:
        ValueError: any other value (the message lists the valid ones).
    """
    return _choice("PLAIT_VLLM_CPU_PATH", CPU_PATHS, "auto", "the measured default (auto)")


def quant_cpu_kernel() -> str:
    """The ``PLAIT_VLLM_QUANT_CPU_KERNEL`` choice: ``torch`` (default) or ``plait``.

    Raises:
        ValueError: any other value (the message lists the valid ones).
    """
    return _choice("PLAIT_VLLM_QUANT_CPU_KERNEL", QUANT_CPU_KERNELS, "torch", "torch's weight-packed kernels")
