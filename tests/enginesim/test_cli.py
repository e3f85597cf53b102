"""The enginesim command: flags, validation, and a real process on port 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from enginesim.cli import build_parser, config_from_args, main


def test_help_documents_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--model", "--max-model-len", "--max-num-seqs",
                 "--num-gpu-blocks", "--block-size", "--max-num-batched-tokens",
                 "--bytes-per-token", "--default-max-tokens", "--time-scale",
                 "--data-parallel-size", "--preset", "--step-overhead-s",
                 "--per-prefill-token-s", "--per-decode-seq-s"):
        assert flag in out
    assert "(default: 127.0.0.1)" in out and "(default: small)" in out


@pytest.mark.parametrize("argv, flag", [
    (["--num-gpu-blocks", "0"], "--num-gpu-blocks"),
    (["--time-scale", "-1"], "--time-scale"),
    (["--port", "70000"], "--port"),
    (["--max-num-seqs", "two"], "--max-num-seqs"),
    (["--max-model-len", "100000"], "--max-model-len"),
])
def test_bad_values_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_reference_preset_is_the_reference_engine():
    config = config_from_args(build_parser().parse_args(["--preset", "reference"]))
    sched = config.scheduler
    assert (sched.num_gpu_blocks, sched.block_size, sched.max_num_seqs) == (9527, 16, 4)
    assert (sched.max_num_batched_tokens, sched.max_model_len) == (2048, 131072)


def test_flags_override_the_preset():
    args = build_parser().parse_args(["--preset", "reference", "--max-num-seqs", "8",
                                      "--per-decode-seq-s", "0.02"])
    config = config_from_args(args)
    assert config.scheduler.max_num_seqs == 8
    assert config.scheduler.cost.per_decode_seq_s == 0.02
    assert config.scheduler.num_gpu_blocks == 9527


def test_process_binds_port_zero_reports_it_and_stops_on_sigterm():
    # The reference engine decodes 30 tok/s: a 2000-token stream would run for a minute.
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginesim", "--port", "0", "--model", "m1",
         "--preset", "reference"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # blocks until the socket is bound (or the process dies)
        match = re.fullmatch(r"enginesim listening on http://127\.0\.0\.1:(\d+)\n", line)
        assert match, line + proc.stderr.read()
        port = int(match.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        body = {"model": "m1", "prompt": "hi", "max_tokens": 2000, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200

        proc.send_signal(signal.SIGTERM)

        assert proc.wait(timeout=10) == 0
        assert stream.read().endswith(b"data: [DONE]\n\n")  # ended early, cleanly
        conn.close()
        assert "enginesim settings:" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_profile_defaults_to_vllm_033_and_reaches_the_config():
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).profile == "vllm-0.33"
    assert config_from_args(parser.parse_args(["--profile", "vllm-0.11"])).profile == "vllm-0.11"


def test_unknown_profile_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--profile", "vllm-0.20"])
    assert info.value.code == 2
    assert "--profile" in capsys.readouterr().err


def test_help_teaches_what_each_profile_does(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: vllm-0.33)" in out
    for phrase in ("whole prompt", "prefix caching", "async scheduling", "h100-llama8b"):
        assert phrase in out


def test_linear_cost_flags_are_refused_with_the_memory_bound_preset(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--preset", "h100-llama8b", "--per-decode-seq-s", "0.01"])
    assert info.value.code == 2
    assert "--per-decode-seq-s applies to the linear cost model" in capsys.readouterr().err


def test_the_tokenizer_defaults_to_qwen3_and_bytes_per_token_alone_selects_bytes4():
    parse = build_parser().parse_args
    assert config_from_args(parse([])).tokenizer == "qwen3"
    old = config_from_args(parse(["--bytes-per-token", "64"]))
    assert (old.tokenizer, old.bytes_per_token) == ("bytes4", 64.0)
    with pytest.raises(ValueError, match="--bytes-per-token applies to --tokenizer bytes4"):
        config_from_args(parse(["--tokenizer", "llama3", "--bytes-per-token", "8"]))
    eos = config_from_args(parse(["--output-len", "lognormal:1500:0.7", "--seed", "9"]))
    assert (eos.output_len, eos.seed, eos.default_max_tokens) == ("lognormal:1500:0.7", 9, None)


def test_a_bad_output_length_model_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--output-len", "uniform:3"])
    assert info.value.code == 2
    assert "--output-len" in capsys.readouterr().err
