"""The pure classification of a request: each verdict the headers, the body and the model lead to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.bodyscan import BodyFacts
from extproc.classify import Gated, Passed, Rejected, Routed, classify_body, classify_headers, route
from extproc.config import Settings, load_settings
from extproc.endpoints import PathRules
from extproc.estimate import TemplateOverhead, estimate_from_bytes
from extproc.models import ModelRegistry
from extproc.outcomes import Outcome

ENV = {"ADMISSION_OBSERVE_MODELS": "m", "MAX_BODY_BYTES": "4096"}
CHAT = "/v1/chat/completions"


def _settings(**env: str) -> Settings:
    return load_settings({**ENV, **env})


def _headers(settings: Settings, path: str = CHAT, method: str = "POST", end_of_stream: bool = False,
             **extra: str) -> Gated | Passed | Rejected:
    headers = {":method": method, ":path": path, "content-type": "application/json", **extra}
    return classify_headers(headers, end_of_stream, PathRules(settings.gated_paths, settings.pass_paths), settings)


def _gated(settings: Settings, path: str = CHAT, content_type: str = "application/json") -> Gated:
    verdict = _headers(settings, path, **{"content-type": content_type})
    assert isinstance(verdict, Gated)
    return verdict


def _body(model: str = "m", **fields: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], **fields}).encode()


def _facts(settings: Settings, body: bytes, path: str = CHAT) -> BodyFacts:
    facts = classify_body(_gated(settings, path), body, True, settings)
    assert isinstance(facts, BodyFacts)
    return facts


# --- headers -------------------------------------------------------------------------------------


def test_an_ungated_path_passes_without_reading_the_body() -> None:
    assert _headers(_settings(), "/v1/models", method="GET") == Passed("path_not_gated")
    assert _headers(_settings(), "/health") == Passed("path_not_gated")


@pytest.mark.parametrize("path", ["/v9/new-thing", "/v1/chat/completions/batch", "/v1/decisions", "/v1/systemone",
                                  "/generative_scoring", "/v2/embed", "/inference/v1/generate",
                                  "/v1/audio/translations", "/cohere/v2/chat", "/sleep", "/reset_prefix_cache"])
def test_a_post_to_any_path_off_the_pass_list_is_gated(path: str) -> None:
    verdict = _headers(_settings(), path)
    assert isinstance(verdict, Gated) and verdict.path == path


def test_an_unknown_post_counts_every_string_but_the_model_as_prompt() -> None:
    settings = _settings()
    body = json.dumps({"model": "m", "thing": {"text": "x" * 100}, "more": ["y" * 50]}).encode()
    facts = classify_body(_gated(settings, "/v9/new-thing"), body, True, settings)
    assert isinstance(facts, BodyFacts) and facts.model == "m" and facts.prompt_bytes == 150


def test_an_unknown_post_without_a_model_is_refused_not_passed() -> None:
    settings = _settings()
    verdict = classify_body(_gated(settings, "/v9/new-thing"), b'{"prompt": "hi"}', True, settings)
    assert isinstance(verdict, Rejected) and verdict.outcome is Outcome.MISSING_MODEL
    no_body = _headers(settings, "/sleep", end_of_stream=True)
    assert isinstance(no_body, Rejected) and no_body.outcome is Outcome.INVALID_BODY


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/models", "/health", "/ping", "/version",
                                  "/metrics", "/v1/responses/resp_1/cancel"])
def test_the_cheap_routes_pass_whatever_the_method(path: str) -> None:
    assert _headers(_settings(), path) == Passed("path_not_gated")
    assert _headers(_settings(), path, method="GET") == Passed("path_not_gated")


def test_the_pass_list_is_a_setting() -> None:
    settings = _settings(ADMISSION_PASS_PATHS="/sleep,/v1/*/admin")
    assert _headers(settings, "/sleep") == Passed("path_not_gated")
    assert _headers(settings, "/v1/x/admin") == Passed("path_not_gated")
    assert isinstance(_headers(settings, "/v1/x/y/admin"), Gated)  # `*` is one segment
    assert isinstance(_headers(settings, "/tokenize"), Gated)  # the list replaces the default


def test_another_method_to_an_unknown_path_passes() -> None:
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        assert _headers(_settings(), "/v9/new-thing", method=method) == Passed("path_not_gated")


def test_a_gated_path_read_with_another_method_passes() -> None:
    assert _headers(_settings(), CHAT, method="GET") == Passed("path_not_gated")


def test_a_gated_post_reads_its_body_with_the_endpoints_rules() -> None:
    verdict = _headers(_settings(), CHAT + "?x=1")
    assert isinstance(verdict, Gated)
    assert (verdict.path, verdict.endpoint.path, verdict.content_type) == (CHAT, CHAT, "application/json")


@pytest.mark.parametrize("path", ["/v1%2Fchat/completions", "/v1/chat/completions/", "/V1/Chat/Completions",
                                  "/v1%5cchat%5ccompletions"])
def test_an_escaped_or_non_canonical_spelling_of_a_gated_path_is_rejected(path: str) -> None:
    verdict = _headers(_settings(), path)
    assert verdict == Rejected(
        Outcome.AMBIGUOUS_PATH,
        f"the path `{path}` is an encoded or non-canonical spelling of a gated endpoint; send the plain path "
        "(e.g. /v1/chat/completions)")


def test_the_quoted_path_is_cut_at_200_characters() -> None:
    path = "/v1%2Fchat/completions?" + "q" * 500
    verdict = _headers(_settings(), path)
    assert isinstance(verdict, Rejected) and f"`{path[:200]}`" in verdict.message


def test_a_declared_length_over_the_cap_is_rejected_before_the_body() -> None:
    assert _headers(_settings(), **{"content-length": "4097"}) == Rejected(
        Outcome.BODY_TOO_LARGE, "request body (4097 bytes) exceeds the limit of 4096 bytes")
    assert isinstance(_headers(_settings(), **{"content-length": "4096"}), Gated)


def test_a_multipart_upload_may_declare_more_than_the_cap() -> None:
    verdict = _headers(_settings(), "/v1/audio/transcriptions", **{"content-length": "10000000"})
    assert isinstance(verdict, Gated) and verdict.endpoint.multipart


def test_a_gated_post_without_a_body_is_rejected() -> None:
    assert _headers(_settings(), end_of_stream=True) == Rejected(Outcome.INVALID_BODY, "request body is required")


# --- bodies --------------------------------------------------------------------------------------


def test_a_body_prefix_cut_at_the_cap_is_too_large() -> None:
    settings = _settings()
    prefix = b'{"model": "m", "messages": [' + b" " * 4096
    verdict = classify_body(_gated(settings), prefix[:4096], False, settings)
    assert verdict == Rejected(Outcome.BODY_TOO_LARGE, "request body exceeds the limit of 4096 bytes")


def test_a_body_followed_by_trailers_is_whole_whatever_its_end_of_stream_says() -> None:
    # Envoy sends the whole body with end_of_stream=false when request trailers follow it (HTTP/2).
    settings = _settings()
    facts = classify_body(_gated(settings), _body(), False, settings)
    assert isinstance(facts, BodyFacts) and facts.model == "m"


def test_a_whole_body_over_the_cap_is_too_large() -> None:
    settings = _settings()
    body = _body(pad="x" * 5000)
    assert classify_body(_gated(settings), body, True, settings) == Rejected(
        Outcome.BODY_TOO_LARGE, "request body exceeds the limit of 4096 bytes")


def test_a_multipart_prefix_is_read_for_its_model() -> None:
    settings = _settings()
    gated = _gated(settings, "/v1/audio/transcriptions", "multipart/form-data; boundary=B")
    prefix = b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--B\r\nContent-Disposition: ' \
             b'form-data; name="file"; filename="a.wav"\r\n\r\nRIFF' + b"\0" * 5000
    facts = classify_body(gated, prefix, False, settings)
    assert isinstance(facts, BodyFacts) and (facts.model, facts.prompt_bytes) == ("m", 0)


def test_a_body_that_is_not_json_is_rejected_with_the_parsers_words() -> None:
    settings = _settings()
    verdict = classify_body(_gated(settings), b"model=m", True, settings)
    assert isinstance(verdict, Rejected) and verdict.outcome is Outcome.INVALID_BODY
    assert verdict.message.startswith("request body is not valid JSON")


def test_a_body_without_a_model_is_rejected() -> None:
    settings = _settings()
    verdict = classify_body(_gated(settings), b'{"messages": []}', True, settings)
    assert isinstance(verdict, Rejected) and verdict.outcome is Outcome.MISSING_MODEL


def test_with_no_model_configured_a_valid_body_passes() -> None:
    settings = load_settings({})
    assert classify_body(_gated(settings), _body(), True, settings) == Passed("no_models_configured")


def test_with_no_model_configured_an_invalid_body_is_still_rejected() -> None:
    settings = load_settings({})
    verdict = classify_body(_gated(settings), b"[]", True, settings)
    assert isinstance(verdict, Rejected) and verdict.outcome is Outcome.INVALID_BODY


def test_the_body_facts_are_what_the_estimate_needs() -> None:
    facts = _facts(_settings(), _body(stream=True, max_tokens=7))
    assert (facts.model, facts.stream, facts.prompt_bytes, facts.max_tokens, facts.messages) == ("m", True, 5, 7, 1)


@pytest.mark.parametrize(("fields", "sequences"), [({}, 1), ({"n": 3}, 3), ({"best_of": 4}, 4),
                                                   ({"n": 2, "best_of": 5}, 5)])
def test_n_and_best_of_multiply_the_ticket_cost(fields: dict[str, int], sequences: int) -> None:
    settings = _settings()
    one = _facts(settings, _body(max_tokens=100))
    facts = _facts(settings, _body(max_tokens=100, **fields))
    assert facts.sequences == sequences
    overhead = TemplateOverhead()
    single = estimate_from_bytes(one, 2.5, 1.0, 1024, overhead, "prior")
    cost = estimate_from_bytes(facts, 2.5, 1.0, 1024, overhead, "prior")
    assert cost.tokens == sequences * single.tokens == sequences * (single.prompt_tokens + 100)


def test_an_invalid_n_is_rejected() -> None:
    settings = _settings()
    verdict = classify_body(_gated(settings), _body(n="many"), True, settings)
    assert isinstance(verdict, Rejected) and verdict.outcome is Outcome.INVALID_BODY


# --- models --------------------------------------------------------------------------------------


def test_an_unknown_model_is_rejected_naming_the_known_ones() -> None:
    settings = _settings()
    gated = _gated(settings)
    facts = _facts(settings, _body("other"))
    registry = ModelRegistry(settings)
    assert route(gated, facts, registry.engine_for("other"), registry.known) == Rejected(
        Outcome.UNKNOWN_MODEL, "The model `other` does not exist. Known models: m")
    assert route(gated, facts, None, list) == Rejected(
        Outcome.UNKNOWN_MODEL, "The model `other` does not exist. Known models: (none)")


def test_each_model_routes_to_the_engine_that_serves_it(tmp_path: Path) -> None:
    config = tmp_path / "engines.yaml"
    config.write_text("engines:\n"
                      "  - {name: small, url: 'http://127.0.0.1:8001', models: [a, a-lora]}\n"
                      "  - {name: large, url: 'http://127.0.0.1:8002', models: [b]}\n")
    settings = load_settings({"EXTPROC_CONFIG": str(config)})
    registry = ModelRegistry(settings)
    gated = _gated(settings)
    for model, engine in (("a", "small"), ("a-lora", "small"), ("b", "large")):
        facts = _facts(settings, _body(model))
        routed = route(gated, facts, registry.engine_for(model), registry.known)
        assert isinstance(routed, Routed)
        assert (routed.engine.name, routed.endpoint.path, routed.facts) == (engine, CHAT, facts)
