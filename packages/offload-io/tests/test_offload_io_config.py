"""Bad input is refused up front with an error naming the field and the fix."""

from __future__ import annotations

import shutil

import pytest
import torch

from plait.offload_io import (
    AsyncIOEngine,
    IOConfig,
    OffloadConfig,
    OffloadDiskFullError,
    OffloadedOptimizer,
    ZeroOffloadPlacement,
    aligned_empty,
)
from plait.offload_io.buffers import BufferPool
from plait.offload_io.errors import OffloadIOError
from plait.offload_io.probe import check_space


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 4097}, "block_size=4097 is not a multiple of alignment=4096.*use 4096 or 8192"),
    ({"block_size": 512}, "block_size=512 must be an int >= alignment"),
    ({"block_size": 1.5e6}, "block_size=1500000.0 must be an int"),
    ({"workers": 0}, "workers=0 must be an int in 1..64"),
    ({"workers": 4, "queue_depth": 2}, "queue_depth=2 must be an int >= workers=4"),
    ({"use_o_direct": "yes"}, "use_o_direct='yes' must be one of auto, on, off"),
    ({"pinned": True}, "pinned=True must be one of auto, on, off"),
    ({"alignment": 3000}, "alignment=3000 must be a power of two"),
    ({"min_free_bytes": -1}, "min_free_bytes=-1 must be an int >= 0"),
    ({"block_size": 1 << 34, "queue_depth": 64}, "more than a quarter of this machine's"),
])
def test_io_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IOConfig(**kwargs)


def test_io_config_is_frozen_and_keyword_only():
    config = IOConfig()
    with pytest.raises(AttributeError):
        config.workers = 3
    with pytest.raises(TypeError):
        IOConfig(1 << 20)  # positional


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "disk"}, "device='disk' must be one of cpu, nvme"),
    ({"device": "nvme"}, "needs path="),
    ({"sub_group_size": 0}, "sub_group_size=0 must be an int >= 1"),
    ({"sub_group_size": 1e8}, r"use int\(1e8\)"),
    ({"master_weights": "always"}, "master_weights='always' must be one of"),
    ({"slots": 1}, "slots=1 must be an int >= 2"),
    ({"offload_ratio": 0.0}, r"offload_ratio=0.0 must be in \(0, 1\]"),
    ({"offload_ratio": 1.5}, r"offload_ratio=1.5 must be in \(0, 1\]"),
    ({"io": {"block_size": 4096}}, "io must be an IOConfig"),
])
def test_offload_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**kwargs)


def test_pinned_on_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinned='on' is valid here")
    with pytest.raises(ValueError, match="pinned='on' needs CUDA"):
        AsyncIOEngine(IOConfig(pinned="on"))


def test_free_space_is_checked_before_any_work(tmp_path):
    with pytest.raises(OffloadDiskFullError, match="needs 1000000000000000000 bytes") as info:
        check_space(str(tmp_path / "x.bin"), 10**18, min_free_bytes=0)
    assert info.value.errno == 28 and isinstance(info.value, OSError)


def test_engine_write_larger_than_the_free_space_is_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with AsyncIOEngine(IOConfig(min_free_bytes=free)) as engine, pytest.raises(OffloadDiskFullError,
                                                                              match="min_free_bytes"):
        engine.write(torch.ones(4096, dtype=torch.uint8), tmp_path / "big.bin")
    assert not (tmp_path / "big.bin").exists()


def test_offloaded_optimizer_checks_disk_space_up_front(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    model = torch.nn.Linear(64, 64)
    with pytest.raises(OffloadDiskFullError, match="optimizer state of 4160 parameters"):
        OffloadedOptimizer(model.parameters(), device="nvme", path=str(tmp_path), io=IOConfig(min_free_bytes=free))


def test_offloaded_optimizer_refuses_bad_arguments(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="rejects"):
        OffloadedOptimizer(model.parameters(), torch.optim.AdamW, betas_typo=(0.9, 0.99))
    with pytest.raises(ValueError, match="not both"):
        OffloadedOptimizer(model.parameters(), config=OffloadConfig(), device="cpu")
    with pytest.raises(ValueError, match="master_weights='off' needs fp32 CPU parameters"):
        OffloadedOptimizer(torch.nn.Linear(4, 4).to(torch.bfloat16).parameters(), master_weights="off")


def test_offload_directory_must_be_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OffloadIOError, match="cannot create offload directory"):
        OffloadedOptimizer(torch.nn.Linear(4, 4).parameters(), device="nvme", path=str(blocker / "sub"))


def test_aligned_buffers():
    for nbytes in (0, 1, 4095, 4097):
        assert aligned_empty(nbytes).data_ptr() % 4096 == 0
    assert aligned_empty(12, dtype=torch.float32).shape == (3,)
    with pytest.raises(ValueError, match="multiple of"):
        aligned_empty(6, dtype=torch.float32)
    pool = BufferPool(2, 8192)
    a, b = pool.acquire(), pool.acquire()
    pool.release(a)
    assert pool.acquire() is a
    assert pool.allocated_bytes == 2 * (8192 + 4096)
    with pytest.raises(ValueError, match="count=0"):
        BufferPool(0, 10)
    del b


def test_parameter_offload_config_errors() -> None:
    with pytest.raises(ValueError, match="param_device='nvme' needs path"):
        OffloadConfig(param_device="nvme")
    with pytest.raises(ValueError, match="param_device='disk' must be one of none, cpu, nvme"):
        OffloadConfig(param_device="disk")
    with pytest.raises(ValueError, match="zero_placement"):
        OffloadedOptimizer([torch.nn.Parameter(torch.zeros(3))], param_device="cpu")


def test_placement_refuses_a_non_config() -> None:
    with pytest.raises(TypeError, match="OffloadConfig"):
        ZeroOffloadPlacement({"device": "cpu"})
