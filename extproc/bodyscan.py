"""Find what admission needs in an OpenAI request body without building the prompt as objects.

Clients order keys differently (openai-python 1.x sends `messages` before `model`; 3.x sends
`model` first), so the whole body is scanned once with ijson's C parser (yajl2_c) as a stream of
events. Only the top-level scalars the gate needs are kept; message contents are measured (their
UTF-8 size feeds the KV estimate) and dropped. The scan also validates that the body is exactly
one JSON object, so the gateway never admits a body the engine would reject as malformed.

Two top-level `model` keys are rejected: JSON parsers disagree on which one wins, and the gateway
must never route or count a request under a different model than the engine serves it as.
"""

from __future__ import annotations

from dataclasses import dataclass

import ijson

from .outcomes import Outcome


class BodyError(Exception):
    """The body cannot be admitted; `outcome` says why (it maps to a 4xx)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass(frozen=True)
class BodyFacts:
    model: str
    stream: bool
    prompt_bytes: int  # UTF-8 bytes of message contents (chat) or prompt text (completions)
    max_tokens: int | None  # max_completion_tokens, else max_tokens, when given as an integer


_TEXT_KEYS = ("content", "text")


def scan_body(body: bytes) -> BodyFacts:
    """Validate `body` as one JSON object and extract the facts admission needs."""
    model: object = None
    model_seen = 0
    stream = False
    prompt_bytes = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    depth = 0
    key: str | None = None  # the top-level key whose value is being read
    inner_key: str | None = None  # the latest key seen below the top level
    try:
        events = ijson.basic_parse(body, use_float=True)
        first = next(events, None)
        if first is None or first[0] != "start_map":
            raise BodyError(Outcome.INVALID_BODY, "request body must be a JSON object")
        depth = 1
        for event, value in events:
            if event in ("start_map", "start_array"):
                depth += 1
                continue
            if event in ("end_map", "end_array"):
                depth -= 1
                if depth == 1:
                    key = None
                continue
            if depth == 1:
                if event == "map_key":
                    key = value
                    if value == "model":
                        model_seen += 1
                    continue
                # A scalar top-level value.
                if key == "model":
                    model = value
                elif key == "stream":
                    stream = value is True
                elif key == "max_tokens" and isinstance(value, int) and not isinstance(value, bool):
                    max_tokens = value
                elif key == "max_completion_tokens" and isinstance(value, int) and not isinstance(value, bool):
                    max_completion_tokens = value
                elif key == "prompt" and event == "string":
                    prompt_bytes += _utf8_len(value)
                key = None
            elif event == "map_key":
                inner_key = value
            elif event == "string" and (key == "prompt" or (key == "messages" and inner_key in _TEXT_KEYS)):
                # Count message text (`content`, or `text` parts), not roles or names.
                prompt_bytes += _utf8_len(value)
    except BodyError:
        raise
    except (ijson.JSONError, ijson.IncompleteJSONError, UnicodeDecodeError, ValueError) as exc:
        raise BodyError(Outcome.INVALID_BODY, f"request body is not valid JSON: {_first_line(exc)}") from None
    if model_seen > 1:
        raise BodyError(Outcome.DUPLICATE_MODEL, "request body has more than one top-level `model` key")
    if model_seen == 0:
        raise BodyError(Outcome.MISSING_MODEL, "request body has no `model`: name the model to use")
    if not isinstance(model, str) or not model:
        raise BodyError(Outcome.MISSING_MODEL, "`model` must be a non-empty string")
    return BodyFacts(
        model=model,
        stream=stream,
        prompt_bytes=prompt_bytes,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
    )


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _first_line(exc: Exception) -> str:
    text = exc.args[0] if exc.args else str(exc)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__
