"""`splitserve bench` flags: defaults, per-workload ownership, and a clear message for every bad value."""
from __future__ import annotations

import json
import math

import pytest

from splitserve.cli import COMMANDS
from loadtest.cli import build_parser, config_from_args, parse_config
from loadtest.poisson import PoissonSpec
from loadtest.shared_prefix import SharedPrefixSpec
from loadtest.trace import TraceSpec


def config(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_bench_is_registered_in_the_splitserve_command():
    assert "bench" in COMMANDS


def test_defaults_and_workload_flags():
    c = config()
    assert c.target == "127.0.0.1:50051" and c.workload == "poisson" and c.seed == 0
    assert c.spec == PoissonSpec(64, 1.0, c.spec.prompt_len, c.spec.output_len)
    assert (c.spec.prompt_len.spelling, c.spec.output_len.spelling) == ("uniform:32,256", "uniform:16,64")
    assert (c.driver.max_concurrency, c.driver.duration_s, c.driver.grace_s) == (64, None, 10.0)
    c = config("--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3", "--prefix-len", "64",
               "--suffix-len", "0", "--rate", "inf", "--ttft-ms", "500", "--tpot-ms", "50", "--tenant", "t",
               "--priority", "-5")
    assert isinstance(c.spec, SharedPrefixSpec) and (c.spec.groups, c.spec.suffix_len) == (2, 0)
    assert math.isinf(c.spec.rate_per_s) and c.sweep_rates == ()
    assert (c.defaults.slo.ttft_ms, c.defaults.slo.tpot_ms, c.defaults.priority, c.defaults.tenant) == \
        (500.0, 50.0, -5, "t")
    assert config("--sweep", "1,2.5", "--duration-s", "30").sweep_rates == (1.0, 2.5)
    c = config("--backend", "openai")
    assert (c.backend, c.target) == ("openai", "http://127.0.0.1:8000")
    assert config("--target", "unix:/run/router.sock").target == "unix:/run/router.sock"


def test_trace_flags(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}) + "\n")
    c = config("--workload", "trace", "--trace", str(trace), "--trace-overflow", "clip", "--trace-spread-s", "3",
               "--sweep", "1,2", "--num-requests", "5")
    assert c.spec == TraceSpec(str(trace), overflow="clip", spread_s=3.0, num_requests=5)
    assert c.sweep_rates == (1.0, 2.0)


@pytest.mark.parametrize("argv, message", [
    (["--target", "localhost"], "--target: target must be HOST:PORT"),
    (["--target", "h:70000"], "--target: target must be HOST:PORT"),
    (["--target", "unix:"], "--target: target 'unix:' names no address"),
    (["--tls-ca-file", "/no/such/ca.pem"], "--tls-ca-file /no/such/ca.pem"),
    (["--tls-cert-file", "c.pem"], "--tls-cert-file and --tls-key-file go together"),
    (["--workload", "closed"], "invalid choice: 'closed'"),
    (["--backend", "openai", "--target", "127.0.0.1:8000"], "--target must be an http(s)://HOST:PORT URL"),
    (["--backend", "grpc"], "invalid choice: 'grpc'"),
    (["--model", "m"], "--model and --tokenizer apply to --backend openai"),
    (["--backend", "openai", "--tokenizer", "/no/such/dir"], "--tokenizer /no/such/dir: no tokenizer.json there"),
    (["--groups", "2"], "--groups applies to --workload shared-prefix, not poisson"),
    (["--trace-overflow", "clip"], "--trace-overflow applies to --workload trace, not poisson"),
    (["--prompt-len", "uniform:9,1"], "--prompt-len: uniform needs LO <= HI"),
    (["--workload", "shared-prefix", "--prompt-len", "fixed:3"], "--prompt-len applies to --workload poisson"),
    (["--workload", "trace"], "--workload trace needs --trace FILE"),
    (["--workload", "trace", "--trace", "/no/such/file"], "--trace /no/such/file: no such file"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--rate", "-1"], "--rate must be > 0"),
    (["--rate", "2", "--sweep", "1,2"], "--sweep sets the rate of each run: drop --rate"),
    (["--sweep", "1,x"], "--sweep must be comma-separated request rates"),
    (["--sweep", "1,1"], "--sweep rates must be distinct"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--duration-s", "0"], "--duration-s must be a finite number > 0"),
    (["--request-timeout-s", "-1"], "--request-timeout-s must be a finite number > 0"),
    (["--grace-s", "nan"], "--grace-s must be a finite number >= 0"),
    (["--ttft-ms", "0"], "--ttft-ms must be a finite number > 0"),
    (["--tpot-ms", "inf"], "--tpot-ms must be a finite number > 0"),
    (["--seed", "-1"], "--seed must be in [0, 2^63)"),
    (["--priority", "1001"], "--priority must be in [-1000, 1000]"),
    (["--tenant", "x" * 129], "--tenant must be at most 128 characters"),
    (["--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    (["--warmup-s", "-1"], "--warmup-s must be a finite number >= 0"),
    (["--attainment-target", "1.5"], "--attainment-target must be in (0, 1]"),
    (["--auth-token-file", "/no/such/token"], "--auth-token-file /no/such/token"),
    (["--num-requests", "two"], "argument --num-requests: invalid int value: 'two'"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_files_given_as_folders_and_empty_tokens_are_refused(tmp_path, capsys):
    (tmp_path / "token").write_text("  \n")
    (tmp_path / "file").write_text("x")
    for argv, message in ((["--auth-token-file", str(tmp_path / "token")], "is empty"),
                          (["--out", str(tmp_path / "file")], "exists and is not a directory"),
                          (["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "2",
                            "--num-requests", "5"], "--num-requests must be in [1, groups x prompts-per-group = 4]"),
                          (["--workload", "trace", "--trace", str(tmp_path / "file"), "--trace-speedup", "2",
                            "--rate", "3"], "--trace-speedup cannot be combined with --rate or --sweep")):
        with pytest.raises(SystemExit):
            parse_config(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "token").write_text(" secret \n")
    assert parse_config(["--auth-token-file", str(tmp_path / "token")]).auth_token_file == str(tmp_path / "token")
