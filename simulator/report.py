"""Console table, JSON, PNG plots and an HTML page of a comparison (one workload, several policies)."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

COLUMNS = [("policy", "policy", "{:<18}"), ("avg_jct_h", "avgJCT h", "{:>9.2f}"), ("p95_jct_h", "p95JCT h", "{:>9.1f}"),
           ("makespan_h", "mkspan h", "{:>9.0f}"), ("jobs_per_h", "jobs/h", "{:>7.2f}"),
           ("jobs_per_h_loaded", "jobs/hL", "{:>7.2f}"),
           ("work_gpu_h_per_h", "work/h", "{:>7.1f}"), ("avg_queue_h", "queue h", "{:>8.2f}"),
           ("slo_attainment", "SLO", "{:>7.4f}"), ("restarts", "restarts", "{:>8d}"),
           ("alloc_util", "alloc", "{:>6.1%}"), ("eff_util", "effect", "{:>6.1%}"),
           ("unfinished", "unfin", "{:>5d}"), ("wall_s", "wall s", "{:>6.1f}")]


def _cell(f: str, v) -> str:
    """One value in its column's format ("n/a" for missing or NaN), padded as the text table pads it."""
    try:
        return (f.format(v) if v is not None and not (isinstance(v, float) and np.isnan(v))
                else f"{'n/a':>{len(f.format(0.0)) if 'd' not in f else 5}}")
    except (ValueError, TypeError):
        return str(v)


def table(summaries: list[dict]) -> str:
    """Fixed-width text table, one row per policy."""
    wide = max([18] + [len(str(s.get("policy", ""))) for s in summaries])
    head = " ".join(f"{h:>{len(f.format(0) if 'd' in f else f.format(0.0))}}" if k != "policy"
                    else f"{h:<{wide}}" for k, h, f in COLUMNS)
    lines = [head]
    for s in summaries:
        lines.append(" ".join(f"{s.get(k)!s:<{wide}}" if k == "policy" else _cell(f, s.get(k)) for k, _, f in COLUMNS))
    return "\n".join(lines)


# --- HTML report: one page a browser opens from disk (no script, no network) --------------------------------
@dataclass(frozen=True)
class Section:
    """One part of an HTML report: a heading, the policies' table, another table, plots and notes."""

    heading: str
    summaries: Sequence[Mapping] = ()  # rows of the policy table (COLUMNS)
    grid: tuple[Sequence[str], Sequence[Sequence[str]]] | None = None  # (header, rows) of any other table
    images: Sequence[tuple[str, bytes | str]] = ()  # (caption, PNG bytes: embedded | relative path: linked)
    notes: Sequence[str] = ()  # lines shown as a list
    link: tuple[str, str] | None = None  # (text, relative href) of a page with more
    config: Mapping = field(default_factory=dict)  # shown as a key/value table


_CSS = ("body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}"
        "table{border-collapse:collapse;margin:.5em 0 1em}th,td{border:1px solid #bbb;padding:2px 8px;font-size:13px}"
        "th{background:#eee}td.n{text-align:right;font-variant-numeric:tabular-nums}"
        "figure{display:inline-block;margin:.5em 1em .5em 0}figcaption{font-size:12px;color:#555}"
        "img{max-width:100%;border:1px solid #ddd}code{font-size:12px}")


def _table_html(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """An HTML table; cells from column ``numeric_from`` on are right-aligned."""
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    num = ' class="n"'
    body = "".join("<tr>" + "".join(f"<td{num if i >= numeric_from else ''}>{e(str(c).strip())}</td>"
                                    for i, c in enumerate(r)) + "</tr>\n" for r in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>\n"


def summary_table_html(summaries: Sequence[Mapping]) -> str:
    """The policies' table (the console table's columns and formats) as HTML."""
    rows = [[str(s.get("policy", "")), *(_cell(f, s.get(k)) for k, _, f in COLUMNS[1:])] for s in summaries]
    return _table_html([h for _, h, _ in COLUMNS], rows)


def markdown_table(lines: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a Markdown pipe table (its ``|---|`` line dropped); ValueError when ``lines`` is not one."""
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.strip()]
    if len(cells) < 2 or not all(set(c) <= set("-: ") for c in cells[1]):
        raise ValueError("not a Markdown table: expected a header line and a |---| line")
    return cells[0], cells[2:]


def html_page(title: str, sections: Sequence[Section]) -> str:
    """The report as one self-contained HTML5 page: embedded PNGs are base64 data URIs, linked ones relative."""
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(title)}</title>",
           f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{e(title)}</h1>"]
    for sec in sections:
        out.append(f"<section>\n<h2>{e(sec.heading)}</h2>")
        if sec.link:
            out.append(f'<p><a href="{e(sec.link[1])}">{e(sec.link[0])}</a></p>')
        if sec.summaries:
            out.append(summary_table_html(sec.summaries))
        if sec.grid:
            out.append(_table_html(*sec.grid))
        if sec.notes:
            out.append("<ul>\n" + "".join(f"<li>{e(n)}</li>\n" for n in sec.notes) + "</ul>")
        for caption, img in sec.images:
            src = f"data:image/png;base64,{base64.b64encode(img).decode('ascii')}" if isinstance(img, bytes) else img
            out.append(f'<figure><img src="{e(src)}" alt="{e(caption)}"><figcaption>{e(caption)}</figcaption></figure>')
        if sec.config:
            rows = [[str(k), json.dumps(v, default=float) if not isinstance(v, str) else v] for k, v in sec.config.items()]
            out.append("<h3>Configuration</h3>\n" + _table_html(["setting", "value"], rows, numeric_from=2))
        out.append("</section>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def write_html(path: Path, title: str, sections: Sequence[Section]) -> Path:
    """Write :func:`html_page` to ``path``; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_page(title, sections), encoding="utf-8")
    return path


def run_title(meta: Mapping) -> str:
    """A report's title from its configuration: cluster size and training load (and inference share if any)."""
    parts = [f"{meta.get('gpus')} GPUs"]
    if meta.get("share") is not None:
        parts.append(f"inference share {meta['share']:.2f}")
    if meta.get("offered_load") is not None:
        parts.append(f"training load {meta['offered_load']:.2f}")
    return "ElastiCo simulation: " + ", ".join(parts)


def write_outputs(out: Path, summaries: list[dict], results: list, meta: dict, extra_images: Sequence[Path] = (),
                  notes: Sequence[str] = ()) -> list[Path]:
    """Write ``summary.json``, ``jct_cdf.png``, ``utilisation.png`` and ``report.html`` under ``out``; the report
    (:func:`write_run_report`) embeds those plots and ``extra_images`` (PNGs already written) and lists ``notes``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json"]
    paths[0].write_text(json.dumps({"meta": meta, "policies": summaries}, indent=2, default=float))
    plots = _write_plots(out, results, meta)
    return paths + plots + [write_run_report(out / "report.html", summaries, meta, [*plots, *extra_images], notes)]


def write_run_report(path: Path, summaries: Sequence[Mapping], meta: Mapping, images: Sequence[Path],
                     notes: Sequence[str] = ()) -> Path:
    """One run's HTML page: the policies' table, ``notes``, the PNGs ``images`` embedded, the configuration."""
    imgs = [(p.name, p.read_bytes()) for p in images if p.exists()]
    return write_html(path, run_title(meta), [Section("Policies", summaries=summaries, notes=notes, images=imgs,
                                                      config=meta)])


def _styles(names: Sequence[str]) -> dict[str, dict]:
    """A line style per policy, none repeated: ElastiCo thick red, its variants (``elastico/...``) dashed, the
    baselines solid, colours from a 20-colour table (the default cycle repeats after 10)."""
    import matplotlib

    palette = [c for i, c in enumerate(matplotlib.colormaps["tab20"].colors) if i not in (6, 7)]  # reds: elastico's
    out, k = {}, 0
    for n in names:
        if n == "elastico":
            out[n] = {"color": "tab:red", "lw": 2.0, "ls": "-", "zorder": 3}
        else:
            out[n] = {"color": palette[k % len(palette)], "lw": 1.0, "ls": "--" if "/" in n else "-"}
            k += 1
    return out


def _smoothed(t: np.ndarray, y: np.ndarray, width: float, points: int = 600) -> tuple[np.ndarray, np.ndarray]:
    """A step series (``y[i]`` holds from ``t[i]`` to ``t[i + 1]``) on a regular grid, averaged over ``width``."""
    if len(t) < 2 or width <= 0:
        return t, y
    grid = np.linspace(t[0], t[-1], points)
    held = y[np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(y) - 1)]
    box = np.ones(max(1, int(round(width / max(grid[1] - grid[0], 1e-12)))))
    # the window shrinks at both ends (no zeros averaged in)
    return grid, np.convolve(held, box, mode="same") / np.convolve(np.ones_like(held), box, mode="same")


def _write_plots(out: Path, results: list, meta: dict) -> list[Path]:
    """``jct_cdf.png`` and ``utilisation.png`` under ``out`` (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return []
    style = _styles([r.policy for r in results])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        done = ~np.isnan(r.completion_s)
        jct = np.sort((r.completion_s[done] - r.arrival_s[done]) / 3600)
        if len(jct):
            ax.plot(jct, np.arange(1, len(jct) + 1) / len(jct), label=r.policy, **style[r.policy])
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT CDF - {meta.get('gpus')} GPUs, training load {meta.get('offered_load', 0):.2f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if len(results) > 6 else 9)
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    span = max((float(r.timeline[-1, 0]) for r in results if len(r.timeline)), default=0.0)
    for r in results:
        if len(r.timeline):
            for a, col in ((axes[0], 1), (axes[1], 2)):
                x, y = _smoothed(r.timeline[:, 0], r.timeline[:, col], span / 100)
                a.plot(x / 3600, y, label=r.policy, **{**style[r.policy], "lw": style[r.policy]["lw"] * 0.8})
    ends = [r.window_end_s for r in results if r.window_end_s > 0]
    for a in axes:
        if ends:
            a.axvline(ends[0] / 3600, color="k", ls=":", lw=1, label="end of the loaded period (metrics average before it)")
        a.grid(alpha=0.3)
        a.set_ylim(0, 1.05)
    axes[0].set_ylabel("allocated")
    axes[1].set_ylabel("effective")
    axes[1].set_xlabel("time (h)")
    axes[0].legend(fontsize=6, ncol=3)
    fig.suptitle(f"GPU utilisation over time (moving average over {span / 100 / 3600:.3g} h)")
    fig.tight_layout()
    fig.savefig(out / "utilisation.png", dpi=120)
    plt.close(fig)
    return [out / "jct_cdf.png", out / "utilisation.png"]


def write_work_plot(path: Path, summaries: list[dict], ceiling: dict, title: str = "", slo_floor: float | None = None,
                    target: float | None = None, target_label: str = "target") -> Path | None:
    """Bar chart of each policy's normalised work/h against the workload's ceiling (``throughput_ceiling``).

    ``slo_floor``: policies whose inference SLO attainment is below it are drawn hatched and grey (their work is
    bought with the services' latency); ``target``: a work/h target drawn as a line, named ``target_label``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [s["policy"] for s in summaries]
    vals = [s["work_gpu_h_per_h"] for s in summaries]
    starved = [slo_floor is not None and s["slo_attainment"] < slo_floor for s in summaries]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(range(len(vals)), vals, color=["lightgrey" if x else "tab:red" if n == "elastico" else "tab:blue"
                                                 for n, x in zip(names, starved)])
    for bar, x in zip(bars, starved):
        if x:
            bar.set_hatch("//")
    ax.axhline(ceiling["work_gpu_h_per_h"], color="k", ls="--", lw=1, label="ceiling (every job alone from arrival)")
    if target is not None:
        ax.axhline(target, color="tab:green", ls=":", lw=1.5, label=f"{target_label} {target:.2f}")
    handles, _ = ax.get_legend_handles_labels()
    if any(starved):
        handles.append(Patch(facecolor="lightgrey", hatch="//", label=f"inference SLO < {slo_floor:.0%}"))
    ax.set_xticks(range(len(vals)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("normalised work (isolated GPU-h) per hour")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    top = max([*vals, ceiling["work_gpu_h_per_h"], target or 0.0])
    ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # room above the bars for the legend
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
