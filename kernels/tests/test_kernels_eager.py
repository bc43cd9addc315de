"""``plait.kernels.eager.eager_only``: what ``torch.compiler.disable`` does under ``torch.compile``
(checked side by side with it), without importing ``torch._dynamo`` when plait is imported."""

from __future__ import annotations

import subprocess
import sys

import torch

from plait.kernels.eager import eager_only

SEEN: list[tuple[str, bool]] = []


def _inner(x: torch.Tensor) -> torch.Tensor:
    SEEN.append(("inner", torch.compiler.is_compiling()))
    return x - 1


def _side(x: torch.Tensor) -> torch.Tensor:
    SEEN.append(("side", torch.compiler.is_compiling()))
    return _inner(x + 1)


LAZY, TORCH = eager_only(_side), torch.compiler.disable(_side)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * 2) * 3


def _hooked_run(decorate) -> tuple[torch.Tensor, int, list[tuple[str, bool]]]:
    """A block with a forward pre-hook that is a method decorated in its class body, as the ZeRO
    engine's hooks are, compiled as a block is: its output, graph breaks and what ran eagerly
    (the ZeRO compile tests count the breaks of real hooks in a compiled model)."""
    from torch._dynamo.utils import counters

    class Engine:
        def pre_forward(self, module: torch.nn.Module, args: tuple) -> None:
            _side(args[0])

        pre_forward = decorate(pre_forward)

    torch.manual_seed(0)
    block = _Block()
    block.register_forward_pre_hook(Engine().pre_forward)
    torch._dynamo.reset()
    counters.clear()
    SEEN.clear()
    block.compile(backend="eager")
    out = torch.stack([block(torch.full((2, 4), float(i))) for i in range(2)])
    return out, sum(counters["graph_break"].values()), list(SEEN)


def _compiled_run(side) -> tuple[torch.Tensor, dict]:
    from torch._dynamo.utils import counters

    def step(x: torch.Tensor) -> torch.Tensor:
        return side(x * 2) * 3

    torch._dynamo.reset()
    counters.clear()
    SEEN.clear()
    compiled = torch.compile(step, backend="eager")
    outs = [compiled(torch.full((3,), float(i))) for i in range(3)]
    return torch.stack(outs), dict(breaks=sum(counters["graph_break"].values()),
                                   graphs=counters["stats"]["unique_graphs"], seen=list(SEEN),
                                   reasons=[reason.split("\n")[0] for reason in counters["graph_break"]])


def test_importing_collectives_does_not_import_dynamo() -> None:
    probe = ("import sys, plait.kernels.collectives, plait.kernels.eager; "
             "sys.exit('torch._dynamo imported' if 'torch._dynamo' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout


def test_without_dynamo_loaded_the_function_runs_as_written() -> None:
    SEEN.clear()
    assert torch.equal(LAZY(torch.ones(2)), torch.ones(2))
    assert SEEN == [("side", False), ("inner", False)]
    assert LAZY.__name__ == "_side" and LAZY.__wrapped__ is _side


def test_under_compile_it_breaks_and_runs_eagerly_as_torch_compiler_disable_does() -> None:
    ours, lazy = _compiled_run(LAZY)
    theirs, disabled = _compiled_run(TORCH)
    assert torch.equal(ours, theirs)
    # Never traced, neither the function nor what it calls: every call ran eagerly, once a step.
    assert lazy["seen"] == [("side", False), ("inner", False)] * 3
    assert lazy["seen"] == disabled["seen"]
    assert lazy["breaks"] == disabled["breaks"] >= 1
    assert lazy["graphs"] == disabled["graphs"] == 2  # before and after the call
    # torch names its own wrapper's break "Skip calling", ours "Skip inlining" (the reason dynamo
    # gives for the ZeRO engine's hooks under both): the same break, at the same call.
    reasons = lazy["reasons"] + disabled["reasons"]
    assert all(reason.endswith("`torch.compiler.disable()`d function") for reason in reasons), reasons


def test_a_hook_method_runs_eagerly_under_a_compiled_block_as_with_torch_compiler_disable() -> None:
    ours, breaks, seen = _hooked_run(eager_only)
    theirs, torch_breaks, torch_seen = _hooked_run(torch.compiler.disable)
    assert torch.equal(ours, theirs)
    assert seen == torch_seen == [("side", False), ("inner", False)] * 2
    assert breaks == torch_breaks
