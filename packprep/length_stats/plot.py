"""stats, plot: draw a report's histograms (and, for inputs, the what-if curves) with matplotlib
(the ``plot`` extra)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ConfigError, OutputError


def plot(report: dict, path: str | os.PathLike) -> None:
    """Draw the histograms (and, for inputs, the what-if curves) of ``report`` into a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'packprep[plot]'") from None

    def bars(ax, bins, title, xlabel, log=True):
        if bins:
            lo = np.array([b["lo"] for b in bins], dtype=float)
            hi = np.array([b["hi"] for b in bins], dtype=float)
            width = np.maximum(hi - lo, lo * 0.15) if log else hi - lo  # a one-value bin stays visible
            ax.bar(lo, [b["count"] for b in bins], width=width, align="edge", edgecolor="white", color="#4C72B0")
            if log:
                from matplotlib.ticker import FuncFormatter

                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("count")

    if report.get("kind") == "packed":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        bars(axes[0], report["histogram"]["bins"], "tokens per packed sequence", "tokens (log scale)")
        bars(axes[1], report["fill_histogram"], "row fill", "tokens / max_len", log=False)
        fig.suptitle(f"{report['folder']}: {report['rows']:,} rows, efficiency {report['efficiency']:.1%}")
    else:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        bars(axes[0], report["histogram"]["bins"], "tokens per conversation", "tokens (log scale)")
        plan = report["what_if"]["rows"]
        for max_len in sorted({r["max_len"] for r in plan}):
            axes[0].axvline(max_len, color="#C44E52", linestyle=":", linewidth=1)
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        styles = ["-o", "--s", ":^", "-.D", "-v"]
        for k, strategy in enumerate(dict.fromkeys(r["strategy"] for r in plan)):
            mine = [r for r in plan if r["strategy"] == strategy]
            xs = [r["max_len"] for r in mine]
            style = styles[k % len(styles)]
            axes[1].plot(xs, [r["efficiency"] for r in mine], style, label=strategy, alpha=0.85)
            axes[2].plot(xs, [r["optimizer_steps"] for r in mine], style, label=strategy, alpha=0.85)
        plain = FuncFormatter(lambda value, _: f"{value:,.0f}")
        for ax, title, ylabel in ((axes[1], "packing efficiency", "tokens / (rows × max_len)"),
                                  (axes[2], "optimizer steps", "steps")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["max_len"] for r in plan}))
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(title)
            ax.set_xlabel("max_len")
            ax.set_ylabel(ylabel)
            ax.legend()
        axes[1].set_ylim(0, 1.05)
        axes[2].set_yscale("log")
        axes[2].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axes[2].yaxis.set_major_formatter(plain)
        axes[2].yaxis.set_minor_formatter(NullFormatter())
        what = report["what_if"]
        fig.suptitle(
            f"{', '.join(Path(i['path']).name for i in report['inputs'])} · {report['conversations']:,} conversations · "
            f"global batch {what['global_batch_size']}, {what['epochs']} epoch(s)"
        )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


def require_matplotlib() -> None:
    """Fail early (before a long run) when ``--plot`` cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'packprep[plot]'") from None
