"""Benchmark prompt text that tokenizes like real traffic, sized in TRUE tokens.

    python -m bench.text            # bytes/4 estimate vs true count, per kind, and tokenizer cost

Kinds (``--text`` of bench.admission):

- ``prose``: English docstrings of ~50 standard-library modules (modules, classes, functions);
- ``code``: those modules' own Python source, in top-level blocks;
- ``json``: OpenAI tool definitions built from the same modules' function signatures (a name,
  the docstring's first sentence as description, the parameters' JSON schema as pydantic makes
  it: title, type, default, required), one per line as a chat template renders a ``tools``
  array (``json.dumps``, default separators);
- ``cjk``: Chinese (simplified and traditional), Japanese and Korean sentences from the
  standard library's own codec test texts (``test/cjkencodings/*-utf8.txt``); where a Python
  build ships without its test suite, CJK words of the tokenizer's own vocabulary instead;
- ``hex``: seeded random hex, what the benchmark's prompts were made of before (it tokenizes
  2.5-3.6x worse than bytes/4 on Qwen, which splits every digit);
- ``mixed`` (the default): each prompt a sequence of ~400-token segments, each of prose (40 %),
  code (30 %), json (20 %) or cjk (10 %), like a RAG or agent prompt that carries documents,
  code and tool schemas.

Everything comes from material that ships with Python (no network), chosen and ordered by a
seed, so a (kind, seed, request index) is one fixed text. ``sized_content`` cuts and pads a
prompt so that the simulator's tokenizer counts the CHAT REQUEST (one user message, the chat
template included) at exactly the requested number of tokens; with the ``bytes4`` tokenizer the
content is exactly 4 x tokens bytes, and ``hex`` is byte for byte the old benchmark text.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import random
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from extproc.tokenizer import DEFAULT_TOKENIZER, Tokenizer, VocabTokenizer, get_tokenizer

TEXT_KINDS = ("prose", "code", "json", "cjk", "hex", "mixed")
DEFAULT_TEXT = "mixed"
MIX: tuple[tuple[str, float], ...] = (("prose", 0.4), ("code", 0.3), ("json", 0.2), ("cjk", 0.1))
SEGMENT_TOKENS = 400

MODULES = (
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.streams", "asyncio.tasks", "base64",
    "bisect", "calendar", "cmd", "codecs", "collections", "concurrent.futures._base", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "email.utils", "enum", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt",
    "gettext", "glob", "gzip", "heapq", "hmac", "html.parser", "http.client", "http.cookies",
    "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "logging", "logging.handlers",
    "mailbox", "mimetypes", "netrc", "numbers", "optparse", "os", "pathlib", "pickle", "pkgutil",
    "platform", "plistlib", "poplib", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.dom.minidom", "zipfile",
)


@functools.cache
def _modules() -> tuple[ModuleType, ...]:
    out = []
    with warnings.catch_warnings():  # deprecated modules and aliases warn when touched
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                out.append(importlib.import_module(name))
            except ImportError:  # a module a Python build lacks: the rest suffice
                continue
    return tuple(out)


def _members(module: ModuleType) -> list[tuple[str, object]]:
    """Public functions and classes defined in ``module``, and the classes' methods, in name order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _members_of(module)


def _members_of(module: ModuleType) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            out.append((name, value))
        elif inspect.isclass(value):
            out.append((name, value))
            for attr, member in sorted(vars(value).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    out.append((f"{name}.{attr}", member))
    return out


def _quiet(build: Callable[..., tuple[str, ...]]) -> Callable[..., tuple[str, ...]]:
    """Build material with warnings off: inspecting deprecated stdlib members warns."""

    @functools.wraps(build)
    def wrapper(*args: object) -> tuple[str, ...]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build(*args)

    return wrapper


@functools.cache
@_quiet
def prose_pieces() -> tuple[str, ...]:
    pieces: list[str] = []
    for module in _modules():
        docs = [inspect.getdoc(module) or ""] + [inspect.getdoc(v) or "" for _, v in _members(module)]
        for doc in docs:
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 80 and sum(c.isalpha() for c in para) > 0.7 * len(para):
                    pieces.append(para + "\n\n")
    return tuple(dict.fromkeys(pieces))


@functools.cache
@_quiet
def code_pieces() -> tuple[str, ...]:
    pieces: list[str] = []
    for module in _modules():
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        block: list[str] = []
        for line in source.splitlines(keepends=True):
            if line[:1] not in (" ", "\t", "\n", "#", ")", "]", "}") and block and line.strip():
                text = "".join(block)
                if 60 <= len(text) <= 6000:
                    pieces.append(text)
                block = []
            block.append(line)
    return tuple(dict.fromkeys(pieces))


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", bytes: "string",
               list: "array", tuple: "array", dict: "object"}


def _tool(name: str, function: Callable[..., object]) -> dict[str, object] | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    doc = inspect.getdoc(function) or ""
    description = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."
    properties: dict[str, object] = {}
    required = []
    for param in signature.parameters.values():
        if param.name in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        # the shape pydantic gives a function's parameters (how most tool schemas are made)
        default = param.default
        schema: dict[str, object] = {"title": param.name.replace("_", " ").title().replace(" ", ""),
                                     "type": _JSON_TYPES.get(type(default), "string")}
        if default is param.empty:
            required.append(param.name)
        elif default is None or isinstance(default, (bool, int, float, str)):
            schema["default"] = default
        properties[param.name] = schema
    if description == ".":
        return None
    return {"type": "function", "function": {
        "name": name.replace(".", "_"), "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


@functools.cache
@_quiet
def json_pieces() -> tuple[str, ...]:
    pieces = []
    for module in _modules():
        for name, member in _members(module):
            if inspect.isfunction(member):
                tool = _tool(f"{module.__name__}.{name}", member)
                if tool is not None:
                    pieces.append(json.dumps(tool, ensure_ascii=False) + "\n")
    return tuple(dict.fromkeys(pieces))


def _cjk_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "test" / "cjkencodings"


CJK_FILES = ("gb18030-utf8.txt", "big5-utf8.txt", "euc_jisx0213-utf8.txt", "euc_jp-utf8.txt",
             "cp949-utf8.txt", "gbk-utf8.txt")


@functools.cache
def cjk_pieces(tokenizer_name: str = DEFAULT_TOKENIZER) -> tuple[str, ...]:
    pieces: list[str] = []
    for name in CJK_FILES:
        path = _cjk_dir() / name
        if path.exists():
            for line in path.read_text("utf-8").splitlines():
                line = line.strip()
                if sum(ord(c) > 0x2E80 for c in line) >= 8:
                    pieces.append(line + "\n")
    if pieces:
        return tuple(dict.fromkeys(pieces))
    # No test suite in this Python: sentences of CJK words from the vocabulary itself.
    tokenizer = get_tokenizer(tokenizer_name if tokenizer_name != "bytes4" else DEFAULT_TOKENIZER)
    assert isinstance(tokenizer, VocabTokenizer)
    words = list(tokenizer.cjk_words())[:6000]
    rng = random.Random(0)
    return tuple("".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "。\n" for _ in range(400))


def _hex_text(rng: random.Random, num_bytes: int) -> str:
    return rng.randbytes(num_bytes // 2 + 1).hex()[:num_bytes]


def _pieces(kind: str, tokenizer_name: str) -> tuple[str, ...]:
    if kind == "prose":
        return prose_pieces()
    if kind == "code":
        return code_pieces()
    if kind == "json":
        return json_pieces()
    if kind == "cjk":
        return cjk_pieces(tokenizer_name)
    raise ValueError(kind)


def raw_text(kind: str, rng: random.Random, num_bytes: int, tokenizer_name: str = DEFAULT_TOKENIZER) -> str:
    """At least ``num_bytes`` UTF-8 bytes of text of ``kind`` (not ``mixed``), drawn by ``rng``."""
    if kind == "hex":
        return _hex_text(rng, num_bytes)
    pieces = _pieces(kind, tokenizer_name)
    out: list[str] = []
    size = 0
    start = rng.randrange(len(pieces))
    i = 0
    while size < num_bytes:  # a run of consecutive pieces from a random start, then random jumps
        piece = pieces[(start + i) % len(pieces)] if i < 8 else pieces[rng.randrange(len(pieces))]
        out.append(piece)
        size += len(piece.encode("utf-8"))
        i += 1
    return "".join(out)


def _mixed_text(rng: random.Random, tokens: int, tokenizer: Tokenizer, tokenizer_name: str) -> str:
    names = [n for n, _ in MIX]
    weights = [w for _, w in MIX]
    out: list[str] = []
    total = 0
    while total < tokens:
        kind = rng.choices(names, weights)[0]
        segment = raw_text(kind, rng, SEGMENT_TOKENS * 4, tokenizer_name)
        out.append(segment)
        total += tokenizer.count_text(segment) if tokenizer.exact else len(segment.encode()) // 4
    return "".join(out)


def _chat_count(tokenizer: Tokenizer, content: str) -> int:
    return tokenizer.count_chat([{"role": "user", "content": content}])


def sized_content(kind: str, tokens: int, seed: int, index: int, head: str = "",
                  tokenizer_name: str = DEFAULT_TOKENIZER) -> str:
    """A user message's content whose chat request counts exactly ``tokens`` prompt tokens on
    the simulator's tokenizer ``tokenizer_name`` (template included), distinct per seed and index."""
    if kind not in TEXT_KINDS:
        raise ValueError(f"text kind must be one of {TEXT_KINDS}, got {kind!r}")
    rng = random.Random(f"{seed}/{index}/{kind}")
    tokenizer = get_tokenizer(tokenizer_name)
    if not tokenizer.exact:  # bytes4: exactly 4 x tokens bytes, ASCII-padded
        size = tokens * 4
        if kind == "hex":
            body = random.Random(f"{seed}/{index}").randbytes(size // 2 + 1).hex()
            return (head + body)[:size]
        text = head + (_mixed_text(rng, tokens, tokenizer, tokenizer_name) if kind == "mixed"
                       else raw_text(kind, rng, size, tokenizer_name))
        cut = text.encode("utf-8")[:size].decode("utf-8", errors="ignore")
        return cut + "0" * (size - len(cut.encode("utf-8")))
    overhead = _chat_count(tokenizer, "")
    need = max(0, tokens - overhead)
    if kind == "mixed":
        text = head + _mixed_text(rng, need + 64, tokenizer, tokenizer_name)
    else:
        text = head + raw_text(kind, rng, need * 4 + 256, tokenizer_name)
        while tokenizer.count_text(text) < need + 16:  # denser text than 4 bytes a token
            text += raw_text(kind, rng, (need + 16) * 4, tokenizer_name)
    assert isinstance(tokenizer, VocabTokenizer)
    ids = tokenizer.encode_text(text)[:need]
    content = tokenizer.decode(ids).rstrip("\ufffd")
    return _fit(tokenizer, content, tokens)


def _fit(tokenizer: Tokenizer, content: str, tokens: int) -> str:
    """Trim characters while the request counts more than ``tokens``, then pad with digits (one
    token each on Qwen) while it counts fewer."""
    count = _chat_count(tokenizer, content)
    while count > tokens and content:
        content = content[:-max(1, (count - tokens) // 2)]
        count = _chat_count(tokenizer, content)
    for _ in range(4 * (tokens - count) + 8):
        if count >= tokens:
            break
        content += "0"
        count = _chat_count(tokenizer, content)
    if count != tokens:
        raise ValueError(f"could not size a prompt at {tokens} tokens (got {count})")
    return content


# --- the estimate the benchmark is about -------------------------------------------------


def bytes4_ratio(content: str, tokenizer: Tokenizer) -> float:
    """The bytes/4 estimate of a one-message chat request over its true count."""
    return (len(content.encode("utf-8")) / 4) / _chat_count(tokenizer, content)


def measure(tokenizer_name: str = DEFAULT_TOKENIZER, sizes: Sequence[int] = (8192, 65536), seed: int = 1,
            repeats: int = 5) -> list[dict[str, object]]:
    """Per kind and size: bytes, true tokens, bytes/4 over true, and the simulator's counting cost."""
    tokenizer = get_tokenizer(tokenizer_name)
    rows = []
    for kind in TEXT_KINDS:
        for size in sizes:
            content = sized_content(kind, size, seed, 0, tokenizer_name=tokenizer_name)
            message = [{"role": "user", "content": content}]
            start = time.perf_counter()
            for _ in range(repeats):
                count = tokenizer.count_chat(message)
            cost_ms = (time.perf_counter() - start) / repeats * 1000
            rows.append({"text": kind, "tokens": count, "bytes": len(content.encode("utf-8")),
                         "bytes_per_token": round(len(content.encode("utf-8")) / count, 2),
                         "estimate_ratio": round(bytes4_ratio(content, tokenizer), 3),
                         "count_ms": round(cost_ms, 2)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.text", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="the simulator's tokenizer")
    parser.add_argument("--sizes", default="8192,65536", help="prompt sizes in true tokens")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rows = measure(args.tokenizer, [int(s) for s in args.sizes.split(",")], args.seed)
    print(f"tokenizer {args.tokenizer}; estimate_ratio = (UTF-8 bytes / 4) / true chat prompt tokens")
    print(f"{'text':<7}{'tokens':>8}{'bytes':>9}{'B/tok':>7}{'ratio':>7}{'count ms':>10}")
    for r in rows:
        print(f"{r['text']:<7}{r['tokens']:>8}{r['bytes']:>9}{r['bytes_per_token']:>7}{r['estimate_ratio']:>7}"
              f"{r['count_ms']:>10}")
    print(json.dumps({"tokenizer": args.tokenizer, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
