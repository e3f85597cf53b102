"""The chart passes every setting extproc/settings_table.py says it sets, and each one it renders
by default is what the service does with the variable unset (no silent second default)."""

from __future__ import annotations

from typing import Any

from extproc.config import load_settings
from extproc.settings_table import BY_ENV, SETTINGS

from .conftest import Chart

# Value sets that switch on every conditional part of the admission container's env.
EVERYTHING: list[dict[str, Any]] = [
    {},
    {"shape": "shared"},
    {"ledger": {"backend": "redis", "redis": {"url": "redis://redis:6379/0"}}},
    {"admission": {"kvCapacityTokens": 65536, "estimate": {"tokenizer": "qwen3"}}},
]


def _env_names(chart: Chart) -> set[str]:
    names: set[str] = set()
    for values in EVERYTHING:
        names |= {e["name"] for e in chart.render(values).container("admission")["env"]}
    return names


def test_the_chart_sets_every_setting_the_table_says_it_sets(chart: Chart) -> None:
    rendered = _env_names(chart)
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
