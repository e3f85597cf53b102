"""The settings table (extproc/settings_table.py) against the places a setting is written down:
the variables config.py reads, what load_settings does when one is unset, the bounds, choices and
engines-file keys it enforces, the docs' configuration reference (docs/configuration/settings.md,
generated from the table by scripts/settings_page.py; tests/unit/test_generated_fresh.py holds it
fresh), the engines-file example in the docs and `extproc --help`. The chart:
tests/helm/test_chart_settings.py."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import _parser
from extproc.config import ConfigError, load_settings
from extproc.settings_table import BY_ENV, SETTINGS, Setting

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_PAGE = ROOT / "docs" / "configuration" / "settings.md"
ENGINES_PAGE = ROOT / "docs" / "configuration" / "engines-file.md"
ENV_NAME = re.compile(r'"((?:ADMISSION|EXTPROC|ENGINE|VLLM|MAX)_[A-Z_]+)"')


def test_config_reads_exactly_the_settings_in_the_table() -> None:
    read = set(ENV_NAME.findall((ROOT / "extproc" / "config.py").read_text()))
    assert read - set(BY_ENV) == set(), "read by config.py but missing from the table"
    assert set(BY_ENV) - read == set(), "in the table but never read by config.py"
    assert len(SETTINGS) == len(BY_ENV), "a setting is listed twice"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.literal and s.default is not None], ids=lambda s: s.env)
def test_setting_a_variable_to_its_documented_default_changes_nothing(setting) -> None:  # noqa: ANN001
    assert load_settings({setting.env: setting.default}) == load_settings({})  # every field, not only the summary's


def _settings_page_rows() -> list[str]:
    return [line for line in SETTINGS_PAGE.read_text().splitlines() if line.startswith("| `")]


def test_the_docs_configuration_table_lists_every_setting_with_its_default() -> None:
    rows = _settings_page_rows()
    named = {name for r in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", r.split("|")[1])}
    assert named - set(BY_ENV) == set(), "the docs document variables the service does not read"
    for s in SETTINGS:
        row = next((r for r in rows if f"`{s.env}`" in r.split("|")[1]), None)
        assert row is not None, f"{s.env} has no row in docs/configuration/settings.md (run: make generate)"
        if s.literal and s.default is not None:
            assert f"`{s.default}`" in row or s.default in row.split("|")[2], (s.env, s.default, row)


def test_help_prints_every_setting_with_its_default() -> None:
    text = _parser().format_help()
    for s in SETTINGS:
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(s.env + " ")), None)
        assert line is not None, s.env
        assert line.rstrip().endswith(f"[{s.default if s.default is not None else 'unset'}]"), line


# --- type, bounds and scope: each row's is what load_settings enforces ----------------------------

BOUNDED = [s for s in SETTINGS if s.bounds is not None]
CHOICES = [s for s in SETTINGS if s.kind == "choice"]
PER_ENGINE = [s for s in SETTINGS if s.engine_key is not None]
# What a value at a bound needs from another setting to be valid (MIN <= MAX).
COMPANIONS = {"ADMISSION_BYTES_PER_TOKEN_MIN": {"ADMISSION_BYTES_PER_TOKEN_MAX": "64"}}


def _text(setting: Setting, value: float) -> str:
    return str(int(value)) if setting.kind == "int" else repr(float(value))


def _edges(setting: Setting) -> list[tuple[str, bool]]:
    """(value, accepted) at each end of the row's bounds: the bound itself, and just outside it."""
    bounds = setting.bounds
    assert bounds is not None
    step = (lambda v, d: v + d) if setting.kind == "int" else (lambda v, d: math.nextafter(v, d * math.inf))
    cases = []
    if bounds.low is not None:
        cases += [(_text(setting, bounds.low), not bounds.low_open), (_text(setting, step(bounds.low, -1)), False)]
    if bounds.high is not None:
        cases += [(_text(setting, bounds.high), not bounds.high_open), (_text(setting, step(bounds.high, 1)), False)]
    return cases


def _refused(env: dict[str, str], name: str, value: object, setting: Setting) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert f"{name}={value!r}: must be {setting.allowed}" in str(info.value)


@pytest.mark.parametrize("setting,value,accepted", [(s, v, ok) for s in BOUNDED for v, ok in _edges(s)],
                         ids=lambda x: x.env if isinstance(x, Setting) else str(x))
def test_a_bound_is_accepted_when_closed_and_a_value_just_outside_is_refused(
        setting: Setting, value: str, accepted: bool) -> None:
    env = {**COMPANIONS.get(setting.env, {}), setting.env: value}
    if accepted:
        load_settings(env)
    else:
        _refused(env, setting.env, value, setting)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind in ("int", "float")], ids=lambda s: s.env)
@pytest.mark.parametrize("value", ["many", "nan", "inf", "1e"])
def test_a_number_setting_refuses_what_is_not_a_finite_number(setting: Setting, value: str) -> None:
    _refused({setting.env: value}, setting.env, value, setting)


@pytest.mark.parametrize("setting", CHOICES, ids=lambda s: s.env)
def test_a_choice_setting_accepts_each_choice_in_any_case_and_refuses_others(setting: Setting) -> None:
    for choice in setting.choices:
        assert load_settings({setting.env: choice.swapcase(), "ADMISSION_REDIS_URL": "redis://r:6379/0"})
    _refused({setting.env: "bogus"}, setting.env, "bogus", setting)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind == "bool"], ids=lambda s: s.env)
def test_a_flag_reads_the_usual_spellings_and_refuses_others(setting: Setting) -> None:
    for text in ("true", "False", "1", "0", "yes", "NO", "on", "off"):
        load_settings({setting.env: text})
    _refused({setting.env: "maybe"}, setting.env, "maybe", setting)


def _engines_file(tmp_path: Path, **keys: Any) -> dict[str, str]:
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"engines": [{"name": "a", "url": "http://x:1", "models": ["m"], **keys}]}))
    return {"EXTPROC_CONFIG": str(path)}


def _inside(setting: Setting) -> Any:
    """A value the row accepts other than its default: a closed bound, a choice, a URL."""
    if setting.bounds is not None:
        b = setting.bounds
        value = b.low if b.low is not None and not b.low_open else b.high
        assert value is not None
        return int(value) if setting.kind == "int" else value
    return {"choice": lambda: setting.choices[0], "url": lambda: "http://x:1/m", "list": lambda: ["m", "n"]}[
        setting.kind]()


def test_an_engines_file_entry_sets_every_per_engine_setting(tmp_path: Path) -> None:
    keys = {s.engine_key: _inside(s) for s in PER_ENGINE if s.engine_key not in ("url", "models")}
    (engine,) = load_settings(_engines_file(tmp_path, **keys)).summary()["engines"]
    for key, value in keys.items():
        assert engine[key] == value, key


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.engine_key is None], ids=lambda s: s.env)
def test_an_engines_file_entry_refuses_a_global_setting(setting: Setting, tmp_path: Path) -> None:
    key = re.sub(r"^(ADMISSION|EXTPROC|ENGINE|VLLM)_", "", setting.env).lower()
    with pytest.raises(ConfigError, match=rf"engines\[0\]: unknown keys \['{key}'\]"):
        load_settings(_engines_file(tmp_path, **{key: _inside(setting) if setting.bounds else "x"}))


@pytest.mark.parametrize("setting,value,accepted",
                         [(s, v, ok) for s in BOUNDED if s.engine_key for v, ok in _edges(s)],
                         ids=lambda x: x.env if isinstance(x, Setting) else str(x))
def test_an_engines_file_entry_holds_the_same_bounds(setting: Setting, value: str, accepted: bool,
                                                     tmp_path: Path) -> None:
    key = setting.engine_key
    assert key is not None
    parsed = int(value) if setting.kind == "int" else float(value)
    env = _engines_file(tmp_path, **{key: parsed})
    if accepted:
        assert load_settings(env).summary()["engines"][0][key] == parsed
    else:
        _refused(env, f"engines[a].{key}", parsed, setting)


def test_the_docs_show_what_each_typed_setting_accepts_and_its_engines_file_keys() -> None:
    rows = _settings_page_rows()
    for s in SETTINGS:
        if s.kind in ("int", "float", "choice"):
            row = next(r for r in rows if f"`{s.env}`" in r.split("|")[1])
            assert f"{s.allowed}" in row.replace("`", ""), (s.env, s.allowed, row)
        if s.engine_key is not None:
            row = next(r for r in rows if f"`{s.env}`" in r.split("|")[1])
            assert f"per engine: `{s.engine_key}`" in row, (s.env, row)
    page = ENGINES_PAGE.read_text()
    example = yaml.safe_load(page[page.index("```yaml") + len("```yaml"):].split("```")[0])
    assert {key for entry in example["engines"] for key in entry} == {"name", *(s.engine_key for s in PER_ENGINE)}


def test_help_shows_what_each_setting_accepts_and_where_an_engine_may_set_it() -> None:
    text = _parser().format_help()
    for s in SETTINGS:
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(s.env + " "))
        assert s.allowed is None or f"; {s.allowed}" in line, line
        assert (f"; per engine: {s.engine_key} " in line) == (s.engine_key is not None), line


def test_the_docs_page_notes_and_accepts_name_only_real_settings() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import settings_page
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert set(settings_page.NOTES) - set(BY_ENV) == set(), "a note for a variable the service does not read"
    assert set(settings_page.ACCEPTS) - set(BY_ENV) == set(), "accepts text for a variable the service does not read"
