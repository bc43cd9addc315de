"""Backend selection and settings: forced backends, bad values named with the fix."""

import pytest
import torch

from plait.kernels import dispatch, settings


def test_auto_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("PLAIT_KERNEL_BACKEND", raising=False)
    assert dispatch.select_backend(torch.zeros(2)) == "reference"


def test_forced_reference_wins(monkeypatch):
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "reference")
    assert dispatch.select_backend(torch.zeros(2)) == "reference"


def test_unknown_backend_names_value_and_fix(monkeypatch):
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match=r"PLAIT_KERNEL_BACKEND='cuda-graphs'.*auto, triton, reference"):
        dispatch.select_backend(torch.zeros(2))


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not dispatch.triton_available():
        pytest.skip("triton not installed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        dispatch.select_backend(torch.zeros(2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select_backend(torch.zeros(2)) == "triton"


@pytest.mark.parametrize("raw", ["fast", "-1", "0"])
def test_bad_timeout_scale_is_refused(monkeypatch, raw):
    monkeypatch.setenv("PLAIT_TEST_TIMEOUT_SCALE", raw)
    with pytest.raises(ValueError, match="PLAIT_TEST_TIMEOUT_SCALE"):
        settings.test_timeout_scale()


def test_triton_launch_mode_mismatch_is_refused_with_the_fix():
    pytest.importorskip("triton")
    from plait.kernels.ops import rms_norm_triton

    interpreted = dispatch.check_triton_launch_mode(rms_norm_triton._rms_norm_fwd_kernel, torch.zeros(1), op="RMSNorm")
    assert interpreted  # no CUDA here: the root conftest set TRITON_INTERPRET before triton was imported
    meta = torch.empty(1, device="meta")
    with pytest.raises(RuntimeError, match=r"Triton RMSNorm kernel was jitted for the interpreter but got meta"):
        # a non-CUDA tensor passes; a CUDA one would not: emulate with a stand-in whose is_cuda is True
        dispatch.check_triton_launch_mode(rms_norm_triton._rms_norm_fwd_kernel, _CudaLike(meta), op="RMSNorm")


class _CudaLike:
    """Just enough of a CUDA tensor for the mode check (no GPU on the CI machines)."""

    def __init__(self, tensor):
        self.device = tensor.device
        self.is_cuda = True
