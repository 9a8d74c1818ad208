"""Template filters of the run pages (the JS of the same pages formats the same way)."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """123.4 -> "2m 03s"; 7300 -> "2h 01m"; None -> "—"."""
    if seconds is None:
        return "—"
    s = int(round(float(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


@register.filter
def percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * float(fraction):.0f}%"


@register.filter
def pretty_json(value) -> str:
    """A model card (or any JSON) indented for a <pre>; autoescaped by the template."""
    import json

    return json.dumps(value, indent=2, sort_keys=False, default=str)


@register.filter
def ratio(value: float | None, digits: int = 2) -> str:
    """1.734 -> "1.73×"; None -> "—" (not measured yet)."""
    return "—" if value is None else f"{float(value):.{int(digits)}f}×"


@register.filter
def sci(value: float | None) -> str:
    """1.67e-06 for tiny figures like a log-prob mismatch; None -> "—"."""
    return "—" if value is None else f"{float(value):.2e}"
