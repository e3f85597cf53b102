"""What a request will cost the engine's KV cache, estimated from its body before admission.

prompt tokens ~= UTF-8 bytes of the message text / bytes_per_token x safety_factor (English
averages ~4 bytes a token; code, CJK and other scripts run lower, so both are settings), plus
the generation allowance: the request's own limit (`BodyFacts.generation_limit`: the larger
positive one of max_completion_tokens / max_tokens, read as the engine reads them, numeric
strings and integral floats included), else a configured default. vLLM allocates KV for prompt
and generated tokens alike, so the sum is the most KV the request can hold; the gate rounds it
up to whole blocks. The default applies only when the body gives no positive limit: a limit the
engine would honour is never replaced by a smaller default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .bodyscan import BodyFacts


@dataclass(frozen=True)
class CostEstimate:
    prompt_tokens: int
    generation_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generation_tokens


def estimate_cost(facts: BodyFacts, bytes_per_token: float, safety_factor: float, default_max_tokens: int) -> CostEstimate:
    prompt = max(1, math.ceil(facts.prompt_bytes / bytes_per_token * safety_factor))
    limit = facts.generation_limit
    generation = limit if limit is not None else default_max_tokens
    return CostEstimate(prompt_tokens=prompt, generation_tokens=generation)
