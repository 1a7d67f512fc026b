"""Medians and ranges over a benchmark's repeats.

Timings on the GPU machine swing by +-30 % between runs, so a figure of several
repeats is reported as its median with its range: `stat(values)` gives
{"median", "min", "max", "n", "values"} (the per-repeat raw values kept, None where a
repeat has none). The readers below (`med`, `lo`, `hi`, `fmt`) take such a dict or a
plain number (a one-run figure, as older result files hold), so tables and plots read
both."""

from __future__ import annotations

import statistics
from numbers import Real


def _number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def stat(values) -> dict | None:
    """Median and [min, max] of the repeats' values (None ones left out); None if none."""
    values = list(values)
    xs = [v for v in values if _number(v)]
    if not xs:
        return None
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs),
                values=values)


def is_stat(x) -> bool:
    return isinstance(x, dict) and "median" in x and "values" in x


def med(x):
    """The median of a stat, a plain number as it is, None for None."""
    return x["median"] if is_stat(x) else x


def lo(x):
    return x["min"] if is_stat(x) else x


def hi(x):
    return x["max"] if is_stat(x) else x


def scaled(x, factor: float):
    """A stat or a number times `factor` (units for printing and plotting)."""
    if x is None:
        return None
    if is_stat(x):
        return dict(x, median=x["median"] * factor, min=x["min"] * factor,
                    max=x["max"] * factor,
                    values=[v * factor if _number(v) else v for v in x["values"]])
    return x * factor


def fmt(x, digits: int = 2, factor: float = 1.0, width: int = 0) -> str:
    """`median [min-max]` (the range left out when it is one value), `-` for None."""
    x = scaled(x, factor)
    if x is None:
        return f"{'-':>{width}}"
    if not is_stat(x):
        return f"{x:{width}.{digits}f}"
    text = f"{x['median']:.{digits}f}"
    if f"{x['min']:.{digits}f}" != f"{x['max']:.{digits}f}":
        sep = ", " if x["min"] < 0 else "-"  # [-0.94, -0.86], not [-0.94--0.86]
        text += f" [{x['min']:.{digits}f}{sep}{x['max']:.{digits}f}]"
    return f"{text:>{width}}"


def aggregate(dicts: list[dict], keys) -> dict:
    """{key: stat over `dicts`} for each of `keys` that some dict has; a key whose
    values are dicts of numbers (per step kind, ...) gives {subkey: stat}."""
    out = {}
    for k in keys:
        vals = [d.get(k) for d in dicts]
        if all(v is None for v in vals):
            continue
        if any(isinstance(v, dict) for v in vals):
            subs = sorted({s for v in vals if isinstance(v, dict) for s in v})
            out[k] = {s: stat((v or {}).get(s) for v in vals) for s in subs}
        else:
            out[k] = stat(vals)
    return out
