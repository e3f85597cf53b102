"""Every generated file in the repository, from one command.

    .venv/bin/python scripts/generate.py           # `make generate`: rewrite what is stale
    .venv/bin/python scripts/generate.py --check   # exit 1 naming each stale file (a test runs this)

The artefacts, each with its one source:
- `envoy/envoy.yaml`: the local stack's Envoy config, from `extproc.envoyconf` with the default
  settings (one model, `sim-model`); the chart's Envoy pods generate theirs at start instead;
- `dashboards/llm-admission.json` and the chart's copies in `helm/llm-admission/files/`
  (the dashboard and `alerts/llm-admission.rules.yml`), from `dashboards.generate`;
- `extproc/_proto/`: the ext_proc stubs compiled from `proto/` by `scripts/generate_protos.py`;
- `docs/configuration/settings.md`: the docs' configuration reference, from
  `extproc/settings_table.py` by `scripts/settings_page.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

#: The settings `envoy/envoy.yaml` is generated from: the defaults, serving the simulator's model.
LOCAL_ENVOY_ENV = {"ADMISSION_OBSERVE_MODELS": "sim-model"}
PROTO_OUT = ROOT / "extproc" / "_proto"


def envoy() -> dict[Path, bytes]:
    from extproc.config import load_settings
    from extproc.envoyconf import render_envoy_config

    return {ROOT / "envoy" / "envoy.yaml": render_envoy_config(load_settings(LOCAL_ENVOY_ENV)).encode()}


def dashboards() -> dict[Path, bytes]:
    from dashboards import generate

    return {path: text.encode() for path, text in generate.outputs().items()}


def docs() -> dict[Path, bytes]:
    import settings_page

    return settings_page.outputs()


def protos() -> dict[Path, bytes]:
    import generate_protos

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "_proto"
        generate_protos.generate(out)
        return {PROTO_OUT / p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts}


#: Each artefact: how to make its files, and the directory it owns whole (files there that it
#: does not make are stale too), if any.
ARTEFACTS: dict[str, tuple[Callable[[], dict[Path, bytes]], Path | None]] = {
    "envoy": (envoy, None),
    "dashboards": (dashboards, None),
    "protos": (protos, PROTO_OUT),
    "docs": (docs, None),
}


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def plan() -> tuple[dict[Path, bytes], list[Path]]:
    """The files that differ from what their generator makes, and the files no generator makes."""
    write: dict[Path, bytes] = {}
    remove: list[Path] = []
    for make, owned in ARTEFACTS.values():
        files = make()
        write.update({path: data for path, data in files.items()
                      if not path.is_file() or path.read_bytes() != data})
        if owned is not None and owned.exists():
            remove += [p for p in sorted(owned.rglob("*"))
                       if p.is_file() and "__pycache__" not in p.parts and p not in files]
    return write, remove


def stale() -> list[str]:
    """What `make generate` would change, one line per file (empty when everything is fresh)."""
    write, remove = plan()
    return [f"stale: {_shown(p)}" for p in sorted(write)] + [f"not generated: {_shown(p)}" for p in remove]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/generate.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        lines = stale()
        for line in lines:
            print(f"{line} (run: make generate)", file=sys.stderr)
        return 1 if lines else 0
    write, remove = plan()
    for path, data in sorted(write.items()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {_shown(path)}")
    for path in remove:
        path.unlink()
        print(f"removed {_shown(path)}")
    if not (write or remove):
        print("every generated file is fresh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
