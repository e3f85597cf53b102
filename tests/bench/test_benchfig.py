"""The benchmark's issue-22 figures without a run: the policy flag, recompute accounting, the goodput
bound over a run's records, the arrival-order check and the long-tail scenarios (no processes)."""

from __future__ import annotations

import pytest

from bench.admission import (
    ARRIVAL_ORDER_EXIT,
    BenchConfig,
    RequestRecord,
    arrival_order_failure,
    arrival_order_status,
    goodput_bound_report,
    main,
    recompute_report,
    recomputed_cell,
)
from bench.scenarios import CLASSES, SCENARIOS, RequestSpec, build_requests


@pytest.mark.parametrize("mode", ["none", "vllm-builtin"])
def test_policy_is_refused_for_a_mode_without_an_admission_service(mode: str, capsys: pytest.CaptureFixture[str]
                                                                   ) -> None:
    with pytest.raises(SystemExit) as exc:  # refused while parsing: nothing starts
        main(["--scenario", "smoke", "--mode", mode, "--policy", "projected", "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--mode {mode} has no admission service" in err and "--mode reference or full" in err


def test_policy_reaches_the_service_only_when_given() -> None:
    assert BenchConfig("smoke", "full", policy="projected").service_env()["ADMISSION_POLICY"] == "projected"
    assert BenchConfig("smoke", "full", policy="strict").service_env()["ADMISSION_POLICY"] == "strict"
    assert "ADMISSION_POLICY" not in BenchConfig("smoke", "full").service_env()  # the service's default
    from extproc.settings_table import BY_ENV

    row = BY_ENV.get("ADMISSION_POLICY")
    # a service without the setting admits as strict does, whatever was asked
    projected = "projected" if row is not None else "strict"
    assert BenchConfig("smoke", "full", policy="projected").effective_policy() == projected
    assert BenchConfig("smoke", "full").effective_policy() == (str(row.default) if row is not None else "strict")
    assert BenchConfig("smoke", "none").effective_policy() is None


def record(i: int, prompt: int, max_tokens: int, *, sent: float, first: float | None, end: float | None,
           tokens: int, outcome: str, engine_prompt: int | None = None) -> RequestRecord:
    cls = CLASSES["smoke"].__class__("x", prompt, max_tokens)
    return RequestRecord(RequestSpec(i, cls, sent), 0, sent=sent, first_token=first, finished=end, tokens=tokens,
                         outcome=outcome, prompt_tokens=engine_prompt)


def test_the_simulators_recompute_is_exact_and_set_beside_the_prefill() -> None:
    out = recompute_report([], recomputed=300, prefill_tokens=60_000, preemptions=2)
    assert out == {"prefill_tokens": 60_000, "recomputed_tokens": 300, "recomputed_share": 0.005}
    assert recomputed_cell(out) == "300"


def test_a_real_engines_recompute_is_an_upper_bound_from_its_preemptions() -> None:
    records = [record(0, 1500, 6000, sent=0.0, first=1.0, end=9.0, tokens=6000, outcome="completed",
                      engine_prompt=1480),
               record(1, 1500, 6000, sent=0.0, first=1.0, end=3.0, tokens=200, outcome="gave_up")]
    out = recompute_report(records, recomputed=None, prefill_tokens=2960, preemptions=3, kv_tokens=20_480)
    # each preemption recomputes at most the largest context of the run (1,480 + 6,000)
    assert out["recomputed_tokens"] is None and out["recomputed_tokens_bound"] == 3 * 7480
    assert recomputed_cell(out) == f"<={3 * 7480}"
    # never more than the whole KV per preemption
    assert recompute_report(records, None, 2960, 1, kv_tokens=5000)["recomputed_tokens_bound"] == 5000
    assert recompute_report(records, None, 2960, 0)["recomputed_tokens_bound"] == 0


def test_goodput_bound_is_reported_for_deadline_runs_from_the_runs_own_rates() -> None:
    # three requests of 1,000 prompt tokens + 11 tokens; the fastest saw 0.5 s TTFT (2,000 tok/s
    # prefill) and decoded 10 tokens in 1 s; deadline 3 s; 1 lane, ample KV
    records = [record(i, 1000, 11, sent=0.0, first=0.5 + i, end=1.5 + i, tokens=11, outcome="completed")
               for i in range(2)]
    records.append(record(2, 1000, 11, sent=0.0, first=None, end=3.0, tokens=0, outcome="gave_up"))
    out = goodput_bound_report(records, deadline=3.0, lanes=1, kv_tokens=100_000, k=1.0)
    engine = out["goodput_bound_engine"]
    assert (engine["prefill_tok_s"], engine["decode_tok_s"], engine["lanes"]) == (2000.0, 10.0, 1)
    # one lane: 0.5 + 1.0 s each, one after another: two end by 3 s, the third cannot
    assert engine["requests_in_time"] == 2 and out["goodput_bound"] == round(2 / 3, 4)
    assert goodput_bound_report(records, deadline=None, lanes=1, kv_tokens=1, k=1.0) == {}


def test_a_reordered_run_fails_loudly_and_says_what_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    bad = {"scenario": "three-65k", "mode": "none", "arrival_order_kept": False,
           "engine_arrival_order": "65k 8k 65k"}
    message = arrival_order_failure(bad, time_scale=25.0, spacing=0.5)
    assert message is not None
    assert "another order than they were sent (65k 8k 65k)" in message
    assert "--time-scale" in message and "--spacing" in message and "--allow-reordered" in message
    cfg = BenchConfig("three-65k", "none", time_scale=25.0)
    assert arrival_order_status([bad], cfg, allow=False) == ARRIVAL_ORDER_EXIT
    assert "error: three-65k / none" in capsys.readouterr().err
    assert arrival_order_status([bad], cfg, allow=True) == 0
    assert "warning: " in capsys.readouterr().err
    kept = {**bad, "arrival_order_kept": True}
    assert arrival_order_failure(kept, 25.0, 0.5) is None
    assert arrival_order_status([kept], cfg, allow=False) == 0
    # closed loop: no fixed order to keep
    assert arrival_order_status([bad], BenchConfig("short", "none"), allow=False) == 0


@pytest.mark.parametrize("name", ["chat-longtail", "real-chat-longtail"])
def test_the_long_tail_chat_scenarios_draw_prompts_from_200_to_2000_tokens(name: str) -> None:
    specs, _ = build_requests(name)
    assert len(specs) >= 20
    sizes = {s.prompt_tokens for s in specs}
    assert min(sizes) >= 200 and max(sizes) <= 2000 and len(sizes) > len(specs) // 2
    assert all(not s.cls.ignore_eos for s in specs)  # natural ends: the length is the model's
    assert [s.at for s in specs] == sorted(s.at for s in specs)
    assert SCENARIOS[name].real == name.startswith("real-")
    assert build_requests(name)[0] == specs  # the seed fixes the load


def test_the_matrix_maps_its_modes_onto_bench_admission_runs() -> None:
    from bench.policy_matrix import cell

    assert cell("reasoning", "strict", "sim").argv == (
        "--scenario", "reasoning", "--quiet", "--engine", "vllm-0.33", "--mode", "full", "--policy", "strict")
    assert cell("overload", "projected", "sim").argv[-4:] == ("--mode", "full", "--policy", "projected")
    assert cell("overload", "none", "sim").argv[-2:] == ("--mode", "none")
    assert "vllm-0.11" in (cell("three-65k", "none", "sim").argv or ())  # the legacy engine
    assert cell("three-65k", "vllm-builtin", "sim").argv is None
    real = cell("real-decode", "projected", "real", "http://127.0.0.1:8000")
    assert real.argv is not None and ("--engine-url", "http://127.0.0.1:8000") == real.argv[3:5]
    assert cell("real-decode", "vllm-builtin", "real", "http://x").argv is None


def test_the_matrix_table_prints_a_dash_for_a_figure_the_service_does_not_report() -> None:
    from bench.policy_matrix import Cell, markdown_table, row

    result = {"output_tokens_per_s": 1234.56, "goodput": 0.5, "goodput_bound": 0.61,
              "ttft_p50": {"all": 1.0}, "ttft_p95": {"all": 2.0}, "e2e_p50": {"all": 3.0}, "e2e_p95": {"all": 4.5},
              "preemptions": 2, "recomputed_tokens": 10, "prefill_tokens": 1000}
    c = Cell("overload", "strict", ())
    cells = row(c, result)
    assert cells == ["overload", "strict", "1234.6", "0.500 (0.610)", "1.0 / 2.0", "3.0 / 4.5", "2", "10 / 1000", "-"]
    assert row(c, {**result, "false_early_rejections": 0})[-1] == "0"
    assert row(c, None, "failed: arrival order not kept")[2] == "failed: arrival order not kept"
    # a service that does not know the policy ran its own: the table says so
    ran_as = row(Cell("overload", "projected", ()), {**result, "policy": "strict", "policy_requested": "projected"})
    assert ran_as[1] == "projected (ran as strict)"
    table = markdown_table([cells])
    assert table.splitlines()[0].startswith("| scenario | mode | output tok/s | goodput (bound)")
    assert len(table.splitlines()) == 3
