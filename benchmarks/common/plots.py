"""Matplotlib figures of the benchmarks: medians with error bars for the range over
repeats (figures as `common.stats` gives them, or plain numbers of a one-run file)."""

from __future__ import annotations

from common.stats import hi, lo, med


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) if not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (later: --plot-only OUT.png JSON)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def yerr(values) -> list[list[float]]:
    """Error bars (below, above the median) spanning each value's [min, max]."""
    ms = [med(v) or 0.0 for v in values]
    return [[m - (lo(v) if v is not None else m) for m, v in zip(ms, values)],
            [(hi(v) if v is not None else m) - m for m, v in zip(ms, values)]]


def bars(ax, x, values, width, bottom=None, **kw):
    """Bars at the medians, the range as an error bar; `bottom`: stacked on these."""
    ys = [med(v) or 0.0 for v in values]
    base = None if bottom is None else [med(b) or 0.0 for b in bottom]
    err = yerr(values)
    ax.bar(x, ys, width, bottom=base, **kw)
    tops = ys if base is None else [y + b for y, b in zip(ys, base)]
    if any(any(e) for e in err):
        ax.errorbar(x, tops, yerr=err, fmt="none", ecolor="black", elinewidth=0.8,
                    capsize=2)
    return ys


def line(ax, x, values, style, **kw):
    """A line through the medians with error bars for the range."""
    ax.errorbar(x, [med(v) for v in values], yerr=yerr(values), fmt=style, capsize=3,
                elinewidth=0.8, **kw)


def save(fig, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
