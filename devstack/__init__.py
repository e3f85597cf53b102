"""Run the whole local stack: engine simulator (or a real engine), the admission service, Envoy.

`python -m devstack` is what `make run` starts; the integration tests drive the same
`LocalStack` class, so the stack they test is the stack a developer runs. Each process is a real
child process on loopback; `stop()` terminates them in reverse order and always reaps them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from extproc.config import ConfigError, load_settings
from extproc.envoyconf import render_envoy_config

SIM_MODEL = "sim-model"
_T = TypeVar("_T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The checkout. The service's wheel holds extproc/ alone; the tools beside it (enginesim, bench,
#: dashboards, devstack) run from here.
CHECKOUT = Path(__file__).resolve().parent.parent


def simulator_argv(*args: str) -> list[str]:
    """The engine simulator as a command line (a tool of the checkout, so run as a module)."""
    return [sys.executable, "-m", "enginesim", *args]


def with_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the checkout first on PYTHONPATH, so a child imports the tools wherever it runs."""
    paths = [str(CHECKOUT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def console_script(name: str) -> str:
    """A console script from this interpreter's environment (the venv), else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH")
    return found


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(check: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """Poll `check()` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError) as exc:
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_error})" if last_error else ""))


class ChildExited(RuntimeError):
    """A child process exited while it was expected to become ready."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None
    process: subprocess.Popen[bytes] | None = None
    _log: BinaryIO | None = None

    def start(self) -> None:
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115
            out = self._log
        else:
            out = None
        # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches only
        # the parent, which stops its children in an order that lets the service answer its parked
        # requests through a still-running Envoy (`LocalStack.drain`).
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.process = None
        return proc.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class RedisServer:
    """A throwaway `redis-server` (Debian's) on a loopback port: the shared ledger's store for the
    tests, the benchmark's `--ledger redis` and `make run` with ADMISSION_LEDGER=redis. No
    persistence: restarting it loses the state, as a real Redis failover without persistence does."""

    workdir: Path
    port: int = 0
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not found: install Debian's `redis-server` (make system-deps)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            port = self.port or free_port()
            argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                    "--dir", str(self.workdir), "--protected-mode", "yes"]
            self.child = Child("redis", argv, dict(os.environ), self.workdir / "redis.log")
            self.child.start()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self.child.alive():
                    break
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        self.port = port
                        return self
                time.sleep(0.05)
            output = self.child.log_tail()
            self.child.stop()
            if "address already in use" not in output.lower() or self.port:
                raise ChildExited(f"redis-server did not start on port {port}:\n{output}", output)
        raise ChildExited("redis-server could not find a free port", "")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None


@dataclass
class LocalStack:
    """Simulator + extproc + Envoy on free loopback ports (or fixed ones for `make run`)."""

    workdir: Path
    engine_url: str | None = None  # a real engine; None = start the simulator
    sim_args: Sequence[str] = ()
    extproc_env: Mapping[str, str] = field(default_factory=dict)
    envoy_args: Mapping[str, object] = field(default_factory=dict)  # extra build_envoy_config kwargs
    envoy_port: int = 0
    envoy_admin_port: int = 0
    grpc_port: int = 0
    admin_port: int = 0
    sim_port: int = 0
    log_to_files: bool = True
    with_extproc: bool = True  # False: Envoy straight to the engine, no ext_proc filter
    shared_extproc: LocalStack | None = None  # use that stack's service instead of starting one

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Ports picked here may be taken by someone else before the child binds them; those
        # (and only those) are re-picked when a child fails with "address already in use".
        self._picked: set[str] = set()
        for name in ("envoy_port", "envoy_admin_port", "grpc_port", "admin_port", "sim_port"):
            if not getattr(self, name):
                setattr(self, name, free_port())
                self._picked.add(name)
        self.sim: Child | None = None
        self.extproc: Child | None = None
        self.envoy: Child | None = None

    # --- addresses ------------------------------------------------------------------------

    @property
    def engine_base(self) -> str:
        return self.engine_url or f"http://127.0.0.1:{self.sim_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def service(self) -> LocalStack:
        """The stack whose admission service this stack's Envoy uses (itself unless shared)."""
        return self.shared_extproc or self

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.service.admin_port}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin_port}"

    def _log(self, name: str) -> Path | None:
        return self.workdir / f"{name}.log" if self.log_to_files else None

    def service_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ADMISSION_", "EXTPROC_", "ENGINE_", "VLLM_"))}
        env.update(
            {
                "ENGINE_URL": self.engine_base,
                "EXTPROC_LISTEN": f"127.0.0.1:{self.grpc_port}",
                "EXTPROC_ADMIN_LISTEN": f"127.0.0.1:{self.admin_port}",
                "EXTPROC_LOG_FORMAT": "json",
            }
        )
        env.update(self.extproc_env)
        return env

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> LocalStack:
        try:
            if self.engine_url is None:
                self.start_sim(timeout)
            if self.with_extproc and self.shared_extproc is None:
                self.start_extproc(timeout)
            self.start_envoy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_sim(self, timeout: float = 30.0) -> None:
        def launch() -> None:
            argv = simulator_argv("--host", "127.0.0.1", "--port", str(self.sim_port), "--model", SIM_MODEL,
                                  *self.sim_args)
            self.sim = Child("enginesim", argv, with_checkout(os.environ), self._log("enginesim"))
            self.sim.start()
            self._wait_http(self.sim, f"{self.engine_base}/health", timeout)

        self._launch_retrying(launch, ("sim_port",))

    def start_extproc(self, timeout: float = 30.0) -> None:
        def launch() -> None:
            self.extproc = Child("extproc", [console_script("extproc"), "serve", "--grace", "5"], self.service_env(),
                                 self._log("extproc"))
            self.extproc.start()
            self._wait_http(self.extproc, f"{self.admin_url}/readyz", timeout)

        self._launch_retrying(launch, ("grpc_port", "admin_port"))

    def write_envoy_config(self) -> Path:
        env = self.service_env()
        if not self.with_extproc:  # nothing gated: no ext_proc filter, no bound on the engine cluster
            env = {**env, "ADMISSION_OBSERVE_MODELS": ""}
        settings = load_settings(env)
        kwargs = {
            "listen_host": "127.0.0.1", "listen_port": self.envoy_port,
            "admin_host": "127.0.0.1", "admin_port": self.envoy_admin_port,
            "extproc_host": "127.0.0.1", "extproc_port": self.service.grpc_port,
            "ext_proc": self.with_extproc,  # False: Envoy straight to the engine (the benchmark's `none` mode)
            "memory_limit_bytes": None,  # no container limit here: no overload manager
            **self.envoy_args,
        }
        text = render_envoy_config(settings, **kwargs)
        path = self.workdir / "envoy.yaml"
        path.write_text(text)
        return path

    def start_envoy(self, timeout: float = 30.0) -> None:
        def launch() -> None:
            path = self.write_envoy_config()
            argv = [
                console_script("envoy"), "-c", str(path), "--concurrency", "1", "--disable-hot-restart",
                "--log-level", "warn", "--drain-time-s", "1",
            ]
            self.envoy = Child("envoy", argv, dict(os.environ), self._log("envoy"))
            self.envoy.start()
            self._wait_http(self.envoy, f"{self.envoy_admin_url}/ready", timeout)

        self._launch_retrying(launch, ("envoy_port", "envoy_admin_port"))

    def _launch_retrying(self, launch: Callable[[], None], ports: tuple[str, ...], attempts: int = 3) -> None:
        """Run `launch`; if the child lost a race for a port this stack picked, re-pick and retry."""
        for attempt in range(attempts):
            try:
                launch()
                return
            except ChildExited as exc:
                retry = attempt + 1 < attempts and "address already in use" in exc.output.lower()
                if not retry or not set(ports) <= self._picked:
                    raise
                for name in ports:
                    setattr(self, name, free_port())

    def stop(self) -> None:
        for child in (self.envoy, self.extproc, self.sim):
            if child is not None:
                child.stop()

    def drain(self) -> None:
        """Stop as an operator's Ctrl-C should: the service first, while Envoy still carries its
        answers (parked requests get `503 shutting_down`, admitted ones finish within its grace),
        then Envoy and the engine."""
        if self.extproc is not None:
            self.extproc.stop()
        self.stop()

    def logs(self) -> str:
        parts = []
        for child in (self.sim, self.extproc, self.envoy):
            if child is not None:
                parts.append(f"----- {child.name} -----\n{child.log_tail()}")
        return "\n".join(parts)

    def _wait_http(self, child: Child, url: str, timeout: float) -> None:
        def ready() -> bool:
            if not child.alive():
                code = child.process.returncode if child.process else "?"
                output = child.log_tail()
                child.stop()
                raise ChildExited(f"{child.name} exited with {code}:\n{output}", output)
            return http_get(url, timeout=1.0)[0] == 200

        try:
            wait_until(ready, timeout, f"{child.name} at {url}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{child.log_tail()}") from None


def engine_models(engine_url: str) -> tuple[list[str] | None, str]:
    """The served model names from a real engine's /v1/models, or None and why it gave none."""
    url = f"{engine_url.rstrip('/')}/v1/models"
    try:
        status, body = http_get(url, timeout=5.0)
    except (OSError, ValueError) as exc:  # refused, timed out, unresolvable, a malformed URL
        return None, str(getattr(exc, "reason", None) or exc)
    if status != 200:
        return None, f"HTTP {status} from {url}"
    try:
        return [m["id"] for m in json.loads(body)["data"]], ""
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{url} did not answer an OpenAI model list ({exc.__class__.__name__})"


def wait_for_engine(engine_url: str, timeout: float, say: Callable[[str], None],
                    every: float = 5.0, interval: float = 1.0) -> list[str]:
    """The engine's model list once its /v1/models answers; says why it does not every `every`
    seconds, and raises TimeoutError with the last reason after `timeout`. A gateway is never
    started in front of an engine it cannot reach: it would pass everything ungated."""
    deadline = time.monotonic() + timeout
    next_say = 0.0
    while True:
        models, reason = engine_models(engine_url)
        if models is not None:
            return models
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"engine unreachable at {engine_url} for {timeout:g} s ({reason}); "
                               "not starting a gateway that could not gate it")
        if now >= next_say:
            say(f"engine unreachable at {engine_url} ({reason}); waiting up to {deadline - now:.0f} s more "
                "(DEVSTACK_ENGINE_WAIT_SECONDS)")
            next_say = now + every
        time.sleep(min(interval, max(0.0, deadline - now)))


#: The ports `make run` uses, each with the variable that moves it.
PORT_VARIABLES = (
    ("envoy_port", "DEVSTACK_PORT", 8080, "Envoy (send requests here)"),
    ("envoy_admin_port", "DEVSTACK_ENVOY_ADMIN_PORT", 9901, "Envoy's admin"),
    ("grpc_port", "DEVSTACK_GRPC_PORT", 9002, "the admission service's gRPC"),
    ("admin_port", "DEVSTACK_STATUS_PORT", 9003, "the status page and metrics"),
    ("sim_port", "DEVSTACK_ENGINE_PORT", 8000, "the engine simulator"),
)


def busy_ports(ports: Mapping[str, int]) -> list[str]:
    """The ports (by name) something on this machine already listens on at 127.0.0.1."""
    busy = []
    for name, port in ports.items():
        with socket.socket() as probe:
            # As the servers bind: a port held only by connections in TIME_WAIT is free to them.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                busy.append(name)
    return busy


_ENGINE_NOTES = {"sim": " (the embedded simulator)", "vllm": " (vLLM's CPU build, a tiny local model)"}


class StartError(Exception):
    """A reason not to start, said in one line (no traceback)."""


def _env_port(variable: str, default: int) -> int:
    value = os.environ.get(variable, "")
    if not value:
        return default
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise StartError(f"{variable}={value!r}: must be a port number (1-65535)")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with contextlib.ExitStack() as cleanup:  # what was started before the stack (a real engine)
            return _main(argv, cleanup)
    except StartError as exc:
        print(f"devstack: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the stack was up (e.g. while vLLM starts): stopped, quietly
        print("devstack: interrupted while starting; everything started is stopped", file=sys.stderr, flush=True)
        return 130


def _main(argv: Sequence[str] | None, cleanup: contextlib.ExitStack) -> int:
    ports_help = "; ".join(f"{var} ({default}): {what}" for _, var, default, what in PORT_VARIABLES)
    parser = argparse.ArgumentParser(
        prog="python -m devstack",
        description="Run the engine simulator (or ENGINE_URL) + the admission service + Envoy in the foreground; "
                    "Ctrl-C stops them, the service first so that parked requests are answered.",
        epilog=f"Ports, each checked before anything starts: {ports_help}. "
               "With ENGINE_URL, the engine must answer /v1/models within DEVSTACK_ENGINE_WAIT_SECONDS (180).",
    )
    parser.add_argument("--port", type=int, default=None, help="Envoy listener port (default: $DEVSTACK_PORT or 8080)")
    parser.add_argument("--workdir", default="run", help="where configs are written (default: %(default)s)")
    args = parser.parse_args(argv)

    engine_url = os.environ.get("ENGINE_URL") or None
    engine_kind = os.environ.get("ENGINE", "sim") or "sim"
    if engine_kind not in ("sim", "vllm"):
        raise StartError(f"ENGINE={engine_kind!r}: must be sim (the embedded simulator) or vllm (vLLM's CPU build "
                         "serving a tiny local model); ENGINE_URL fronts an engine already running")
    if engine_kind == "vllm" and engine_url is not None:
        raise StartError("ENGINE=vllm starts an engine and ENGINE_URL names one already running: set one of them")
    ports = {name: _env_port(var, default) for name, var, default, _ in PORT_VARIABLES}
    if args.port is not None:
        ports["envoy_port"] = args.port
    if engine_url is not None:
        del ports["sim_port"]
    busy = busy_ports(ports)
    if busy:
        variables = {name: var for name, var, _, _ in PORT_VARIABLES}
        named = ", ".join(f"{ports[name]} ({variables[name]})" for name in busy)
        raise StartError(f"port(s) already in use on 127.0.0.1: {named}; stop what holds them or choose others, "
                         f"e.g. {variables[busy[0]]}={ports[busy[0]] + 100} make run")
    wait_s = os.environ.get("DEVSTACK_ENGINE_WAIT_SECONDS", "180")
    try:
        engine_wait = float(wait_s)
    except ValueError:
        raise StartError(f"DEVSTACK_ENGINE_WAIT_SECONDS={wait_s!r}: must be a number of seconds") from None

    extproc_env: dict[str, str] = {"EXTPROC_LOG_FORMAT": os.environ.get("EXTPROC_LOG_FORMAT", "text")}
    for key, value in os.environ.items():
        if key.startswith(("ADMISSION_", "EXTPROC_", "VLLM_", "MAX_BODY", "ENGINE_POLL", "ENGINE_STALE")):
            extproc_env[key] = value
    model = SIM_MODEL
    if engine_kind == "vllm":
        import realengine  # the tool beside this one; imports nothing of vLLM's

        reason = realengine.missing()
        if reason:
            raise StartError(reason)
        real = realengine.VllmEngine(Path(args.workdir) / "vllm", port=ports["sim_port"])
        print(f"devstack: starting vLLM (CPU build, tiny local model) at {real.url}: 40-100 s; "
              f"its log: {real.workdir / 'vllm.log'}", flush=True)
        try:
            real.start()
        except (ChildExited, TimeoutError, RuntimeError) as exc:
            raise StartError(f"vLLM did not start: {str(exc).splitlines()[0]} (its log: {real.workdir / 'vllm.log'})") \
                from None
        cleanup.callback(real.stop)
        engine_url = real.url
    if engine_url is None:
        extproc_env.setdefault("ADMISSION_OBSERVE_MODELS", SIM_MODEL)
    else:
        try:
            models = wait_for_engine(engine_url, engine_wait, lambda line: print(f"devstack: {line}", flush=True))
        except TimeoutError as exc:
            raise StartError(str(exc)) from None
        if "ADMISSION_OBSERVE_MODELS" not in extproc_env and "EXTPROC_CONFIG" not in extproc_env:
            if not models:
                raise StartError(f"the engine at {engine_url} lists no models on /v1/models; "
                                 "set ADMISSION_OBSERVE_MODELS to the names it serves")
            extproc_env["ADMISSION_OBSERVE_MODELS"] = ",".join(models)
            print(f"devstack: gating the engine's models: {', '.join(models)}", flush=True)
    model = extproc_env.get("ADMISSION_OBSERVE_MODELS", model).split(",")[0]

    redis: RedisServer | None = None
    stack = LocalStack(workdir=Path(args.workdir), engine_url=engine_url, extproc_env=extproc_env, log_to_files=False,
                       envoy_port=ports["envoy_port"], envoy_admin_port=ports["envoy_admin_port"],
                       grpc_port=ports["grpc_port"], admin_port=ports["admin_port"], sim_port=ports.get("sim_port", 0))
    try:  # a bad setting is named before anything starts (the service would refuse it the same way)
        load_settings(stack.service_env())
    except ConfigError as exc:
        raise StartError(f"configuration error: {exc}") from None
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        if extproc_env.get("ADMISSION_LEDGER", "").lower() == "redis" and not extproc_env.get("ADMISSION_REDIS_URL"):
            redis = RedisServer(Path(args.workdir) / "redis").start()
            extproc_env["ADMISSION_REDIS_URL"] = redis.url
            print(f"devstack: shared ledger on a local redis-server at {redis.url}", flush=True)
        stack.start()
        children = [c.name for c in (stack.sim, stack.extproc, stack.envoy) if c is not None]
        if engine_kind == "vllm":
            children.insert(0, "vllm")
        print(
            "\n"
            f"  Envoy (send requests here):  {stack.url}\n"
            f"  status page:                 {stack.admin_url}/\n"
            f"  admission metrics / state:   {stack.admin_url}/metrics   {stack.admin_url}/debug/engines\n"
            f"  engine:                      {stack.engine_base}"
            f"{'' if os.environ.get('ENGINE_URL') else _ENGINE_NOTES[engine_kind]}\n\n"
            "  Try:\n"
            f"    curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' \\\n"
            f"      -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
            f"\"max_tokens\": 8}}'\n\n"
            f"  Ctrl-C stops all {len(children)} ({', '.join(children)}).\n",
            flush=True,
        )
        while not stop:
            for child in (stack.sim, stack.extproc, stack.envoy):
                if child is not None and not child.alive():
                    code = child.process.returncode if child.process is not None else None
                    print(f"devstack: {child.name} exited with {code}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (ChildExited, TimeoutError) as exc:  # the child said why above (its output is this terminal)
        first = str(exc).splitlines()[0]
        raise StartError(f"{first.rstrip(':')}; its own message is above") from None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the orderly stop short
        print("devstack: stopping (the service first: parked requests are answered 503 shutting_down)", flush=True)
        stack.drain()
        if redis is not None:
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
