"""``python -m bench.render_report REPORT.html``: render an HTML report in headless Chromium and check the screenshot.

The reports of ``python -m simulator`` and ``bench.headline`` are meant to be opened in a browser; this renders one
as a browser does (``chromium --headless --screenshot``) and checks that the page is not blank and that its plots
drew (coloured pixels: the tables and text are grey-scale, the plots' lines and bars are not). ``bench.headline``
runs it on its report when Chromium is installed (``make bench``); ``make test`` does not need a browser.

Exit status: 0 rendered and looks right, 1 rendered but blank or without plots, 2 no Chromium or it failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MIN_INK = 0.02  # fraction of pixels that differ from the background: below it the page is blank
MIN_COLOUR = 0.002  # fraction of saturated pixels: below it no plot drew


class RenderError(RuntimeError):
    """Chromium is missing, failed, or wrote no screenshot."""


@dataclass(frozen=True)
class ScreenshotStats:
    """What a screenshot shows, as fractions of its pixels."""

    ink: float  # pixels that differ from the most common (background) colour
    colour: float  # saturated pixels (max - min channel > 0.25)

    def problems(self) -> list[str]:
        """Why the render looks wrong; empty when it looks right."""
        out = []
        if self.ink < MIN_INK:
            out.append(f"blank page: {self.ink:.2%} of the pixels differ from the background (< {MIN_INK:.0%})")
        if self.colour < MIN_COLOUR:
            out.append(f"no plot drew: {self.colour:.3%} of the pixels are coloured (< {MIN_COLOUR:.1%})")
        return out


def screenshot_stats(pixels: np.ndarray) -> ScreenshotStats:
    """Stats of an RGB(A) image, ``[H, W, 3 or 4]`` floats in [0, 1] or uint8."""
    if pixels.ndim != 3 or pixels.shape[2] not in (3, 4) or pixels.size == 0:
        raise ValueError(f"pixels: expected an [H, W, 3|4] image, got shape {pixels.shape}")
    rgb = pixels[..., :3].astype(float)
    if pixels.dtype == np.uint8:
        rgb /= 255.0
    flat = np.round(rgb.reshape(-1, 3), 2)
    values, counts = np.unique(flat, axis=0, return_counts=True)
    background = values[np.argmax(counts)]
    ink = float(np.mean(np.abs(flat - background).max(axis=1) > 0.05))
    colour = float(np.mean(rgb.max(axis=2) - rgb.min(axis=2) > 0.25))
    return ScreenshotStats(ink, colour)


def find_browser() -> str | None:
    """The Chromium binary: ``$CHROMIUM`` if set, else the first of BROWSERS on PATH."""
    env = os.environ.get("CHROMIUM", "")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def render(report: Path, png: Path, browser: str | None = None, width: int = 1280, height: int = 2000,
           timeout_s: float = 120.0) -> Path:
    """Screenshot of ``report`` as headless Chromium renders it (``width`` x ``height`` CSS pixels) at ``png``."""
    browser = browser or find_browser()
    if browser is None:
        raise RenderError(f"no Chromium on PATH (looked for {', '.join(BROWSERS)}; set CHROMIUM=...): "
                          "apt-get install chromium")
    if not report.is_file():
        raise RenderError(f"report: {report} is not a file")
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="elastico-chromium-") as profile:
        # --no-sandbox: the sandbox needs user namespaces, absent when running as root or in containers
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png}",
               report.resolve().as_uri()]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RenderError(f"{browser} did not finish in {timeout_s:.0f} s") from None
    if not png.is_file() or png.stat().st_size == 0:
        raise RenderError(f"{browser} wrote no screenshot (exit {p.returncode}): {p.stderr[-1500:]}")
    return png


def check(report: Path, png: Path | None = None, browser: str | None = None) -> tuple[ScreenshotStats, Path]:
    """Render ``report`` (screenshot next to it unless ``png``) and return its stats and the screenshot."""
    import matplotlib.image

    shot = render(report, png or report.with_suffix(".png"), browser)
    return screenshot_stats(matplotlib.image.imread(shot)), shot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.render_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="HTML report (report.html of python -m simulator or bench.headline)")
    ap.add_argument("--png", type=Path, default=None, help="where the screenshot goes (default: next to the report)")
    a = ap.parse_args(argv)
    try:
        stats, shot = check(a.report, a.png)
    except RenderError as exc:
        print(f"render check: {exc}", file=sys.stderr)
        return 2
    problems = stats.problems()
    print(f"render check: {'FAIL' if problems else 'PASS'} {shot} ({stats.ink:.1%} ink, {stats.colour:.2%} coloured)")
    for p in problems:
        print(f"  {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
