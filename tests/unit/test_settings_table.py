"""The settings table (extproc/settings_table.py) against the places a setting is written down:
the variables config.py reads, what load_settings does when one is unset, the README's
configuration table and `extproc --help`. The chart: tests/helm/test_chart_settings.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from extproc.cli import _parser
from extproc.config import load_settings
from extproc.settings_table import BY_ENV, SETTINGS

ROOT = Path(__file__).resolve().parents[2]
ENV_NAME = re.compile(r'"((?:ADMISSION|EXTPROC|ENGINE|VLLM|MAX)_[A-Z_]+)"')


def test_config_reads_exactly_the_settings_in_the_table() -> None:
    read = set(ENV_NAME.findall((ROOT / "extproc" / "config.py").read_text()))
    assert read - set(BY_ENV) == set(), "read by config.py but missing from the table"
    assert set(BY_ENV) - read == set(), "in the table but never read by config.py"
    assert len(SETTINGS) == len(BY_ENV), "a setting is listed twice"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.literal and s.default is not None], ids=lambda s: s.env)
def test_setting_a_variable_to_its_documented_default_changes_nothing(setting) -> None:  # noqa: ANN001
    assert load_settings({setting.env: setting.default}).summary() == load_settings({}).summary()


def test_the_readme_configuration_table_lists_every_setting_with_its_default() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Configuration"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for r in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", r.split("|")[1])}
    assert named - set(BY_ENV) == set(), "README documents variables the service does not read"
    for s in SETTINGS:
        row = next((r for r in rows if f"`{s.env}`" in r.split("|")[1]), None)
        assert row is not None, f"{s.env} has no row in README's configuration table"
        if s.literal and s.default is not None:
            assert f"`{s.default}`" in row or s.default in row.split("|")[2], (s.env, s.default, row)


def test_help_prints_every_setting_with_its_default() -> None:
    text = _parser().format_help()
    for s in SETTINGS:
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(s.env + " ")), None)
        assert line is not None, s.env
        assert line.rstrip().endswith(f"[{s.default if s.default is not None else 'unset'}]"), line
