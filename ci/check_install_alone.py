"""Install-alone check: each distribution installs into a fresh environment with only its declared
dependencies, pulls in no other plait distribution than those it declares, imports, and passes its
own tests there (``<distribution>/tests``; tests of several pieces together live in the top-level
``tests/``, run by ci/test.sh in the full environment). Tests of optional third-party extras skip
where the extra is absent (``pytest.importorskip``); the full environment runs them.

One base environment holds torch (installed once from the pinned wheel, or the machine's CUDA
torch); each distribution then gets its own fresh venv that sees the base through a ``.pth``
file, so torch is not reinstalled seven times. Every plait distribution is built once into a
wheel folder; installs use that folder with ``--no-index`` first (fast, offline, and plait names
can never come from an index where an unrelated project could own them) and reach the package
index only for third-party dependencies the base lacks.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cpu_busy import busy_cores, snapshot
from distributions import ROOT, Distribution, distributions

WORK = Path(os.environ.get("PLAIT_ISOLATION_DIR", ROOT / "build" / "install-alone"))
# One file per distribution: the node ids of its tests that passed alone (ci/passed_alone.py).
PASSED = WORK / "passed"
FORBIDDEN_AT_IMPORT = ("lightning", "transformers", "vllm", "deepspeed")
# What running a distribution's tests needs besides the distribution: the test runner, at the
# versions of the calling environment (so both runs behave alike).
TEST_TOOLS = ("pytest", "pytest-timeout")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def _site_packages(venv: Path) -> Path:
    rel = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    return venv / rel


def base_env() -> Path:
    """A venv holding only torch (and what torch needs) and the test runner, made once and reused."""
    from importlib import metadata

    base = WORK / "base"
    import torch

    want = f"torch=={torch.__version__.split('+')[0]}"
    tools = [f"{name}=={metadata.version(name)}" for name in TEST_TOOLS]
    if not (base / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(base)])
    # torch's metadata asks for setuptools>=77; the base must satisfy it so installs stay offline.
    probe = subprocess.run([str(base / "bin" / "python"), "-c",
                            "import torch, setuptools, numpy, pytest, pytest_timeout; "
                            "assert int(setuptools.__version__.split('.')[0]) >= 77"],
                           capture_output=True)
    if probe.returncode:
        _run([str(base / "bin" / "python"), "-m", "pip", "install", "-q", want, "numpy", "setuptools>=77", *tools])
    return base


def build_wheels(dists: list[Distribution]) -> Path:
    """One wheel per distribution, built from this checkout without build isolation."""
    wheels = WORK / "wheels"
    subprocess.run(["rm", "-rf", str(wheels)], check=True)
    # Building writes egg-info into the source folders: one build at a time with ci/setup.sh and
    # ci/setup_vllm.sh (which ci/test.sh runs in the background).
    (ROOT / "build").mkdir(exist_ok=True)
    with open(ROOT / "build" / ".source-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # setuptools stages a wheel's files in the source folder's build/ and keeps what an earlier
        # build put there: a module since moved or deleted would ship in the wheel and be tested.
        for dist in dists:
            subprocess.run(["rm", "-rf", str(dist.folder / "build")], check=True)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
              *[str(d.folder) for d in dists]])
    return wheels


def _closure(dist: Distribution, by_name: dict[str, Distribution]) -> list[Distribution]:
    out, todo = [], [dist]
    while todo:
        current = todo.pop()
        if current in out:
            continue
        out.append(current)
        todo.extend(by_name[name] for name in current.plait_dependencies)
    return out


def check(dist: Distribution, by_name: dict[str, Distribution], base: Path, wheels: Path) -> str | None:
    """Install ``dist`` alone; return a problem description or None."""
    venv = WORK / dist.name
    subprocess.run(["rm", "-rf", str(venv)], check=True)
    # No pip of its own: the base's pip (seen through the .pth) installs into this prefix, which
    # saves the ensurepip step per distribution.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    _site_packages(venv).joinpath("plait_base_torch.pth").write_text(str(_site_packages(base)) + "\n")
    py = str(venv / "bin" / "python")
    needed = _closure(dist, by_name)
    pin = venv / "torch-pin.txt"
    torch_version = _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    pin.write_text(f"torch=={torch_version}\n")
    install = [py, "-m", "pip", "install", "-q", "-c", str(pin), "--find-links", str(wheels), *[d.name for d in needed]]
    try:
        _run([*install, "--no-index"])
    except subprocess.CalledProcessError:
        try:  # a third-party dependency the base lacks: let pip reach the index for it
            _run(install)
        except subprocess.CalledProcessError as exc:
            return f"{dist.name}: pip install failed:\n{exc.stderr[-2000:]}"
    listed = _run([py, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    plait_installed = sorted(line.split("==")[0] for line in listed.splitlines() if line.startswith("plait"))
    expected = sorted(d.name for d in needed)
    if plait_installed != expected:
        return f"{dist.name}: installed plait distributions {plait_installed}, expected only {expected}"
    # Feature packages must not import host frameworks at module level; integrations may.
    forbidden = () if dist.folder.is_relative_to(ROOT / "integrations") else FORBIDDEN_AT_IMPORT
    probe = (f"import sys, {dist.import_name}; "
             f"bad = [m for m in {forbidden!r} if m in sys.modules]; "
             "sys.exit('imported at module level: ' + ', '.join(bad) if bad else 0)")
    result = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=WORK)
    if result.returncode:
        return f"{dist.name}: `import {dist.import_name}` failed:\n{(result.stderr or result.stdout)[-2000:]}"
    return None


def run_tests(dist: Distribution) -> str | None:
    """Run ``dist``'s own tests in its isolated venv (made by :func:`check`); a problem or None.

    Runs from the repository root so the root conftest.py and pytest settings apply; the
    distribution under test is the installed wheel (src/ is not on the path).
    """
    tests = dist.folder / "tests"
    if not tests.is_dir():
        return None
    start, counters = time.monotonic(), snapshot()
    # What passes here is recorded, and ci/test.sh's full run does not run it again (ci/passed_alone.py).
    env = {**os.environ, "PYTHONPATH": str(ROOT / "ci"), "PLAIT_RECORD_PASSED": str(PASSED / f"{dist.name}.txt")}
    env.pop("PLAIT_SKIP_PASSED", None)
    junit = ROOT / "build" / "junit" / f"alone-{dist.name}.xml"  # ci/slowest.py lists the slowest at the end
    result = subprocess.run([str(WORK / dist.name / "bin" / "python"), "-m", "pytest", "-q", "-ra",
                             "-p", "passed_alone", f"--junitxml={junit}", str(tests.relative_to(ROOT))],
                            capture_output=True, text=True, cwd=ROOT, env=env)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    # How busy the machine was: a distribution whose tests mostly wait could share the cores with another.
    busy = busy_cores(counters, snapshot())
    cores = "" if busy is None else f", {busy:.2f} cores busy"
    print(f"install-alone: {dist.name} tests alone: {summary} ({time.monotonic() - start:.0f}s{cores})", flush=True)
    if result.returncode:
        return f"{dist.name}: its tests fail when it is installed alone:\n{(result.stdout + result.stderr)[-4000:]}"
    return None


def main() -> int:
    """Check every distribution; exit 1 if any fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports-only", action="store_true", help="install and import; skip running the tests")
    args = parser.parse_args()
    start = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(PASSED)], check=True)  # never let an older run's record skip a test
    dists = distributions()
    by_name = {d.name: d for d in dists}
    base = base_env()
    wheels = build_wheels(dists)
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for p in pool.map(lambda d: check(d, by_name, base, wheels), dists) if p]
    if not args.imports_only:
        # One distribution at a time: the distributed tests start processes of their own, and two
        # suites at once on two cores would time them out.
        failed = {p.split(":", 1)[0] for p in problems}
        problems += [p for p in (run_tests(d) for d in dists if d.name not in failed) if p]
    for problem in problems:
        print(f"install-alone: {problem}")
    print(f"install-alone: {len(dists)} distributions, {len(problems)} problem(s), {time.monotonic() - start:.0f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
