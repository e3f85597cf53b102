"""``python -m enginesim`` command line: parse flags, start the server, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from extproc.tokenizer import DEFAULT_TOKENIZER, TOKENIZERS

from .config import DP_ROUTING, PRESETS, SimConfig
from .metrics import DIALECTS
from .outputs import OutputLenModel
from .scheduler import DEFAULT_PROFILE, PROFILES, CostModel, MemoryBoundCostModel, SchedulerConfig
from .server import create_app, create_runner

__all__ = ["build_parser", "config_from_args", "main"]

log = logging.getLogger("enginesim")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, with a message naming what was wrong."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _output_len(text: str) -> str:
    try:
        return str(OutputLenModel.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for preset-dependent flags (their help names both presets)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _by_preset(key: str) -> str:
    values = ", ".join(f"{name}: {preset[key]}" for name, preset in PRESETS.items()
                       if key in preset)
    return f"default: the preset's; {values}"


LINEAR_COST_FLAGS = ("per_prefill_token_s", "per_decode_seq_s", "per_attention_pair_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m enginesim",
        description=(
            "A vLLM V1 engine simulator: OpenAI-compatible API, vllm:* metrics and "
            "the V1 scheduler (KV blocks, chunked prefill, preemption by recompute), with "
            "no GPU. --profile picks the vLLM version it behaves as; --preset the GPU "
            "geometry and step cost. Geometry flags left unset take the preset's value."),
        formatter_class=_HelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=_port, default=8000, help="port to listen on; 0 picks a free one")
    add("--model", default="sim-model", help="served model name (the only accepted `model`)")
    add("--profile", choices=list(PROFILES), default=DEFAULT_PROFILE,
        help="the vLLM scheduler to behave as. 'vllm-0.33' (today's defaults): a waiting "
             "request is admitted only if its whole prompt (plus outputs so far) fits in the "
             "free KV blocks (scheduler_reserve_full_isl), prefix caching keeps a finished or "
             "preempted request's blocks reusable until evicted (a preempted request "
             "recomputes only what was evicted), async scheduling runs one batch ahead "
             "(arrivals and freed slots join one batch later), and a preemption is counted "
             "when its victim next emits a token. 'vllm-0.11' (and any vLLM <= 0.18): admits "
             "a prompt when its first chunk fits, no prefix cache, synchronous steps, so a "
             "big prompt can be admitted and later preempted, recomputing from zero")
    add("--dialect", choices=list(DIALECTS), default="vllm",
        help="the metric names /metrics speaks: 'vllm' (vllm:*, the profile's exposition), 'sglang' "
             "(sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage, "
             "sglang:max_total_num_tokens, ...) or 'trtllm' (trtllm-serve's trtllm_num_requests_running, "
             "trtllm_kv_cache_utilization, trtllm_kv_cache_max_blocks, ...; one rank only); the engine "
             "behind them is the same")
    add("--preset", choices=list(PRESETS), default="small",
        help="engine geometry and cost model: 'small' is tiny and fast for tests; 'reference' "
             "is the reference engine (9527 blocks x 16, max_num_seqs 4, token budget 2048, "
             "max_model_len 131072, linear cost: ~525 tok/s prefill, 30 tok/s decode per "
             "sequence whatever the batch); 'h100-llama8b' is Llama-3.1-8B BF16 on one H100 "
             "80GB (27800 blocks x 16, max_num_seqs 1024, token budget 8192, memory-bound "
             "cost: a step reads the weights once plus every sequence's KV, so a lone "
             "sequence decodes at ~143 tok/s and 64 at ~4,770 tok/s); 'cpu-tiny' is the real vLLM "
             "CPU build of `realengine` (640 blocks x 32, max_num_seqs 4, token budget 2048, "
             "max_model_len 16384), its linear cost (with an attention term) fitted to "
             "`bench.calibrate_real`")
    add("--num-gpu-blocks", type=_positive_int, default=None,
        help=f"KV cache blocks per engine rank, including vLLM's reserved null block "
             f"({_by_preset('num_gpu_blocks')})")
    add("--block-size", type=_positive_int, default=None,
        help=f"tokens per KV block ({_by_preset('block_size')})")
    add("--max-num-seqs", type=_positive_int, default=None,
        help=f"most requests RUNNING at once per rank ({_by_preset('max_num_seqs')})")
    add("--max-num-batched-tokens", type=_positive_int, default=None,
        help=f"token budget of one step, chunked prefill "
             f"({_by_preset('max_num_batched_tokens')})")
    add("--max-model-len", type=_positive_int, default=None,
        help=f"context length: prompt + max_tokens limit ({_by_preset('max_model_len')})")
    add("--step-overhead-s", type=_non_negative_float, default=None,
        help=f"engine seconds every step costs ({_by_preset('step_overhead_s')})")
    add("--per-prefill-token-s", type=_non_negative_float, default=None,
        help=f"linear cost model only: engine seconds per prefill token in a step "
             f"({_by_preset('per_prefill_token_s')})")
    add("--per-decode-seq-s", type=_non_negative_float, default=None,
        help=f"linear cost model only: engine seconds per decoding sequence in a step "
             f"({_by_preset('per_decode_seq_s')})")
    add("--per-attention-pair-s", type=_non_negative_float, default=None,
        help=f"linear cost model only: engine seconds per query-key pair of causal attention in a "
             f"step, so a prefill chunk deep into a long prompt costs more ({_by_preset('per_attention_pair_s')}; "
             f"else 0)")
    add("--tokenizer", choices=TOKENIZERS, default=None,
        help=f"how prompt tokens are counted, as vLLM's usage.prompt_tokens counts them: a real "
             f"vocabulary and its chat template (per message, generation prompt, tools block); "
             f"'bytes4' is the old rule, ceil(UTF-8 bytes of the message contents / 4), no "
             f"template (default: {DEFAULT_TOKENIZER}; bytes4 when only --bytes-per-token is given)")
    add("--bytes-per-token", type=_positive_float, default=None,
        help="the bytes4 tokenizer's divisor: prompt tokens = ceil(UTF-8 bytes / this), at least "
             "1; given alone, it selects --tokenizer bytes4 (default 4)")
    add("--output-len", type=_output_len, default="max",
        help="where the model ends a sequence on its own (EOS, finish_reason 'stop'): 'max' "
             "never (every sequence runs to max_tokens, as with ignore_eos), 'fixed:N', "
             "'geometric:MEAN', 'lognormal:MEAN[:SIGMA]'; a request's ignore_eos: true always "
             "runs to its limit")
    add("--no-limit-len", type=_non_negative_int, default=16,
        help="with --output-len max: where the model ends (EOS, finish_reason 'stop') a request "
             "that sets no max_tokens, whose limit is the context left; 0: never, it generates "
             "up to the context left (as with ignore_eos)")
    add("--seed", type=int, default=0,
        help="seed of the stream that output lengths and generated texts are drawn from "
             "(a request's own `seed` takes precedence)")
    add("--default-max-tokens", type=_positive_int, default=None,
        help="cap on the output limit of a request that sets neither max_tokens nor "
             "max_completion_tokens (default: none, the context left, as vLLM)")
    add("--time-scale", type=_positive_float, default=1.0,
        help="run the engine this many times faster than real time; reported durations stay "
             "in engine seconds")
    add("--data-parallel-size", type=_positive_int, default=1,
        help="number of independent engine ranks (the `engine` label), each with its own KV "
             "cache and scheduler")
    add("--dp-routing", choices=DP_ROUTING, default="round-robin",
        help="how requests are spread over ranks: round-robin, or vLLM's least-loaded "
             "(lowest waiting*4 + running)")
    add("--max-num-queued-reqs", type=_non_negative_int, default=None,
        help="vLLM 0.33's API-server limit on unfinished requests (waiting + running, all "
             "ranks): a request that would exceed it gets HTTP 503; unset = no limit")
    add("--max-num-queued-tokens", type=_non_negative_int, default=None,
        help="vLLM 0.33's API-server limit on the prompt tokens of requests still in prefill "
             "(no token yet): once they reach it, new requests get HTTP 503; unset = no limit")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level")
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Merge flags over the preset; raises ValueError naming the bad setting."""
    preset: dict[str, Any] = dict(PRESETS[args.preset])
    memory_bound = preset.pop("memory_bound", None)
    if memory_bound is not None:
        given = [key for key in LINEAR_COST_FLAGS if getattr(args, key, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} applies to the linear cost model; preset {args.preset} "
                             "uses the memory-bound one")
    if memory_bound is None:
        preset.setdefault("per_attention_pair_s", 0.0)  # only cpu-tiny's model needs the term
    for key in preset:
        value = getattr(args, key, None)
        if value is not None:
            preset[key] = value
    cost: CostModel | MemoryBoundCostModel
    if memory_bound is not None:
        cost = MemoryBoundCostModel(step_overhead_s=preset["step_overhead_s"], **memory_bound)
    else:
        cost = CostModel(step_overhead_s=preset["step_overhead_s"],
                         per_prefill_token_s=preset["per_prefill_token_s"],
                         per_decode_seq_s=preset["per_decode_seq_s"],
                         per_attention_pair_s=preset["per_attention_pair_s"])
    scheduler = SchedulerConfig(
        num_gpu_blocks=preset["num_gpu_blocks"], block_size=preset["block_size"],
        max_num_seqs=preset["max_num_seqs"],
        max_num_batched_tokens=preset["max_num_batched_tokens"],
        max_model_len=preset["max_model_len"], cost=cost)
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = "bytes4" if args.bytes_per_token is not None else DEFAULT_TOKENIZER
    elif args.bytes_per_token is not None and tokenizer != "bytes4":
        raise ValueError(f"--bytes-per-token applies to --tokenizer bytes4, not {tokenizer}")
    return SimConfig(host=args.host, port=args.port, model=args.model, scheduler=scheduler,
                     bytes_per_token=args.bytes_per_token or 4.0, tokenizer=tokenizer,
                     output_len=args.output_len, seed=args.seed, no_limit_len=args.no_limit_len,
                     default_max_tokens=args.default_max_tokens, time_scale=args.time_scale,
                     data_parallel_size=args.data_parallel_size, dp_routing=args.dp_routing,
                     max_num_queued_reqs=args.max_num_queued_reqs,
                     max_num_queued_tokens=args.max_num_queued_tokens,
                     profile=args.profile, dialect=args.dialect)


async def serve(config: SimConfig) -> None:
    """Run until SIGTERM or SIGINT."""
    app = create_app(config)
    runner = create_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    print(f"enginesim listening on http://{config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("enginesim stopping")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("enginesim settings: %s", config.describe())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
