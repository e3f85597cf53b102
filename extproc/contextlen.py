"""What vLLM refuses for length before it uses any KV: answered by the gate at once, never forwarded.

An engine serves each model with a context limit, `max_model_len`, which vLLM lists per model on
`/v1/models` (`extproc/models.py` keeps it). A prompt over it fits the KV budget whenever the
cache is larger than the context (the real engine in the tests: 16,384 against 20,480 KV
tokens), so the gate used to admit it, maybe after a wait, and vLLM then refused it with a 400.

What vLLM 0.32 refuses, read from its code (and checked on the real engine,
tests/realengine/test_gateway_on_vllm.py), mirrored here exactly and no further:

- an output limit over the context: `TokenizeParams.__post_init__` (vllm/renderers/params.py)
  refuses `max_completion_tokens` (chat, when given) or else `max_tokens` greater than
  `max_model_len`, whatever the prompt;
- a prompt of more than `max_model_len` tokens (`TokenizeParams._token_len_check`, the message
  "This model's maximum context length is ...") and one of exactly `max_model_len`
  (`InputProcessor._validate_model_len`: no room for one output token).

It does NOT refuse prompt + max_tokens > max_model_len: `get_max_tokens`
(vllm/entrypoints/serve/utils/api_utils.py) lowers the output limit to the context left. (The
simulator refuses that case, as vLLM did before; see enginesim/protocol.py.)

The prompt rules are applied only to a count that is certain: the engine's own `/tokenize` or a
local tokenizer that counts exactly what the engine will (`CostEstimate.exact`), for one prompt,
with no `truncate_prompt_tokens` in the body (vLLM truncates such a prompt instead of refusing
it). The bytes rule over-estimates on purpose (a safe reservation), so a prompt it puts over the
limit may fit: such a request goes on, and if the engine refuses it, it does so at once, before
scheduling, without allocating KV.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthFacts:
    """What the length rules read from one request."""

    prompt_tokens: int  # one prompt's tokens, as estimated
    exact: bool  # the count is the engine's own (or a tokenizer's that matches it)
    prompts: int  # a completion batch's prompts (each is checked by the engine on its own)
    output_limit: int | None  # the output limit the engine checks (see output_limit)
    output_param: str  # its name, as vLLM's message quotes it
    truncates: bool  # the body asks the engine to truncate the prompt


def output_limit(chat: bool, max_tokens: int | None, max_completion_tokens: int | None) -> tuple[int | None, str]:
    """The output limit vLLM checks against the context, and its name: chat takes
    `max_completion_tokens` when given, else `max_tokens`; completions take `max_tokens`."""
    if chat and max_completion_tokens is not None:
        return max_completion_tokens, "max_completion_tokens"
    return max_tokens, "max_tokens"


def context_refusal(facts: LengthFacts, max_model_len: int | None) -> str | None:
    """vLLM's own message for a request it refuses for length, or None when it would not (or
    when that is not certain)."""
    if max_model_len is None or max_model_len <= 0:
        return None
    limit = facts.output_limit
    if limit is not None and limit > max_model_len:
        return (f"{facts.output_param}={limit} cannot be greater than max_model_len={max_model_len}. "
                f"Please request fewer output tokens. (parameter={facts.output_param}, value={limit})")
    if not facts.exact or facts.prompts != 1 or facts.truncates:
        return None
    n = facts.prompt_tokens
    if n > max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains {n} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={n})")
    if n == max_model_len:
        return (f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` "
                f"is no smaller than the number of text tokens (prompt + requested output tokens).")
    return None
