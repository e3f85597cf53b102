"""The prompt-token estimate (issue 11, part 3): what the body holds, each source, the fallback,
the calibration, a cold-start burst. The engine is the real simulator, in process."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from bench.text import sized_content
from enginesim.config import SimConfig
from enginesim.scheduler import SchedulerConfig
from enginesim.server import create_app
from extproc.bodyscan import BodyError, scan_body
from extproc.config import ConfigError, load_settings
from extproc.endpoints import endpoint_for
from extproc.estimate import TemplateOverhead, estimate_cost, estimate_from_bytes, prompt_from_bytes
from extproc.metrics import Metrics
from extproc.tokencount import Calibration, Estimator, LocalTokenizer, tokenize_request
from extproc.tokenizer import get_tokenizer

CHAT = "/v1/chat/completions"
QWEN = get_tokenizer("qwen3")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place, today.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "description": "the city"},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                             "required": ["city"]}}}


def chat(content: str, **extra: Any) -> bytes:
    return json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 16, **extra}).encode()


# --- what the body holds ----------------------------------------------------------------------


def test_the_tools_array_is_measured_as_the_template_renders_it() -> None:
    tools = [TOOL, {**TOOL, "function": {**TOOL["function"], "name": "get_time"}}]
    facts = scan_body(chat("hi", tools=tools))
    rendered = sum(len(json.dumps(t, ensure_ascii=False).encode()) for t in tools)
    assert abs(facts.tools_bytes - rendered) / rendered < 0.1
    assert facts.prompt_bytes == 2 and facts.messages == 1


def test_messages_tool_calls_and_token_ids_are_counted() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    facts = scan_body(json.dumps(body).encode())
    assert facts.messages == 3
    assert facts.prompt_bytes == len("be brief") + len("get_weather") + len('{"city": "Paris"}') + len("sunny")
    ids = scan_body(b'{"model":"m","prompt":[1,2,3,4]}')
    assert ids.prompt_token_ids == 4 and ids.prompt_bytes == 0 and ids.messages == 0


@pytest.mark.parametrize(("extra", "sequences"), [({}, 1), ({"n": 3}, 3), ({"n": "2"}, 2), ({"best_of": 4, "n": 2}, 4),
                                                  ({"n": None}, 1), ({"n": 0}, 1)])
def test_n_and_best_of_are_read_as_the_engine_reads_them(extra: dict[str, Any], sequences: int) -> None:
    assert scan_body(chat("x", **extra)).sequences == sequences


def test_an_n_the_engine_would_reject_is_rejected_here() -> None:
    with pytest.raises(BodyError, match="`n` must be an integer"):
        scan_body(chat("x", n="two"))


def test_n_sequences_reserve_n_prompts_and_n_generations() -> None:
    facts = scan_body(chat("a" * 400, n=3, max_tokens=100))
    cost = estimate_from_bytes(facts, 4.0, 1.0, 1024, TemplateOverhead(fixed=3, per_message=5, tools=0), "prior")
    assert cost.prompt_tokens == 100 + 3 + 5
    assert cost.sequences == 3 and cost.tokens == 3 * (108 + 100) and cost.engine_prompt_tokens == 3 * 108


def test_the_old_estimate_is_unchanged() -> None:
    facts = scan_body(chat("a" * 400, n=3, tools=[TOOL]))
    cost = estimate_cost(facts, 4.0, 1.0, 1024)
    assert (cost.prompt_tokens, cost.generation_tokens, cost.sequences, cost.tokens) == (100, 16, 1, 116)


def test_the_template_overhead_defaults_cover_the_real_templates() -> None:
    """Per message, fixed and tools framing measured on the simulator's three templates."""
    o = TemplateOverhead()
    for name in ("qwen3", "qwen2.5", "llama3"):
        t = get_tokenizer(name)
        for messages in ([{"role": "user", "content": ""}],
                         [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                          {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]):
            facts = scan_body(json.dumps({"model": "m", "messages": messages}).encode())
            assert o.tokens(facts) >= t.count_chat(messages), name
            with_tools = scan_body(json.dumps({"model": "m", "messages": messages, "tools": [TOOL]}).encode())
            framing = t.count_chat(messages, [TOOL]) - t.count_text(json.dumps(TOOL))
            assert o.tokens(with_tools) >= framing, name


# --- the calibration --------------------------------------------------------------------------


def _finished(cal: Calibration, text_bytes: int, requests: int = 1) -> None:
    facts = scan_body(b'{"model":"m","prompt":"' + b"a" * text_bytes + b'"}')
    for _ in range(requests):
        cal.finished(facts, TemplateOverhead())


def test_the_prior_holds_until_the_engine_has_counted_enough() -> None:
    cal = Calibration(prior=2.5, low=1.0, high=4.0, learn=True, min_evidence=990)  # (sums decay a little)
    assert cal.bytes_per_token() == (2.5, False) and cal.ratio() is None
    cal.engine_counted(5_000, 1.0)  # the first reading: the engine's history, not ours
    _finished(cal, 3_000)
    cal.engine_counted(5_900, 2.0)
    assert cal.bytes_per_token() == (2.5, False)  # 900 tokens: not enough
    cal.engine_counted(6_000, 3.0)
    bpt, learned = cal.bytes_per_token()
    assert learned and bpt == pytest.approx(3.0, rel=1e-3)


def test_the_learned_value_is_bounded_and_reads_low_while_prompts_are_in_flight() -> None:
    cal = Calibration(prior=2.5, low=1.0, high=4.0, learn=True, min_evidence=1000)
    cal.engine_counted(0, 0.0)
    _finished(cal, 10_000)  # 10,000 bytes finished ...
    cal.engine_counted(2_000, 1.0)  # ... but the engine counted 2,000 tokens: 5 B/t, above the bound
    assert cal.bytes_per_token() == (4.0, True)
    cal.engine_counted(12_000, 2.0)  # prompts still in flight counted too: reads low, never high
    assert cal.bytes_per_token()[0] < 1.1
    cal.engine_counted(100_000, 3.0)
    assert cal.bytes_per_token() == (1.0, True)


def test_learning_off_keeps_the_prior_and_a_restarted_engine_starts_over() -> None:
    off = Calibration(prior=2.5, low=1.0, high=4.0, learn=False, min_evidence=10)
    off.engine_counted(0, 0.0)
    _finished(off, 4_000)
    off.engine_counted(1_000, 1.0)
    assert off.bytes_per_token() == (2.5, False)
    cal = Calibration(prior=2.5, low=1.0, high=4.0, learn=True, min_evidence=10)
    cal.engine_counted(0, 0.0)
    _finished(cal, 4_000)
    cal.engine_counted(1_000, 1.0)
    assert cal.bytes_per_token()[1]
    cal.engine_counted(10, 2.0)  # the counter went back: a new engine process
    assert cal.bytes_per_token() == (2.5, False) and cal.engine_tokens == 0


def test_the_ratio_compares_what_was_estimated_with_what_the_engine_counted() -> None:
    cal = Calibration(prior=2.5, low=1.0, high=4.0, learn=True, min_evidence=100, half_life=1e12)
    cal.engine_counted(0, 0.0)
    facts = scan_body(chat("x" * 3600))
    for _ in range(10):
        cal.admitted(estimate_from_bytes(facts, 4.0, 1.0, 0, TemplateOverhead(0, 0, 0), "prior"))  # 900 each
    cal.engine_counted(10_000, 1.0)
    assert cal.ratio() == pytest.approx(0.9)


def test_sums_decay_so_a_new_traffic_mix_is_learned() -> None:
    cal = Calibration(prior=2.5, low=1.0, high=8.0, learn=True, min_evidence=100, half_life=10_000)
    cal.engine_counted(0, 0.0)
    total = 0
    for _ in range(20):  # prose: 4.5 B/t
        _finished(cal, 4_500)
        total += 1_000
        cal.engine_counted(total, float(total))
    assert cal.bytes_per_token()[0] == pytest.approx(4.5, rel=0.02)
    for _ in range(100):  # then JSON: 3 B/t
        _finished(cal, 3_000)
        total += 1_000
        cal.engine_counted(total, float(total))
    assert cal.bytes_per_token()[0] == pytest.approx(3.0, rel=0.02)


# --- the sources, on the real simulator --------------------------------------------------------


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    clients: list[TestClient] = []

    async def start(app: web.Application) -> str:
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return str(client.make_url("")).rstrip("/")

    yield start
    for client in clients:
        await client.close()


def sim_app(tokenizer: str = "qwen3") -> web.Application:
    sched = SchedulerConfig(num_gpu_blocks=20_000, block_size=16, max_num_seqs=4, max_num_batched_tokens=2048,
                            max_model_len=131_072)
    return create_app(SimConfig(port=0, scheduler=sched, tokenizer=tokenizer))


_made: list[Estimator] = []


@pytest.fixture(autouse=True)
async def _close_estimators() -> Any:
    """Each estimator keeps its connections to the engine for its life: close them, as the service does."""
    yield
    while _made:
        await _made.pop().aclose()


def estimator(url: str, **env: str) -> tuple[Estimator, Metrics]:
    settings = load_settings({"ENGINE_URL": url, "ADMISSION_OBSERVE_MODELS": "sim-model", **env})
    metrics = Metrics(CollectorRegistry())
    metrics.initialise(settings)
    est = Estimator(settings, metrics)
    _made.append(est)
    return est, metrics


async def estimate(est: Estimator, body: bytes, path: str = CHAT) -> Any:
    engine = est._settings.engines[0]
    return await est.estimate(engine, endpoint_for(path), body, scan_body(body))


def sources(metrics: Metrics) -> dict[str, float]:
    return {s.labels["source"]: s.value for m in metrics.estimate_source.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


def test_an_unknown_tokenizer_or_a_missing_file_is_a_clear_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="built-in vocabulary"):
        load_settings({"ADMISSION_TOKENIZER": "gpt-2"})
    with pytest.raises(ConfigError, match="no readable file"):
        load_settings({"ADMISSION_TOKENIZER": str(tmp_path / "tokenizer.json")})
    with pytest.raises(ConfigError, match="ADMISSION_ESTIMATE"):
        load_settings({"ADMISSION_ESTIMATE": "guess"})
    with pytest.raises(ConfigError, match="above ADMISSION_BYTES_PER_TOKEN_MAX"):
        load_settings({"ADMISSION_BYTES_PER_TOKEN_MIN": "5", "ADMISSION_BYTES_PER_TOKEN_MAX": "4"})
    with pytest.raises(ConfigError, match="ADMISSION_TOKENIZE_TIMEOUT_MS"):
        load_settings({"ADMISSION_TOKENIZE_TIMEOUT_MS": "0"})


async def test_a_large_prompt_is_counted_by_the_engine_exactly(serve: Any) -> None:
    url = await serve(sim_app())
    est, metrics = estimator(url)
    content = sized_content("json", 8192, seed=1, index=0)
    body = chat(content, tools=[TOOL], n=2)
    cost = await estimate(est, body)
    truth = QWEN.count_chat([{"role": "user", "content": content}], [TOOL])
    assert cost.source == "engine" and cost.prompt_tokens == truth and cost.sequences == 2
    small = await estimate(est, chat("hello"))
    assert small.source == "prior"
    assert sources(metrics) == {"engine": 1, "prior": 1}
    assert tokenize_request(CHAT, body) == {"model": "sim-model", "messages": [{"role": "user", "content": content}],
                                            "add_generation_prompt": True, "tools": [TOOL]}


async def test_a_completion_prompt_is_counted_by_the_engine_too(serve: Any) -> None:
    url = await serve(sim_app("llama3"))
    est, _ = estimator(url, ADMISSION_TOKENIZE_ABOVE_BYTES="1")
    body = json.dumps({"model": "sim-model", "prompt": "The quick brown fox", "max_tokens": 5}).encode()
    cost = await estimate(est, body, "/v1/completions")
    assert cost.source == "engine" and cost.prompt_tokens == get_tokenizer("llama3").count_prompt("The quick brown fox")


async def test_a_slow_engine_falls_back_to_the_bytes_rule_within_the_timeout(serve: Any) -> None:
    never = asyncio.Event()
    asked = 0

    async def hang(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        await never.wait()  # never answers: the estimator's timeout must end the wait
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/tokenize", hang)
    url = await serve(app)
    est, metrics = estimator(url, ADMISSION_TOKENIZE_TIMEOUT_MS="50")
    body = chat("{" * 9000)
    cost = await estimate(est, body)
    assert asked == 1 and cost.source == "fallback"
    assert cost.prompt_tokens == prompt_from_bytes(scan_body(body), 2.5, 1.0, est.overhead)
    assert sources(metrics) == {"fallback": 1}
    never.set()


@pytest.mark.parametrize("status", [500, 400])
async def test_an_engine_error_falls_back_and_is_asked_again_next_time(serve: Any, status: int) -> None:
    asked = 0

    async def fail(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"error": {"message": "boom"}}, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", fail)
    est, _ = estimator(await serve(app))
    assert (await estimate(est, chat("x" * 9000))).source == "fallback"
    assert (await estimate(est, chat("x" * 9000))).source == "fallback"
    assert asked == 2


async def test_an_engine_without_tokenize_is_not_asked_again(serve: Any) -> None:
    asked = 0

    async def count(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"count": "many"})  # an answer without a usable count

    app = web.Application()
    app.router.add_post("/other", count)
    est, _ = estimator(await serve(app))
    assert (await estimate(est, chat("x" * 9000))).source == "fallback"  # 404
    assert (await estimate(est, chat("x" * 9000))).source == "prior"  # not asked for a while
    app2 = web.Application()
    app2.router.add_post("/tokenize", count)
    est2, _ = estimator(await serve(app2))
    assert (await estimate(est2, chat("x" * 9000))).source == "fallback" and asked == 1


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
async def test_a_builtin_tokenizer_counts_exactly_what_the_engine_counts(serve: Any, name: str) -> None:
    url = await serve(sim_app(name))
    est, metrics = estimator(url, ADMISSION_TOKENIZER=name)
    tokenizer = get_tokenizer(name)
    for kind in ("prose", "cjk", "hex"):
        content = sized_content(kind, 1024, seed=2, index=0, tokenizer_name=name)
        cost = await estimate(est, chat(content, tools=[TOOL]))
        assert cost.source == "tokenizer"
        assert cost.prompt_tokens == tokenizer.count_chat([{"role": "user", "content": content}], [TOOL])
    assert sources(metrics) == {"tokenizer": 3}


def _train_tokenizer_json(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [sized_content(kind, 2048, seed=3, index=i) for kind in ("prose", "code", "json") for i in range(2)]
    tok.train_from_iterator(corpus,
                            trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


async def test_a_tokenizer_json_is_counted_with_hugging_face_tokenizers(serve: Any, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = _train_tokenizer_json(tmp_path / "tokenizer.json")
    est, metrics = estimator("http://127.0.0.1:9", ADMISSION_TOKENIZER=str(path))
    hf = Tokenizer.from_file(str(path))
    content = sized_content("prose", 4096, seed=4, index=0)
    cost = await estimate(est, chat(content, tools=[TOOL]))
    text = content + "\n" + json.dumps(TOOL, ensure_ascii=False)
    assert cost.source == "tokenizer"
    assert cost.prompt_tokens == len(hf.encode(text, add_special_tokens=False).ids) + 32 + 5 + 100
    prompt = json.dumps({"model": "sim-model", "prompt": "hello world"}).encode()
    assert (await estimate(est, prompt, "/v1/completions")).prompt_tokens == len(hf.encode("hello world").ids)


async def test_a_body_the_tokenizer_cannot_count_falls_back_to_the_bytes_rule(tmp_path: Path) -> None:
    est, _ = estimator("http://127.0.0.1:9", ADMISSION_TOKENIZER="qwen3", ADMISSION_TOKENIZE_ABOVE_BYTES="0")
    body = json.dumps({"model": "sim-model", "messages": [{"role": "wizard", "content": "hi"}]}).encode()
    assert (await estimate(est, body)).source == "prior"
    batch = json.dumps({"model": "sim-model", "prompt": ["a", "b"]}).encode()
    assert (await estimate(est, batch, "/v1/completions")).source == "prior"


async def test_the_old_estimate_is_one_switch_away(serve: Any) -> None:
    url = await serve(sim_app())
    est, metrics = estimator(url, ADMISSION_ESTIMATE="bytes", ADMISSION_BYTES_PER_TOKEN="4")
    cost = await estimate(est, chat("x" * 40_000, n=4))
    assert cost.source == "bytes" and cost.prompt_tokens == 10_000 and cost.sequences == 1
    assert sources(metrics) == {"bytes": 1}


def test_local_tokenizer_counting_matches_the_simulator_for_every_text_kind() -> None:
    local = LocalTokenizer("qwen3", TemplateOverhead())
    for kind in ("json", "cjk", "hex", "mixed"):
        content = sized_content(kind, 8192, seed=5, index=1)
        assert local.count(CHAT, chat(content)) == 8192


# --- a cold start ----------------------------------------------------------------------------


async def test_a_cold_start_burst_of_large_json_cjk_and_hex_prompts_is_never_under_counted(serve: Any) -> None:
    """Before any calibration, 65k-token prompts of the texts bytes/4 under-counts most, all at once."""
    url = await serve(sim_app())
    est, metrics = estimator(url)
    contents = {kind: sized_content(kind, 65_536, seed=6, index=i) for i, kind in enumerate(("json", "cjk", "hex"))}
    costs = await asyncio.gather(*(estimate(est, chat(c)) for c in contents.values()))
    for cost in costs:
        assert cost.source == "engine" and cost.prompt_tokens == 65_536
    assert sources(metrics) == {"engine": 3}


def test_when_the_engine_cannot_count_the_prior_is_safe_for_json_cjk_and_hex() -> None:
    """The cold-start prior (2.5 bytes a token) over-counts JSON and CJK on Qwen3 and Llama-3;
    hex (~1.1-1.8 bytes a token) is mostly digits, which count a token a byte with their neighbours."""
    overhead = TemplateOverhead()
    for name in ("qwen3", "llama3"):
        for kind in ("json", "cjk", "hex"):
            content = sized_content(kind, 8192, seed=7, index=0, tokenizer_name=name)
            estimate_ = prompt_from_bytes(scan_body(chat(content)), 2.5, 1.0, overhead)
            truth = get_tokenizer(name).count_chat([{"role": "user", "content": content}])
            assert estimate_ >= truth, (name, kind, estimate_ / truth)


async def test_calibration_follows_the_engine_counter_and_publishes_the_ratio(serve: Any) -> None:
    url = await serve(sim_app())
    est, metrics = estimator(url)
    engine = est._settings.engines[0].name
    content = sized_content("prose", 8192, seed=8, index=0)
    body = chat(content)
    facts = scan_body(body)
    est.observe(engine, 1_000.0, 1.0)
    for i in range(8):
        cost = await est.estimate(est._settings.engines[0], endpoint_for(CHAT), body, facts, 1_000.0 + 8192 * i,
                                  2.0 + i)
        est.admitted(engine, "sim-model", cost)
        est.observe(engine, 1_000.0 + 8192 * (i + 1), 2.5 + i)
        est.finished(engine, facts)
    bpt = metrics.registry.get_sample_value("admission_bytes_per_token", {"engine": engine})
    assert bpt == pytest.approx(4.0)  # prose (4.7 B/t) learned, bounded by the maximum
    ratio = metrics.registry.get_sample_value("admission_estimate_ratio", {"engine": engine, "model": "sim-model"})
    assert ratio == pytest.approx(1.0, abs=0.01)  # every prompt counted by the engine itself
    assert not math.isnan(ratio)


def test_exact_counts_teach_the_rate_within_a_few_prompts() -> None:
    # The engine's counter needs MIN_EVIDENCE_TOKENS (50,000) counted tokens: 49 prompts of the 1k
    # class before the prior gives way. An exact count is an exact sample: three of them suffice.
    cal = Calibration(prior=2.5, low=1.0, high=8.0, learn=True)
    o = TemplateOverhead()
    facts = scan_body(chat("x" * 3_300))
    for _ in range(3):
        assert cal.bytes_per_token() == (2.5, False)
        cal.counted(facts, o, 1_000 + o.tokens(facts))  # 3.3 bytes a token
    assert cal.bytes_per_token() == (pytest.approx(3.3), True)
    cal.counted(facts, o, o.tokens(facts))  # a prompt the template estimate covers wholly: no sample
    assert cal.samples == 3
    cal.reset()  # another engine (its counter went back): the samples go too
    assert cal.bytes_per_token() == (2.5, False)


async def test_prompts_under_the_threshold_use_the_rate_learned_from_the_engines_counts(serve: Any) -> None:
    url = await serve(sim_app())
    est, metrics = estimator(url)
    for i in range(3):  # large prompts: counted by the engine (> 8 KB)
        assert (await estimate(est, chat(sized_content("mixed", 4_000, seed=9, index=i)))).source == "engine"
    content = sized_content("mixed", 1_024, seed=9, index=9)  # ~3.7 KB: the bytes rule
    cost = await estimate(est, chat(content))
    truth = QWEN.count_chat([{"role": "user", "content": content}])
    assert cost.source == "learned"
    assert truth <= cost.prompt_tokens <= 1.1 * truth  # the prior (2.5 B/t) says 1.58x
    assert prompt_from_bytes(scan_body(chat(content)), 2.5, 1.0, est.overhead) > 1.5 * truth
