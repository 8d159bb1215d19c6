"""Plots of the benchmark report (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import records as records_io
from .tables import Report
from .units import ALL


def _panels(report: Report) -> list[tuple[float, int]]:
    return sorted({(row.temperature, row.batch_size) for row in report.rows})


def new_figure(n_panels: int, title: str):
    """A figure with n_panels side by side, drawn by the Agg canvas (no pyplot, no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * max(n_panels, 1), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title)
    axes = figure.subplots(1, max(n_panels, 1), squeeze=False)[0]
    return figure, axes


def _k_axis(ax, report: Report, title: str, ylabel: str) -> None:
    """A panel against K: its title and labels, a tick at every K of the report, the legend."""
    ax.set(title=title, xlabel="K (draft length)", ylabel=ylabel)
    ax.set_xticks(sorted({r.max_draft for r in report.rows}))
    _legend(ax, 7)


def plot_efficiency(report: Report, path: Path) -> Path:
    """BE vs K: token (dashed) vs block (solid) per dataset; analytic values as hollow markers."""
    panels = _panels(report)
    figure, axes = new_figure(len(panels), "block efficiency (1 + mean accepted per step) vs K")
    for ax, (temperature, batch_size) in zip(axes, panels):
        for index, label in enumerate((*report.datasets, ALL)):
            rows = [r for r in report.rows_of(label) if (r.temperature, r.batch_size) == (temperature, batch_size)]
            if not rows:
                continue
            color, ks = ("black" if label == ALL else f"C{index}"), [r.max_draft for r in rows]
            ax.plot(ks, [r.be_token for r in rows], "o--", color=color, label=f"{label} token")
            ax.plot(ks, [r.be_block for r in rows], "s-", color=color, label=f"{label} block")
            ax.plot(ks, [r.analytic_be_token for r in rows], "o", mfc="none", color=color, alpha=0.6)
            ax.plot(ks, [r.analytic_be_block for r in rows], "s", mfc="none", color=color, alpha=0.6)
        _k_axis(ax, report, f"T={temperature:g}, B={batch_size} (hollow: analytic)", "block efficiency")
    figure.savefig(path, dpi=110)
    return path


def plot_speedup(report: Report, path: Path) -> Path:
    """Wall-clock speedup over target-only vs K: token (dashed), block (solid), hf-assisted (x)."""
    panels = _panels(report)
    figure, axes = new_figure(len(panels), "wall-clock speedup over target-only vs K")
    for ax, (temperature, batch_size) in zip(axes, panels):
        ax.axhline(1.0, color="grey", lw=0.8)
        for index, label in enumerate((*report.datasets, ALL)):
            rows = [r for r in report.rows_of(label) if (r.temperature, r.batch_size) == (temperature, batch_size)]
            color, ks = ("black" if label == ALL else f"C{index}"), [r.max_draft for r in rows]
            ax.plot(ks, [_nan(r.speedup_token_vs_target) for r in rows], "o--", color=color, label=f"{label} token")
            ax.plot(ks, [_nan(r.speedup_block_vs_target) for r in rows], "s-", color=color, label=f"{label} block")
            hf = [
                b
                for b in report.baselines
                if b.dataset == label
                and b.config == "hf-assisted"
                and (b.temperature, b.batch_size) == (temperature, batch_size)
                and b.speedup_vs_target
            ]
            for b in hf:  # own schedule (K=0): a horizontal line; fixed K: a point
                if b.max_draft:
                    ax.plot([b.max_draft], [b.speedup_vs_target], "x", color=color, ms=9)
                else:
                    ax.axhline(b.speedup_vs_target, color=color, ls=":", lw=1)
        _k_axis(ax, report, f"T={temperature:g}, B={batch_size} (x / dotted: hf-assisted)", "tok/s over target-only")
    figure.savefig(path, dpi=110)
    return path


def plot_accepted(report: Report, path: Path) -> Path:
    """Histogram of accepted lengths per step, token vs block, one panel per (T, K), pooled over datasets."""
    panels = sorted({(h.temperature, h.max_draft) for h in report.histograms})
    figure, axes = new_figure(len(panels), "accepted draft tokens per step (fraction of steps)")
    for ax, (temperature, max_draft) in zip(axes, panels):
        for offset, name in ((-0.2, "token"), (0.2, "block")):
            for h in report.histograms:
                if (h.config, h.temperature, h.max_draft) == (name, temperature, max_draft):
                    counts = np.array(h.counts, float)
                    ax.bar(np.arange(len(counts)) + offset, counts / counts.sum(), width=0.4, label=name)
        ax.set(title=f"T={temperature:g}, K={max_draft}", xlabel="accepted tokens", ylabel="fraction of steps")
        _legend(ax, 8)
    figure.savefig(path, dpi=110)
    return path


FIXED_COLORS = ("C0", "C1", "C2", "C6", "C8", "C9")  # one per K; C3-C5 are the SV configurations


def plot_batch(report: Report, path: Path) -> Path:
    """tok/s vs batch size per configuration (and K), one panel per temperature, pooled over datasets."""
    temperatures = sorted({row.temperature for row in report.batch})
    figure, axes = new_figure(len(temperatures), "tokens/s vs batch size (all datasets pooled)")
    style = {
        "target-only": ("o-", "black"),
        "hf-assisted": ("x", "grey"),
        "hf-lookup": ("+", "grey"),
        "sv-draft": ("D-", "C3"),
        "sv-token": ("^-", "C4"),
        "sv-block": ("v-", "C5"),
        "auto": ("*-", "C7"),
        "lookup": ("P-", "darkgreen"),
        "lookup+model": ("X-", "darkred"),
        records_io.AUTO_TREE: ("h--", "C9"),
    }
    for ax, temperature in zip(axes, temperatures):
        rows = [r for r in report.batch if r.temperature == temperature]
        ks = sorted({r.max_draft for r in rows if r.config in records_io.FIXED_CONFIGS})
        for name, k in sorted({(r.config, r.max_draft) for r in rows}):
            line = sorted(
                (r.batch_size, r.tokens_per_s.value)
                for r in rows
                if (r.config, r.max_draft) == (name, k) and r.tokens_per_s is not None
            )
            if not line:
                continue
            if name in records_io.FIXED_CONFIGS:  # one colour per K; token dashed, block solid
                fmt = {"token": "o--", "block": "s-", "block-int8": "s:"}[name]
                color = FIXED_COLORS[ks.index(k) % len(FIXED_COLORS)]
                label = f"{name} K={k}"
            elif records_io.is_tree(name):  # the shape is in the name; K is its nodes
                fmt, color, label = "h-", "C9", f"{name} ({k} nodes)"
            elif records_io.is_paths(name):  # k is in the name; K is each path's length
                fmt, color, label = "p-", "C8", f"{name} K={k}"
            else:
                (fmt, color), label = style[name], name + (f" (K<={k})" if k else "")
            xs, ys = zip(*line)
            ax.plot(xs, ys, fmt, color=color, label=label, lw=2 if name in records_io.SV_CONFIGS else 1)
        sizes = sorted({r.batch_size for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set(title=f"T={temperature:g}", xlabel="batch size B", ylabel="tokens/s (all rows)")
        _legend(ax, 7)
    figure.savefig(path, dpi=110)
    return path


def _legend(ax, fontsize: int) -> None:
    """The panel's legend, where it plotted something labelled (an empty panel gets none, rather than matplotlib's
    warning that it found nothing to put in a legend)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
