"""plait-vllm's switch, CPU-path setting and version gate: pure Python, no vLLM needed."""

from __future__ import annotations

import sys

import pytest

from plait.vllm import plugin, settings


@pytest.mark.parametrize(("text", "expected"), [("0.32.0", (0, 32, 0)), ("0.32.1+cpu", (0, 32, 1)),
                                                 ("0.33.0rc1", (0, 33, 0)), ("1.2", (1, 2, 0))])
def test_vllm_parse_version(text, expected):
    assert plugin.parse_version(text) == expected


def test_vllm_parse_version_refuses_garbage():
    with pytest.raises(ValueError, match="major"):
        plugin.parse_version("dev")


@pytest.mark.parametrize(("text", "ok"), [("0.32.0", True), ("0.32.9+cpu", True), ("0.31.2", False),
                                          ("0.33.0", False), ("1.0.0", False), ("unknown", False)])
def test_vllm_version_range(text, ok):
    assert plugin.version_supported(text) is ok


@pytest.mark.parametrize(("raw", "on"), [("1", True), ("", True), ("yes", True), ("0", False), ("off", False)])
def test_vllm_switch(monkeypatch, raw, on):
    monkeypatch.setenv("PLAIT_VLLM", raw)
    assert settings.plugin_enabled() is on


def test_vllm_switch_refuses_unknown_value(monkeypatch):
    monkeypatch.setenv("PLAIT_VLLM", "maybe")
    with pytest.raises(ValueError, match="PLAIT_VLLM=0"):
        settings.plugin_enabled()


def test_vllm_cpu_path_setting(monkeypatch):
    monkeypatch.delenv("PLAIT_VLLM_CPU_PATH", raising=False)
    assert settings.cpu_path() == "auto"
    monkeypatch.setenv("PLAIT_VLLM_CPU_PATH", "Plait")
    assert settings.cpu_path() == "plait"
    monkeypatch.setenv("PLAIT_VLLM_CPU_PATH", "fast")
    with pytest.raises(ValueError, match="auto, plait, vllm"):
        settings.cpu_path()


def test_vllm_quant_cpu_kernel_setting(monkeypatch):
    monkeypatch.delenv("PLAIT_VLLM_QUANT_CPU_KERNEL", raising=False)
    assert settings.quant_cpu_kernel() == "torch"
    monkeypatch.setenv("PLAIT_VLLM_QUANT_CPU_KERNEL", " Plait ")
    assert settings.quant_cpu_kernel() == "plait"
    monkeypatch.setenv("PLAIT_VLLM_QUANT_CPU_KERNEL", "avx")
    with pytest.raises(ValueError, match="PLAIT_VLLM_QUANT_CPU_KERNEL='avx' is not one of torch, plait"):
        settings.quant_cpu_kernel()


@pytest.mark.timeout(60)
def test_vllm_switched_off_registers_nothing_and_imports_no_vllm(monkeypatch):
    monkeypatch.setenv("PLAIT_VLLM", "0")
    monkeypatch.setattr(plugin, "_report", None)
    had_vllm = "vllm" in sys.modules
    report = plugin.register()
    assert not report.registered and report.reason == "PLAIT_VLLM=0"
    assert plugin.registration_report() is report
    assert ("vllm" in sys.modules) == had_vllm
