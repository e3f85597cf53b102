"""OpenAI-compatible request parsing and response shapes, as vLLM 0.11 serves them.

Pure functions, no IO. The JSON shapes copy vLLM 0.11's pydantic models and the way its
handlers dump them (vllm/entrypoints/openai/protocol.py, serving_chat.py,
serving_completion.py):

- errors: ``{"error": {"message", "type", "param": null, "code"}}`` with the HTTP status
  in ``code`` (0.11 nests the error; older releases used a flat ``"object": "error"``).
  Engine-level errors use type ``BadRequestError`` / ``NotFoundError``; FastAPI request
  validation errors (invalid JSON, missing fields) use the status phrase ``Bad Request``.
- chat streaming: the first chunk carries ``delta: {"role": "assistant", "content": ""}``;
  each later chunk one token; the LAST token's chunk also carries ``finish_reason``
  ("length") and ``stop_reason`` (vLLM puts both in one chunk); then, if
  ``stream_options.include_usage``, a chunk with ``choices: []`` and ``usage``; then
  ``data: [DONE]``. Chunks are dumped with ``exclude_unset=True`` (so only the fields
  vLLM sets explicitly appear), completion chunks with every field.

Token accounting is deterministic: prompt tokens are counted by the served model's tokenizer
and chat template (``extproc.tokenizer``; ``bytes4``: ceil(UTF-8 bytes of the text / 4));
the output limit is ``max_completion_tokens`` or ``max_tokens`` when given, else the context
left, and where a sequence ends within it is ``enginesim.outputs``' business.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.tokenizer import TemplateError, Tokenizer

__all__ = [
    "ApiError",
    "ParsedRequest",
    "Choice",
    "chat_chunk_first",
    "chat_chunk_token",
    "chat_response",
    "completion_chunk_token",
    "completion_response",
    "error_body",
    "model_list",
    "RequestBody",
    "count_prompt",
    "decode_request",
    "finish_request",
    "parse_request",
    "queue_limit_error",
    "sse_error_completion",
    "token_text",
    "tokenize_response",
    "usage",
    "usage_chunk",
]

CHAT = "chat"
COMPLETION = "completion"


class ApiError(Exception):
    """An error answered with vLLM's JSON error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status)

    def __str__(self) -> str:
        return f"{self.status} {self.err_type}: {self.message}"


def error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    """vLLM 0.11 ErrorResponse.model_dump()."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


# vLLM 0.33 vllm/exceptions.py: QueueOverflowError and MaxQueuedTokensError are
# GracefulHTTPErrors; create_error_response (serve/exception_handling/error_response.py) gives
# them type HTTPStatus(503).phrase and param None.
QUEUE_FULL_MESSAGE = ("The engine is currently busy and cannot accept new requests. "
                      "Please try again later or on a different instance.")
QUEUED_TOKENS_MESSAGE = ("The engine has reached its prefill token backlog limit. "
                         "Please try again later or on a different instance.")


def queue_limit_error(reason: str) -> ApiError:
    """The ApiError vLLM 0.33 answers when a queue limit (``reason``) refuses a request."""
    message = QUEUE_FULL_MESSAGE if reason == "max_num_queued_reqs" else QUEUED_TOKENS_MESSAGE
    return ApiError(503, message, "Service Unavailable")


def sse_error_completion(body: dict[str, Any]) -> bytes:
    """An error event as vLLM 0.33's completion stream writes it: ``json.dumps`` with its
    default separators (``create_streaming_error_response``); the chat stream instead dumps the
    ErrorResponse with pydantic, compact (``sse``)."""
    return f"data: {json.dumps(body)}\n\n".encode()


@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from an OpenAI request body."""

    kind: str  # CHAT or COMPLETION
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int
    max_tokens: int  # the limit: max_tokens, else the context left (or --default-max-tokens)
    max_tokens_explicit: bool
    user: Any
    metadata: Any
    n: int = 1  # choices: n sequences, each with its own KV, sharing the prompt
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class RequestBody:
    """A validated body before its prompt is tokenized (see ``decode_request``)."""

    kind: str
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    requested: int | None
    n: int
    stop: tuple[str, ...]
    ignore_eos: bool
    include_stop_str_in_output: bool
    seed: int | None

    @property
    def prompt_bytes(self) -> int:
        """A rough size of what ``count_prompt`` will tokenize (to decide where to count it)."""
        if self.kind == CHAT:
            return sum(count_text_bytes(m.get("content")) for m in self.body.get("messages") or []
                       if isinstance(m, dict))
        prompt = self.body.get("prompt")
        return len(prompt.encode("utf-8")) if isinstance(prompt, str) else 0


def _validation_error(detail: str) -> ApiError:
    return ApiError(400, detail, "Bad Request")


def count_text_bytes(value: Any) -> int:
    """UTF-8 bytes of a message ``content`` (string or list of parts)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part.encode("utf-8"))
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"].encode("utf-8"))
        return total
    raise _validation_error("message content must be a string or a list of content parts")


def count_prompt(request: RequestBody, tokenizer: Tokenizer) -> int:
    """The prompt tokens vLLM would count for this request (``usage.prompt_tokens``)."""
    body = request.body
    try:
        if request.kind == CHAT:
            tools = body.get("tools") or None
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            return tokenizer.count_chat(body.get("messages"), tools, add_generation_prompt)
        add_special = body.get("add_special_tokens", True) is not False
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return max(1, tokenizer.count_prompt(prompt, add_special))
        if isinstance(prompt, list) and prompt:
            # Token ids count as themselves; several prompts are treated as one (no batches).
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return len(prompt)
            total_tokens = 0
            for item in prompt:
                if isinstance(item, str):
                    total_tokens += max(1, tokenizer.count_prompt(item, add_special))
                elif isinstance(item, list) and item and all(isinstance(p, int) for p in item):
                    total_tokens += len(item)
                else:
                    raise _validation_error("prompt must be a string, a list of strings or token ids")
            return total_tokens
    except TemplateError as exc:
        raise _validation_error(str(exc)) from None
    raise _validation_error("Field required: 'prompt' must be a string or a list")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _validation_error(f"'{key}' must be an integer >= 1, got {value!r}")
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise _validation_error("'stop' must be a string or a list of strings")


def decode_request(kind: str, raw: bytes, *, served_model: str,
                   preflight: Callable[[int], None] | None = None) -> RequestBody:
    """The body's JSON and sampling parameters, validated like vLLM's request models; the
    served-model check (404); then ``preflight(n)``, where vLLM 0.33 runs ``_preflight`` (the
    queue limits): before the prompt is rendered and its length checked, so a full queue
    answers 503 even to a prompt that is too long."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _validation_error(
            f"[{{'type': 'json_invalid', 'loc': ('body', {getattr(exc, 'pos', 0)}), "
            f"'msg': 'JSON decode error', 'input': {{}}, 'ctx': {{'error': "
            f"'{getattr(exc, 'msg', str(exc))}'}}}}]") from None
    if not isinstance(body, dict):
        raise _validation_error("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_model  # vLLM 0.11 falls back to the first served model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    stream = body.get("stream") is True
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _validation_error("'stream_options' must be an object")
    if stream_options and not stream:
        raise _validation_error("Stream options can only be defined when `stream=True`.")
    include_usage = bool(stream_options.get("include_usage"))
    continuous_usage = include_usage and bool(stream_options.get("continuous_usage_stats"))
    if kind == CHAT:
        requested = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise _validation_error("Field required: 'messages' must be a non-empty list")
    else:
        requested = _positive_int(body, "max_tokens")
    n = body.get("n")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _validation_error(f"n must be at least 1, got {n}.")
    seed = body.get("seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    request = RequestBody(
        kind=kind, body=body, model=model, stream=stream, include_usage=include_usage,
        continuous_usage=continuous_usage, requested=requested, n=n, stop=_stop_strings(body),
        ignore_eos=body.get("ignore_eos") is True,
        include_stop_str_in_output=body.get("include_stop_str_in_output") is True, seed=seed)
    if preflight is not None:
        preflight(n)
    return request


def finish_request(request: RequestBody, prompt_tokens: int, *, max_model_len: int,
                   default_max_tokens: int | None = None) -> ParsedRequest:
    """vLLM's length checks (serving_engine._validate_input) and the output limit: without
    ``max_tokens``, the context left (``default_max_tokens`` caps it when set)."""
    kind = request.kind
    requested = request.requested
    # the chat handler appends the exception's __cause__, which is None here, to the message
    suffix = " None" if kind == CHAT else ""
    if prompt_tokens >= max_model_len:
        raise ApiError(400, (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the "
            f"input messages.{suffix}"))
    if requested is not None and prompt_tokens + requested > max_model_len:
        raise ApiError(400, (
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_tokens} input tokens ({requested} > {max_model_len} - {prompt_tokens})."
            f"{suffix}"))
    if requested is not None:
        max_tokens = requested
    else:
        max_tokens = max_model_len - prompt_tokens
        if default_max_tokens is not None:
            max_tokens = min(default_max_tokens, max_tokens)
    body = request.body
    return ParsedRequest(
        kind=kind, model=request.model, stream=request.stream, include_usage=request.include_usage,
        continuous_usage=request.continuous_usage, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, max_tokens_explicit=requested is not None,
        user=body.get("user"), metadata=body.get("metadata"), n=request.n, stop=request.stop,
        ignore_eos=request.ignore_eos, include_stop_str_in_output=request.include_stop_str_in_output,
        seed=request.seed)


def parse_request(kind: str, raw: bytes, *, served_model: str, max_model_len: int,
                  tokenizer: Tokenizer, default_max_tokens: int | None = None,
                  preflight: Callable[[int], None] | None = None) -> ParsedRequest:
    """Validate a request body like vLLM's frontend does; raise ApiError on refusal.

    ``decode_request``, ``count_prompt`` and ``finish_request`` in one call."""
    request = decode_request(kind, raw, served_model=served_model, preflight=preflight)
    prompt_tokens = count_prompt(request, tokenizer)
    return finish_request(request, prompt_tokens, max_model_len=max_model_len,
                          default_max_tokens=default_max_tokens)


def token_text(index: int) -> str:
    """The deterministic text of generated token ``index``."""
    return f" tok{index}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """UsageInfo with vLLM's field order."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: ...`` and a blank line."""
    data = obj if isinstance(obj, str) else _dumps(obj)
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Choice:
    """One finished sequence of a non-streaming answer."""

    text: str
    finish_reason: str = "length"
    stop_reason: str | None = None


def chat_chunk_first(request_id: str, created: int, model: str, index: int = 0) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": None}


def chat_chunk_token(request_id: str, created: int, model: str, text: str,
                     finish_reason: str | None, index: int = 0,
                     stop_reason: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice]}


def completion_chunk_token(request_id: str, created: int, model: str, text: str,
                           finish_reason: str | None, index: int = 0,
                           stop_reason: str | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None,
                         "finish_reason": finish_reason, "stop_reason": stop_reason,
                         "prompt_token_ids": None, "token_ids": None}],
            "usage": None}


def usage_chunk(kind: str, request_id: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def _choices(text: str | list[Choice]) -> list[Choice]:
    return [Choice(text)] if isinstance(text, str) else text


def chat_response(request_id: str, created: int, model: str, text: str | list[Choice],
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    choices = []
    for index, choice in enumerate(_choices(text)):
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None,
                   "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                   "reasoning_content": None}
        choices.append({"index": index, "message": message, "logprobs": None,
                        "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                        "token_ids": None})
    body_usage = usage(prompt_tokens, completion_tokens) | {"prompt_tokens_details": None}
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": body_usage,
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}


def completion_response(request_id: str, created: int, model: str, text: str | list[Choice],
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    body_usage = usage(prompt_tokens, completion_tokens) | {"prompt_tokens_details": None}
    choices = [{"index": index, "text": choice.text, "logprobs": None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
               for index, choice in enumerate(_choices(text))]
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": body_usage,
            "kv_transfer_params": None}


def tokenize_response(tokens: list[int], max_model_len: int) -> dict[str, Any]:
    """vLLM's TokenizeResponse (``POST /tokenize``)."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": None}


def model_list(model: str, max_model_len: int, created: int, permission_id: str) -> dict[str, Any]:
    """GET /v1/models as vLLM 0.11 answers it."""
    permission = {"id": permission_id, "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    card = {"id": model, "object": "model", "created": created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": max_model_len,
            "permission": [permission]}
    return {"object": "list", "data": [card]}
