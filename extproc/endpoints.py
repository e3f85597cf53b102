"""Which requests are gated, and the body facts each gated endpoint needs for its estimate.

Paths. Envoy normalizes the path before the service sees it (`normalize_path`: dot segments,
percent-encoded unreserved characters, backslashes; `merge_slashes`), but it keeps `%2F`,
`%5C`, `%25`, `;params`, a trailing slash and letter case as sent, and an engine's router may
still route those to a generation endpoint: vLLM's uvicorn percent-decodes the whole path,
`%2F` included, before FastAPI matches it, and FastAPI redirects a trailing slash to the
route without it. So a request is gated when its path is exactly a gated path, and a path that
is not exactly one but reads as one once decoded (repeatedly), stripped of `;params`, dot
segments, duplicate and trailing slashes, and lower-cased, is rejected with 400
`ambiguous_path`, whatever the method: the gateway never forwards a spelling of a gated path it
did not gate.

Bodies. Every JSON endpoint goes through `bodyscan.scan_body` (one JSON object, one `model`,
`stream`, `max_tokens`/`max_completion_tokens`, chat and completion prompt text). Endpoints
whose prompt lives under other keys (`input`, `instructions`, `query`, `documents`, ...) get a
second streaming pass that measures the strings under those keys (and counts token-id arrays
as one token per id); pooling endpoints generate nothing, so their generation allowance is 0;
`/v1/responses` limits generation with `max_output_tokens`.

Audio (`/v1/audio/transcriptions`, `/v1/audio/translations`) is `multipart/form-data`: the
`model` field is read from the part of the body the service receives (at most
`MAX_BODY_BYTES`; Envoy forwards the rest of a larger upload unbuffered once the request is
admitted). A `model` field that comes after the file and beyond that prefix cannot be read:
the request is rejected (400 `missing_model`) with a message saying to send `model` before the
file (the official clients do). Its cost is the generation allowance; audio bytes are not
prompt tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from urllib.parse import unquote

import ijson

from .bodyscan import BodyError, BodyFacts, scan_body
from .outcomes import Outcome

_ALL = ("*",)  # count every string except the model name (paths an operator adds)


@dataclass(frozen=True)
class Endpoint:
    path: str
    text_keys: tuple[str, ...] | None = None  # top-level keys holding prompt text; None: bodyscan's count
    output_key: str | None = None  # top-level key limiting generation; None: bodyscan's max_tokens
    generates: bool = True  # False: a pooling endpoint, no generated tokens
    multipart: bool = False


_POOLING_TEXT = ("input", "messages", "prompt", "text")
_SCORE_TEXT = ("text_1", "text_2", "data_1", "data_2", "queries", "query", "documents", "items")

#: Every generation and pooling endpoint vLLM's OpenAI-compatible server serves (plus `/generate`
#: of its demo server), with where each keeps its prompt.
KNOWN_ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        Endpoint("/v1/chat/completions"),
        Endpoint("/v1/completions"),
        Endpoint("/generate"),
        Endpoint("/inference/v1/generate", text_keys=("token_ids", "prompt"), output_key="sampling_params.max_tokens"),
        Endpoint("/v1/responses", text_keys=("input", "instructions"), output_key="max_output_tokens"),
        Endpoint("/v1/messages", text_keys=("messages", "system")),
        Endpoint("/invocations", text_keys=("messages", "prompt", "input")),
        Endpoint("/v1/embeddings", text_keys=_POOLING_TEXT, generates=False),
        Endpoint("/pooling", text_keys=_POOLING_TEXT, generates=False),
        Endpoint("/classify", text_keys=_POOLING_TEXT, generates=False),
        Endpoint("/score", text_keys=_SCORE_TEXT, generates=False),
        Endpoint("/v1/score", text_keys=_SCORE_TEXT, generates=False),
        Endpoint("/rerank", text_keys=_SCORE_TEXT, generates=False),
        Endpoint("/v1/rerank", text_keys=_SCORE_TEXT, generates=False),
        Endpoint("/v2/rerank", text_keys=_SCORE_TEXT, generates=False),
        Endpoint("/v1/audio/transcriptions", multipart=True),
        Endpoint("/v1/audio/translations", multipart=True),
        # vLLM 0.33's other engine routes: their prompts' keys are not all known here, so every
        # string in the body but the model name counts as prompt text (an over-estimate, not a bypass).
        Endpoint("/v1/chat/completions/batch", text_keys=_ALL),
        Endpoint("/cohere/v2/chat"),
        Endpoint("/v1/decisions", text_keys=_ALL),
        Endpoint("/v1/systemone", text_keys=_ALL),
        Endpoint("/generative_scoring", text_keys=_ALL),
        Endpoint("/v2/embed", text_keys=("texts", "inputs", "input", "images"), generates=False),
    )
}

DEFAULT_GATED_PATHS: tuple[str, ...] = tuple(KNOWN_ENDPOINTS)

#: What passes ungated by default, whatever the method: vLLM's cheap routes (no engine step). A
#: `*` stands for one path segment. Any other POST is gated (unknown engine routes included);
#: vLLM's admin POSTs (`/sleep`, `/wake_up`, `/reset_prefix_cache`, LoRA loading, ...) are not
#: here, so they are refused (no `model`) unless an operator lists them.
DEFAULT_PASS_PATHS: tuple[str, ...] = (
    "/tokenize", "/detokenize", "/v1/models", "/health", "/ping", "/version", "/metrics",
    "/v1/responses/*/cancel",
)


def path_pattern(path: str) -> str:
    """A pass-list entry as a regex of the whole path (RE2 and Python alike): `*` is one segment."""
    return "[^/]+".join(re.escape(part) for part in path.split("*"))


def endpoint_for(path: str) -> Endpoint:
    """The body rules for a gated path (an unknown one counts every string as prompt text)."""
    return KNOWN_ENDPOINTS.get(path) or Endpoint(path, text_keys=_ALL)


# --- paths ---------------------------------------------------------------------------------------


class Route(enum.Enum):
    GATED = "gated"
    AMBIGUOUS = "ambiguous"
    PASS = "pass"


def canonical_path(path: str) -> str:
    """What `path` reads as to the most lenient router: decoded, no params, no dot segments, lower case."""
    for _ in range(4):  # %252F -> %2F -> /
        decoded = unquote(path, errors="replace")
        if decoded == path:
            break
        path = decoded
    path = path.split("?", 1)[0].split("#", 1)[0].replace("\\", "/")
    segments: list[str] = []
    for segment in path.split("/"):
        segment = segment.split(";", 1)[0].strip(" \t\r\n\x00\x0b\x0c")
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments).lower()


class PathRules:
    def __init__(self, gated_paths: tuple[str, ...], pass_paths: tuple[str, ...] = DEFAULT_PASS_PATHS) -> None:
        self._gated = frozenset(gated_paths)
        self._canonical = frozenset(canonical_path(p) for p in gated_paths)
        self._passes = frozenset(p for p in pass_paths if "*" not in p)
        self._pass_patterns = re.compile("|".join(path_pattern(p) for p in pass_paths if "*" in p) or "(?!)")

    def route(self, method: str, target: str) -> tuple[Route, str]:
        """Classify a request by its method and `:path` (query included); returns the path without query.

        A POST is gated unless its path is on the pass list: a route vLLM added since this list was
        written does engine work, so an unknown POST is gated (its body must name a model), never passed."""
        path = target.split("?", 1)[0]
        if path in self._gated:
            return (Route.GATED if method == "POST" else Route.PASS), path
        if canonical_path(path) in self._canonical:
            return Route.AMBIGUOUS, path
        if method != "POST" or path in self._passes or self._pass_patterns.fullmatch(path):
            return Route.PASS, path
        return Route.GATED, path


# --- bodies --------------------------------------------------------------------------------------


def body_facts(endpoint: Endpoint, body: bytes, content_type: str, complete: bool, bytes_per_token: float) -> BodyFacts:
    """The facts admission needs from a gated request's body (or prefix, for multipart)."""
    if endpoint.multipart:
        return _multipart_facts(body, content_type, complete)
    facts = scan_body(body)
    if endpoint.text_keys is not None:
        text_bytes, token_ids, output = _measure(body, endpoint.text_keys, endpoint.output_key)
        facts = dataclasses.replace(facts, prompt_bytes=text_bytes + math.ceil(token_ids * bytes_per_token))
        if endpoint.output_key is not None:
            facts = dataclasses.replace(facts, max_tokens=output)
    if not endpoint.generates:
        facts = dataclasses.replace(facts, max_tokens=0)
    return facts


_SKIP_INNER = frozenset({"type", "role", "name", "id", "model", "object"})


def _measure(body: bytes, text_keys: tuple[str, ...], output_key: str | None) -> tuple[int, int, int | None]:
    """UTF-8 bytes of strings and count of token ids under `text_keys`; the `output_key` integer."""
    keys = frozenset(text_keys)
    every = text_keys == _ALL
    text_bytes = token_ids = 0
    output: int | None = None
    # The body already passed scan_body, so it is one valid JSON object; read as one buffer, as
    # there (a string spanning ijson's default 64 KiB reads is re-buffered at each).
    for prefix, event, value in ijson.parse(body, use_float=True, buf_size=max(len(body), 1)):
        if event not in ("string", "number"):
            continue
        top, _, rest = prefix.partition(".")
        if prefix == output_key and isinstance(value, int):
            output = value
        if top == "model" or not (every or top in keys):
            continue
        inner = prefix.rpartition(".")[2]  # the map key holding the value, or "item" in an array
        if event == "string" and (not rest or inner not in _SKIP_INNER):
            text_bytes += len(value.encode("utf-8", "surrogatepass"))
        elif event == "number" and rest and inner == "item" and isinstance(value, int):
            token_ids += 1
    return text_bytes, token_ids, output


_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)


def _multipart_facts(body: bytes, content_type: str, complete: bool) -> BodyFacts:
    if not content_type.lower().startswith("multipart/form-data"):
        raise BodyError(Outcome.INVALID_BODY, "this endpoint takes multipart/form-data")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise BodyError(Outcome.INVALID_BODY, "multipart/form-data without a boundary")
    delimiter = b"--" + (match.group(1) or match.group(2)).encode("latin-1")
    pieces = body.split(delimiter)
    models: list[bytes] = []
    stream = False
    for index, piece in enumerate(pieces[1:], start=1):
        if piece.startswith(b"--"):
            break  # the closing delimiter
        if index == len(pieces) - 1 and not complete:
            break  # the part the prefix cut off
        head, sep, value = piece.partition(b"\r\n\r\n")
        if not sep:
            continue
        disposition = next((line for line in head.split(b"\r\n") if line.lower().startswith(b"content-disposition")),
                           b"")
        name = _NAME.search(disposition)
        if name is None:
            continue
        value = value[:-2] if value.endswith(b"\r\n") else value
        if name.group(1) == b"model":
            models.append(value)
        elif name.group(1) == b"stream":
            stream = value.strip().lower() == b"true"
    if len(models) > 1:
        raise BodyError(Outcome.DUPLICATE_MODEL, "request form has more than one `model` field")
    if not models:
        hint = ("" if complete else
                " (send the `model` field before the file: only the first part of a large upload is read)")
        raise BodyError(Outcome.MISSING_MODEL, f"request form has no `model` field{hint}")
    try:
        model = models[0].decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BodyError(Outcome.MISSING_MODEL, "`model` must be UTF-8 text") from None
    if not model:
        raise BodyError(Outcome.MISSING_MODEL, "`model` must be a non-empty string")
    return BodyFacts(model=model, stream=stream, prompt_bytes=0, max_tokens=None)
