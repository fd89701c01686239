"""The documentation works as written: every shell and Python block of README.md and docs/ runs, the site
builds with ``mkdocs build --strict``, its generated config reference lists every key, and its home page,
rendered by a headless browser, shows the navigation of mkdocs.yml.

A fenced ```` ```bash ```` or ```` ```python ```` block runs unless the line right before its fence is
``<!-- not-run: REASON -->`` with a reason; ```` ```text ```` (and any other language) never runs. A page's
blocks run in order in one temporary folder (so a later block sees the files of an earlier one), with this
environment's ``fedhpro`` and ``python`` first on PATH, 60 s per block, one OpenMP thread, Flower's telemetry
and update check off, and a data folder of this test process's own (``FEDHPRO_DATA_DIR``, where digits-offline is
built once per process before any block runs).
"""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md"])
RUN_LANGUAGES = ("bash", "python")
BLOCK_TIMEOUT_S = 60
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"^<!--\s*not-run\b(.*?)-->\s*$")


class MarkerError(ValueError):
    """A not-run marker that is malformed, has no reason, or stands before a block that never runs anyway."""


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    not_run: str | None  # the reason, when the block is marked not-run


def parse_blocks(text: str, where: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order, with the not-run reason of each (None: none)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        end = index + 1
        while end < len(lines) and not lines[end].startswith(fence[0] * len(fence)):
            end += 1
        if end == len(lines):
            raise MarkerError(f"{where}:{index + 1}: code block never closed")
        reason = None
        previous = lines[index - 1].strip() if index > 0 else ""
        if previous.startswith("<!--") and "not-run" in previous:
            marker = NOT_RUN.match(previous)
            if not marker or not marker.group(1).startswith(":"):
                raise MarkerError(f"{where}:{index}: write the marker as <!-- not-run: REASON -->, got {previous!r}")
            reason = marker.group(1)[1:].strip()
            if not reason:
                raise MarkerError(f"{where}:{index}: a not-run marker needs its reason: <!-- not-run: REASON -->")
            if language not in RUN_LANGUAGES:
                raise MarkerError(f"{where}:{index}: not-run marker before a ```{language} block, which never runs")
        blocks.append(Block(language, "\n".join(lines[index + 1:end]), index + 1, reason))
        index = end + 1
    return blocks


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _environment(workdir: Path, data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.update({"OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FEDHPRO_DATA_DIR": str(data_dir), "MPLBACKEND": "Agg", "NO_MKDOCS_2_WARNING": "1",
                "TMPDIR": str(workdir)})
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run a command in its own process group; on timeout end the whole group. (status or None, output)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output
    finally:
        if process.poll() is None:  # pragma: no cover - only when communicate itself failed
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def docs_data_dir(tmp_path_factory) -> Path:
    """This test process's data folder (FEDHPRO_DATA_DIR of the blocks): nothing shared with other workers.
    digits-offline is built there first, with the defaults a plain ``fedhpro run`` reads, so that the ~10 s of
    building it count against no block's time limit."""
    from fedhpro.data.digits_offline import build_digits_offline

    data_dir = tmp_path_factory.mktemp("docs-data")
    build_digits_offline(data_dir)
    return data_dir


def test_marker_rules():
    """The parser the page tests rely on: a marker needs a reason, and marks only a block that would run."""
    page = "text\n<!-- not-run: takes minutes -->\n```bash\nfedhpro run\n```\n```python\nprint(1)\n```\n" \
           "```text\nout\n```\n"
    blocks = parse_blocks(page, "page.md")
    assert [(b.language, b.not_run, b.line) for b in blocks] == [
        ("bash", "takes minutes", 3), ("python", None, 6), ("text", None, 9)]
    assert blocks[1].code == "print(1)"
    for bad in ("<!-- not-run: -->", "<!-- not-run:    -->", "<!-- not-run -->", "<!-- not-run because -->"):
        with pytest.raises(MarkerError):
            parse_blocks(f"{bad}\n```bash\nfedhpro run\n```\n", "page.md")
    with pytest.raises(MarkerError, match="never runs"):
        parse_blocks("<!-- not-run: output -->\n```text\nout\n```\n", "page.md")
    with pytest.raises(MarkerError, match="never closed"):
        parse_blocks("```bash\nls\n", "page.md")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_blocks_run(page: Path, tmp_path: Path, docs_data_dir: Path):
    """Every bash/python block of the page, in order, in one folder; a failing block names page and line."""
    blocks = parse_blocks(page.read_text(encoding="utf-8"), _page_id(page))
    env = _environment(tmp_path, docs_data_dir)
    workdir = tmp_path / "work"
    workdir.mkdir()
    for block in blocks:
        if block.language not in RUN_LANGUAGES or block.not_run is not None:
            continue
        if block.language == "bash":
            command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
        else:
            command = [sys.executable, "-c", block.code]
        status, output = _run(command, workdir, env, BLOCK_TIMEOUT_S)
        where = f"{_page_id(page)}:{block.line}"
        if status is None:
            pytest.fail(f"{where}: the {block.language} block ran past {BLOCK_TIMEOUT_S} s (make it tiny, or mark "
                        f"it <!-- not-run: REASON -->)\n{block.code}\n--- output ---\n{output[-4000:]}")
        if status != 0:
            pytest.fail(f"{where}: the {block.language} block exited {status}\n{block.code}\n"
                        f"--- output ---\n{output[-4000:]}")


def _nav_pages(nav: list, section: str = "") -> list[tuple[str, str, str]]:
    """(section, title, page path) for every page in mkdocs.yml's nav, depth first."""
    pages = []
    for entry in nav:
        ((title, target),) = entry.items()
        if isinstance(target, list):
            pages += _nav_pages(target, title)
        else:
            pages.append((section, title, target))
    return pages


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` of the repository's docs into a folder of this test process."""
    site = tmp_path_factory.mktemp("site")
    env = _environment(site, site)
    status, output = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], ROOT, env, 300)
    assert status == 0, f"mkdocs build --strict failed:\n{output[-6000:]}"
    return site


@pytest.mark.slow
def test_site_builds_strict(built_site: Path):
    """The strict build passed (the fixture), and wrote a page for every nav entry."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    for _, title, page in _nav_pages(nav):
        built = built_site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} ({title}) was not built"


@pytest.mark.slow
def test_config_reference_lists_every_key(built_site: Path):
    """The generated config reference holds every key `fedhpro config --keys` lists, for every data set."""
    from fedhpro.cli import key_lines
    from fedhpro.data import DATASETS

    page = (built_site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    keys = {line.split(":", 1)[0].split(" [", 1)[0] for dataset in DATASETS.names() for line in key_lines(dataset)}
    assert len(keys) > 100
    missing = sorted(key for key in keys if f"<code>{key}</code>" not in page)
    assert not missing, f"keys missing from reference/config: {missing}"


class _Links(html.parser.HTMLParser):
    """Every ``<a>`` of a document: (href, visible text)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._open: list[tuple[str, list[str]]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._open.append((dict(attrs).get("href") or "", []))

    def handle_data(self, data):
        for _, texts in self._open:
            texts.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._open:
            href, texts = self._open.pop()
            self.links.append((href, " ".join("".join(texts).split())))


def _browser_dom(page: Path, window: str = "1280,900") -> str:
    """The DOM of ``page`` as headless Chromium leaves it once loaded (its scripts run); skips the test where
    Chromium is not installed."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)")
    # Chromium puts Unix sockets under TMPDIR and its profile, and aborts at start (status -6) when their path
    # exceeds the 108 bytes a socket path may have: an xdist worker's tmp_path is too deep, so a short folder
    short = Path(tempfile.mkdtemp(prefix="chromium-", dir="/tmp"))
    try:
        env = _environment(short, short)
        env["HOME"] = str(short)  # its profile and crash reports stay in this folder
        status, dom = _run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                            f"--user-data-dir={short / 'profile'}", f"--window-size={window}", "--dump-dom",
                            page.as_uri()], short, env, 120)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert status == 0, f"chromium failed:\n{dom[-4000:]}"
    return dom


@pytest.mark.slow
def test_home_page_in_a_browser_shows_the_navigation(built_site: Path):
    """Headless Chromium renders the built home page; its DOM links every nav entry under its title."""
    dom = _browser_dom(built_site / "index.html")
    assert "<html" in dom and "md-nav" in dom, dom[-2000:]
    parser = _Links()
    parser.feed(dom)
    links = set(parser.links)
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    missing = []
    for section, title, page in _nav_pages(nav):
        href = "." if page == "index.md" else page.removesuffix(".md") + "/"
        if (href, title) not in links and (f"./{href}", title) not in links:
            missing.append(f"{section} / {title} -> {href}")
    assert not missing, f"nav entries not in the rendered home page: {missing}"
    sections = {section for section, _, _ in _nav_pages(nav) if section}
    shown = {text for _, text in parser.links} | set(re.findall(r">\s*([^<>]+?)\s*<", dom))
    assert sections <= shown, f"nav sections not in the rendered home page: {sorted(sections - shown)}"


#: measures, in the rendered page, what a reader sees: per element of ``selector``, how many lines (client
#: rectangles) it takes and whether its content runs past its box (scrollWidth > clientWidth)
_MEASURE = """<script>
window.addEventListener("load", () => {
  const out = [...document.querySelectorAll(%r)].map(e => [e.textContent, e.getClientRects().length,
                                                          e.scrollWidth > e.clientWidth + 1]);
  const node = document.createElement("pre"); node.id = "fedhpro-measured";
  node.textContent = JSON.stringify(out); document.body.appendChild(node);
});
</script>"""


def _measured(built_site: Path, page: str, selector: str, window: str) -> list[tuple[str, int, bool]]:
    """``(text, lines, overflows)`` of every element of ``selector`` on a built ``page``, rendered by Chromium
    at ``window`` (a copy of the page beside it, with :data:`_MEASURE` added, so its stylesheets apply)."""
    import json

    source = built_site / page
    probe = source.with_name("measured.html")
    probe.write_text(source.read_text(encoding="utf-8").replace("</body>", _MEASURE % selector + "</body>"),
                     encoding="utf-8")
    dom = _browser_dom(probe, window)
    found = re.search(r'<pre id="fedhpro-measured">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return [tuple(row) for row in json.loads(html.unescape(found.group(1)))]


@pytest.mark.slow
def test_config_keys_do_not_break_mid_word(built_site: Path):
    """In the rendered config reference, at a laptop's width, every key name is on one line (a name broken as
    ``feature_di`` / ``m`` takes two client rectangles)."""
    keys = _measured(built_site, "reference/config/index.html", "td:first-child code", "1000,900")
    assert len(keys) > 100
    broken = [text for text, lines, _ in keys if lines != 1]
    assert not broken, f"config keys broken over lines: {broken[:10]}"
    assert any(text == "data.clients_per_domain" for text, _, _ in keys)


@pytest.mark.slow
def test_long_commands_wrap_in_code_blocks(built_site: Path):
    """In the rendered own-images tutorial, at a narrow width, no code block's text runs past its box: the long
    ``fedhpro run`` command wraps onto more lines instead of hiding behind a scroll bar."""
    blocks = _measured(built_site, "tutorials/own-images/index.html", "pre > code", "700,900")
    command = [row for row in blocks if row[0].startswith("fedhpro run dataset=imagefolder data_dir=shapes")]
    assert command, [text[:40] for text, _, _ in blocks]
    assert not [text[:60] for text, _, overflows in blocks if overflows]


def _where_to_start_links() -> set[str]:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    section = text.split("## Where to start", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"\]\(([^)#]+\.md)\)", section))


def test_home_page_lists_every_tutorial_and_how_to():
    """The home page's "Where to start" links every tutorial, how-to guide and reference page of mkdocs.yml's
    nav."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    wanted = {page for section, _, page in _nav_pages(nav) if section in ("Tutorials", "How-to guides", "Reference")}
    assert len(wanted) > 20
    missing = sorted(wanted - _where_to_start_links())
    assert not missing, f"pages missing from docs/index.md's Where to start: {missing}"
