"""Measure the real vLLM's step costs and output lengths: the figures enginesim's `cpu-tiny` preset is fitted to.

    python -m realengine 18431 &                       # the real engine (40-100 s to start)
    python -m bench.calibrate_real --engine-url http://127.0.0.1:18431 [--repeats 3] [--eos 12]

Talks to the engine directly (no Envoy, no gate), one measurement at a time so that nothing of its
own competes with it, and prints a table, then ONE JSON object as the last line of stdout. Every
figure carries the machine's 1-minute load average (`/proc/loadavg`) read when it was taken: the
machine is shared, and a loaded one stretches every step.

- **Prefill**: one streamed chat at a time, prompts of 256..8,192 true tokens (sized on the
  engine's own `/tokenize`, distinct per request so the prefix cache never helps), `max_tokens` 1.
  Per request: the engine's `vllm:request_prefill_time_seconds` (its sum's difference over the
  request) and the client's TTFT. Fitted to the median per size: prefill seconds = `steps x
  step_overhead_s + tokens x per_prefill_token_s + tokens (tokens + 1) / 2 x per_attention_pair_s`
  (the causal attention's query-key pairs: on a model this small they dominate long prompts),
  with `steps = ceil(tokens / max_num_batched_tokens)` and the step overhead from the decode fit.
- **Decode**: B = 1..4 streamed chats started together (`--decode-prompt` tokens each, default
  32 and 1,500: a short and a real-decode context), `max_tokens` `--decode-tokens`, `ignore_eos`.
  The step time is the engine's `vllm:inter_token_latency_seconds` (sum / count over the batch);
  they start and end together, so each step decodes all B. Beside it the client's `(last token -
  first token) / (tokens - 1)`, which bunches when the API server lags on a loaded machine.
  Fitted: step seconds = `step_overhead_s + B x per_decode_seq_s` (least squares over the
  median of each B).
- **Output length** (`--eos N`): N chats shaped like real-decode-eos (1,500-token prompt,
  `max_tokens` 8,000, natural end), 4 at a time; the lengths from each stream's usage and the
  engine's `vllm:request_generation_tokens` histogram over them; fitted: a lognormal's mean and
  sigma (of the log), enginesim's `--output-len lognormal:MEAN:SIGMA`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from devstack import engine_models, http_get

from .admission import BenchConfig, _metric_samples, real_prompt_content
from .scenarios import PromptClass, RequestSpec

PREFILL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 2, 3, 4)
MAX_BATCHED_TOKENS = 2048  # realengine.MAX_BATCHED_TOKENS (not imported: realengine pulls in devstack's children)
REQUEST_TIMEOUT_S = 300.0  # wall seconds one calibration request may take on a loaded machine
HISTOGRAMS = ("vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_generation_tokens")


def load() -> float:
    """The machine's 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def histograms(engine_url: str) -> dict[str, dict[str, Any]]:
    """Sum, count and cumulative buckets of the HISTOGRAMS families, summed over the engine's ranks."""
    status, body = http_get(f"{engine_url}/metrics", timeout=30.0)
    if status != 200:
        raise RuntimeError(f"{engine_url}/metrics answered {status}")
    out: dict[str, dict[str, Any]] = {h: {"sum": 0.0, "count": 0.0, "buckets": {}} for h in HISTOGRAMS}
    for name, labels, value in _metric_samples(body.decode()):
        for family in HISTOGRAMS:
            if name == family + "_sum":
                out[family]["sum"] += value
            elif name == family + "_count":
                out[family]["count"] += value
            elif name == family + "_bucket":
                le = float(labels["le"])
                out[family]["buckets"][le] = out[family]["buckets"].get(le, 0.0) + value
    return out


def hist_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {"sum": after["sum"] - before["sum"], "count": after["count"] - before["count"],
            "buckets": {le: n - before["buckets"].get(le, 0.0) for le, n in sorted(after["buckets"].items())}}


@dataclass
class Stream:
    """One streamed chat's timeline (wall, monotonic clock)."""

    sent: float = 0.0
    tokens_at: list[float] = field(default_factory=list)  # when each content chunk arrived
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.tokens_at[0] - self.sent

    def step_time(self) -> float | None:
        """Seconds per generated token after the first (the decode step time)."""
        n = self.completion_tokens
        if n < 2 or len(self.tokens_at) < 2:
            return None
        return (self.tokens_at[-1] - self.tokens_at[0]) / (n - 1)


async def stream_chat(session: aiohttp.ClientSession, url: str, model: str, content: str, max_tokens: int,
                      ignore_eos: bool) -> Stream:
    """One streamed chat completion, read chunk by chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    out = Stream(sent=time.monotonic())
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"the engine answered {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.monotonic()
            for choice in chunk.get("choices") or []:
                if choice.get("delta", {}).get("content"):
                    out.tokens_at.append(now)
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
    if not out.tokens_at:  # a token with no text: its arrival is the end of the stream
        out.tokens_at.append(time.monotonic())
    return out


class Calibration:
    def __init__(self, engine_url: str, model: str) -> None:
        self.url = engine_url
        self.model = model
        self.cfg = BenchConfig(scenario="real-decode", mode="none", engine="real", engine_url=engine_url, model=model)
        self.index = 0  # every prompt distinct: no prefix-cache hit between measurements

    def prompt(self, tokens: int) -> str:
        self.index += 1
        spec = RequestSpec(self.index, PromptClass(f"calib{tokens}", tokens, 1), 0.0)
        return real_prompt_content(self.cfg, spec, seed=2026)

    async def prefill(self, session: aiohttp.ClientSession, tokens: int) -> dict[str, Any]:
        content = self.prompt(tokens)
        before = histograms(self.url)
        begin_load = load()
        stream = await stream_chat(session, self.url, self.model, content, 1, True)
        after = await self._settled(before, "vllm:request_prefill_time_seconds", 1)
        prefill = hist_delta(after["vllm:request_prefill_time_seconds"], before["vllm:request_prefill_time_seconds"])
        return {"prompt_tokens": stream.prompt_tokens, "engine_prefill_s": round(prefill["sum"], 4),
                "client_ttft_s": round(stream.ttft, 4), "load": max(begin_load, load())}

    async def decode(self, session: aiohttp.ClientSession, batch: int, prompt_tokens: int,
                     max_tokens: int) -> dict[str, Any]:
        contents = [self.prompt(prompt_tokens) for _ in range(batch)]
        before = histograms(self.url)
        begin_load = load()
        streams = await asyncio.gather(*(stream_chat(session, self.url, self.model, c, max_tokens, True)
                                         for c in contents))
        after = await self._settled(before, "vllm:inter_token_latency_seconds", batch * (max_tokens - 1))
        itl = hist_delta(after["vllm:inter_token_latency_seconds"], before["vllm:inter_token_latency_seconds"])
        steps = [s for s in (st.step_time() for st in streams) if s is not None]
        return {"batch": batch, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                "client_step_s": round(statistics.mean(steps), 5),
                "engine_itl_s": round(itl["sum"] / itl["count"], 5) if itl["count"] else None,
                "tok_s": round(batch / statistics.mean(steps), 1), "load": max(begin_load, load())}

    async def eos(self, session: aiohttp.ClientSession, n: int, concurrency: int = 4) -> dict[str, Any]:
        contents = [self.prompt(1500) for _ in range(n)]
        before = histograms(self.url)
        begin_load = load()
        gate = asyncio.Semaphore(concurrency)

        async def one(content: str) -> Stream:
            async with gate:
                return await stream_chat(session, self.url, self.model, content, 8000, False)

        streams = await asyncio.gather(*(one(c) for c in contents))
        after = await self._settled(before, "vllm:request_generation_tokens", n)
        hist = hist_delta(after["vllm:request_generation_tokens"], before["vllm:request_generation_tokens"])
        lengths = sorted(s.completion_tokens for s in streams)
        logs = [math.log(x) for x in lengths if x > 0]
        sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
        return {"n": n, "lengths": lengths, "mean": round(statistics.mean(lengths), 1),
                "median": statistics.median(lengths), "log_sigma": round(sigma, 3),
                "finish_reasons": sorted({s.finish_reason or "?" for s in streams}),
                "engine_histogram_mean": round(hist["sum"] / hist["count"], 1) if hist["count"] else None,
                "engine_histogram_buckets": {f"{le:g}": int(c) for le, c in hist["buckets"].items()},
                "load": max(begin_load, load())}

    async def _settled(self, before: dict[str, Any], family: str, want: float,
                       timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """The histograms once `family` counted `want` more observations (the engine's stats
        reach /metrics a step or so after the stream ends), or as they are after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            after = await asyncio.to_thread(histograms, self.url)
            if after[family]["count"] - before[family]["count"] >= want or time.monotonic() > deadline:
                return after
            await asyncio.sleep(0.2)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def fit(prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> dict[str, float]:
    """The linear cost model: step = overhead + decoding sequences x b + prefill tokens x a + attention pairs x c.

    Decode: the engine's inter-token latency (the client's chunk times bunch when the API server
    lags), its median per batch size over every repeat and context (one stretched run on a loaded
    machine must not drag the fit; the context, 32 or 1,500 tokens, changed nothing measurable),
    against the batch. Prefill: the median per prompt size, less each chunk's step overhead, against
    the prompt's tokens and its causal attention pairs, P (P + 1) / 2, through the origin."""
    by_batch: dict[int, list[float]] = {}
    for d in decode:
        if d["engine_itl_s"] is not None:
            by_batch.setdefault(d["batch"], []).append(d["engine_itl_s"])
    batches = sorted(by_batch)
    overhead, per_seq = fit_line(batches, [statistics.median(by_batch[b]) for b in batches])
    by_size: dict[int, list[float]] = {}
    for p in prefill:
        by_size.setdefault(p["prompt_tokens"], []).append(p["engine_prefill_s"])
    sizes = sorted(by_size)
    ys = [statistics.median(by_size[n]) - math.ceil(n / MAX_BATCHED_TOKENS) * overhead for n in sizes]
    # relative errors (each row divided by its y): a 256-token prompt's 9 ms counts as much as an 8k one's 1 s
    xs = [(n / y, n * (n + 1) / 2 / y) for n, y in zip(sizes, ys, strict=True)]
    ys = [1.0] * len(ys)
    # normal equations of y = a x1 + c x2
    s11 = sum(x1 * x1 for x1, _ in xs)
    s12 = sum(x1 * x2 for x1, x2 in xs)
    s22 = sum(x2 * x2 for _, x2 in xs)
    t1 = sum(x1 * y for (x1, _), y in zip(xs, ys, strict=True))
    t2 = sum(x2 * y for (_, x2), y in zip(xs, ys, strict=True))
    det = s11 * s22 - s12 * s12
    per_token = (t1 * s22 - t2 * s12) / det
    per_pair = (s11 * t2 - s12 * t1) / det
    return {"step_overhead_s": round(overhead, 6), "per_decode_seq_s": round(per_seq, 6),
            "per_prefill_token_s": round(per_token, 10), "per_attention_pair_s": round(per_pair, 13)}


async def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    url = args.engine_url.rstrip("/")
    models, reason = engine_models(url)
    if not models:
        raise SystemExit(f"the engine at {url} lists no model ({reason})")
    cal = Calibration(url, models[0])
    result: dict[str, Any] = {"engine_url": url, "model": models[0], "prefill": [], "decode": []}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # a fresh connection per request: vLLM closes a keep-alive connection idle for 5 s, and sizing the
    # next prompts on /tokenize takes longer than that ("Can not write request body")
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await stream_chat(session, url, models[0], cal.prompt(64), 4, True)  # warm-up, not measured
        for _ in range(args.repeats):
            for size in args.prefill_sizes:
                row = await cal.prefill(session, size)
                result["prefill"].append(row)
                print(f"prefill {row}", file=sys.stderr, flush=True)
            for prompt in args.decode_prompt:
                for batch in DECODE_BATCHES:
                    row = await cal.decode(session, batch, prompt, args.decode_tokens)
                    result["decode"].append(row)
                    print(f"decode {row}", file=sys.stderr, flush=True)
        if args.eos:
            result["eos"] = await cal.eos(session, args.eos)
            print(f"eos {result['eos']}", file=sys.stderr, flush=True)
    result["fit"] = fit(result["prefill"], result["decode"])
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"engine {result['engine_url']} model {result['model']}", "",
             f"{'prompt':>8}{'engine prefill s':>18}{'client ttft s':>15}{'tok/s':>9}{'load':>7}"]
    for p in result["prefill"]:
        rate = p["prompt_tokens"] / p["engine_prefill_s"] if p["engine_prefill_s"] else float("nan")
        lines.append(f"{p['prompt_tokens']:>8}{p['engine_prefill_s']:>18.4f}{p['client_ttft_s']:>15.4f}"
                     f"{rate:>9.0f}{p['load']:>7.2f}")
    lines += ["", f"{'batch':>6}{'context':>9}{'client step s':>15}{'engine itl s':>14}{'tok/s':>8}{'load':>7}"]
    for d in result["decode"]:
        itl = f"{d['engine_itl_s']:.5f}" if d["engine_itl_s"] is not None else "-"
        lines.append(f"{d['batch']:>6}{d['prompt_tokens']:>9}{d['client_step_s']:>15.5f}{itl:>14}"
                     f"{d['tok_s']:>8.1f}{d['load']:>7.2f}")
    if "eos" in result:
        e = result["eos"]
        lines += ["", f"output lengths (natural end, max_tokens 8000): n {e['n']}, mean {e['mean']}, median "
                  f"{e['median']}, sigma of log {e['log_sigma']}, engine histogram mean {e['engine_histogram_mean']}, "
                  f"load {e['load']:.2f}", f"  {e['lengths']}"]
    f = result["fit"]
    lines += ["", f"fit: step_overhead_s {f['step_overhead_s']}, per_decode_seq_s {f['per_decode_seq_s']}, "
              f"per_prefill_token_s {f['per_prefill_token_s']}, per_attention_pair_s {f['per_attention_pair_s']}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate_real", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine-url", required=True, help="the real vLLM (e.g. `python -m realengine 18431`)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the prefill and decode measurements")
    parser.add_argument("--prefill-sizes", type=int, nargs="+", default=list(PREFILL_SIZES), help="prompt tokens")
    parser.add_argument("--decode-prompt", type=int, nargs="+", default=[32, 1500],
                        help="prompt tokens of the decoding requests (their context)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="tokens each decoding request generates")
    parser.add_argument("--eos", type=int, default=12, help="natural-end requests to measure output lengths (0: none)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.decode_tokens < 2 or args.eos < 0:
        parser.error("--repeats >= 1, --decode-tokens >= 2 and --eos >= 0")
    result = asyncio.run(calibrate(args))
    print(render(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
