"""Figures as people read them, for the CLI and for error messages alike."""

from __future__ import annotations


def size_text(value: float) -> str:
    """Bytes: 631 B, 631.0 KiB, 1.2 GiB, 3.0 TiB."""
    if value < 1024:
        return f"{value:.0f} B"
    amount = float(value)
    for unit in ("KiB", "MiB", "GiB"):
        amount /= 1024
        if amount < 1024:
            return f"{amount:.1f} {unit}"
    return f"{amount / 1024:.1f} TiB"


def duration_text(seconds: float) -> str:
    """41s, 3m12s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def latency_text(ms: float) -> str:
    """A call's latency: 3.2 ms, 412 ms, 7.9 s, then as durations (3m12s)."""
    # each step where the one before would round up to the next's first figure
    if ms < 9.95:
        return f"{ms:.1f} ms"
    if ms < 999.5:
        return f"{ms:.0f} ms"
    if ms < 59_950:
        return f"{ms / 1000:.1f} s"
    return duration_text(ms / 1000)
