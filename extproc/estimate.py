"""What a request will cost the engine's KV cache, estimated from its body before admission.

KV tokens = sequences x (prompt tokens + generation allowance); the gate rounds it up to blocks.

- Prompt tokens come from one of several sources (`extproc/tokencount.py` picks one per request
  and says which in `admission_estimate_source_total{source}`): an exact count with the served
  model's tokenizer (`tokenizer`), the engine's own count (`engine`, vLLM's `POST /tokenize`),
  or the bytes rule below at a learned (`learned`) or the configured (`prior`) bytes-per-token
  (`fallback`: the engine was asked and did not answer in time). `ADMISSION_ESTIMATE=bytes` is
  the estimate as it was before issue 11 (`estimate_cost`, source `bytes`).
- The bytes rule (`estimate_from_bytes`): UTF-8 bytes of everything the chat template renders
  (message text, tool calls' names and arguments, the `tools` array's JSON) / bytes-per-token x
  the safety factor, plus what the template adds around them: `fixed` once (generation prompt,
  Llama-3's system header), `per_message` for each message (ChatML's and Llama-3's framing are
  5 tokens each), `tools` when there are tools (the template's instructions around them), plus
  a completion prompt's token ids, one token each. Measured on Qwen3 / Qwen2.5 / Llama-3.1's
  templates: 5 per message; fixed 3 / 24 / 30; tools 78-83 + their JSON.
  Text no rate fits (`BodyFacts.dense_bytes`: the "\n" between a message's text parts, strings
  under 4 bytes, digits and a byte either side of each) counts one token a byte instead, the
  most a byte-level BPE can make of it, and is left out of the bytes the rate applies to (and of
  what `Calibration` learns the rate from). So 1,900 one-character parts estimate 3,836 tokens
  (Qwen3 counts 3,807), spaced digits one token a byte (Qwen3: 6,007 for 5,999 bytes), where
  the rate alone said 797 and 2,437.
- The generation allowance: the request's own limit (`BodyFacts.generation_limit`: the larger
  positive one of max_completion_tokens / max_tokens, read as the engine reads them), else a
  configured default. vLLM allocates KV for prompt and generated tokens alike.
- Sequences: `n` (and `best_of`, `BodyFacts.sequences`). vLLM (V1, 0.11 and later) runs a
  request with n > 1 as n child requests with the same prompt: each allocates the blocks of its
  own prompt and generation, so n x (prompt + generation) is the most KV it can hold. With
  prefix caching (vLLM's default since V1; not the simulator's `vllm-0.11` profile) the children
  share the prompt's FULL blocks when one child's are cached before another is scheduled: a
  saving the budget does not count on, since it is not guaranteed (a child scheduled in the same
  step as the first, an evicted block). Each child counts its prompt in `vllm:prompt_tokens_total`,
  so the estimated prompt tokens compared with it are n x prompt too. `best_of`: V1 refuses
  best_of > 1 (0.11-0.18) or ignores it (0.19 on, removed from SamplingParams); only V0 allocated
  best_of sequences. Counting max(n, best_of) reserves for a refused request until the engine
  answers 400, never too little.
- Prompts: a completion whose `prompt` is a list of strings or of token-id lists is a batch; vLLM
  runs each prompt as its own request (times n), each generating up to the limit. So the KV is
  sequences x (all prompts + prompts x generation allowance), and the request takes
  `engine_requests` = sequences x prompts slots at the gate (`extproc/gate.py`, "Engine requests").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .bodyscan import BodyFacts


@dataclass(frozen=True)
class TemplateOverhead:
    """Prompt tokens a chat template adds around the rendered text (see the module docstring)."""

    fixed: int = 32
    per_message: int = 5
    tools: int = 100

    def tokens(self, facts: BodyFacts) -> int:
        if facts.messages == 0:  # not a chat request: no template
            return 0
        return self.fixed + self.per_message * facts.messages + (self.tools if facts.tools_bytes else 0)


@dataclass(frozen=True)
class CostEstimate:
    prompt_tokens: int  # one sequence's prompt (a batch: all its prompts together)
    generation_tokens: int  # one sequence's generation allowance
    sequences: int = 1
    source: str = "bytes"
    prompts: int = 1  # a completion batch's prompts: each generates its own allowance
    exact: bool = False  # prompt_tokens is the engine's own count (extproc/contextlen.py acts on it)

    @property
    def tokens(self) -> int:
        """The most KV the request can hold: every sequence's prompt and generation."""
        return self.sequences * (self.prompt_tokens + self.prompts * self.generation_tokens)

    @property
    def engine_requests(self) -> int:
        """Engine requests it becomes, each with a slot: sequences x prompts."""
        return self.sequences * self.prompts

    @property
    def engine_prompt_tokens(self) -> int:
        """What the engine's `vllm:prompt_tokens_total` will count for it (each sequence's prompt)."""
        return self.sequences * self.prompt_tokens


def generation_allowance(facts: BodyFacts, default_max_tokens: int) -> int:
    limit = facts.generation_limit
    return limit if limit is not None else default_max_tokens


def estimate_cost(facts: BodyFacts, bytes_per_token: float, safety_factor: float,
                  default_max_tokens: int) -> CostEstimate:
    """The estimate before issue 11 (`ADMISSION_ESTIMATE=bytes`): message text bytes / bytes-per-token
    x safety, one sequence, nothing for the template, tools or token ids."""
    prompt = max(1, math.ceil(facts.prompt_bytes / bytes_per_token * safety_factor))
    return CostEstimate(prompt_tokens=prompt, generation_tokens=generation_allowance(facts, default_max_tokens))


def prompt_from_bytes(facts: BodyFacts, bytes_per_token: float, safety_factor: float,
                      overhead: TemplateOverhead) -> int:
    """One sequence's prompt tokens by the bytes rule: rendered text at the rate, dense text a
    token a byte, template, token ids."""
    text = facts.prompt_bytes + facts.tools_bytes - facts.dense_bytes
    return max(1, math.ceil(text / bytes_per_token * safety_factor) + facts.dense_bytes + overhead.tokens(facts)
               + facts.prompt_token_ids)


def estimate_from_bytes(facts: BodyFacts, bytes_per_token: float, safety_factor: float, default_max_tokens: int,
                        overhead: TemplateOverhead, source: str) -> CostEstimate:
    return CostEstimate(prompt_tokens=prompt_from_bytes(facts, bytes_per_token, safety_factor, overhead),
                        generation_tokens=generation_allowance(facts, default_max_tokens),
                        sequences=facts.sequences, source=source, prompts=facts.prompts)


def estimate_counted(facts: BodyFacts, prompt_tokens: int, default_max_tokens: int, source: str,
                     exact: bool = False) -> CostEstimate:
    """A prompt counted (by a tokenizer or the engine), with the body's generation and n; `exact`:
    the count is the engine's own, not a tokenizer's with the template's framing approximated."""
    return CostEstimate(prompt_tokens=max(1, prompt_tokens),
                        generation_tokens=generation_allowance(facts, default_max_tokens),
                        sequences=facts.sequences, source=source, prompts=facts.prompts, exact=exact)
