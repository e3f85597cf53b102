"""What vLLM 0.32 refuses for length, mirrored exactly (extproc/contextlen.py): refused at once
only where the engine is certain to refuse, in the engine's own words."""

from __future__ import annotations

from extproc.contextlen import LengthFacts, context_refusal, output_limit

LIMIT = 16384


def facts(prompt: int, exact: bool = True, output: int | None = None, param: str = "max_tokens",
          prompts: int = 1, truncates: bool = False) -> LengthFacts:
    return LengthFacts(prompt_tokens=prompt, exact=exact, prompts=prompts, output_limit=output,
                       output_param=param, truncates=truncates)


def test_an_exact_prompt_over_the_limit_is_refused_with_the_limit_and_the_count() -> None:
    assert context_refusal(facts(40008), LIMIT) == (
        "This model's maximum context length is 16384 tokens. However, your prompt contains 40008 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
        "input prompt. (parameter=input_tokens, value=40008)")


def test_an_exact_prompt_of_exactly_the_limit_leaves_no_room_for_output_and_is_refused() -> None:
    message = context_refusal(facts(LIMIT), LIMIT)
    assert message is not None and message.startswith("The decoder prompt (length 16384) plus the number of requested")
    assert context_refusal(facts(LIMIT - 1), LIMIT) is None


def test_prompt_plus_max_tokens_over_the_limit_is_not_refused_since_vllm_lowers_max_tokens() -> None:
    assert context_refusal(facts(10000, output=10000), LIMIT) is None


def test_an_output_limit_over_the_context_is_refused_whatever_the_prompt_and_its_count() -> None:
    assert context_refusal(facts(5, exact=False, output=17000), LIMIT) == (
        "max_tokens=17000 cannot be greater than max_model_len=16384. Please request fewer output tokens. "
        "(parameter=max_tokens, value=17000)")
    assert context_refusal(facts(5, output=LIMIT), LIMIT) is None


def test_a_prompt_estimate_that_is_not_certain_is_left_to_the_engine() -> None:
    assert context_refusal(facts(40008, exact=False), LIMIT) is None  # the bytes rule over-estimates
    assert context_refusal(facts(40008, prompts=2), LIMIT) is None  # a batch: each prompt is checked alone
    assert context_refusal(facts(40008, truncates=True), LIMIT) is None  # vLLM truncates instead


def test_no_known_limit_refuses_nothing() -> None:
    assert context_refusal(facts(10**9, output=10**9), None) is None


def test_chat_checks_max_completion_tokens_when_given_else_max_tokens_and_completions_only_max_tokens() -> None:
    assert output_limit(True, 5, 20000) == (20000, "max_completion_tokens")
    assert output_limit(True, 20000, None) == (20000, "max_tokens")
    assert output_limit(False, 5, 20000) == (5, "max_tokens")
