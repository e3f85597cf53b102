"""The service's wheel is the service alone; the tools beside it never ship and are never imported by it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"enginesim", "bench", "dashboards", "devstack", "tests", "scripts"}


def test_the_wheel_holds_extproc_and_its_metadata_only(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "run", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheels"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("llm_admission-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"extproc"}
    assert "extproc/_proto/envoy/service/ext_proc/v3/external_processor_pb2.py" in names
    assert "extproc/static/index.html" in names  # the status page is served from the package
    assert "extproc = extproc.cli:main" in scripts and "enginesim" not in scripts


def test_the_service_never_imports_a_tool() -> None:
    offenders = []
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in TOOLS]
    assert not offenders, offenders
