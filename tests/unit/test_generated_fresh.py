"""Every generated file in the repository is what its generator makes now (`make generate`).

The one freshness check for the Envoy config, the dashboard and the chart's copies, the
ext_proc stubs and the docs' configuration reference: scripts/generate.py runs each generator in
memory and compares byte for byte.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_file_is_fresh() -> None:
    generate = _generate_module()
    assert set(generate.ARTEFACTS) == {"envoy", "dashboards", "protos", "docs"}
    stale = generate.stale()
    assert not stale, "generated files are stale; run `make generate`:\n" + "\n".join(stale)


def test_a_changed_file_and_a_file_no_generator_makes_are_reported_and_fixed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate = _generate_module()
    owned = tmp_path / "owned"
    owned.mkdir()
    (owned / "made.txt").write_bytes(b"old\n")
    (owned / "leftover.txt").write_bytes(b"from an older generator\n")
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    monkeypatch.setattr(generate, "ARTEFACTS", {"one": (lambda: {owned / "made.txt": b"new\n"}, owned)})

    assert generate.stale() == ["stale: owned/made.txt", "not generated: owned/leftover.txt"]
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0
    assert (owned / "made.txt").read_bytes() == b"new\n" and not (owned / "leftover.txt").exists()
    assert generate.main(["--check"]) == 0
