"""A long, coverage-guided fuzz run of the body scan against Python's json + pydantic (lax mode).

    python -m bench.fuzz_body --minutes 10

The property is the one `tests/unit/test_bodyscan_fuzz.py` checks in `make test` (the oracle
lives here and the tests import it): `scan_body` accepts exactly when `json.loads` gives a dict
whose `model`, `stream`, `max_tokens` and `max_completion_tokens` the engine would accept (and
the gateway's policy allows), and then finds the same values; the only bodies it may reject
although the engine would not are the documented strictnesses (`gateway_may_be_stricter`).

With `atheris` installed (`pip install atheris`, not a test dependency) the run is libFuzzer's
coverage-guided mutation of the Python scan, seeded with a small corpus of request bodies; a
counterexample stops the run and is written as `crash-*` in a temporary directory it names. Without it,
the run is a long Hypothesis search (generated objects and byte mutations) for the same time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pydantic

from extproc.bodyscan import MAX_DEPTH, BodyError, scan_body
from extproc.outcomes import Outcome


class EngineFields(pydantic.BaseModel):
    """The fields the gateway reads, typed as vLLM's ChatCompletionRequest declares them."""

    model_config = pydantic.ConfigDict(extra="allow")
    model: str | None = None
    stream: bool | None = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Read by the gateway since issue 11 (KV for n sequences). `best_of` as vLLM <= 0.18 declared
    # it; 0.19+ ignore it, where the gateway refusing a malformed one is merely stricter.
    n: int | None = 1
    best_of: int | None = None


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _walk(value: Any):  # noqa: ANN202
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def _walk_keys(text: str) -> list[str]:
    keys: list[str] = []
    json.loads(text, object_pairs_hook=lambda p: keys.extend(k for k, _ in p))
    return keys


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def gateway_may_be_stricter(body: bytes, doc: dict[str, Any]) -> bool:
    """The documented cases where the gateway answers 400 and the engine might not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return True
    if text.startswith("\ufeff"):
        return True
    try:
        # every value, the ones a later duplicate key overwrites included
        everything = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=lambda p: [v for _, v in p])
    except (ValueError, RecursionError):
        return True  # NaN / Infinity
    for value in _walk(everything):
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return True
        if isinstance(value, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            return True  # lone surrogates
    for key in _walk_keys(text):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in key):
            return True
    if _depth(doc) > MAX_DEPTH:
        return True
    for key in ("max_tokens", "max_completion_tokens"):
        value = doc.get(key)
        if isinstance(value, str) and (len(value) > 64 or "_" in value
                                       or any(c.isspace() and c not in " \t\n\r" for c in value)):
            return True
    stream = doc.get("stream")
    return isinstance(stream, str) and not stream.isascii()


def engine_reading(body: bytes) -> tuple[str, Any]:
    """('reject', None), ('policy', Outcome) or ('accept', (model, stream, max_tokens, mct))."""
    try:
        pairs = json.loads(body, object_pairs_hook=lambda p: ("__pairs__", p))
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return "reject", None
    if not isinstance(doc, dict):
        return "reject", None
    try:
        fields = EngineFields.model_validate(doc)
    except pydantic.ValidationError:
        return "reject", doc
    model_keys = sum(1 for k, _ in pairs[1] if k == "model")
    if model_keys > 1:
        return "policy", (Outcome.DUPLICATE_MODEL, doc)
    if not isinstance(doc.get("model"), str) or not doc["model"]:
        return "policy", (Outcome.MISSING_MODEL, doc)
    return "accept", (doc, (fields.model, fields.stream is True, fields.max_tokens, fields.max_completion_tokens))


def check(body: bytes) -> None:
    verdict, detail = engine_reading(body)
    try:
        facts = scan_body(body)
    except BodyError as exc:
        if verdict == "accept":
            doc, _ = detail
            assert gateway_may_be_stricter(body, doc), (body, exc.outcome, exc.message)
        elif verdict == "policy":
            outcome, doc = detail
            assert exc.outcome is outcome or gateway_may_be_stricter(body, doc), (body, exc.outcome, outcome)
        return
    assert verdict == "accept", (body, verdict, facts)
    _, expected = detail
    assert (facts.model, facts.stream, facts.max_tokens, facts.max_completion_tokens) == expected, body
    positive = [v for v in expected[2:] if v is not None and v > 0]
    assert facts.generation_limit == (max(positive) if positive else None)



SEEDS = [
    b'{"model":"m","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}',
    b'{"messages":[{"role":"user","content":[{"type":"text","text":"h\\u00e9"}]}],"stream":"true","model":"m"}',
    b'{"model":"m","prompt":["ab","cd"],"max_completion_tokens":"100000","max_tokens":100000.0}',
    b'{"model":"m","max_tokens":5,"max_tokens":"  7.00 ","stream":1.0,"x":[[{"y":null}]]}',
    b'{"model":"m\\ud83d\\ude00","stream":false,"max_tokens":true,"n":-0.0e+2}',
]


def _run_atheris(seconds: int) -> int:
    import atheris

    atheris.instrument_all()  # coverage feedback from the scan, json and the oracle (already imported)

    corpus = Path(tempfile.mkdtemp(prefix="fuzz_body_corpus_"))
    artifacts = Path(tempfile.mkdtemp(prefix="fuzz_body_crashes_"))
    for i, seed in enumerate(SEEDS):
        (corpus / f"seed{i}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        check(data)

    print(f"atheris: {seconds} s, corpus {corpus}, counterexamples go to {artifacts}", flush=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-max_len=4096", "-print_final_stats=1",
                   f"-artifact_prefix={artifacts}/", str(corpus)], one_input)
    atheris.Fuzz()  # exits the process when done (0) or on a counterexample (non-zero)
    return 0


def _run_hypothesis(seconds: int) -> int:
    from hypothesis import HealthCheck, given, settings

    from tests.unit.test_bodyscan_fuzz import bodies, mutated_bodies

    deadline = time.monotonic() + seconds
    rounds = examples = 0
    while time.monotonic() < deadline:
        for strategy in (bodies(), mutated_bodies()):
            @settings(max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(strategy)
            def run(body: bytes) -> None:
                check(body)

            run()
            examples += 2000
        rounds += 1
        print(f"hypothesis: {examples} bodies checked, {deadline - time.monotonic():.0f} s left", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz_body", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default: %(default)s)")
    parser.add_argument("--engine", choices=["auto", "atheris", "hypothesis"], default="auto",
                        help="atheris if installed (auto), or force one")
    args = parser.parse_args(argv)
    seconds = max(1, int(args.minutes * 60))
    use_atheris = args.engine == "atheris"
    if args.engine == "auto":
        try:
            import atheris  # noqa: F401
            use_atheris = True
        except ImportError:
            print("atheris is not installed: a long Hypothesis run instead (pip install atheris for coverage guidance)")
    return _run_atheris(seconds) if use_atheris else _run_hypothesis(seconds)


if __name__ == "__main__":
    sys.exit(main())
