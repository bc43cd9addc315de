"""Discovery and registration without an engine: the entry point, the out-of-tree registry, re-entry,
the version gate, and each registered op against vLLM's own path (runs where vLLM is installed:
ci/test.sh runs it in .venv-vllm)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot

from plait.vllm import ops, plugin

PLAIT_KEYS = ("RMSNorm", "SiluAndMul", "GeluAndMul", "RotaryEmbedding", "UnquantizedFusedMoEMethod")


@pytest.fixture(scope="module")
def loaded():
    """vLLM's own plugin loading, as an engine process does it."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return plugin.registration_report()


def test_vllm_entry_point_is_declared():
    found = {ep.name: ep for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert "plait" in found, sorted(found)
    assert found["plait"].value == "plait.vllm:register"
    assert found["plait"].load() is plugin.register


@pytest.mark.timeout(120)
def test_vllm_general_plugins_register_ops_and_loader(loaded):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from plait.vllm.loader import PlaitUniversalLoader

    assert loaded is not None and loaded.registered, loaded
    assert set(loaded.ops) == set(PLAIT_KEYS) and loaded.loaders == ("plait_universal",)
    for key in PLAIT_KEYS:
        assert op_registry_oot[key] is ops.PLAIT_OPS[key]
    assert ops.PlaitRMSNorm.name == "rms_norm"  # the in-tree name, so custom_ops flags still apply
    assert isinstance(get_model_loader(LoadConfig(load_format="plait_universal")), PlaitUniversalLoader)


@pytest.mark.timeout(120)
def test_vllm_second_load_is_a_no_op(loaded):
    before = dict(op_registry_oot)
    assert plugin.register() is loaded
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert ops.register_ops() == loaded.ops
    assert dict(op_registry_oot) == before


_UNSUPPORTED = """
import vllm
vllm.__version__ = "0.99.0"
from vllm.plugins import load_general_plugins
from vllm.model_executor.custom_op import op_registry_oot
import plait.vllm as pv
load_general_plugins()
pv.register()
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
print("REPORT", pv.registration_report().registered, sorted(op_registry_oot),
      "plait_universal" in _LOAD_FORMAT_TO_MODEL_LOADER)
"""
_SWITCHED_OFF = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
                 "from vllm.model_executor.custom_op import op_registry_oot; import plait.vllm as pv; "
                 "print('REPORT', pv.registration_report(), sorted(op_registry_oot))")
_FILTERED = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
             "from vllm.model_executor.custom_op import op_registry_oot; "
             "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as formats; "
             "import plait.vllm as pv; "
             "print('REPORT', pv.registration_report(), sorted(op_registry_oot), 'plait_universal' in formats)")
# Each check: (variables to set, variables to remove, the code a fresh interpreter runs).
_CASES = {
    "unsupported": ({}, [], _UNSUPPORTED),
    "switched_off": ({"PLAIT_VLLM": "0"}, [], _SWITCHED_OFF),
    "filtered": ({"VLLM_PLUGINS": "some_other_plugin"}, ["PLAIT_VLLM"], _FILTERED),
}
# The checks above each need a process in which neither vLLM's plugins nor plait.vllm have been
# loaded and a setting is in place before they are. Importing vLLM is most of such a process's
# cost (about 20 s on two busy cores), so one interpreter imports vLLM's modules once and forks a
# child per check, one after the other: the child sets its variables, then runs its code with its
# own stdout and stderr. vLLM reads its variables when asked (vllm.envs), not at import, and the
# parent loads no plugin and never imports plait, so each child starts where a fresh interpreter
# that had just imported vLLM would.
_FORK_EACH = r"""
import json, os, sys, traceback
import vllm, vllm.plugins, vllm.model_executor.custom_op, vllm.model_executor.model_loader
assert not vllm.plugins.plugins_loaded and not any(m.startswith("plait.vllm") for m in sys.modules)
cases, folder, results = json.loads(sys.argv[1]), sys.argv[2], {}
for name, (set_env, unset_env, code) in cases.items():
    out, err = os.path.join(folder, name + ".out"), os.path.join(folder, name + ".err")
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 0
        try:
            os.environ.update(set_env)
            for key in unset_env:
                os.environ.pop(key, None)
            os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            exec(compile(code, "<" + name + ">", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(rc)
    results[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("RESULTS", json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_processes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each of ``_CASES`` run in its own process (forked after one import of vLLM): name -> result."""
    folder = tmp_path_factory.mktemp("vllm-fresh")
    driver = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(_CASES), str(folder)],
                            capture_output=True, text=True, timeout=400)
    assert driver.returncode == 0 and "RESULTS " in driver.stdout, (driver.stdout + driver.stderr)[-3000:]
    codes = json.loads(driver.stdout.split("RESULTS ", 1)[1].splitlines()[0])
    return {name: subprocess.CompletedProcess(name, codes[name], (folder / f"{name}.out").read_text(),
                                              (folder / f"{name}.err").read_text()) for name in _CASES}


@pytest.mark.timeout(420)  # the first of the three pays for the shared import
def test_vllm_unsupported_version_registers_nothing_with_one_warning(fresh_processes):
    result = fresh_processes["unsupported"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REPORT False [] False" in result.stdout, result.stdout[-2000:]
    output = result.stdout + result.stderr
    assert output.count("outside the tested range") == 1, output[-3000:]


@pytest.mark.timeout(420)
def test_vllm_switched_off_by_env_registers_nothing(fresh_processes):
    result = fresh_processes["switched_off"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reason='PLAIT_VLLM=0'" in result.stdout and result.stdout.rstrip().endswith("[]"), result.stdout[-2000:]


@pytest.mark.timeout(420)
def test_vllm_plugins_filter_without_plait_registers_nothing(fresh_processes):
    """vLLM's own switch: ``VLLM_PLUGINS`` names the plugins to load; a list without ``plait`` leaves it out."""
    result = fresh_processes["filtered"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REPORT None [] False" in result.stdout, result.stdout[-2000:]


def _both_paths(monkeypatch, build, call):
    """``call(build())`` with vLLM's CPU path, then with plait's (a layer reads the setting when built)."""
    out = []
    for path in ("vllm", "plait"):
        monkeypatch.setenv("PLAIT_VLLM_CPU_PATH", path)
        torch.manual_seed(1)
        out.append(call(build()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_ops_match_vllms_cpu_path(loaded, monkeypatch, dtype):
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    # fp32: vLLM's native norm casts before the weight multiply, plait after; bf16: one rounding apart.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.manual_seed(0)
    x, res = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    gate_up = torch.randn(3, 2, 40, dtype=dtype)
    q, k = torch.randn(7, 4 * 64, dtype=dtype), torch.randn(7, 2 * 64, dtype=dtype)
    pos = torch.tensor([0, 1, 2, 9, 100, 255, 3])

    def norm():
        layer = RMSNorm(96, eps=1e-5, dtype=dtype)
        assert type(layer) is ops.PlaitRMSNorm
        layer.weight.data.uniform_(0.5, 1.5)
        return layer

    with set_current_vllm_config(VllmConfig()):
        a, b = _both_paths(monkeypatch, norm, lambda layer: layer.forward_cpu(x.clone()))
        torch.testing.assert_close(b, a, **tol)
        (ya, ha), (yb, hb) = _both_paths(monkeypatch, norm, lambda layer: layer.forward_cpu(x.clone(), res.clone()))
        torch.testing.assert_close(yb, ya, **tol)
        torch.testing.assert_close(hb, ha, rtol=0, atol=0)
        for make, cls in ((SiluAndMul, ops.PlaitSiluAndMul), (lambda: GeluAndMul("tanh"), ops.PlaitGeluAndMul)):
            assert type(make()) is cls
            a, b = _both_paths(monkeypatch, make, lambda layer: layer.forward_cpu(gate_up))
            torch.testing.assert_close(b, a, **tol)

        def rope():
            layer = get_rope(64, max_position=256, is_neox_style=True, dtype=dtype)
            assert type(layer) is ops.PlaitRotaryEmbedding
            return layer

        (qa, ka), (qb, kb) = _both_paths(monkeypatch, rope, lambda layer: layer.forward_cpu(pos, q.clone(), k.clone()))
        torch.testing.assert_close(qb, qa, **tol)
        torch.testing.assert_close(kb, ka, **tol)


class _FakeModel(torch.nn.Module):
    """Stands in for a vLLM model: records what load_weights gets, reports the names it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.extra = torch.nn.Parameter(torch.zeros(2))
        self.seen: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.seen[name] = tensor
        return set(self.seen)


def _loader(extra: dict):
    from vllm.config.load import LoadConfig

    from plait.vllm.loader import PlaitUniversalLoader

    return PlaitUniversalLoader(LoadConfig(load_format="plait_universal", model_loader_extra_config=extra))


@pytest.mark.timeout(60)
def test_vllm_loader_names_the_parameters_a_checkpoint_lacks(tmp_path):
    from types import SimpleNamespace

    from plait.universal_ckpt import save

    saved = torch.nn.Module()
    saved.proj = torch.nn.Linear(4, 3)  # the fake model's proj, but not its `extra`
    save({"model": saved}, tmp_path, step=0)
    config = SimpleNamespace(model=str(tmp_path), hf_config=SimpleNamespace(model_type="llama"))
    model = _FakeModel()
    loader = _loader({})
    loader.download_model(config)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) of _FakeModel: extra") as info:
        loader.load_weights(model, config)
    assert "proj.weight" not in str(info.value)
    torch.testing.assert_close(model.seen["proj.weight"], saved.proj.weight.detach(), rtol=0, atol=0)


def test_vllm_loader_refuses_unknown_extra_config_keys():
    with pytest.raises(ValueError, match=r"\['chekpoint'\].*use only"):
        _loader({"chekpoint": "/tmp/x"})


@pytest.mark.timeout(60)
def test_vllm_loader_refuses_nan_after_per_rank_row_reads():
    """A rank that read only its rows of a consolidated tensor left NaN elsewhere: if vLLM took other
    rows than plait.vllm.tensor_parallel says, start-up stops naming the parameter and the switch."""
    from types import SimpleNamespace

    from plait.vllm.loader import _check_no_nan

    model = torch.nn.Linear(4, 3)
    weights = SimpleNamespace(directory="/ckpt", nan_filled={"weight"})
    _check_no_nan(model, weights)  # no NaN: nothing to say
    with torch.no_grad():
        model.weight[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"parameter weight holds NaN.*'rank_rows': False"):
        _check_no_nan(model, weights)
