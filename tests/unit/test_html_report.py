"""The HTML report of a run: ``python -m simulator`` writes one self-contained page next to its PNGs (the policies'
table, the plots embedded, the configuration) and prints its path; the page is well-formed HTML; the headline's
page links its cells' plots; and the render check's screenshot test tells a blank page from a drawn one."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from bench.headline import write_report
from bench.render_report import MIN_COLOUR, MIN_INK, screenshot_stats
from simulator.report import COLUMNS, Section, html_page, markdown_table

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "gavel_philly_vc_traces_seed0.csv"
VOID = {"meta", "img", "br", "hr", "link", "input", "source", "col", "area", "base", "wbr"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class StrictPage(HTMLParser):
    """Collects a page's structure and fails on what a browser would have to repair: unclosed or stray tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: dict[str, int] = {}
        self.doctype = ""
        self.imgs: list[dict[str, str]] = []
        self.links: list[str] = []
        self.rows: list[list[str]] = []  # every table row's cell texts
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self.errors: list[str] = []

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        a = {k: v or "" for k, v in attrs}
        if tag == "img":
            self.imgs.append(a)
        if tag == "a":
            self.links.append(a.get("href", ""))
        if tag == "tr":
            self._row = []
        if tag in ("td", "th"):
            self._cell = []
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(text: str) -> StrictPage:
    p = StrictPage()
    p.feed(text)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    assert p.doctype.lower() == "doctype html"
    assert p.tags["html"] == p.tags["head"] == p.tags["body"] == p.tags["title"] == 1
    return p


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    """A small simulator run through its command line: (stdout, output folder)."""
    import contextlib
    import io

    from simulator.__main__ import main

    out = tmp_path_factory.mktemp("sim")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--trace", str(TRACE), "--gpus", "8", "--max-jobs", "12", "--policies", "exclusive-fifo,elastico",
                     "--estimator", "rule", "--quiet", "--out", str(out)]) == 0
    return buf.getvalue(), out


def test_simulator_writes_a_valid_report_with_the_table_plots_and_configuration(sim_run):
    stdout, out = sim_run
    report = out / "report.html"
    assert f"wrote {report}" in stdout and f"report: {report.resolve().as_uri()}" in stdout
    page = parse(report.read_text(encoding="utf-8"))
    # the policies' table: the console table's header and one row per policy, the same figures
    header = [h for _, h, _ in COLUMNS]
    assert header in page.rows
    by_policy = {r[0]: r for r in page.rows if r and r[0] in ("exclusive-fifo", "elastico")}
    assert set(by_policy) == {"exclusive-fifo", "elastico"}
    console = {ln.split()[0]: ln.split() for ln in stdout.splitlines() if ln.split()[:1] in (["exclusive-fifo"], ["elastico"])}
    for policy, row in by_policy.items():
        assert row == console[policy], policy
    # the plots, embedded: the very PNG files written next to the page
    srcs = {img["alt"]: img["src"] for img in page.imgs}
    assert set(srcs) == {"jct_cdf.png", "utilisation.png"}
    for name, src in srcs.items():
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_MAGIC) and data == (out / name).read_bytes()
    # the configuration
    config = {r[0]: r[1] for r in page.rows if len(r) == 2}
    assert config["gpus"] == "8" and config["trace"] == str(TRACE) and "rule" in config["estimator"]


def test_page_escapes_text():
    text = html_page('a <b> & "c"', [Section("<script>alert(1)</script>", notes=["x < y & z"],
                                             config={"k": "<i>"}, images=[("p", "dir/p.png")])])
    page = parse(text)
    assert "script" not in page.tags and "i" not in page.tags and "b" not in page.tags
    assert "x &lt; y &amp; z" in text and page.imgs[0]["src"] == "dir/p.png"


def test_markdown_table():
    header, rows = markdown_table(["| a | b |", "|---|:-:|", "| 1 | 2 |", "| 3 | 4 |"])
    assert header == ["a", "b"] and rows == [["1", "2"], ["3", "4"]]
    with pytest.raises(ValueError, match="not a Markdown table"):
        markdown_table(["| a | b |", "| 1 | 2 |"])


def test_headline_report_links_each_cells_plots(tmp_path):
    (tmp_path / "g16").mkdir()
    (tmp_path / "g16" / "jct_cdf.png").write_bytes(PNG_MAGIC)
    rows = ["| GPUs | load |", "|---|---|", "| 16 | 1 |"]
    cells = [{"head": "== 16 GPUs, load 1", "sums": [{"policy": "elastico", "avg_jct_h": 2.5, "restarts": 3}],
              "tag": "g16", "notes": ["PASS leads on avg JCT"]}]
    path = write_report(tmp_path / "report.html", rows, cells, None, ["16 GPUs: a miss"], {"sizes": [16]})
    page = parse(path.read_text(encoding="utf-8"))
    assert ["GPUs", "load"] in page.rows and ["16", "1"] in page.rows
    assert [i["src"] for i in page.imgs] == ["g16/jct_cdf.png"]  # linked relative, only the plots that exist
    assert "g16/report.html" in page.links
    text = path.read_text(encoding="utf-8")
    assert "FAIL (1 miss(es))" in text and "miss: 16 GPUs: a miss" in text and "PASS leads on avg JCT" in text
    elastico = next(r for r in page.rows if r and r[0] == "elastico")
    assert elastico[1] == "2.50" and elastico[COLUMNS.index(("restarts", "restarts", "{:>8d}"))] == "3"
    assert re.search(r"<td class=\"n\">\s*n/a</td>", text)  # missing figures read n/a


def test_screenshot_stats_tell_blank_text_and_plots_apart():
    white = np.ones((200, 300, 3))
    assert screenshot_stats(white).problems() and screenshot_stats(white).ink == 0.0
    text = white.copy()
    text[20:60, 20:280] = 0.2  # grey-scale ink (tables, text): not blank, but no plot
    problems = screenshot_stats(text).problems()
    assert len(problems) == 1 and problems[0].startswith("no plot drew")
    plot = text.copy()
    plot[100:110, 20:280] = (0.12, 0.47, 0.71)  # a tab:blue line
    stats = screenshot_stats((plot * 255).astype(np.uint8))
    assert stats.ink >= MIN_INK and stats.colour >= MIN_COLOUR and not stats.problems()
    with pytest.raises(ValueError, match="pixels"):
        screenshot_stats(np.ones((10, 10)))
