"""Command-line argument types shared by the project's commands (python -m simulator, the benchmarks, make demo)."""

from __future__ import annotations

import argparse
import math


def ranged(lo: float, hi: float = float("inf"), cast=float, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] ((lo, hi] with ``lo_open``), else a usage error naming the range."""
    def parse(text: str):
        try:
            x = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {cast.__name__}: {text!r}") from None
        if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi):
            raise argparse.ArgumentTypeError(f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}"
                                             f"{')' if math.isinf(hi) else ']'}, got {text}")
        return x
    return parse
