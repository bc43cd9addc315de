"""Build the documentation site and check it in a real browser.

1. ``docs/gen_results.py --check``: the results pages match the committed results files.
2. ``mkdocs build --strict`` into ``build/site`` (warnings are errors; mkdocs checks Markdown links).
3. Every ``href``/``src`` in the built HTML that points inside the site names a file that exists,
   and every ``#anchor`` names an ``id`` on its page.
4. ``build/site`` is served by ``http.server`` on a free port; headless Chromium opens the home page,
   one guide and one results page, saves a screenshot of each under ``build/site-shots/`` and dumps
   its DOM. Each DOM must hold the rendered content (tables; a code block on the guide), every image
   the results page shows must have been fetched by the browser with status 200, and no screenshot
   may be blank.

Run it from ``ci/test.sh`` (or alone: ``python ci/build_docs.py``). It needs ``ci/requirements-docs.txt``
and a ``chromium`` binary (``ci/setup.sh`` installs both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import html.parser
import http.server
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
SHOTS = ROOT / "build" / "site-shots"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# A blank or error page renders in a handful of colours; a page of text, tables and a plot in hundreds.
MIN_COLOURS = 64


@dataclass(frozen=True)
class PageCheck:
    """A page the browser opens and what its DOM must contain.

    Attributes:
        path: the page, relative to the site root.
        needs: strings the rendered DOM must contain (``"<table"`` for a rendered table).
        images: whether the page shows images that the browser must have loaded.
    """

    path: str
    needs: tuple[str, ...]
    images: bool = False


PAGES = (
    PageCheck("index.html", ("<table", "plait-zero-sharding")),
    PageCheck("guides/torch.html", ("<h1", "<pre")),
    PageCheck("results/zero-sharding.html", ("<table", "<img"), images=True),
)


class _Links(html.parser.HTMLParser):
    """Collects the ids of a page and the href/src values it points at."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("name"):
            self.ids.add(values["name"])
        for key in ("href", "src"):
            if values.get(key):
                self.targets.append(values[key])
        if tag == "img" and values.get("src"):
            self.images.append(values["src"])


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def check_links(site: Path) -> int:
    """Check every internal link and anchor of the built site.

    Returns:
        The number of links checked.

    Raises:
        SystemExit: naming each page and the target it cannot find.
    """
    pages = {page: _parse(page) for page in site.rglob("*.html")}
    broken, checked = [], 0
    for page, links in pages.items():
        for target in links.targets:
            parts = urllib.parse.urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith(("mailto:", "data:", "javascript:")):
                continue
            checked += 1
            # The 404 page links from the site root (it is served at any depth); the others relatively.
            base = site if parts.path.startswith("/") else page.parent
            path = (base / urllib.parse.unquote(parts.path).lstrip("/")).resolve() if parts.path else page
            if path.is_dir():
                path = path / "index.html"
            if not path.is_file():
                broken.append(f"{page.relative_to(site)} -> {target} (no such file)")
            elif parts.fragment and path.suffix == ".html" and parts.fragment not in pages[path].ids:
                broken.append(f"{page.relative_to(site)} -> {target} (no id {parts.fragment!r} on that page)")
    if broken:
        raise SystemExit("docs: broken internal links:\n  " + "\n  ".join(broken))
    return checked


def find_browser() -> str:
    """The headless browser binary.

    Raises:
        SystemExit: none on PATH, with the fix.
    """
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("docs: no chromium binary on PATH; run `bash ci/setup.sh` (it installs Debian's chromium) "
                     "or `apt-get install chromium`.")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site and records every request's path and status."""

    requests: list[tuple[str, int]]

    def log_message(self, format: str, *args: object) -> None:
        pass  # no line per request on stderr: the requests are kept in ``requests`` instead

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.requests.append((urllib.parse.unquote(urllib.parse.urlsplit(self.path).path), int(code)))


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, list[tuple[str, int]]]:
    """Serve ``site`` on a free local port in a background thread; returns the server and its request log."""
    log: list[tuple[str, int]] = []
    handler = type("Handler", (_QuietHandler,), {"requests": log})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, log


def browse(browser: str, url: str, *, screenshot: Path, timeout: float) -> str:
    """Open ``url`` in headless Chromium once: the PNG is written to ``screenshot``, the DOM returned.

    Raises:
        SystemExit: Chromium failed or wrote no screenshot (its stderr's tail in the message).
    """
    with tempfile.TemporaryDirectory(prefix="plait-chromium-") as profile:
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1280,1600",
                   # wait (in virtual time) until the page and its scripts settled, however loaded the machine
                   "--virtual-time-budget=5000",
                   f"--screenshot={screenshot}", "--dump-dom", url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0 or not screenshot.is_file():
        raise SystemExit(f"docs: chromium failed on {url} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def distinct_colours(png: Path) -> int:
    """How many distinct colours a screenshot has (a blank page has very few)."""
    from PIL import Image

    with Image.open(png) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20


def check_page(browser: str, base: str, check: PageCheck, log: list[tuple[str, int]], timeout: float) -> str:
    """Screenshot and DOM-check one page; returns a one-line report.

    Raises:
        SystemExit: the DOM lacks what it needs, an image did not load, or the screenshot is blank.
    """
    url = f"{base}/{check.path}"
    shot = SHOTS / (check.path.replace("/", "-").removesuffix(".html") + ".png")
    shot.unlink(missing_ok=True)
    dom = browse(browser, url, screenshot=shot, timeout=timeout)
    missing = [need for need in check.needs if need not in dom]
    if missing:
        raise SystemExit(f"docs: {check.path} as rendered by chromium lacks {missing}")
    images = []
    if check.images:
        page_dir = urllib.parse.urlsplit(url).path.rsplit("/", 1)[0]
        parser = _Links()
        parser.feed(dom)
        images = [urllib.parse.unquote(urllib.parse.urljoin(page_dir + "/", src)) for src in parser.images
                  if not urllib.parse.urlsplit(src).scheme]
        served = {path for path, code in log if code == 200}
        unloaded = [image for image in images if image not in served]
        if not images or unloaded:
            raise SystemExit(f"docs: {check.path}: images not loaded by the browser with status 200: "
                             f"{unloaded or 'the page shows none'}")
    colours = distinct_colours(shot)
    if colours < MIN_COLOURS:
        raise SystemExit(f"docs: {shot.relative_to(ROOT)} looks blank ({colours} colours, want >= {MIN_COLOURS})")
    return (f"{check.path}: {dom.count('<table')} tables, {len(images)} images loaded (200), "
            f"screenshot {shot.relative_to(ROOT)} with {colours} colours")


def build(site: Path) -> None:
    """Check the results pages are current, then ``mkdocs build --strict`` into ``site``."""
    subprocess.run([sys.executable, str(ROOT / "docs" / "gen_results.py"), "--check"], check=True, cwd=ROOT)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if done.returncode != 0:
        raise SystemExit(f"docs: mkdocs build --strict failed:\n{done.stderr[-6000:]}")


def main(argv: list[str] | None = None) -> int:
    """Build, link-check and browser-check the site.

    Returns:
        0 when every check passed (a failing check exits with its message).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-browser", action="store_true", help="build and link-check only")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per chromium run")
    args = parser.parse_args(argv)
    start = time.monotonic()
    build(SITE)
    built = time.monotonic()
    checked = check_links(SITE)
    print(f"docs: built build/site with mkdocs --strict in {built - start:.1f}s; "
          f"{checked} internal links and anchors ok ({time.monotonic() - built:.1f}s)")
    if args.no_browser:
        return 0
    browser = find_browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    server, log = serve(SITE)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        # One Chromium per page, side by side: each mostly waits on its own start-up.
        with concurrent.futures.ThreadPoolExecutor(len(PAGES)) as pool:
            reports = list(pool.map(lambda check: check_page(browser, base, check, log, args.timeout), PAGES))
        for report in reports:
            print("docs: " + report)
    finally:
        server.shutdown()
        server.server_close()
    cpu = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"docs: site built and checked in chromium in {time.monotonic() - start:.1f}s "
          f"({sum(r.ru_utime + r.ru_stime for r in cpu):.1f}s of CPU; 1-min load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
