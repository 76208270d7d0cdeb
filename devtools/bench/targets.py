"""A benchmark's targets: each judged PASS or FAIL on a measured value, and
printed one a line, for the benches that print their numbers beside their
targets (`gateway-dev bench-fairness`, `gateway-dev bench-dispatch`)."""

from __future__ import annotations

from typing import Any


def status(ok: bool | None) -> str:
    """PASS, FAIL, or n/a when there was nothing to judge."""
    return "PASS" if ok else ("FAIL" if ok is not None else "n/a")


def at_most(name: str, value: float | None, limit: float, text: str, **extra: Any) -> dict[str, Any]:
    """A target met when ``value <= limit`` (no value: FAIL)."""
    return {"target": name, "ok": value is not None and value <= limit, "value": value,
            "limit": limit, "text": text, **extra}


def at_least(name: str, value: float | None, limit: float, text: str, **extra: Any) -> dict[str, Any]:
    """A target met when ``value >= limit`` (no value: FAIL)."""
    return {"target": name, "ok": value is not None and value >= limit, "value": value,
            "limit": limit, "text": text, **extra}


def below(name: str, value: float | None, limit: float, text: str, **extra: Any) -> dict[str, Any]:
    """A target met when ``value < limit`` (no value: FAIL)."""
    return {"target": name, "ok": value is not None and value < limit, "value": value,
            "limit": limit, "text": text, **extra}


def all_pass(targets: list[dict[str, Any]]) -> bool:
    return bool(targets) and all(t["ok"] for t in targets)


def format_targets(targets: list[dict[str, Any]]) -> list[str]:
    """``== targets`` and one ``PASS|FAIL  text`` line a target."""
    return ["== targets"] + [f"  {status(t['ok'])}  {t['text']}" for t in targets]
