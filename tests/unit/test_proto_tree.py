"""proto/ holds exactly the import closure of external_processor.proto (scripts/generate_protos.py
refuses a stray or a missing file). That extproc/_proto/ is fresh is checked with every other
generated file in tests/unit/test_generated_fresh.py."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "scripts" / "generate_protos.py"


def _generator_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("generate_protos", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_proto_dir_is_exactly_the_import_closure(tmp_path: Path) -> None:
    gen = _generator_module()
    tree = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", tree)
    closure = gen.check_tree(tree, gen.ENTRY)
    assert closure == sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.proto"))

    (tree / "envoy" / "stray.proto").write_text('syntax = "proto3";\n')
    with pytest.raises(gen.ProtoTreeError, match="stray.proto"):
        gen.check_tree(tree, gen.ENTRY)
    (tree / "envoy" / "stray.proto").unlink()

    (tree / "envoy" / "type" / "v3" / "percent.proto").unlink()
    with pytest.raises(gen.ProtoTreeError, match="percent.proto is imported but missing"):
        gen.check_tree(tree, gen.ENTRY)
