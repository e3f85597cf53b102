"""Property tests: the body scan against Python's `json` + pydantic lax mode, as vLLM reads a body.

For generated JSON objects and for byte mutations of them: `scan_body` accepts exactly when
`json.loads` gives a dict whose fields the gateway reads (`model`, `stream`, `max_tokens`,
`max_completion_tokens`) pass the engine's validation (pydantic, lax, as vLLM declares them) and
the gateway's own policy (a non-empty `model` string, one `model` key); when it accepts, it finds
the same model, the same streaming flag and the same token limits the engine will use.

The only bodies the scan may reject although the engine would accept them are the documented
deliberate strictnesses (`extproc/bodyscan.py`): not strictly UTF-8, NaN/Infinity, numbers beyond
64-bit integers or a double's range, nesting deeper than MAX_DEPTH, a lone surrogate in `model`,
and numeric/boolean strings outside the canonical forms. `gateway_may_be_stricter` names them;
nothing else may differ. The oracle lives in `bench/fuzz_body.py`, whose command is the longer,
coverage-guided run: `python -m bench.fuzz_body --minutes 10`.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from bench.fuzz_body import check, engine_reading

# --- generators --------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=8)
int_strings = st.from_regex(r"\A[ \t\n\r]{0,2}[+-]?[0-9]{1,7}(\.0{0,2}|\.[0-9])?[ \t\n\r]{0,2}\Z")
bool_strings = st.sampled_from(["true", "false", "True", "FALSE", "yes", "no", "on", "off", "1", "0",
                                "t", "f", "y", "n", " true", "maybe", "", "ｙes"])
def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` three times in four: enough bodies are accepted for the facts to be compared."""
    return st.integers(0, 3).flatmap(lambda i: odd if i == 0 else valid)


models = mostly(st.sampled_from(["m", "sim-model", "m\U0001f600", "mod\"el", "m?"]),
                st.sampled_from(["", "?", "m\ud800"]) | st.text(max_size=6) | json_values)
streams = mostly(st.booleans() | st.none() | bool_strings | st.sampled_from([0, 1, 0.0, 1.0, -0.0]),
                 st.sampled_from([2, 0.5, -1]) | json_values)
token_values = mostly(st.integers(-5, 10**6) | st.sampled_from([100000.0, 1e5, 2.0**62, True, False, None])
                      | int_strings,
                      st.sampled_from([100000.5, 1e300, 2.0**63, "1_000", "0x10", "1e5", "abc", "\u000b5", "5\u00a0"])
                      | json_values)
KEPT = {"model": models, "stream": streams, "max_tokens": token_values, "max_completion_tokens": token_values}
keys = st.sampled_from(["model", "stream", "max_tokens", "max_completion_tokens", "messages", "prompt", "x"])
separators = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    pairs: list[tuple[str, Any]] = []
    pairs.append(("model", draw(models)))
    for name, values in (("stream", streams), ("max_tokens", token_values), ("max_completion_tokens", token_values)):
        if draw(st.booleans()):
            pairs.append((name, draw(values)))
    if draw(st.booleans()):
        pairs.append(("messages", [{"role": "user", "content": draw(st.text(max_size=20))}]))
    for _ in range(draw(st.integers(0, 2))):  # extra and duplicate keys
        key = draw(keys | st.text(max_size=4))
        pairs.append((key, draw(KEPT.get(key, json_values))))
    pairs = draw(st.permutations(pairs))
    if draw(st.integers(0, 9)) == 0:
        pairs = [p for p in pairs if p[0] != "model"]
    ascii_only = draw(st.booleans())
    sep = draw(separators)
    text = "{" + sep + ("," + sep).join(
        json.dumps(k, ensure_ascii=ascii_only) + sep + ":" + sep + json.dumps(v, ensure_ascii=ascii_only)
        for k, v in pairs) + sep + "}"
    return text.encode("utf-8", "surrogatepass")


INTERESTING = b'\x00\x0b\x0c\t\n\r "\\{}[],:-+.0159eENtfnu\x7f\x80\xc3\xed\xef\xbb\xbf'


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    body = bytearray(draw(bodies()))
    for _ in range(draw(st.integers(1, 3))):
        if not body:
            break
        at = draw(st.integers(0, len(body) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        byte = draw(st.sampled_from(list(INTERESTING)) | st.integers(0, 255))
        if op == "replace":
            body[at] = byte
        elif op == "insert":
            body.insert(at, byte)
        elif op == "delete":
            del body[at]
        else:
            del body[at:]
    return bytes(body)


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(bodies())
def test_generated_objects_are_read_as_json_loads_and_pydantic_read_them(body: bytes) -> None:
    check(body)


@FUZZ
@given(mutated_bodies())
def test_mutated_bodies_are_never_admitted_differently_than_the_engine_reads_them(body: bytes) -> None:
    check(body)


def test_the_oracle_sees_the_defect_10_cases() -> None:
    """The property would have caught each body of defect 10 on the old scan."""
    assert engine_reading(b'{"model":"m","max_tokens":"100000"}')[1][1][2] == 100000
    assert engine_reading(b'{"model":"m","max_tokens":100000.0}')[1][1][2] == 100000
    assert engine_reading(b'{"model":"m","max_tokens":5,"max_tokens":100000}')[1][1][2] == 100000
    assert engine_reading(b'{"model":\x0b"m"}')[0] == "reject"
    assert engine_reading(b'{"model":"m","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")[0] == "reject"
