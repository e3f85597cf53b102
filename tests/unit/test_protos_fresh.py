"""The committed stubs in extproc/_proto/ are exactly what scripts/generate_protos.py makes from proto/.

The generator runs into a temporary directory and the two trees are compared file by file, byte
for byte; a difference means proto/ or grpcio-tools changed without `make protos`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "scripts" / "generate_protos.py"
COMMITTED = ROOT / "extproc" / "_proto"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    out = tmp_path / "_proto"
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], check=True, timeout=120)
    fresh, committed = _tree(out), _tree(COMMITTED)
    assert fresh, "the generator wrote nothing"
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    stale = sorted(name for name in set(fresh) & set(committed) if fresh[name] != committed[name])
    assert not (missing or extra or stale), (
        f"extproc/_proto is stale (missing: {missing}, not generated: {extra}, different: {stale}); run `make protos`"
    )


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
