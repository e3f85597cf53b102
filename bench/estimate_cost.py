"""What each prompt-estimate source costs per 8k / 65k-token prompt, and how long it stalls the
event loop (bench/README.md, "The token estimate").

    .venv/bin/python -m bench.estimate_cost

Starts a `reference`-preset simulator (Qwen3) as the engine, builds a Qwen3 tokenizer.json from
the simulator's vocabulary for the Hugging Face path (`qwen3_tokenizer_json`), and times
`extproc.tokencount.Estimator.estimate` per source (median of 7 runs, wall ms) while a 0.5 ms
ticker measures the longest the event loop went without running.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.text import sized_content
from extproc.bodyscan import scan_body
from extproc.config import load_settings
from extproc.endpoints import endpoint_for
from extproc.metrics import Metrics
from extproc.tokencount import Estimator

# A tiktoken-style vocabulary as a Hugging Face tokenizer.json, the way transformers converts one
# (byte-level BPE, merges recovered from the ranks), with Qwen2's pre-tokenizer regex and NFC.
PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
       r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

def _bytes_to_unicode() -> dict[int, str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def qwen3_tokenizer_json(path: Path) -> Path:
    import quicktok
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    enc = quicktok.get_encoding("qwen3")
    B2U = _bytes_to_unicode()
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for i in range(enc.max_token_value + 1):
        if enc.is_special_token(i):
            specials[enc.decode_single_token_bytes(i).decode()] = i
            continue
        try:
            ranks[enc.decode_single_token_bytes(i)] = i
        except (KeyError, ValueError):
            pass
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        local = []
        for k in range(1, len(token)):
            a, b = token[:k], token[k:]
            if a in ranks and b in ranks and ranks[a] < rank and ranks[b] < rank:
                local.append((ranks[a], ranks[b], a, b))
        local.sort()
        merges.extend((rank, a, b) for _, _, a, b in local)
    merges.sort(key=lambda m: m[0])

    def u(token: bytes) -> str:
        return "".join(B2U[x] for x in token)

    vocab = {u(t): r for t, r in ranks.items()}
    model = models.BPE(vocab=vocab, merges=[(u(a), u(b)) for _, a, b in merges], ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in sorted(specials, key=lambda s: specials[s])])
    tok.save(str(path))
    return path




def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def body(kind: str, tokens: int, i: int = 0) -> bytes:
    content = sized_content(kind, tokens, seed=12, index=i)
    return json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 16}).encode()


async def measure(hf_path: Path) -> None:
    import aiohttp

    port = free_port()
    # Started once before anything is measured, so the loop blocking for the fork costs nothing here.
    sim = subprocess.Popen([sys.executable, "-m", "enginesim", "--preset", "reference", "--port", str(port)],  # noqa: ASYNC220
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        configs = {
            "bytes rule (prior)": {"ADMISSION_TOKENIZE_ABOVE_BYTES": "0"},
            "engine /tokenize": {},
            "tokenizer qwen3 (built-in)": {"ADMISSION_TOKENIZER": "qwen3"},
            "tokenizer.json (HF tokenizers)": {"ADMISSION_TOKENIZER": str(hf_path)},
        }
        bodies = {(k, t): body(k, t) for k in ("mixed", "hex") for t in (8192, 65536)}
        for name, env in configs.items():
            settings = load_settings({"ENGINE_URL": url, "ADMISSION_OBSERVE_MODELS": "sim-model", **env})
            est = Estimator(settings, Metrics(CollectorRegistry()))
            engine, endpoint = settings.engines[0], endpoint_for("/v1/chat/completions")
            for (kind, tokens), raw in bodies.items():
                facts = scan_body(raw)
                times: list[float] = []
                stalls: list[float] = []
                for _ in range(7):
                    gaps: list[float] = []
                    done = asyncio.Event()

                    async def tick(done: asyncio.Event, gaps: list[float]) -> None:
                        last = time.perf_counter()
                        while not done.is_set():
                            await asyncio.sleep(0.0005)
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now

                    ticker = asyncio.create_task(tick(done, gaps))
                    await asyncio.sleep(0.002)
                    t0 = time.perf_counter()
                    cost = await est.estimate(engine, endpoint, raw, facts)
                    times.append((time.perf_counter() - t0) * 1000)
                    done.set()
                    await ticker
                    stalls.append(max(gaps) * 1000)
                print(f"{name:32s} {kind:5s} {tokens:6d} tokens: source {cost.source:9s} "
                      f"prompt {cost.prompt_tokens:6d}  "
                      f"{statistics.median(times):7.2f} ms (loop stall max {statistics.median(stalls):6.2f} ms)",
                      flush=True)
    finally:
        sim.terminate()
        sim.wait()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen3_tokenizer_json(Path(tmp) / "tokenizer.json")
        asyncio.run(measure(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
