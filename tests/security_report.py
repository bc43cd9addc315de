"""The security table of docs/reliability.md: measured by the security tests, kept in a results file.

``python tests/security_report.py run [N]`` runs the attack tests of universal-ckpt (each attack
a test whose marker file must never appear) and the manifest fuzzer with N inputs (default 1000),
and writes ``tests/security_results.json``. ``python tests/security_report.py render`` writes the
table rendered from that committed file into docs/reliability.md between its two marker lines;
``test_security_report.py`` checks that the page holds exactly that rendering.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "security_results.json"
PAGE = HERE.parent / "docs" / "reliability.md"
TESTS = HERE.parent / "packages" / "universal-ckpt" / "tests"
START, END = "<!-- security-table: start (tests/security_report.py render) -->", "<!-- security-table: end -->"

# test name -> (attack, what happens now); the test asserts the outcome and that no marker appears
ATTACKS = {
    "test_crafted_objects_never_run": (
        "crafted `objects/rank-*.pt` (a `__reduce__` calling `os.system`) with a re-signed manifest, "
        "against `plait ckpt verify`, `plait ckpt inspect --hash` and `uc.load`",
        "verify/inspect hash the bytes and never unpickle (OK, nothing runs); load refuses with "
        "`UnsafeObjectError` naming the file and `posix.system`; the marker never appears"),
    "test_json_objects_run_no_unpickler": (
        "loading plain non-tensor state (optimizer param groups, LR schedulers, `GradScaler`, RNG); a "
        "crafted JSON objects file (pickle bytes under an unknown `$plait` kind, a tensor declaring 2**40 "
        "elements) with a re-signed manifest",
        "objects file holds JSON; no unpickler runs for plain values (the load passes with `torch.load` and "
        "`pickle` disabled); the crafted files are refused with `CheckpointFormatError` naming the file and "
        "key path, before any tensor is allocated; the marker never appears"),
    "test_unsafe_value_refused_at_save_naming_the_key_path": (
        "saving a value outside the allowlist (a function in `extra`)",
        "refused before anything is written: `UnsafeObjectError` names the key path and type and the "
        "`allow_pickle=True` opt-in"),
    "test_allow_pickle_needs_trust_on_load": (
        "loading a checkpoint saved with `allow_pickle=True`",
        "refused unless the load passes `trust_pickled_objects=True` (the manifest records the opt-in)"),
    "test_crafted_deepspeed_pickle_refused": (
        "crafted DeepSpeed `mp_rank_00_model_states.pt` naming `os.system`",
        "restricted unpickler refuses `posix.system`, naming it and the file; the marker never appears"),
    "test_crafted_dcp_metadata_refused": (
        "crafted DCP `.metadata` naming `os.system`",
        "restricted unpickler refuses it before DCP reads anything; nothing is written, no marker"),
    "test_traversal_paths_refused_naming_the_field": (
        "re-signed manifest with `../`, absolute, `data/../../` and backslash paths",
        "`PathEscapeError` naming the manifest field, before any file is opened"),
    "test_symlink_escape_refused": (
        "a data file replaced by a symlink pointing outside the checkpoint",
        "`PathEscapeError` (load and verify) naming the field and where it resolves"),
    "test_keep_last_never_deletes_foreign_directories": (
        "`keep_last` with a user's `step-*` directory and a symlink to a checkpoint elsewhere in the root",
        "both left untouched: pruning deletes only real directories with plait's manifest, never through a link"),
}


def run(inputs: int) -> dict:
    """Run the attack tests and the fuzzer; return the results (also written to the results file)."""
    sys.path.insert(0, str(TESTS))
    from test_universal_ckpt_fuzz import SEED, fuzz

    names = " or ".join(ATTACKS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           str(TESTS / "test_universal_ckpt_security.py"), "-k", names],
                          capture_output=True, text=True, check=False)
    passed = {name for name in ATTACKS if any(line.startswith("PASSED") and f"::{name}" in line
                                                for line in proc.stdout.splitlines())}
    with tempfile.TemporaryDirectory() as work:
        fuzzed = fuzz(Path(work), inputs, SEED)
    results = {"attacks": [{"test": name, "attack": attack, "outcome": outcome, "passed": name in passed}
                           for name, (attack, outcome) in ATTACKS.items()],
               "fuzzer": fuzzed,
               "command": f"python tests/security_report.py run {inputs}"}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return results


def render(results: dict) -> str:
    """The markdown table (attacks, then the fuzzer's counts) for docs/reliability.md."""
    lines = ["| attack | what happens now | test passes |", "|---|---|---|"]
    for row in results["attacks"]:
        lines.append(f"| {row['attack']} | {row['outcome']} | {'yes' if row['passed'] else 'NO'} "
                     f"(`{row['test']}`) |")
    fz = results["fuzzer"]
    kinds = ", ".join(f"{k}: {v['refused']}/{v['tried']}" for k, v in fz["by_kind"].items())
    errors = ", ".join(f"{k} {v}" for k, v in fz["errors"].items())
    lines.append(f"| manifest fuzzer (seed {fz['seed']}), load and verify of each input | "
                 f"{fz['inputs_refused']} of {fz['inputs_tried']} inputs refused with a typed error ({kinds}); "
                 f"errors raised: {errors}; no file inside or outside the checkpoint changed | "
                 f"yes (`{results['command']}`) |")
    return "\n".join(lines)


def write_page() -> None:
    """Replace the table between the markers of docs/reliability.md with the rendering."""
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{START}\n{render(json.loads(RESULTS.read_text()))}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
        write_page()
    elif sys.argv[1:2] == ["render"]:
        write_page()
    else:
        sys.exit(__doc__)
