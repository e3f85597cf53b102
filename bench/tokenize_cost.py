"""What the engine's exact prompt count (`POST /tokenize`) costs against the prompt's size, and how
far the bytes rule is from it (bench/README.md, "Prompt estimates that do not waste").

    .venv/bin/python -m realengine 18731 &      # or any vLLM serving /tokenize
    .venv/bin/python -m bench.tokenize_cost --engine-url http://127.0.0.1:18731

For each prompt size (`bench.text` mixed text sized in Qwen3 tokens, as the benchmark's prompts are;
the engine's own count differs), one-message chat bodies, distinct per call so that no cache can
answer, are counted `--reps` times over one kept-alive connection, the way the service's
estimator asks (extproc/tokencount.py). Prints per size: body bytes, the engine's count, text bytes
per token, the bytes rule's over-reservation at the prior 2.5 bytes/token, and the round trip
(median and p95, wall ms). `--busy N` keeps N streaming chats decoding beside the measurement (the
engine's API server is then shared, as it is in service).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence

from bench.text import sized_content

SIZES = (32, 128, 512, 1_024, 2_048, 8_192)  # prompt tokens on the simulator's tokenizer (qwen3)
PRIOR_BYTES_PER_TOKEN = 2.5  # ADMISSION_BYTES_PER_TOKEN's default


def _model(conn: http.client.HTTPConnection) -> str:
    conn.request("GET", "/v1/models")
    return str(json.loads(conn.getresponse().read())["data"][0]["id"])


def _busy(url: urllib.parse.SplitResult, model: str, halt: threading.Event) -> None:
    """One client streaming long generations until `halt` (keeps the engine decoding)."""
    while not halt.is_set():
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=120)
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello " * 200}],
                           "max_tokens": 2_000, "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = conn.getresponse()
        while not halt.is_set() and response.read(4096):
            pass
        conn.close()


def measure(engine_url: str, sizes: Sequence[int], reps: int, busy: int, seed: int = 7) -> list[dict[str, float]]:
    url = urllib.parse.urlsplit(engine_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    model = _model(conn)
    halt = threading.Event()
    loaders = [threading.Thread(target=_busy, args=(url, model, halt), daemon=True) for _ in range(busy)]
    for t in loaders:
        t.start()
    rows = []
    try:
        if busy:
            time.sleep(3.0)  # let the generations start (a fixed warm-up, not a synchronisation)
        for size in sizes:
            times, counts, texts = [], [], []
            for rep in range(reps):
                text = sized_content("mixed", size, seed, size * 1000 + rep)
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                                   "add_generation_prompt": True}).encode()
                t0 = time.perf_counter()
                try:
                    conn.request("POST", "/tokenize", body, {"content-type": "application/json"})
                    answer = json.loads(conn.getresponse().read())
                except (ConnectionError, http.client.HTTPException):  # vLLM closes idle connections after 5 s
                    conn.close()
                    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
                    t0 = time.perf_counter()
                    conn.request("POST", "/tokenize", body, {"content-type": "application/json"})
                    answer = json.loads(conn.getresponse().read())
                times.append((time.perf_counter() - t0) * 1000)
                counts.append(int(answer["count"]))
                texts.append(len(text.encode()))
            times.sort()
            tokens, text_bytes = statistics.mean(counts), statistics.mean(texts)
            rows.append({"text_bytes": round(text_bytes), "body_bytes": round(text_bytes + 60),
                         "tokens": round(tokens), "bytes_per_token": round(text_bytes / tokens, 2),
                         "prior_over_reservation": round(text_bytes / PRIOR_BYTES_PER_TOKEN / tokens, 2),
                         "rtt_p50_ms": round(statistics.median(times), 2),
                         "rtt_p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 2)})
    finally:
        halt.set()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tokenize_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--busy", type=int, default=0, help="streaming chats decoding beside the measurement")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt tokens (qwen3), comma-separated")
    args = parser.parse_args(argv)
    rows = measure(args.engine_url, [int(s) for s in args.sizes.split(",")], args.reps, args.busy)
    print(f"{'text B':>8}{'tokens':>8}{'B/tok':>7}{'prior x':>8}{'rtt p50 ms':>11}{'rtt p95 ms':>11}")
    for r in rows:
        print(f"{r['text_bytes']:>8}{r['tokens']:>8}{r['bytes_per_token']:>7}{r['prior_over_reservation']:>8}"
              f"{r['rtt_p50_ms']:>11}{r['rtt_p95_ms']:>11}")
    print(json.dumps({"engine_url": args.engine_url, "busy": args.busy, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
