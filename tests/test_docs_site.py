"""The documentation site's own checks, tested: the results pages are current, the link checker finds
broken links and anchors, a blank screenshot is told from a page.

The build itself (mkdocs --strict and headless Chromium) runs once in CI, from ci/test.sh through
ci/build_docs.py; these tests keep the checks it relies on honest, in well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path):
    # Scripts, not packages: loaded from their files (registered first, as dataclasses need).
    spec = importlib.util.spec_from_file_location(f"plait_docs_site_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen_results = _load(ROOT / "docs" / "gen_results.py")
build_docs = _load(ROOT / "ci" / "build_docs.py")


def test_committed_results_pages_are_current(capsys):
    assert gen_results.main(["--check"]) == 0, capsys.readouterr().out


def test_every_distribution_has_a_results_page_named_after_its_folder():
    pages = {path.name for path in (ROOT / "docs" / "results").glob("*.md")}
    folders = {f"{folder.name}.md" for folder in gen_results.distribution_folders()}
    assert pages == folders
    assert {"zero-sharding.md", "kernels.md", "lightning.md", "transformers.md", "vllm.md"} <= pages


def test_a_plot_belongs_to_the_results_file_with_the_longest_matching_stem(tmp_path):
    for name in ("zero-breakdown.json", "zero-breakdown-before.json", "ulysses-sp.json"):
        (tmp_path / name).write_text("{}")
    for name in ("zero-breakdown.png", "zero-breakdown-before.png", "ulysses-sp-memory.png", "stray.png"):
        (tmp_path / name).write_bytes(b"")
    owned = {stem: [p.name for p in gen_results.plot_for(tmp_path / f"{stem}.json")]
             for stem in ("zero-breakdown", "zero-breakdown-before", "ulysses-sp")}
    assert owned == {"zero-breakdown": ["zero-breakdown.png"], "zero-breakdown-before": ["zero-breakdown-before.png"],
                     "ulysses-sp": ["ulysses-sp-memory.png"]}


def test_a_quick_runs_plot_belongs_to_the_quick_results(tmp_path):
    for name in ("optimizers.json", "optimizers-quick.json", "ulysses-sp.json"):
        (tmp_path / name).write_text("{}")
    for name in ("optimizers-quality.png", "optimizers-quality-quick.png", "ulysses-sp-memory-quick.png"):
        (tmp_path / name).write_bytes(b"")
    owned = {stem: [p.name for p in gen_results.plot_for(tmp_path / f"{stem}.json")]
             for stem in ("optimizers", "optimizers-quick", "ulysses-sp")}
    # ulysses-sp has no quick results here: its quick plot stays with the results it names
    assert owned == {"optimizers": ["optimizers-quality.png"], "optimizers-quick": ["optimizers-quality-quick.png"],
                     "ulysses-sp": ["ulysses-sp-memory-quick.png"]}


def test_provenance_names_date_machine_and_command_without_machine_paths():
    payload = {"meta": {"date": "2026-01-02T03:04:05+00:00", "machine": "Linux-x86_64", "cpus": 2,
                        "command": "plait train --out /tmp/run1 --steps 40"}, "rows": []}
    line = gen_results.provenance(payload)
    assert "2026-01-02T03:04:05+00:00" in line and "Linux-x86_64, 2 CPUs" in line
    assert "`plait train --out DIR --steps 40`" in line


def test_a_table_cell_that_looks_like_a_link_stays_text(tmp_path):
    results = tmp_path / "kernels" / "benchmarks" / "results" / "kernels.json"
    results.parent.mkdir(parents=True)
    row = {"benchmark": "swiglu", "figure": "time (ms)", "ours": 1.0, "peer": "ACT2FN[silu](gate)*up"}
    results.write_text(json.dumps({"meta": {}, "rows": [row]}))
    section = gen_results.benchmark_section(results, {})
    assert "ACT2FN[silu]\\(gate)*up" in section and "](gate)" not in section


def _site(tmp_path: Path, link: str) -> Path:
    (tmp_path / "guides").mkdir(parents=True)
    (tmp_path / "index.html").write_text(f'<h1 id="top">plait</h1><a href="{link}">x</a><img src="img/a.png">')
    (tmp_path / "guides" / "torch.html").write_text('<h2 id="install">Install</h2><a href="../index.html#top">home</a>')
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"")
    return tmp_path


def test_link_checker_passes_a_sound_site_and_names_what_is_broken(tmp_path):
    assert build_docs.check_links(_site(tmp_path / "ok", "guides/torch.html#install")) == 3
    with pytest.raises(SystemExit, match=r"index.html -> guides/torch.html#missing \(no id 'missing'"):
        build_docs.check_links(_site(tmp_path / "anchor", "guides/torch.html#missing"))
    with pytest.raises(SystemExit, match=r"index.html -> guides/gone.html \(no such file\)"):
        build_docs.check_links(_site(tmp_path / "file", "guides/gone.html"))


def test_a_blank_screenshot_is_told_from_a_rendered_page(tmp_path):
    image = pytest.importorskip("PIL.Image")
    blank, page = tmp_path / "blank.png", tmp_path / "page.png"
    image.new("RGB", (64, 64), "white").save(blank)
    rendered = image.new("RGB", (64, 64))
    rendered.putdata([(x * 4, y * 4, (x + y) * 2) for y in range(64) for x in range(64)])
    rendered.save(page)
    assert build_docs.distinct_colours(blank) == 1 < build_docs.MIN_COLOURS <= build_docs.distinct_colours(page)


def test_site_links_to_repository_files_resolve_to_pages_images_or_text(tmp_path):
    pytest.importorskip("mkdocs")
    hooks = _load(ROOT / "docs" / "site_hooks.py")
    from mkdocs.config import load_config
    from mkdocs.structure.files import Files

    files, config = Files([]), load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path))
    config.plugins._current_plugin = None  # set by mkdocs while it runs an event; here no event runs
    guide = ROOT / "docs" / "guides" / "torch.md"
    text = ("[zero](../../packages/zero-sharding/README.md#usage) [concept](../concepts/zero.md) "
            "[test](../../tests/test_docs_site.py) [gone](../nowhere.md) ACT2FN[silu](gate)\n"
            "```\n[code](../../tests/test_docs_site.py)\n```\n")
    out = hooks._rewrite(text, guide, "guides/torch.md", files, config)
    assert "[zero](../packages/zero-sharding.md#usage)" in out and "[concept](../concepts/zero.md)" in out
    assert " test " in out and "[gone](../nowhere.md)" in out and "ACT2FN[silu]\\(gate)" in out
    assert "[code](../../tests/test_docs_site.py)" in out  # fenced code is left alone
    readme = ROOT / "packages" / "zero-sharding" / "README.md"
    pngs = sorted(readme.parent.glob("benchmarks/results/*.png"))
    out = hooks._rewrite(f"![plot](benchmarks/results/{pngs[0].name})", readme, "packages/zero-sharding.md",
                         files, config)
    assert out == f"![plot](../assets/repo/packages/zero-sharding/benchmarks/results/{pngs[0].name})"
    assert files.get_file_from_path(f"assets/repo/packages/zero-sharding/benchmarks/results/{pngs[0].name}")


def test_the_estimate_table_on_the_zero_page_is_what_plait_estimate_prints():
    estimate = pytest.importorskip("plait.zero_sharding.estimate")
    printed = estimate.table(estimate.estimate(7 * 10**9, world_sizes=[8]), num_params=7 * 10**9, ranks_per_node=8)
    rows = [line for line in printed.splitlines() if line.startswith("| 8 ")]
    page = (ROOT / "docs" / "concepts" / "zero.md").read_text()
    assert len(rows) == 6 and all(row in page.splitlines() for row in rows), printed
