"""Find what admission needs in an OpenAI request body without building the prompt as objects.

Clients order keys differently (openai-python 1.x sends `messages` before `model`; 3.x sends
`model` first), so the whole body is scanned once with ijson's C parser (yajl2_c) as a stream of
events. Only the top-level scalars the gate needs are kept; message contents are measured (their
UTF-8 size feeds the KV estimate) and dropped. The scan also validates that the body is exactly
one JSON object, so the gateway never admits a body the engine would reject as malformed.

The engine (vLLM) reads a body with Python's `json.loads` and then validates it with pydantic in
lax mode; the scan reads the fields it keeps THE SAME WAY, so gateway and engine never disagree on
the model, on streaming, or on how many tokens the request may generate:

- `max_tokens` / `max_completion_tokens`: an integer; a float with no fractional part
  (`100000.0` is 100000) inside the 64-bit range; `true`/`false` (1/0, as pydantic coerces them); a decimal integer
  string, optionally signed, with ASCII whitespace around it and an all-zero fraction
  (`"100000"`, `" 100000.0 "`); `null` (not given). Anything else (`100000.5`, `"abc"`, `[]`, a
  string longer than 64 characters) is rejected by the engine's validation, so the gateway answers
  `400 invalid_body` itself. Exotic strings pydantic would also coerce (`"1_000"`, Unicode
  whitespace) get 400 here too: the gateway never guesses a budget.
- `stream`: `true`/`false`, `null` (false), 0/1, 0.0/1.0, or one of pydantic's boolean strings
  (`"true"`, `"yes"`, `"on"`, `"1"`, `"t"`, `"y"` and their negatives, any ASCII case); anything
  else is `400 invalid_body`.
- A duplicate key takes its LAST value, as `json.loads` does (an invalid earlier value does not
  matter). Exception: two top-level `model` keys are rejected (`duplicate_model`): other JSON
  parsers keep the first, and the gateway must never route or count a request under a different
  model than the engine serves it as.
- The generation allowance (`generation_limit`) is the larger of the two fields that are
  positive: vLLM's chat handler uses `max_completion_tokens or max_tokens` and its completions
  handler `max_tokens`, so the larger is never below what either honours (0 means "not given"
  there, the engine then generates up to the context length, and the configured default applies).

Besides the prompt text, the scan measures what else the engine's prompt and KV depend on
(`extproc/estimate.py`): the number of chat messages (each gets the template's framing), the
`tools` array's JSON as the template renders it (keys and values, quotes and separators, from the
events), tool calls' names and arguments, a completion prompt's token ids, and `n` / `best_of`
(read like the token limits: an invalid one is `400 invalid_body`, as the engine answers).
A message's content given as a list of text parts is rendered as the parts joined with `"\n"`
(vLLM's `_parse_chat_message_content_parts`, "string" content format, which the simulator
follows): each separator is a rendered byte and a token of its own, so 1,900 one-character
parts are 3,799 bytes and ~3,800 tokens, not 1,900 bytes. Of the rendered text, `dense_bytes`
are those that tokenize near one token a byte whatever the vocabulary (separators, strings
shorter than `SHORT_STRING_BYTES`, each digit with a byte either side: Qwen splits every digit,
and whitespace or punctuation next to a digit is its own token in the Qwen, Llama-3 and
o200k/cl100k pre-tokenizers): the estimate counts them a token each (byte-level BPE never
makes more tokens than bytes). Counting digits is one C pass over each string's UTF-8
(`bytes.translate`), ~1-2 ms per MiB of text.

The grammar is Python's, not yajl's, wherever they differ and it matters: vertical tab and form
feed are not JSON whitespace (`json.loads` rejects them, yajl accepts them), nesting deeper than
`MAX_DEPTH` is rejected (Python's parser gives up near 1,000 levels, the exact point depending on
its stack; yajl has no limit), and a `model` whose `\\uD800`-style escape is a lone surrogate is
rejected (yajl reads it as `?` or pairs it with any next escape, Python keeps the lone surrogate,
so the name would read differently: found by `python -m bench.fuzz_body`;
elsewhere it changes no kept fact: the same string is invalid for `stream` and the token limits
either way, and a prompt's size moves by two bytes; a lone LOW surrogate is rejected anywhere, as
yajl cannot decode it). Anything after the object but whitespace is rejected, an unterminated
string included (yajl alone would ignore that one).
The gateway is deliberately STRICTER than `json.loads` on what is not RFC 8259 JSON or cannot be
represented exactly by the C parser, and answers 400 where the engine might accept: `NaN` /
`Infinity`, integers beyond 64 bits, numbers beyond a double's range, a byte-order mark or a
UTF-16/32 body, invalid UTF-8. Never the other way round: whatever the gateway accepts, the
engine reads identically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ijson

from .outcomes import Outcome

MAX_DEPTH = 512  # nesting of objects and arrays; Python's json stops near 1,000


class BodyError(Exception):
    """The body cannot be admitted; `outcome` says why (it maps to a 4xx)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass(frozen=True, slots=True)  # one per request that reaches the gate, kept while it is parked or open
class BodyFacts:
    model: str
    stream: bool
    prompt_bytes: int  # UTF-8 bytes of message contents (chat) or prompt text (completions)
    max_tokens: int | None  # top-level `max_tokens` as the engine reads it (None: not given)
    max_completion_tokens: int | None = None  # likewise
    # What else the engine's prompt and KV depend on (issue 11; see extproc/estimate.py):
    messages: int = 0  # chat messages (each adds the chat template's per-message framing)
    tools_bytes: int = 0  # the `tools` array as the chat template renders it (its JSON, approximated)
    prompt_token_ids: int = 0  # a completion prompt given as token ids: exact tokens, not text
    # Of `prompt_bytes`, those estimated at one token each, not at a bytes-per-token rate: text that
    # tokenizes near one token a byte (the separators between content parts, strings shorter than
    # SHORT_STRING_BYTES, digits and a byte either side of each). See extproc/estimate.py.
    dense_bytes: int = 0
    n: int | None = None  # sequences to generate (`n`), as the engine reads it
    best_of: int | None = None  # `best_of`, where the engine still honours it
    prompts: int = 1  # a completion's `prompt` as a batch (a list of strings or of token-id lists): its length

    @property
    def sequences(self) -> int:
        """Sequences the engine allocates KV for: vLLM runs n > 1 as n requests sharing one prompt."""
        return max(1, self.n or 1, self.best_of or 1)

    @property
    def engine_requests(self) -> int:
        """Requests the engine runs for this one: vLLM runs each prompt of a batch, and each of its
        `sequences`, as an engine request of its own (each takes a slot of max-num-seqs)."""
        return self.sequences * self.prompts

    @property
    def generation_limit(self) -> int | None:
        """The most tokens the engine may generate for this request, as far as the body says."""
        given = [v for v in (self.max_completion_tokens, self.max_tokens) if v is not None and v > 0]
        return max(given) if given else None


# Message fields a chat template renders: text, text parts, tool calls' names and arguments.
_TEXT_KEYS = frozenset(("content", "text", "arguments", "name", "reasoning_content"))
_TOKEN_KEYS = ("max_tokens", "max_completion_tokens")
_SEQ_KEYS = ("n", "best_of")
_KEPT_KEYS = ("model", "stream", *_TOKEN_KEYS, *_SEQ_KEYS)
_TWO_63 = 2.0**63
_TRAILER = b' "'
_INVALID = object()  # a kept key whose (last) value the engine's validation rejects
_INT_STRING = re.compile(r"[ \t\n\r]*([+-]?[0-9]+)(?:\.0+)?[ \t\n\r]*", re.ASCII)
_TRUE_STRINGS = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_STRINGS = frozenset(("0", "off", "f", "false", "n", "no"))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
SHORT_STRING_BYTES = 4  # shorter rendered strings count a token a byte (at least one token, which a rate rounds away)
DIGIT_NEIGHBOURS = 3  # bytes counted at one token each per digit: the digit and one on either side
_DIGITS = b"0123456789"


def scan_body(body: bytes) -> BodyFacts:
    """Validate `body` as one JSON object and extract the facts admission needs."""
    if b"\x0b" in body or b"\x0c" in body:
        raise BodyError(Outcome.INVALID_BODY,
                        "request body is not valid JSON: vertical tab or form feed outside a string escape")
    model: object = None
    model_seen = 0
    kept: dict[str, object] = {}
    prompt_bytes = 0
    messages = tools_bytes = token_ids = dense_bytes = 0
    parts = -1  # text parts in the message content list being read (-1: not in one)
    batch_items = 0  # strings and token-id lists directly inside a `prompt` list
    batch_ids = False  # a `prompt` list holding token ids directly (one prompt of ids)
    depth = 0
    key: str | None = None  # the top-level key whose value is being read
    inner_key: str | None = None  # the latest key seen below the top level
    try:
        # yajl ignores an unterminated string after the document (`{"model":"m"}"x`): the
        # appended ` "` completes such a string, which yajl then reports as trailing garbage, and
        # is an unterminated (so ignored) string after a body that really ends with the object.
        # (A reader, not `body + _TRAILER`: that copy of a 1 MB body measured +0.5 ms, +15%.)
        # The whole body is yajl's one buffer (`buf_size`): a string spanning ijson's default
        # 64 KiB reads is re-buffered at each, and a 1 MiB prompt took 17 ms instead of 2.5 (issue 14).
        events = ijson.basic_parse(_Reader(body), use_float=True, buf_size=len(body) + len(_TRAILER))
        first = next(events, None)
        if first is None or first[0] != "start_map":
            raise BodyError(Outcome.INVALID_BODY, "request body must be a JSON object")
        depth = 1
        for event, value in events:
            if event in ("start_map", "start_array"):
                if key == "tools":
                    tools_bytes += 2  # the brackets; a tool's own JSON is summed below
                elif depth == 2 and key == "messages" and event == "start_map":
                    messages += 1
                elif depth == 3 and key == "messages" and event == "start_array" and inner_key == "content":
                    parts = 0  # a message's content as a list of parts
                elif depth == 2 and key == "prompt":
                    batch_items += 1  # a list of token ids inside the prompt list: one prompt
                if depth == 1 and key in _KEPT_KEYS:
                    if key == "model":
                        model = None
                    else:
                        kept[key] = _INVALID
                depth += 1
                if depth > MAX_DEPTH:
                    raise BodyError(Outcome.INVALID_BODY, f"request body is nested deeper than {MAX_DEPTH} levels")
                continue
            if event in ("end_map", "end_array"):
                depth -= 1
                if depth == 1:
                    key = None
                elif depth == 3 and parts >= 0:
                    # vLLM joins a message's text parts with "\n" before the template sees them
                    # (its "string" content format): each separator is a token of its own.
                    separators = max(0, parts - 1)
                    prompt_bytes += separators
                    dense_bytes += separators
                    parts = -1
                continue
            if depth == 2 and key == "prompt":  # a batch: each string is a prompt; ids directly are one
                if event == "string":
                    batch_items += 1
                elif event == "number":
                    batch_ids = True
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
                    kept[key] = _as_bool(value)
                elif key in _TOKEN_KEYS or key in _SEQ_KEYS:
                    kept[key] = _as_int(value)
                elif key == "prompt" and event == "string":
                    size, dense = _measure(value)
                    prompt_bytes += size
                    dense_bytes += dense
                key = None
            elif key == "tools":
                # The template renders each tool as its JSON (`json.dumps`: `"key": value, `).
                if event in ("map_key", "string"):
                    tools_bytes += _utf8_len(value) + 4
                else:
                    tools_bytes += len(str(value)) + 2
            elif event == "map_key":
                inner_key = value
            elif event == "string" and (key == "prompt" or (key == "messages" and (
                    inner_key in _TEXT_KEYS or (depth == 4 and parts >= 0)))):
                # Count what the template renders of a message: its text (`content`, `text`
                # parts, a part given as a bare string), tool calls' names and arguments; roles
                # are the per-message framing.
                size, dense = _measure(value)
                prompt_bytes += size
                dense_bytes += dense
                if parts >= 0 and (depth == 4 or (depth == 5 and inner_key == "text")):
                    parts += 1
            elif event == "number" and key == "prompt" and type(value) is int:
                token_ids += 1  # a prompt of token ids (or a batch of them): one token each
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
    if ("?" in model or not model.isascii()) and b"\\u" in body and _has_lone_surrogate(body):
        # yajl reads a lone surrogate escape as `?`, or pairs a high one with whatever escape
        # follows; Python keeps the lone surrogate: the names would differ.
        raise BodyError(Outcome.INVALID_BODY, "request body is not valid JSON: a \\u escape of a lone UTF-16 surrogate")
    for name, value in kept.items():
        if value is _INVALID:
            kind = "true or false" if name == "stream" else "an integer"
            raise BodyError(Outcome.INVALID_BODY, f"`{name}` must be {kind}")
    stream = kept.get("stream")
    return BodyFacts(
        model=model,
        stream=stream is True,
        prompt_bytes=prompt_bytes,
        max_tokens=_kept_int(kept, "max_tokens"),
        max_completion_tokens=_kept_int(kept, "max_completion_tokens"),
        messages=messages,
        tools_bytes=tools_bytes,
        prompt_token_ids=token_ids,
        dense_bytes=dense_bytes,
        n=_kept_int(kept, "n"),
        best_of=_kept_int(kept, "best_of"),
        prompts=max(1, batch_items + batch_ids),
    )


class _Reader:
    """`body` then `_TRAILER`, read in the chunks ijson asks for, without copying `body` (a read of
    the whole of it returns `body` itself)."""

    __slots__ = ("_body", "_pos", "_tail")

    def __init__(self, body: bytes) -> None:
        self._body, self._pos, self._tail = body, 0, _TRAILER

    def read(self, size: int) -> bytes:
        pos = self._pos
        if pos < len(self._body):
            self._pos = pos + size
            return self._body[pos:pos + size]
        tail, self._tail = self._tail, b""
        return tail


def _kept_int(kept: dict[str, object], name: str) -> int | None:
    """A kept integer once the _INVALID ones are refused: its int, or None when absent or null."""
    value = kept.get(name)
    return value if isinstance(value, int) else None


def _as_int(value: object) -> object:
    """A scalar as pydantic's lax `Optional[int]` reads it: an int, None, or _INVALID."""
    if value is None or type(value) is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        # pydantic takes an integral float only inside the 64-bit range (both ends excluded).
        return int(value) if value.is_integer() and -_TWO_63 < value < _TWO_63 else _INVALID
    if isinstance(value, str) and len(value) <= 64:
        match = _INT_STRING.fullmatch(value)
        if match:
            return int(match.group(1))
    return _INVALID


def _as_bool(value: object) -> object:
    """A scalar as pydantic's lax `Optional[bool]` reads it: True, False (also for null), or _INVALID."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value) if value in (0, 1) else _INVALID
    if isinstance(value, str) and value.isascii():
        lowered = value.lower()
        if lowered in _TRUE_STRINGS:
            return True
        if lowered in _FALSE_STRINGS:
            return False
    return _INVALID


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether a string in `body` has a `\\uD800`-`\\uDFFF` escape that is not half of a pair."""
    pending_high = -1  # end offset of a high-surrogate escape still waiting for its low half
    for match in _SURROGATE_ESCAPE.finditer(body):
        start = match.start()
        backslashes = 0
        while start - backslashes - 1 >= 0 and body[start - backslashes - 1] == 0x5C:
            backslashes += 1
        if backslashes % 2:  # `\\uD800`: an escaped backslash followed by text, not an escape
            continue
        is_high = match.group()[3] in b"89abAB"
        if pending_high >= 0:
            if is_high or start != pending_high:
                return True
            pending_high = -1
        elif is_high:
            pending_high = match.end()
        else:
            return True
    return pending_high >= 0


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _measure(text: str) -> tuple[int, int]:
    """A rendered string's UTF-8 bytes, and how many of them count a token each (`dense_bytes`)."""
    data = text.encode("utf-8", "surrogatepass")
    size = len(data)
    if size < SHORT_STRING_BYTES:
        return size, size
    digits = size - len(data.translate(None, _DIGITS))  # one C pass; digits are ASCII in UTF-8
    return size, min(size, DIGIT_NEIGHBOURS * digits)


def _first_line(exc: Exception) -> str:
    text = exc.args[0] if exc.args else str(exc)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__
