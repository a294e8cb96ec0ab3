"""Numbers as the planner says them, each with a unit that does not round it to 0."""

from __future__ import annotations


def gb_text(value: float) -> str:
    """A size given in GB, said with a unit that does not round it to 0: 1,536 GB, 25 GB, 0.5 GB, 38 MB."""
    if value >= 100:
        return f"{value:,.0f} GB"
    if value >= 0.1:
        return f"{value:.3g} GB"
    return f"{value * 1000:.3g} MB"


def parameters(count: float) -> str:
    """68.98B, 8.92M, 0.26M, 4,000: a parameter count as model cards write it."""
    if count >= 1e9:
        return f"{count / 1e9:.2f}B"
    return f"{count / 1e6:.2f}M" if count >= 1e4 else f"{count:,.0f}"


def si(value: float) -> str:
    """A count with three significant digits and an SI prefix: 430e9 is `430 G`, 8.29e6 `8.29 M`, 999.7e9 `1 T`."""
    prefixes = (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15))
    for index, (prefix, scale) in enumerate(prefixes):
        shown = float(f"{value / scale:.3g}")
        if abs(shown) < 1000 or index == len(prefixes) - 1:
            return f"{shown:g} {prefix}".rstrip()
    raise AssertionError("unreachable")


def format_total(seconds: float) -> str:
    """A run's length: minutes to days, and years beside days once it is longer than one."""
    if seconds >= 365 * 86_400:
        return f"{seconds / 86_400:,.0f} days ({seconds / 86_400 / 365:.1f} years)"
    return format_duration(seconds)


def format_duration(seconds: float) -> str:
    if seconds >= 86_400:
        return f"{seconds / 86_400:,.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.2g} s"
