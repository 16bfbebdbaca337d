"""What the `pdserve` command shows before it does anything: every flag's help (present, no measurements, GPU-only
settings saying so), backend choices that are every backend pdserve has (one that cannot run here exits 2 with the
reason), and the environment check of the guard variables, per command."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from pdserve.cli import build_parser, main
from pdserve.cli.env import GUARDS, _subparsers, parse_args, variable_for

from stack import REPO, free_port


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    return [("pdserve", parser), *_subparsers(parser).items()]


# A number with a unit of time, rate or share: what a benchmark measures, which belongs in benchmarks/results, not in
# --help (defaults such as "16 MiB" or "(default 30)" are settings, not measurements).
MEASUREMENT = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:ms|us|µs|ns|%|x faster|x slower|tok/s|tokens/s|req/s|[GMT]B/s|"
                         r"TFLOP/?s|GFLOP/?s)(?![A-Za-z])")


@pytest.mark.parametrize("command, sub", parsers(), ids=[c for c, _ in parsers()])
def test_every_flag_has_help_without_measurements(command, sub):
    for action in sub._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), f"{command} {name}: no help"
        assert not MEASUREMENT.search(action.help), f"{command} {name}: a measurement in its help: {action.help!r}"
    assert not MEASUREMENT.search(sub.description or ""), f"{command}: a measurement in its description"


def test_the_measurement_pattern_catches_measurements():
    for text in ("about 12 ms faster", "TTFT 1.4x lower, 35% of the time", "runs at 480 tok/s", "3.2 GB/s"):
        assert MEASUREMENT.search(text), text
    for text in ("(default 16 MiB)", "every MS milliseconds (default 0: back to back)", "after a step of G ms",
                 "(default 30)", "PORT+1+k (9101, 9102, ...)"):
        assert not MEASUREMENT.search(text), text


def test_up_says_which_settings_apply_on_a_gpu_only():
    """On a CPU-only machine `up --help` must not read as if GPU time shares and CUDA graphs applied there."""
    up = dict(parsers())["up"]
    helps = {a.option_strings[0]: a.help for a in up._actions if a.option_strings}
    for flag in ("--decode-gpu-share", "--disable-cuda-graph", "--cuda-graph-max-bs"):
        assert "on a GPU" in helps[flag], (flag, helps[flag])
    assert "CPU" in helps["--decode-gpu-share"]  # ... and what happens on the CPU: nothing is limited
    assert not re.search(r"\d\.\d+ (of|when)", helps["--decode-gpu-share"])


def test_up_paces_decode_only_on_a_shared_gpu_never_on_the_cpu():
    from pdserve.cli.gpu_layout import place_workers
    from pdserve.cli.up import decode_gpu_share

    args = build_parser().parse_args(["up", "--device", "cpu"])
    assert decode_gpu_share(args, place_workers("cpu", 1, 1, "auto", 0)) == 1.0  # no CUDA graphs to time there
    assert decode_gpu_share(args, place_workers("cuda", 1, 1, "auto", 1)) == 1 / 3


def test_up_resolves_the_auto_device_as_its_workers_do():
    from pdserve.cli.up import resolved_device

    assert resolved_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolved_device("cuda:1") == "cuda:1" and resolved_device("cpu") == "cpu"


# ---- backend choices -------------------------------------------------------------------------------------------
def backend_choices(flag: str) -> list[str]:
    gen = dict(parsers())["generate"]
    return list(next(a for a in gen._actions if flag in a.option_strings).choices)


def test_backend_choices_are_every_backend_pdserve_has():
    from pdserve.kernels.backends import PREFERENCE, REGISTRIES

    for kind in ("attention", "moe", "gemm"):
        choices = backend_choices(f"--{kind}-backend")
        assert choices[0] == "auto" and set(choices[1:]) == set(REGISTRIES[kind].names()) | set(PREFERENCE[kind])
    assert "flashinfer" in backend_choices("--attention-backend") and "deep_gemm" in backend_choices("--moe-backend")
    from pdserve.kv_transfer import TRANSPORTS

    for command in ("prefill", "decode", "up"):
        assert sorted(_subparsers(build_parser())[command]._option_string_actions["--kv-transport"].choices) == \
            sorted(TRANSPORTS.names())


def test_help_and_a_users_mistake_come_without_importing_torch():
    """Written-out choices: `--help` and a flag's mistake need none of the registries' modules (torch's import
    alone takes seconds)."""
    probe = ("import sys\nfrom pdserve.cli import main\nfor argv in (['decode', '--help'], ['up', '--help'], "
             "['generate', '--model', '/nonexistent', '--prompt', 'hi']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "False", run.stdout[-2000:] + run.stderr[-2000:]


def pdserve(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


GPU_BACKENDS_ON_THE_CPU = [("--moe-backend", "deep_gemm", "deep_gemm"), ("--attention-backend", "flashinfer", "flashinfer"),
                           ("--gemm-backend", "deep_gemm", "deep_gemm")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these backends may run")
@pytest.mark.parametrize("flag, name, package", GPU_BACKENDS_ON_THE_CPU)
def test_a_gpu_backend_on_the_cpu_exits_2_with_the_reason(flag, name, package, capsys):
    assert main(["generate", flag, name, "--input-ids", "5,6"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve generate: error: {flag} {name} needs a CUDA GPU") and package in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these backends may run")
@pytest.mark.parametrize("flag, name, package", GPU_BACKENDS_ON_THE_CPU[:2])
def test_up_refuses_a_gpu_backend_on_the_cpu_before_any_worker_starts(flag, name, package):
    out = pdserve("up", flag, name, "--port", str(free_port()), "--http-port", "0", "--metrics-port", "0")
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()  # not each worker's error, then up's "exited with status 2"
    assert line.startswith(f"pdserve up: error: {flag} {name} needs a CUDA GPU") and package in line, line


def test_an_unknown_backend_is_still_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "--moe-backend", "cutlass"])
    assert exit_.value.code == 2 and "invalid choice: 'cutlass'" in capsys.readouterr().err


# ---- the environment's guard variables, per command ------------------------------------------------------------
@pytest.mark.parametrize("variable", sorted(GUARDS))
def test_a_server_honours_each_guard_variable_or_refuses_to_start(variable, monkeypatch, capsys):
    """Every server command a guard variable concerns either reads it as its flag's default or exits 2 naming it:
    none serves less guarded than asked (`PDSERVE_API_KEY=k pdserve up` once served without a key)."""
    value = "/nonexistent/pem" if "TLS" in variable else "k"
    flag = "--" + variable[len("PDSERVE_"):].lower().replace("_", "-")
    for command in GUARDS[variable]:
        sub = _subparsers(build_parser())[command]
        flags = {o for a in sub._actions for o in a.option_strings}
        if flag in flags:
            args = parse_args(build_parser(), [command], {variable: value})
            got = getattr(args, flag.lstrip("-").replace("-", "_"))
            assert got in (value, [value]), (command, variable, got)
        else:
            monkeypatch.setenv(variable, value)
            assert main([command]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and variable in err and f"pdserve {command}" in err, err
            monkeypatch.delenv(variable)


def test_up_takes_its_api_key_from_the_environment_and_tls_refuses():
    args = parse_args(build_parser(), ["up"], {"PDSERVE_API_KEY": "k1,k2", "PDSERVE_INTERNAL_TOKEN": "t"})
    assert (args.api_key, args.internal_token) == (["k1", "k2"], "t")
    for variable in ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY"):  # `up` has no TLS: it would serve in plaintext
        assert variable_for("--" + variable[8:].lower().replace("_", "-")) == variable
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        out = pdserve("up", env={**env, variable: "/etc/cert.pem"})
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert f"{variable} is set, but `pdserve up` has no" in out.stderr and "`pdserve router`" in out.stderr
    # A worker has no API key (clients never call it): a configuration shared by every role may hold one.
    assert parse_args(build_parser(), ["prefill"], {"PDSERVE_API_KEY": "k"}).port == 0


def test_a_list_flag_takes_a_comma_separated_variable_and_the_command_line_replaces_it():
    args = parse_args(build_parser(), ["bench"], {"PDSERVE_MAX_CONCURRENCY": "1,4", "PDSERVE_REQUEST_RATE": "8"})
    assert (args.max_concurrency, args.request_rate) == ([1, 4], [8.0])
    args = parse_args(build_parser(), ["bench", "--max-concurrency", "2"], {"PDSERVE_MAX_CONCURRENCY": "1,4"})
    assert args.max_concurrency == [2]
