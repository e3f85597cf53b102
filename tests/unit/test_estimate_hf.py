"""ADMISSION_TOKENIZER=/path/tokenizer.json, counted with Hugging Face `tokenizers`, on a real
vocabulary: Qwen3's, converted from the simulator's own (quicktok) into a tokenizer.json the way
transformers converts a tiktoken vocabulary (`bench.estimate_cost.qwen3_tokenizer_json`), so its
counts can be checked against the engine's token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.estimate_cost import qwen3_tokenizer_json
from bench.text import sized_content
from extproc.bodyscan import scan_body
from extproc.estimate import TemplateOverhead
from extproc.tokencount import LocalTokenizer
from extproc.tokenizer import get_tokenizer

QWEN = get_tokenizer("qwen3")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_tokenizer_json(tmp_path_factory.mktemp("hf") / "tokenizer.json")


def chat(content: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


@pytest.mark.parametrize("kind", ["prose", "code", "json", "cjk", "hex", "mixed"])
def test_a_completion_prompt_counts_exactly_what_the_engine_counts(tokenizer_json: Path, kind: str) -> None:
    local = LocalTokenizer(str(tokenizer_json), TemplateOverhead())
    content = sized_content(kind, 8192, seed=9, index=0)
    body = json.dumps({"model": "m", "prompt": content}).encode()
    assert local.count("/v1/completions", body) == QWEN.count_prompt(content)


@pytest.mark.parametrize("kind", ["json", "cjk", "hex"])
def test_a_chat_prompt_counts_its_text_exactly_and_the_template_from_the_settings(tokenizer_json: Path,
                                                                                   kind: str) -> None:
    overhead = TemplateOverhead()
    local = LocalTokenizer(str(tokenizer_json), overhead)
    content = sized_content(kind, 8192, seed=9, index=1)
    counted = local.count("/v1/chat/completions", chat(content))
    assert counted == QWEN.count_text(content) + overhead.tokens(scan_body(chat(content)))
    assert 8192 <= counted <= 8192 + overhead.fixed  # Qwen3's real framing is 8 tokens: never under
