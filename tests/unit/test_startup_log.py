"""The start-up log says the effective configuration in readable lines: one short INFO line per
group and per engine, every setting in one of them, and the whole document only at DEBUG."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from extproc.cli import log_configuration
from extproc.config import load_settings
from extproc.logs import JsonFormatter, TextFormatter

MAX_LINE = 340  # characters of a text-format line, timestamp and level included (the old one: 1,700)


def leaves(doc: Any, prefix: str = "") -> set[str]:
    if isinstance(doc, dict):
        return {leaf for key, value in doc.items() for leaf in leaves(value, f"{prefix}{key}.")}
    return {prefix.rstrip(".")}


def test_the_configuration_is_logged_in_short_info_lines_and_in_full_at_debug(
        caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    config = tmp_path / "engines.yaml"
    config.write_text("engines:\n"
                      "  - {name: a, url: 'http://127.0.0.1:8001', models: [m1]}\n"
                      "  - {name: b, url: 'http://127.0.0.1:8002', models: [m2, m3]}\n")
    settings = load_settings({"EXTPROC_CONFIG": str(config)})
    with caplog.at_level(logging.DEBUG, logger="extproc"):
        log_configuration(settings)
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]

    messages = [r.getMessage() for r in info]
    assert messages[-2:] == ["configuration: engine a", "configuration: engine b"]
    assert all(m.startswith("configuration: ") for m in messages) and len(set(messages)) == len(messages)
    for record in info:
        line = TextFormatter().format(record)
        assert len(line) <= MAX_LINE, line
        JsonFormatter().format(record)  # the JSON format takes it too

    # Every setting of the summary is in one INFO line (by its last key), none is lost.
    summary = settings.summary()
    shown = {key for r in info for key in vars(r)}
    wanted = {leaf.split(".")[-1] for leaf in leaves({k: v for k, v in summary.items() if k != "engines"})}
    assert {w for w in wanted if not any(s.endswith(w) for s in shown)} == set()
    engine_b = next(r for r in info if r.getMessage() == "configuration: engine b")
    assert (engine_b.models, engine_b.max_inflight) == ("m2,m3", summary["engines"][1]["max_inflight"])

    (full,) = debug
    assert full.getMessage() == "effective configuration" and full.config == summary
