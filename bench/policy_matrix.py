"""Issue 22's benchmark matrix: every scenario x admission mode, one markdown table.

    python -m bench.policy_matrix --engine sim [--scenarios reasoning,overload] [--modes none,strict,projected]
    python -m bench.policy_matrix --engine real [--engine-url URL]

Each cell is one `python -m bench.admission` run (a process of its own, so one cell's failure
cannot spoil the next): `strict` is `--mode full --policy strict`, `projected` is `--mode full
--policy projected`, `none` and `vllm-builtin` are those modes. `three-65k` runs on the legacy
engine (`--engine vllm-0.11`), where vLLM has no queue limits of its own, so its `vllm-builtin`
cell is skipped; a real engine has no `vllm-builtin` either (it would need the engine started with
its own flag). With `--engine real` and no `--engine-url` ONE real vLLM is started for the whole
matrix and stopped at the end.

Writes each cell's JSON (the last line of bench.admission's stdout) and its table to
`--out` (default bench-matrix/<engine>/), then `table.md`, and prints the table: output tok/s,
goodput (and `goodput_bound`, deadline scenarios), TTFT and e2e p50/p95 over all completed
requests, preemptions, tokens recomputed because of preemptions beside the prompt tokens
prefilled (a real engine: `<=` an upper bound, see bench/README.md), and false early rejections
(`-` where the service does not report them). A cell that failed shows its exit status; a run
whose engine-side arrival order was not kept (exit status 3) is failed, not reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIM_SCENARIOS = ("reasoning", "reasoning-eos", "chat-longtail", "three-65k", "overload")
REAL_SCENARIOS = ("real-decode", "real-decode-eos", "real-chat-longtail", "real-burst", "real-overload")
MATRIX_MODES = ("none", "vllm-builtin", "strict", "projected")
# scenarios whose comparison is on another simulator profile than the default vllm-0.33
SCENARIO_ENGINE = {"three-65k": "vllm-0.11"}
CELL_TIMEOUT_S = 1800  # bounds a hung cell; the longest (three-65k none) takes ~1 minute idle


@dataclass(frozen=True)
class Cell:
    scenario: str
    mode: str  # a matrix mode: none, vllm-builtin, strict, projected
    argv: tuple[str, ...] | None  # bench.admission's arguments, or None: not available
    why_not: str | None = None

    @property
    def name(self) -> str:
        return f"{self.scenario}--{self.mode}"


def cell(scenario: str, mode: str, engine: str, engine_url: str | None = None,
         extra: Sequence[str] = ()) -> Cell:
    """The bench.admission run for one matrix cell, or why there is none."""
    if mode not in MATRIX_MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MATRIX_MODES)}")
    argv = ["--scenario", scenario, "--quiet"]
    if engine == "real":
        argv += ["--engine-url", engine_url] if engine_url else ["--engine", "real"]
        if mode == "vllm-builtin":
            return Cell(scenario, mode, None, "a real engine has no vllm-builtin mode here")
    else:
        sim_engine = SCENARIO_ENGINE.get(scenario, "vllm-0.33")
        argv += ["--engine", sim_engine]
        if mode == "vllm-builtin" and sim_engine == "vllm-0.11":
            return Cell(scenario, mode, None, "vLLM 0.11 has no queue limits of its own")
    if mode in ("strict", "projected"):
        argv += ["--mode", "full", "--policy", mode]
    else:
        argv += ["--mode", mode]
    return Cell(scenario, mode, (*argv, *extra))


def _pair(result: dict[str, Any], a: str, b: str) -> str:
    x, y = result.get(a, {}).get("all"), result.get(b, {}).get("all")
    if x is None and y is None:
        return "-"
    return f"{'-' if x is None else f'{x:.1f}'} / {'-' if y is None else f'{y:.1f}'}"


def row(c: Cell, result: dict[str, Any] | None, status: str | None = None) -> list[str]:
    """One markdown row: the cell's figures, or why it has none."""
    if result is None:
        return [c.scenario, c.mode, status or (c.why_not or "-"), *["-"] * 6]
    goodput = f"{result['goodput']:.3f}"
    if result.get("goodput_bound") is not None:
        goodput += f" ({result['goodput_bound']:.3f})"
    if result.get("recomputed_tokens") is not None:
        recomputed = f"{result['recomputed_tokens']}"
    elif result.get("recomputed_tokens_bound") is not None:
        recomputed = f"<={result['recomputed_tokens_bound']}"
    else:
        recomputed = "-"
    if result.get("prefill_tokens"):
        recomputed += f" / {result['prefill_tokens']}"
    false_early = result.get("false_early_rejections")
    tok_s = result.get("output_tokens_per_s")
    mode = c.mode
    if result.get("policy_requested"):  # the service did not know the policy and ran its own
        mode += f" (ran as {result.get('policy')})"
    return [c.scenario, mode, "-" if tok_s is None else f"{tok_s:.1f}", goodput,
            _pair(result, "ttft_p50", "ttft_p95"), _pair(result, "e2e_p50", "e2e_p95"), str(result["preemptions"]),
            recomputed, "-" if false_early is None else str(false_early)]


HEADER = ("scenario", "mode", "output tok/s", "goodput (bound)", "TTFT p50 / p95 s", "e2e p50 / p95 s",
          "preemptions", "recomputed / prefill tokens", "false early rejections")


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def run_cell(c: Cell, out: Path) -> tuple[dict[str, Any] | None, str | None]:
    """Run one cell; its JSON (or None) and, for a failed cell, its status."""
    assert c.argv is not None
    proc = subprocess.run([sys.executable, "-m", "bench.admission", *c.argv], capture_output=True, text=True,
                          timeout=CELL_TIMEOUT_S)
    (out / f"{c.name}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr[-20000:])
    result = None
    lines = proc.stdout.strip().splitlines()
    if lines:
        with contextlib.suppress(ValueError):
            result = json.loads(lines[-1])
    if result is not None:
        (out / f"{c.name}.json").write_text(json.dumps(result, indent=1))
    if proc.returncode == 3:
        return None, "failed: arrival order not kept"
    if proc.returncode != 0 or result is None:
        return None, f"failed: exit {proc.returncode}"
    return result, None


@contextlib.contextmanager
def real_engine(url: str | None, workdir: Path) -> Iterator[str]:
    """The real engine's URL: the one given, or one vLLM started for the whole matrix."""
    if url is not None:
        yield url.rstrip("/")
        return
    import realengine

    engine = realengine.VllmEngine(workdir / "vllm")
    print(f"starting the real vLLM (CPU) in {workdir / 'vllm'}: 40-100 s, minutes on a busy machine",
          file=sys.stderr, flush=True)
    try:
        engine.start()
    except BaseException:
        print(engine.log_tail(60), file=sys.stderr)
        raise
    try:
        yield engine.url
    finally:
        engine.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("sim", "real"), default="sim")
    parser.add_argument("--engine-url", default=None, metavar="URL",
                        help="with --engine real: the vLLM already serving there (else one is started)")
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated (default: sim {','.join(SIM_SCENARIOS)}; "
                             f"real {','.join(REAL_SCENARIOS)})")
    parser.add_argument("--modes", default=",".join(MATRIX_MODES), help="comma-separated matrix modes")
    parser.add_argument("--out", type=Path, default=None, help="directory for each cell's JSON and table.md")
    parser.add_argument("--bench-arg", action="append", default=[], metavar="ARG",
                        help="extra bench.admission argument for every cell (repeatable), e.g. "
                             "--bench-arg=--sim-arg=--max-num-seqs=5")
    parser.add_argument("--dry-run", action="store_true", help="print each cell's command and run nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_url and args.engine != "real":
        parser.error("--engine-url drives a real engine: add --engine real")
    default = SIM_SCENARIOS if args.engine == "sim" else REAL_SCENARIOS
    scenarios = [s for s in (args.scenarios.split(",") if args.scenarios else default) if s]
    modes = [m for m in args.modes.split(",") if m]
    from .scenarios import SCENARIOS

    for s in scenarios:
        if s not in SCENARIOS or SCENARIOS[s].real != (args.engine == "real"):
            names = ", ".join(sorted(n for n, d in SCENARIOS.items() if d.real == (args.engine == "real")))
            parser.error(f"scenario {s!r} is not one for --engine {args.engine}: one of {names}")
    for m in modes:
        if m not in MATRIX_MODES:
            parser.error(f"mode {m!r}: one of {', '.join(MATRIX_MODES)}")
    out = args.out or Path("bench-matrix") / args.engine
    with contextlib.ExitStack() as stack:
        url = None
        if args.engine == "real" and not args.dry_run:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-matrix-")))
            url = stack.enter_context(real_engine(args.engine_url, work))
        elif args.engine == "real":
            url = args.engine_url
        cells = [cell(s, m, args.engine, url, args.bench_arg) for s in scenarios for m in modes]
        if args.dry_run:
            for c in cells:
                print(f"{c.name}: " + ("python -m bench.admission " + " ".join(c.argv) if c.argv else str(c.why_not)))
            return 0
        out.mkdir(parents=True, exist_ok=True)
        rows, failed = [], 0
        for c in cells:
            if c.argv is None:
                rows.append(row(c, None))
                continue
            print(f"[{c.name}] python -m bench.admission {' '.join(c.argv)}", file=sys.stderr, flush=True)
            result, status = run_cell(c, out)
            failed += status is not None
            rows.append(row(c, result, status))
    table = markdown_table(rows)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
