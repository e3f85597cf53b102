"""The committed dashboard's queries, and how to run them outside Grafana."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "llm-admission.json"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def targets() -> Iterator[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of every panel."""
    for panel in panels():
        for target in panel["targets"]:
            yield panel["title"], target["refId"], target["expr"]


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """What Grafana sends with every variable at "All" (allValue `.*`)."""
    names = {v["name"] for v in dashboard()["templating"]["list"] if v["type"] == "query"}
    out = expr.replace("$__rate_interval", rate_interval)
    for name in names:
        out = re.sub(rf"\$\{{{name}\}}|\${name}\b", ".*", out)
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out
