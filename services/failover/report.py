"""Rendering a readiness report or a runbook run: a table for people, JSON for machines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from services.failover.checks import Report

_MARK = {"ok": "OK", "warn": "WARN", "fail": "FAIL"}


def report_dict(report: Report, standby: str | None = None) -> dict[str, Any]:
    """The report as plain data; ``ready`` is judged for ``standby`` (all when None)."""
    targets = [standby] if standby else list(report.standbys)
    return {
        "ready": all(report.ready_for(t) for t in targets) and bool(targets),
        "standbys": {t: report.ready_for(t) for t in report.standbys},
        "replay_lag_bytes": report.replay_lag_bytes,
        "checks": [asdict(c) for c in report.checks],
        "slots": [asdict(s) for s in report.slots],
        "subscriptions": [asdict(s) for s in report.subscriptions],
    }


def render_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def render_report(report: Report, standby: str | None = None, verbose: bool = True) -> str:
    """Checks as a table (ok rows only when ``verbose``), remedies under it, then verdict."""
    data = report_dict(report, standby)
    shown = [c for c in report.checks if verbose or c.status != "ok"]
    lines: list[str] = []
    if shown:
        lines += _table(
            [("STATUS", "SCOPE", "CHECK", "DETAIL")]
            + [(_MARK[c.status], c.scope, c.code, c.detail) for c in shown]
        )
    todo = [c for c in report.checks if c.status != "ok"]
    if todo:
        lines += ["", "What to do:"]
        lines += [f"  [{_MARK[c.status]}] {c.scope} {c.code}: {c.remedy}" for c in todo]
    verdict = ", ".join(
        f"{n}: {'ready' if ok else 'NOT ready'}" for n, ok in data["standbys"].items()
    )
    lines += ["", f"{'READY' if data['ready'] else 'NOT READY'} for failover ({verdict})"]
    return "\n".join(lines)


def render_steps(steps: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """A runbook run: one line per step with its duration, then the summary."""
    rows = [("STEP", "RESULT", "SECONDS", "DETAIL")]
    rows += [(s["step"], s["result"], f"{s['seconds']:.2f}", s["detail"]) for s in steps]
    lines = _table(rows)
    lines += ["", *[f"{k}: {v}" for k, v in summary.items()]]
    return "\n".join(lines)
