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
    """68.98B, 8.92M, 0.86M: a parameter count as model cards write it."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def si(value: float) -> str:
    """A count with three significant digits and an SI prefix: 68.98B is `69.0 G`, 8.92M `8.92 M`, 0.3 `0.3`."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g}"


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
