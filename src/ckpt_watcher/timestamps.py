"""Timestamps as users read them: ISO-8601 in UTC, with a trailing Z."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(ts: float) -> str:
    """A Unix time as `2026-11-22T04:48:27Z` (whole seconds: what status and logs show)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utcnow() -> str:
    """Now, to the microsecond (`...T04:48:27.123456Z`): when an eval started or finished."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def stamp(ts: float) -> str:
    """A Unix time as `utcnow()` writes it."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seconds_between(started: str, finished: str) -> float | None:
    """Seconds from one `utcnow()` stamp to another (None if either is missing)."""
    if not started or not finished:
        return None
    return round(
        (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds(), 3
    )
