"""Named load scenarios for `bench.admission`: which requests, how big, and when they arrive.

A scenario is a list of `RequestSpec`s with arrival offsets in ENGINE seconds; the runner divides
them by the time scale. Everything is derived from the seed, so a scenario + seed is one fixed load.

Prompt sizes are exact in TRUE tokens: the simulator counts a chat request's prompt with a real
vocabulary and chat template (`enginesim --tokenizer`, default qwen3), and `bench.text` sizes
each request's single user message so that the simulator counts exactly the class's tokens,
template included, whatever the text (`--text prose|code|json|cjk|hex|mixed`, default mixed).
With `--tokenizer bytes4` (the simulator's old rule, ceil(UTF-8 bytes / 4)) a T-token prompt is
exactly 4*T bytes, and `--text hex` is the old benchmark text byte for byte. Each request's
content is distinct (its index and seed open it, the rest is drawn from the seed), so nothing
can be shared between requests even by an engine with a prefix cache. A 65,536-token prompt is
~280 KB of mixed text (~75 KB of hex), under the service's 1 MiB body cap (MAX_BODY_BYTES).

Prompt classes (name: prompt tokens, max_tokens):
    65k: 65,536 / 256     8k: 8,192 / 128     1k: 1,024 / 64     smoke: 256 / 16     short: 32 / 3

A scenario with a `concurrency` is closed-loop: that many clients each send their next request
as soon as the previous one ends (the arrival offsets are ignored), which is how chat load
generators (aiperf, vLLM's benchmark with --max-concurrency) drive an engine.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from enginesim.config import CPU_TINY_OUTPUT_LEN
from extproc.tokenizer import DEFAULT_TOKENIZER

from .text import DEFAULT_TEXT, sized_content

BYTES_PER_TOKEN = 4  # enginesim's bytes4 tokenizer


@dataclass(frozen=True)
class PromptClass:
    name: str
    prompt_tokens: int
    max_tokens: int
    # sent with vLLM's `ignore_eos: true` (the real engine's classes): the model generates
    # max_tokens whatever it samples, so a request's cost is fixed
    ignore_eos: bool = False


CLASSES: dict[str, PromptClass] = {
    c.name: c
    for c in (
        PromptClass("65k", 65_536, 256),
        PromptClass("8k", 8_192, 128),
        PromptClass("1k", 1_024, 64),
        PromptClass("smoke", 256, 16),
        # ~250 ms on the reference engine with four sequences decoding (a 73 ms step): a short
        # chat turn, the shape most real traffic has.
        PromptClass("short", 32, 3),
        # On h100-llama8b (Llama-3.1-8B on an H100; 444,800 tokens of KV, max-num-seqs 1024):
        # a reasoning turn (long generation: its KV grows for minutes after it was admitted) and
        # a RAG-style request (long prompt, short answer: prefill-bound).
        PromptClass("think", 1_000, 4_000),
        PromptClass("rag", 4_000, 64),
        # On the real vLLM (CPU build, realengine: 20,480 KV tokens, max-num-seqs 4, ~290 tok/s
        # decode for one sequence, ~900-1,300 with four). `decode`: a long streamed chat that
        # generates to its limit (1,500 + 6,000 = 7,500 tokens of KV: two fit beside each other,
        # a third does not, so four running outgrow the cache as they decode); `decode-eos`: the
        # same prompt, max_tokens 8,000, ended where the random-weight model samples its end token.
        PromptClass("decode", 1_500, 6_000, ignore_eos=True),
        PromptClass("decode-eos", 1_500, 8_000),
        # the seed's long-prompt burst on the real engine's geometry (65k and 8k scaled by
        # 20,480 / 152,416 KV tokens, to the nearest power of two)
        PromptClass("long", 8_192, 256, ignore_eos=True),
        PromptClass("mid", 1_024, 64, ignore_eos=True),
        # a short chat turn on the real engine (~20 ms of decode per token with four running)
        PromptClass("chat", 32, 16, ignore_eos=True),
        # mixed chat with a long-tail generation length (issue 22): each request's prompt is drawn
        # from 200-2,000 tokens (the class's prompt_tokens is the middle, for listings only) and
        # it ends where the model samples its end, far below a generous max_tokens. `longtail`:
        # h100-llama8b (the simulator draws the length: lognormal, see chat-longtail);
        # `longtail-real`: the real engine (its random-weight model's own end token decides).
        PromptClass("longtail", 1_100, 8_192),
        PromptClass("longtail-real", 1_100, 6_000),
    )
}

# steady: the mix of prompt classes (weights) for the Poisson stream.
STEADY_MIX: tuple[tuple[str, float], ...] = (("65k", 0.15), ("8k", 0.35), ("1k", 0.50))


@dataclass(frozen=True)
class RequestSpec:
    index: int
    cls: PromptClass
    at: float  # arrival offset, engine seconds

    @property
    def prompt_tokens(self) -> int:
        return self.cls.prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.cls.max_tokens


@dataclass(frozen=True)
class LoadShape:
    """The tunable parts of a scenario, all in engine seconds."""

    rate: float = 0.03  # steady: arrivals per engine second
    duration: float = 600.0  # steady: engine seconds of arrivals
    spacing: float = 0.5  # bursts: engine seconds between consecutive sends
    concurrency: int | None = None  # closed loop: clients sending back to back (None: the scenario's)
    count: int | None = None  # closed loop: requests in all (None: the scenario's)
    deadline: float | None = None  # engine seconds a client waits before giving up (None: the scenario's)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    build: Callable[[random.Random, LoadShape], list[RequestSpec]]
    time_scale: float = 20.0  # default K: poll interval 2/K = 0.1 s, and a run under a minute
    concurrency: int | None = None  # closed loop with this many clients (arrival offsets ignored)
    preset: str = "reference"  # the simulator's geometry and cost model (enginesim --preset)
    sim_args: tuple[str, ...] = ()  # flags after the preset (a scenario's own geometry)
    deadline: float | None = None  # engine seconds after which a client gives up and disconnects
    # the gateway's limits for this scenario, unless given on the command line
    limits: tuple[tuple[str, float], ...] = ()
    # vllm-builtin's --max-num-queued-reqs, where the gate is bound by KV rather than max in-flight
    builtin_queued_reqs: int | None = None
    # for the real vLLM (bench.admission --engine real / --engine-url): wall clock, prompts sized
    # on the engine's own tokenizer; the simulator's scenarios refuse it. These also run on the
    # simulator (preset cpu-tiny, the real engine's geometry and costs): the fidelity check.
    real: bool = False
    spacing: float | None = None  # a burst's default spacing, engine seconds (None: LoadShape's 0.5)


def prompt_content(spec: RequestSpec, seed: int, text: str = DEFAULT_TEXT,
                   tokenizer: str = DEFAULT_TOKENIZER) -> str:
    """A user message whose chat request the simulator's `tokenizer` counts at exactly the
    class's prompt tokens, distinct per request and seed (see bench.text)."""
    head = f"[bench request {spec.index} seed {seed} class {spec.cls.name}] "
    return sized_content(text, spec.prompt_tokens, seed, spec.index, head=head, tokenizer_name=tokenizer)


def _burst(counts: dict[str, int], shuffle: bool = True) -> Callable[[random.Random, LoadShape], list[RequestSpec]]:
    """A burst, `spacing` engine seconds apart, in a seeded random order (or as listed).

    The small spacing fixes the order in which the requests reach the engine (sent all at once,
    262 KB and 32 KB bodies race through Envoy and the service, and the order changes from run to
    run); with the default 0.5 s, 17 requests land within 8 engine seconds (two 2048-token
    prefill steps), long before the first one finishes.
    """

    def build(rng: random.Random, shape: LoadShape) -> list[RequestSpec]:
        names = [name for name, n in counts.items() for _ in range(n)]
        if shuffle:
            rng.shuffle(names)
        return [RequestSpec(i, CLASSES[name], i * shape.spacing) for i, name in enumerate(names)]

    return build


def _arrivals(rng: random.Random, rate: float, duration: float, pick: Callable[[], str]) -> list[RequestSpec]:
    """Poisson arrivals at `rate` per engine second for `duration` engine seconds; `pick` names each class."""
    specs: list[RequestSpec] = []
    t = rng.expovariate(rate)
    while t < duration:
        specs.append(RequestSpec(len(specs), CLASSES[pick()], t))
        t += rng.expovariate(rate)
    return specs


def _poisson_sized(name: str, rate: float, duration: float, low: int, high: int
                   ) -> Callable[[random.Random, LoadShape], list[RequestSpec]]:
    """Poisson arrivals of one class, each request's prompt drawn uniformly from [low, high] tokens."""

    def build(rng: random.Random, shape: LoadShape) -> list[RequestSpec]:
        specs = _arrivals(rng, rate, duration, lambda: name)
        return [dataclasses.replace(s, cls=dataclasses.replace(s.cls, prompt_tokens=rng.randint(low, high)))
                for s in specs]

    return build


def _poisson(name: str, rate: float, duration: float) -> Callable[[random.Random, LoadShape], list[RequestSpec]]:
    """Poisson arrivals of one class at `rate` per engine second for `duration` engine seconds."""
    return lambda rng, shape: _arrivals(rng, rate, duration, lambda: name)


def _steady(rng: random.Random, shape: LoadShape) -> list[RequestSpec]:
    """Poisson arrivals at `rate` per engine second over `duration` engine seconds, mixed sizes."""
    names = [name for name, _ in STEADY_MIX]
    weights = [w for _, w in STEADY_MIX]
    return _arrivals(rng, shape.rate, shape.duration, lambda: rng.choices(names, weights)[0])


def _closed_loop(name: str, count: int) -> Callable[[random.Random, LoadShape], list[RequestSpec]]:
    """`count` requests of one class (or --count), sent by the scenario's clients back to back."""

    def build(rng: random.Random, shape: LoadShape) -> list[RequestSpec]:
        return [RequestSpec(i, CLASSES[name], 0.0) for i in range(shape.count or count)]

    return build


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("reference-65k", "2 x 65k + 15 x 8k prompts in a burst (the reference acceptance test)",
                 seed=65, build=_burst({"65k": 2, "8k": 15})),
        Scenario("three-65k", "3 x 65k then 8 x 8k prompts in a burst: the three big ones alone need more KV "
                 "than the engine holds (3 x 65,792 > 152,416 tokens) and all fit under max-num-seqs 4",
                 # preemption thrash makes this the longest run: 1,315 engine s, 53 s at K=25
                 seed=3, build=_burst({"65k": 3, "8k": 8}, shuffle=False), time_scale=25.0),
        Scenario("steady", "Poisson arrivals at --rate per engine second for --duration engine seconds; "
                 "mix " + ", ".join(f"{w:.0%} {n}" for n, w in STEADY_MIX),
                 seed=7, build=_steady),
        Scenario("short", "400 short chat requests (32-token prompt, 3 tokens, ~250 ms each) from --concurrency "
                 "clients back to back (default 8): does the gate keep the engine busy?",
                 # real time: the gateway's per-request cost is not scaled, and at K=20 it would be
                 # as long as a whole request
                 seed=11, build=_closed_loop("short", 400), time_scale=1.0, concurrency=8),
        Scenario("reasoning", "40 reasoning turns (1,000-token prompt, 4,000 generated) in a burst on h100-llama8b "
                 "with its KV cut to 8,000 blocks (128k tokens, as if the GPU were shared): every prompt fits at "
                 "once, but 40 x 5,000 = 200,000 tokens of KV outgrow the cache while they decode",
                 # real time: 160,000 streamed tokens are as much as the 2-core machine's clients,
                 # Envoy and simulator can carry in ~80 s; faster, the sends fall behind the schedule
                 seed=21, build=_burst({"think": 40}), time_scale=1.0, preset="h100-llama8b",
                 sim_args=("--num-gpu-blocks", "8000", "--max-model-len", "32768"),
                 limits=(("max_inflight", 1024), ("queue_depth", 64), ("park_cap", 1800.0))),
        Scenario("reasoning-eos", "reasoning, but each turn ends where the model samples its end (lognormal, mean "
                 "1,500 tokens, sigma 0.7) well below max_tokens 4,000: what a budget that reserves max_tokens "
                 "over-reserves, and what an expected length learned from vllm:request_generation_tokens would save",
                 seed=21, build=_burst({"think": 40}), time_scale=1.0, preset="h100-llama8b",
                 sim_args=("--num-gpu-blocks", "8000", "--max-model-len", "32768",
                           "--output-len", "lognormal:1500:0.7"),
                 limits=(("max_inflight", 1024), ("queue_depth", 64), ("park_cap", 1800.0))),
        Scenario("overload", "RAG requests (4,000-token prompt, 64 generated) arriving at 2.5x what h100-llama8b "
                 "can prefill (Poisson, 16/s for 60 s); each client gives up after 20 s and disconnects",
                 seed=33, build=_poisson("rag", 16.0, 60.0), time_scale=1.0, preset="h100-llama8b",
                 deadline=20.0, limits=(("max_inflight", 1024), ("queue_depth", 64), ("park_cap", 20.0)),
                 # what the KV budget lets in (444,800 / 4,064 = 109) + the park
                 builtin_queued_reqs=109 + 64),
        Scenario("chat-longtail", "mixed chat with a long-tail generation length on h100-llama8b (KV cut to 1,500 "
                 "blocks, 24k tokens): Poisson arrivals at 4/s for 60 s, prompts 200-2,000 tokens, each turn "
                 "ending where the model samples its end (lognormal, mean 400 tokens, sigma 1.2: median ~195, "
                 "1 in 100 beyond ~3,000) below a generous max_tokens 8,192",
                 # real time, like reasoning: ~100,000 streamed tokens over ~80 s (what the 2-core
                 # machine's clients carry). The running set's KV (~10-20 requests) outgrows 24k
                 # tokens only when the tail is in it: no gate, 5 preemptions in one run here (0 at
                 # 40k and 64k tokens on a quiet machine, 13 at 64k on a loaded one).
                 seed=51, build=_poisson_sized("longtail", 4.0, 60.0, 200, 2_000), time_scale=1.0,
                 preset="h100-llama8b",
                 sim_args=("--num-gpu-blocks", "1500", "--max-model-len", "16384",
                           "--output-len", "lognormal:400:1.2"),
                 limits=(("max_inflight", 1024), ("queue_depth", 64), ("park_cap", 1800.0))),
        Scenario("smoke", "6 small prompts (256 tokens, max_tokens 16) in a burst: a quick check of the harness",
                 # K = 4, not the default 20: the scaled poll interval (0.5 s) and stale threshold are then
                 # long enough that a machine with four busy loops beside the test suite still polls in
                 # time (at 0.1 s it counted stale transitions); the run's wall time is its start-up.
                 seed=1, build=_burst({"smoke": 6}), time_scale=4.0),
        # The real vLLM (CPU build; realengine's geometry). Wall clock: time_scale 1, and the
        # offsets and deadlines below are wall seconds. Each runs in at most ~3 minutes here.
        Scenario("real-decode", "10 streaming chats (1,500-token prompt, max_tokens 6,000, ignore_eos) in a burst: "
                 "decode-heavy to the limit; four running need 30,000 tokens of KV against 20,480",
                 seed=41, build=_burst({"decode": 10}), time_scale=1.0, real=True, preset="cpu-tiny"),
        Scenario("real-decode-eos", "real-decode with max_tokens 8,000 and natural ends: each chat ends where the "
                 "random-weight model samples its end token (lengths vary; none reaches its limit by design)",
                 seed=41, build=_burst({"decode-eos": 10}), time_scale=1.0, real=True, preset="cpu-tiny",
                 # on the simulator: the real model's measured output lengths (enginesim/config.py, cpu-tiny)
                 sim_args=("--output-len", CPU_TINY_OUTPUT_LEN)),
        Scenario("real-burst", "the seed's long-prompt burst on the real engine: 2 x 8k + 15 x 1k prompts "
                 "(reference-65k scaled to 20,480 KV tokens; 33,216 tokens of need in all), 50 ms apart",
                 # a 1k request takes ~0.2 s here: 0.5 s apart they would never meet
                 # queue depth 16, as the simulator's bursts are measured: 17 requests, none turned away
                 seed=65, build=_burst({"long": 2, "mid": 15}), time_scale=1.0, real=True, spacing=0.05,
                 limits=(("queue_depth", 16),), preset="cpu-tiny"),
        Scenario("real-overload", "RAG requests (4,000-token prompt, 64 generated) at ~1.5x what the real engine "
                 "prefills (Poisson, 6/s for 30 s); each client gives up after 20 s",
                 seed=33, build=_poisson("rag", 6.0, 30.0), time_scale=1.0, deadline=20.0,
                 limits=(("park_cap", 20.0),), real=True, preset="cpu-tiny"),
        Scenario("real-chat-longtail", "chat-longtail on the real engine's geometry (20,480 KV tokens, 4 sequences, "
                 "~1k tok/s decode): Poisson arrivals at 0.6/s for 50 s, prompts 200-2,000 tokens, max_tokens "
                 "6,000, natural ends (the random-weight model's own end token: lengths vary widely)",
                 seed=51, build=_poisson_sized("longtail-real", 0.6, 50.0, 200, 2_000), time_scale=1.0, real=True,
                 preset="cpu-tiny", sim_args=("--output-len", CPU_TINY_OUTPUT_LEN)),
        Scenario("real-short", "40 short chats (32-token prompt, 16 tokens, ignore_eos) from 8 clients back to back: "
                 "the shortest real-engine scenario (the smoke test's)",
                 seed=11, build=_closed_loop("chat", 40), time_scale=1.0, concurrency=8, real=True,
                 preset="cpu-tiny"),
    )
}


def build_requests(name: str, seed: int | None = None, shape: LoadShape = LoadShape()) -> tuple[list[RequestSpec], int]:
    """The scenario's requests and the seed used."""
    scenario = SCENARIOS[name]
    used = scenario.seed if seed is None else seed
    return scenario.build(random.Random(used), shape), used
