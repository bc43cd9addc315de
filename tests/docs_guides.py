"""Find and run the examples of the guides in ``docs/guides/``.

A guide marks what a test runs with HTML comments, which Markdown renderers do not show:

- ``<!-- example: NAME -->`` right before a fenced block whose info string carries
  ``title="FILE"`` (for example ```` ```python title="train.py" ````): the block is written to
  ``FILE`` in the example's own directory. Several blocks may share a NAME (a script and its
  config file).
- ``<!-- run: NAME | expect: TEXT -->`` right before a fenced ``bash`` block: the block is run
  with ``bash -e`` in that directory, exactly as a user types it, and must exit 0 with ``TEXT``
  in its output. ``TEXT`` may repeat (``expect: A | expect: B``); each must appear.

The runner puts the interpreter that runs the tests first on ``PATH`` (so ``python``,
``torchrun`` and ``plait`` are that environment's) and gives ``torchrun`` a free rendezvous port through
``PET_MASTER_PORT``, torchrun's own environment form of ``--master-port``, so runs never collide.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from plait.kernels.testing.distributed import free_port
from plait.kernels.testing.processes import SessionTimeoutError, run_in_session

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"

_MARKER = re.compile(r"<!--\s*(example|run):\s*(.*?)\s*-->\s*\n```([^\n]*)\n(.*?)\n```", re.S)
_TITLE = re.compile(r'title="([^"]+)"')
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass
class Example:
    """One named example of a guide: the files it writes and the commands that run it."""

    guide: str
    name: str
    files: dict[str, str] = field(default_factory=dict)
    runs: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.guide}:{self.name}"


def guide_paths() -> list[Path]:
    """Every guide, sorted by name."""
    return sorted(GUIDES.glob("*.md"))


def examples(path: Path) -> list[Example]:
    """The examples of one guide, in the order they first appear.

    Raises:
        ValueError: a marker without a name, an example block without ``title="..."``, a run
            block that is not ``bash``, a run without ``expect:``, or a run of an example with
            no files; each message names the guide and the example.
    """
    found: dict[str, Example] = {}
    for kind, spec, info, body in _MARKER.findall(path.read_text()):
        parts = [p.strip() for p in spec.split("|")]
        name = parts[0]
        if not name:
            raise ValueError(f"{path.name}: a '{kind}:' marker without a name")
        example = found.setdefault(name, Example(path.stem, name))
        if kind == "example":
            title = _TITLE.search(info)
            if title is None:
                raise ValueError(f"{path.name}:{name}: the block after 'example:' needs title=\"FILE\"")
            example.files[title.group(1)] = body + "\n"
            continue
        if not info.strip().startswith("bash"):
            raise ValueError(f"{path.name}:{name}: the block after 'run:' must be a bash block")
        expects = [p.split(":", 1)[1].strip() for p in parts[1:] if p.startswith("expect:")]
        if not expects:
            raise ValueError(f"{path.name}:{name}: a 'run:' marker needs 'expect: TEXT'")
        example.runs.append((body + "\n", expects))
    for example in found.values():
        if example.runs and not example.files:
            raise ValueError(f"{path.name}:{example.name}: runs an example that writes no file")
    return list(found.values())


def relative_links(path: Path) -> list[str]:
    """The relative link targets of a guide (no scheme, no pure anchors), anchors stripped."""
    targets = []
    for target in _LINK.findall(path.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def _environment(tmp: Path) -> dict[str, str]:
    """The test interpreter's environment first on PATH, a free port for torchrun, no stray group."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    # Wrappers, not symlinks: a virtual environment's interpreter finds its packages from the
    # path it was started by, so a symlink elsewhere would lose them.
    wrappers = {"python": f'exec "{sys.executable}" "$@"',
                "torchrun": f'exec "{sys.executable}" -m torch.distributed.run "$@"',
                "plait": f'exec "{sys.executable}" -m plait.kernels.cli.main "$@"'}
    for name, line in wrappers.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PET_MASTER_PORT"] = str(free_port())
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def run_example(example: Example, tmp: Path, timeout: float) -> list[str]:
    """Write the example's files under ``tmp`` and run its bash blocks in order.

    Returns:
        The combined output of each run.

    Raises:
        AssertionError: a run exited non-zero, timed out, or lacked an expected text; the
            message carries the run's output tail.
    """
    workdir = tmp / example.name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for name, text in example.files.items():
        target = workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    outputs = []
    for script, expects in example.runs:
        code, output = _run_bash(script, workdir, _environment(tmp), timeout)
        tail = output[-6000:]
        assert code is not None, f"{example.id} ran past {timeout}s:\n{script}\n{tail}"
        assert code == 0, f"{example.id} exited {code}:\n{script}\n{tail}"
        for text in expects:
            assert text in output, f"{example.id}: {text!r} not in the output:\n{tail}"
        outputs.append(output)
    return outputs


def _run_bash(script: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run ``script`` in its own session; on timeout kill the whole session (torchrun's workers too).

    Returns:
        (exit code, or None after a timeout; combined stdout and stderr).
    """
    try:
        run = run_in_session(["bash", "-e", "-c", script], limit_s=timeout, env=env, cwd=cwd)
    except SessionTimeoutError as exc:
        return None, exc.output
    return run.rc, run.output
