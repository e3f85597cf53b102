"""Where a request's prompt-token estimate comes from, per request (issue 11, part 3).

In order, the first that applies (`ADMISSION_ESTIMATE=counted`, the default):

1. `tokenizer`: the operator named the served model's tokenizer (`ADMISSION_TOKENIZER`): a
   built-in vocabulary with its chat template (`qwen3`, `qwen2.5`, `llama3`, `extproc/tokenizer.py`:
   the simulator counts with the same module, so the count is exactly the engine's) or a
   `tokenizer.json` counted with Hugging Face `tokenizers` (what vLLM loads), the template's framing added from the
   `ADMISSION_TEMPLATE_TOKENS_*` settings. Chat and completion requests; counted in a worker
   thread, off the event loop.
2. `engine`: a chat or completion request whose BODY has at least `ADMISSION_TOKENIZE_ABOVE_BYTES`
   bytes (not its text: structure such as many tiny content parts renders far more tokens than
   its text bytes suggest, and cannot shrink the body) is counted by the engine itself
   (`POST /tokenize`, which vLLM serves: the same template and tokenizer as the request will
   get), within `ADMISSION_TOKENIZE_TIMEOUT_MS`. On a timeout, an
   error or an answer without a count, the bytes rule decides (`fallback`); an engine that
   answers 404/405 (no such endpoint) is not asked again for `UNSUPPORTED_RETRY_SECONDS`.
3. `learned` / `prior`: the bytes rule (`extproc.estimate.prompt_from_bytes`) at the
   bytes-per-token learned from the engine's own counter (`Calibration`), or, until there is
   enough of it or when learning is off, at `ADMISSION_BYTES_PER_TOKEN` (the prior).

Why this order and these defaults (measured in bench/README.md, "The token estimate"): only a
long prompt can hurt the budget, and a long prompt spends seconds to minutes in the engine, so
a round trip to count it exactly costs nothing that matters; short prompts are estimated from
their bytes at a prior that is safe for JSON and CJK (2.5 bytes a token: the issue's worst
measured tokenizers are 2.76 on JSON and 2.28 on CJK, Qwen3 3.65 / 3.62), so a cold start that
meets a burst of large JSON, CJK or hex prompts counts them exactly, and small ones at worst
over-reserve.

`Calibration` learns bytes-per-token per engine (one vLLM engine serves one model's tokenizer).
First from exact counts: every prompt counted by the tokenizer or the engine is one sample of its
text bytes against its tokens (less the template's and token ids' share, as the bytes rule adds
them), and after `MIN_EXACT_SAMPLES` (3) such prompts their decayed sums give the rate. So the
bytes rule for prompts under the threshold converges within three large prompts, where the
counter below needs `MIN_EVIDENCE_TOKENS` (50,000) counted tokens: 49 prompts of the 1k class,
34 of the real engine's 1,500-token chats, never for 32-token chats (bench/README.md, "Prompt
estimates that do not waste"). Without exact counts (no tokenizer, no /tokenize, or only small
prompts), from `vllm:prompt_tokens_total` against the bytes of the requests this service admitted: the
engine counts a prompt when its first token is sampled, so it has surely counted every request
whose stream has ended, and maybe some still open. The learned value is therefore
bytes(finished) / (tokens the engine counted - what the template and token ids account for),
which reads LOW while prompts are in flight (the safe side: a lower bytes-per-token estimates
more tokens), converging as the finished work outgrows what is in flight. Sums decay by half
every `HALF_LIFE_TOKENS` counted tokens, so a changed traffic mix is learned in about that many
tokens. Bounded by `ADMISSION_BYTES_PER_TOKEN_MIN`/`_MAX`. Limits: traffic that reaches the
engine without this service (other replicas with their own ledger, callers that bypass it)
counts in the engine's counter and not here, so the learned value reads low (safe, and costly:
it over-reserves; turn learning off there); a request the engine refused after admission (400)
counts bytes without tokens, reading high, bounded by the maximum.

`admission_estimate_ratio{engine,model}` compares the same decayed sums the other way: the
prompt tokens this service estimated for what it admitted over what the engine counted. It reads
HIGH while admitted prompts wait for their prefill and converges the same way; the alert on
under-counting uses the counters across replicas (alerts/llm-admission.rules.yml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from .bodyscan import BodyFacts
from .config import BUILTIN_TOKENIZERS, EngineConfig, EstimateSettings, Settings
from .endpoints import Endpoint
from .estimate import (
    CostEstimate,
    TemplateOverhead,
    estimate_cost,
    estimate_counted,
    estimate_from_bytes,
)
from .metrics import Metrics
from .tokenizer import content_text, get_tokenizer

log = logging.getLogger("extproc.tokencount")

HALF_LIFE_TOKENS = 1_000_000  # calibration sums halve every this many engine-counted prompt tokens
MIN_EVIDENCE_TOKENS = 50_000  # engine-counted tokens before the learned value (and the ratio) is used
MIN_EXACT_SAMPLES = 3  # prompts counted exactly before their bytes-per-token is used (module docstring)
UNSUPPORTED_RETRY_SECONDS = 60.0  # an engine without /tokenize is asked again after this
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
COUNTABLE = (CHAT, COMPLETIONS)


class CountError(Exception):
    """The prompt could not be counted exactly (the bytes rule decides instead)."""


# --- local tokenizers ---------------------------------------------------------------------------


class LocalTokenizer:
    """The served model's tokenizer in this process: counts a chat or completion body's prompt."""

    def __init__(self, spec: str, overhead: TemplateOverhead) -> None:
        self.spec = spec
        self._overhead = overhead
        if spec in BUILTIN_TOKENIZERS:
            self._builtin: Any = get_tokenizer(spec)
            self._hf: Any = None
        else:
            from tokenizers import Tokenizer  # Hugging Face tokenizers, what vLLM loads

            self._builtin = None
            self._hf = Tokenizer.from_file(spec)

    def count(self, path: str, body: bytes) -> int:
        """The prompt tokens of `body` for the endpoint `path` (CHAT or COMPLETIONS)."""
        doc = _load(body)
        try:
            if path == CHAT:
                messages, tools = doc.get("messages"), doc.get("tools") or None
                if self._builtin is not None:
                    return int(self._builtin.count_chat(messages, tools))
                return self._hf_chat(messages, tools)
            prompt = doc.get("prompt")
            if not isinstance(prompt, str):
                raise CountError("only a single string prompt is counted")
            if self._builtin is not None:
                return int(self._builtin.count_prompt(prompt, doc.get("add_special_tokens", True) is not False))
            return self._hf_count(prompt, special=doc.get("add_special_tokens", True) is not False)
        except CountError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a body the template cannot render
            raise CountError(f"cannot count this body: {exc}") from None

    def exact(self, path: str) -> bool:
        """Whether `count` is the engine's own count: a built-in vocabulary with its template, or a
        Hugging Face tokenizer on a completion prompt (a chat's framing is approximated)."""
        return self._builtin is not None or path != CHAT

    def _hf_count(self, text: str, special: bool = False) -> int:
        # encode_batch releases the GIL while it tokenizes (encode does not): the event loop runs on.
        return len(self._hf.encode_batch([text], add_special_tokens=special)[0].ids)

    def _hf_chat(self, messages: Any, tools: Any) -> int:
        if not isinstance(messages, list) or not messages:
            raise CountError("messages must be a non-empty list")
        texts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                raise CountError("each message must be an object")
            texts.append(content_text(message.get("content")))
            for call in message.get("tool_calls") or ():
                function = call.get("function", call) if isinstance(call, dict) else {}
                if isinstance(function, dict):
                    texts.append(str(function.get("name", "")))
                    arguments = function.get("arguments", "")
                    texts.append(arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
        for tool in tools or ():
            texts.append(json.dumps(tool, ensure_ascii=False))
        o = self._overhead
        framing = o.fixed + o.per_message * len(messages) + (o.tools if tools else 0)
        return self._hf_count("\n".join(texts)) + framing


def _load(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CountError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CountError("not a JSON object")
    return doc


def tokenize_request(path: str, body: bytes) -> dict[str, Any]:
    """vLLM's `POST /tokenize` body for a chat or completion request body (what changes the count)."""
    doc = _load(body)
    if path == CHAT:
        request: dict[str, Any] = {"model": doc.get("model"), "messages": doc.get("messages"),
                                   "add_generation_prompt": doc.get("add_generation_prompt", True)}
        for key in ("tools", "chat_template_kwargs", "continue_final_message", "chat_template"):
            if doc.get(key) is not None:
                request[key] = doc[key]
        return request
    prompt = doc.get("prompt")
    if not isinstance(prompt, str):
        raise CountError("only a single string prompt is counted by the engine")
    request = {"model": doc.get("model"), "prompt": prompt}
    if doc.get("add_special_tokens") is not None:
        request["add_special_tokens"] = doc["add_special_tokens"]
    return request


# --- calibration ---------------------------------------------------------------------------------


class Calibration:
    """One engine's bytes-per-token learned from its prompt-token counter (see the module docstring)."""

    def __init__(self, prior: float, low: float, high: float, learn: bool,
                 half_life: float = HALF_LIFE_TOKENS, min_evidence: float = MIN_EVIDENCE_TOKENS) -> None:
        self.prior, self.low, self.high, self.learn = prior, low, high, learn
        self._half_life, self._min_evidence = half_life, min_evidence
        self._last_total: float | None = None
        self._last_at: float | None = None  # scrape_started of the last snapshot taken
        self.engine_tokens = 0.0  # decayed: prompt tokens the engine counted
        self.finished_bytes = 0.0  # decayed: text bytes x sequences of our finished requests
        self.finished_fixed = 0.0  # decayed: their template + token-id tokens x sequences
        self.admitted_estimate = 0.0  # decayed: estimated engine prompt tokens of what we admitted
        self.samples = 0  # prompts counted exactly (by the engine or the tokenizer) since the last reset
        self.sample_bytes = 0.0  # decayed: their text bytes (what the rate applies to)
        self.sample_tokens = 0.0  # decayed: their exact counts less the template and token ids
        # Since the last counter reading: merged with the engine's delta at the next one, so what
        # happened in one interval is weighed alike on both sides.
        self._pending = [0.0, 0.0, 0.0]  # finished bytes, finished fixed tokens, admitted estimate

    def engine_counted(self, total: float | None, scrape_started: float | None = None) -> float:
        """The engine's `vllm:prompt_tokens_total` at a scrape; returns the tokens it added."""
        if total is None or (scrape_started is not None and scrape_started == self._last_at):
            return 0.0
        self._last_at = scrape_started
        last, self._last_total = self._last_total, total
        if last is None:
            return 0.0  # the first reading: what was counted before we started is not ours
        delta = total - last
        if delta < 0:  # the engine restarted: its counter began again
            self.reset()
            return 0.0
        if delta > 0:
            factor = 0.5 ** (delta / self._half_life)
            pending_bytes, pending_fixed, pending_admitted = self._pending
            self._pending = [0.0, 0.0, 0.0]
            self.engine_tokens = self.engine_tokens * factor + delta
            self.finished_bytes = self.finished_bytes * factor + pending_bytes
            self.finished_fixed = self.finished_fixed * factor + pending_fixed
            self.admitted_estimate = self.admitted_estimate * factor + pending_admitted
        return delta

    def reset(self) -> None:
        self.engine_tokens = self.finished_bytes = self.finished_fixed = self.admitted_estimate = 0.0
        self._pending = [0.0, 0.0, 0.0]
        self.samples, self.sample_bytes, self.sample_tokens = 0, 0.0, 0.0

    def counted(self, facts: BodyFacts, overhead: TemplateOverhead, tokens: int) -> None:
        """A prompt counted exactly: its bytes against its tokens, less what the bytes rule adds on
        its own (template, token ids, dense text), is one exact sample of the rate."""
        text_bytes = facts.prompt_bytes + facts.tools_bytes - facts.dense_bytes
        text_tokens = tokens - (overhead.tokens(facts) + facts.prompt_token_ids + facts.dense_bytes)
        if text_bytes <= 0 or text_tokens <= 0:
            return  # nothing the rate applies to, or the template's estimate covers it all
        factor = 0.5 ** (tokens / self._half_life)
        self.sample_bytes = self.sample_bytes * factor + text_bytes
        self.sample_tokens = self.sample_tokens * factor + text_tokens
        self.samples += 1

    def admitted(self, cost: CostEstimate) -> None:
        self._pending[2] += cost.engine_prompt_tokens

    def finished(self, facts: BodyFacts, overhead: TemplateOverhead) -> None:
        seqs = facts.sequences
        # Dense text is estimated a token a byte, not at the rate: it stays out of what the rate
        # is learned from (its tokens count as fixed, like the template's).
        self._pending[0] += seqs * (facts.prompt_bytes + facts.tools_bytes - facts.dense_bytes)
        self._pending[1] += seqs * (overhead.tokens(facts) + facts.prompt_token_ids + facts.dense_bytes)

    @property
    def evidence(self) -> bool:
        return self.engine_tokens >= self._min_evidence

    def learned(self) -> float | None:
        """The learned bytes-per-token (bounded): from exact counts once there are
        `MIN_EXACT_SAMPLES`, else from the engine's counter once it has enough evidence, else None."""
        if not self.learn:
            return None
        if self.samples >= MIN_EXACT_SAMPLES:
            return min(self.high, max(self.low, self.sample_bytes / self.sample_tokens))
        text_tokens = self.engine_tokens - self.finished_fixed
        if not self.evidence or self.finished_bytes <= 0 or text_tokens <= 0:
            return None
        return min(self.high, max(self.low, self.finished_bytes / text_tokens))

    def bytes_per_token(self) -> tuple[float, bool]:
        learned = self.learned()
        return (self.prior, False) if learned is None else (learned, True)

    def ratio(self) -> float | None:
        """Estimated prompt tokens of what was admitted over what the engine counted (decayed)."""
        if not self.evidence:
            return None
        return self.admitted_estimate / self.engine_tokens


# --- the estimator -------------------------------------------------------------------------------


class Estimator:
    """Picks each request's source, counts, and keeps the per-engine calibration and its metrics."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        e: EstimateSettings = settings.estimate
        self._settings = settings
        self._est = e
        self._metrics = metrics
        self.overhead = TemplateOverhead(fixed=e.template_fixed, per_message=e.template_per_message,
                                         tools=e.template_tools)
        self.calibration = {eng.name: Calibration(settings.bytes_per_token, e.bytes_per_token_min,
                                                  e.bytes_per_token_max, e.learn) for eng in settings.engines}
        self._unsupported_until: dict[str, float] = {}
        self._session: aiohttp.ClientSession | None = None  # one pool of connections to the engines
        self._models: dict[str, set[str]] = {eng.name: set(eng.models) for eng in settings.engines}
        self.tokenizer: LocalTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None
        if e.mode == "counted" and e.tokenizer:
            t0 = time.perf_counter()
            self.tokenizer = LocalTokenizer(e.tokenizer, self.overhead)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokencount")
            log.info("prompt tokens counted with the served model's tokenizer",
                     extra={"tokenizer": e.tokenizer, "load_s": round(time.perf_counter() - t0, 3)})
        for eng in settings.engines:
            metrics.bytes_per_token.labels(eng.name).set(settings.bytes_per_token)

    async def estimate(self, engine: EngineConfig, endpoint: Endpoint, body: bytes, facts: BodyFacts,
                       snapshot_total: float | None = None, scrape_started: float | None = None) -> CostEstimate:
        """The request's cost, and the metric of where its prompt count came from."""
        self.observe(engine.name, snapshot_total, scrape_started)
        s, e = self._settings, self._est
        if e.mode == "bytes":
            cost = estimate_cost(facts, s.bytes_per_token, s.estimate_safety_factor, s.default_max_tokens)
        else:
            cost = await self._counted(engine, endpoint, body, facts)
        m = self._metrics
        m.child(m.estimate_source, engine.name, facts.model, cost.source).inc()
        return cost

    async def _counted(self, engine: EngineConfig, endpoint: Endpoint, body: bytes, facts: BodyFacts) -> CostEstimate:
        s, e = self._settings, self._est
        countable = endpoint.path in COUNTABLE and facts.messages + facts.prompt_bytes > 0
        if countable and self.tokenizer is not None and self._pool is not None:
            try:
                loop = asyncio.get_running_loop()
                tokens = await loop.run_in_executor(self._pool, self.tokenizer.count, endpoint.path, body)
                self.calibration[engine.name].counted(facts, self.overhead, tokens)
                return estimate_counted(facts, tokens, s.default_max_tokens, "tokenizer",
                                        exact=self.tokenizer.exact(endpoint.path))
            except CountError as exc:
                log.debug("tokenizer could not count the prompt; bytes rule", extra={"detail": str(exc)})
        source = None
        # The threshold is on the body's size: what the template renders (text, the "\n" between
        # parts, each message's framing) never outgrows it by more than the fixed framing, and
        # structure cannot make it small (each part or message costs body bytes): 1,900
        # one-character parts are 1,900 text bytes but ~51 KB of body.
        if (countable and e.tokenize_above_bytes and len(body) >= e.tokenize_above_bytes
                and self._unsupported_until.get(engine.name, 0.0) <= time.monotonic()):
            try:
                tokens = await self._engine_count(engine, endpoint.path, body)
                self.calibration[engine.name].counted(facts, self.overhead, tokens)
                return estimate_counted(facts, tokens, s.default_max_tokens, "engine", exact=True)
            except CountError as exc:
                source = "fallback"
                log.info("the engine did not count the prompt; bytes rule", extra={"engine": engine.name,
                                                                                   "detail": str(exc)})
        bpt, learned = self.calibration[engine.name].bytes_per_token()
        return estimate_from_bytes(facts, bpt, s.estimate_safety_factor, s.default_max_tokens, self.overhead,
                                   source or ("learned" if learned else "prior"))

    async def _engine_count(self, engine: EngineConfig, path: str, body: bytes) -> int:
        request = tokenize_request(path, body)
        timeout = aiohttp.ClientTimeout(total=self._est.tokenize_timeout_seconds)
        if self._session is None or self._session.closed:
            # Kept for the service's life: a session per call opened a connection (and a
            # connector) per large prompt, too slow for Envoy's message timeout under a burst.
            self._session = aiohttp.ClientSession()
        t0 = time.perf_counter()
        try:
            async with self._session.post(f"{engine.url}/tokenize", json=request, timeout=timeout) as response:
                if response.status in (404, 405):
                    self._unsupported_until[engine.name] = time.monotonic() + UNSUPPORTED_RETRY_SECONDS
                    raise CountError(f"the engine has no /tokenize (HTTP {response.status})")
                if response.status != 200:
                    raise CountError(f"HTTP {response.status}: {(await response.text())[:200]}")
                answer = await response.json(content_type=None)
        except TimeoutError:
            raise CountError(f"no answer within {self._est.tokenize_timeout_seconds * 1000:g} ms") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise CountError(f"{type(exc).__name__}: {exc}") from None
        finally:
            m = self._metrics
            m.child(m.tokenize_duration, engine.name).observe(time.perf_counter() - t0)
        count = answer.get("count") if isinstance(answer, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CountError("the answer has no count")
        return count

    async def aclose(self) -> None:
        """Close the connections to the engines' /tokenize and the counting thread (at shutdown)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # --- calibration feed ----------------------------------------------------------------------

    def observe(self, engine: str, total: float | None, scrape_started: float | None) -> None:
        """Take the engine's prompt-token counter from its latest snapshot."""
        cal = self.calibration[engine]
        if cal.engine_counted(total, scrape_started) > 0:
            self._publish(engine)

    def admitted(self, engine: str, model: str, cost: CostEstimate) -> None:
        self.calibration[engine].admitted(cost)
        self._models.setdefault(engine, set()).add(model)
        m = self._metrics
        m.child(m.estimated_prompt_tokens, engine, model).inc(cost.engine_prompt_tokens)

    def finished(self, engine: str, facts: BodyFacts) -> None:
        self.calibration[engine].finished(facts, self.overhead)
        self._publish(engine)

    def _publish(self, engine: str) -> None:
        cal, m = self.calibration[engine], self._metrics
        m.child(m.bytes_per_token, engine).set(cal.bytes_per_token()[0])
        ratio = cal.ratio()
        for model in self._models.get(engine, ()):
            m.child(m.estimate_ratio, engine, model).set(math.nan if ratio is None else ratio)
