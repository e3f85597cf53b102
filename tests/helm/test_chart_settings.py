"""The chart passes every setting extproc/settings_table.py says it sets, each one it renders by
default is what the service does with the variable unset (no silent second default), and its
values.schema.json allows what the service allows (type, bounds, choices)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from extproc.config import load_settings
from extproc.settings_table import BY_ENV, SETTINGS, Setting

from .conftest import CHART, TLS_SECRET, Chart

# Value sets that switch on every conditional part of the admission container's env.
EVERYTHING: list[dict[str, Any]] = [
    {},
    {"shape": "shared"},
    {"ledger": {"backend": "redis", "redis": {"url": "redis://redis:6379/0"}}},
    {"admission": {"kvCapacityTokens": 65536, "pollTimeoutSeconds": 6, "estimate": {"tokenizer": "qwen3"}}},
    {"shape": "shared", "extproc": {"tls": {"secretName": TLS_SECRET}}},
]


def _env_names(chart: Chart, tls_files: dict[str, str]) -> set[str]:
    names: set[str] = set()
    for values in EVERYTHING:
        rendered = chart.render(values, volume_files={"extproc-tls": tls_files})
        names |= {e["name"] for e in rendered.container("admission")["env"]}
    return names


def test_the_chart_sets_every_setting_the_table_says_it_sets(chart: Chart, tls_secret_files: dict[str, str]) -> None:
    rendered = _env_names(chart, tls_secret_files)
    said = {s.env for s in SETTINGS if s.chart is not None}
    assert said - rendered == set(), "the table names a chart key for these, but the chart never sets them"
    assert rendered & set(BY_ENV) == rendered, (
        f"the chart sets variables the service does not read: {rendered - set(BY_ENV)}")
    unset = {s.env for s in SETTINGS if s.chart is None}
    assert unset & rendered == set(), "the table says the chart does not set these, but it does"
    assert all(s.chart_note for s in SETTINGS if s.chart is None), "a setting the chart leaves alone needs a reason"


def test_the_charts_default_values_are_the_services_defaults(chart: Chart) -> None:
    env = chart.render({}).env()
    # What the chart chooses on purpose (listeners, the engines file) is not a default to compare.
    chosen = {"EXTPROC_CONFIG", "EXTPROC_LISTEN", "EXTPROC_ADMIN_LISTEN", "EXTPROC_PROBE_LISTEN",
              "ADMISSION_LEDGER_KEY_PREFIX"}
    for name, value in env.items():
        setting = BY_ENV[name]
        if name in chosen or not setting.literal:
            continue
        alone = load_settings({name: value}).summary()
        assert alone == load_settings({}).summary(), f"the chart's {name}={value!r} differs from the service's default"


SCHEMA = json.loads((CHART / "values.schema.json").read_text())
SCHEMA_TYPE = {"int": "integer", "float": "number", "bool": "boolean"}


def _schema_at(path: list[str], node: dict[str, Any] = SCHEMA) -> dict[str, Any] | None:
    for key in path:
        node = node.get("properties", {}).get(key)
        if node is None:
            return None
    return node


def _agrees(setting: Setting, node: dict[str, Any], where: str) -> None:
    """The schema allows what the row allows: its type, bounds (or the chart's own, where narrower) or choices."""
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    if setting.kind in SCHEMA_TYPE:
        assert SCHEMA_TYPE[setting.kind] in types, (where, node)
    if setting.kind == "choice":
        assert node.get("enum") == list(setting.choices), (where, node)
    bounds = setting.chart_bounds or setting.bounds
    if bounds is None:
        return
    low = "exclusiveMinimum" if bounds.low_open else "minimum"
    high = "exclusiveMaximum" if bounds.high_open else "maximum"
    assert (node.get(low), node.get(high)) == (bounds.low, bounds.high), (where, node, bounds)
    assert {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"} & set(node) <= {low, high}, (where, node)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind in (*SCHEMA_TYPE, "choice")], ids=lambda s: s.env)
def test_the_charts_schema_allows_what_the_service_allows(setting: Setting) -> None:
    checked = 0
    if setting.chart is not None and (node := _schema_at(setting.chart.split("."))) is not None:
        _agrees(setting, node, setting.chart)
        checked += 1
    if setting.engine_key is not None:  # the chart's engines[] entries use the key in camelCase
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), setting.engine_key)
        node = SCHEMA["properties"]["engines"]["items"]["properties"].get(camel)
        assert node is not None, f"the chart's engines[] entries have no {camel} for {setting.env}"
        _agrees(setting, node, f"engines[].{camel}")
        checked += 1
    if setting.chart is not None and not setting.chart_note:
        assert checked, f"{setting.chart} ({setting.env}) has no schema"
