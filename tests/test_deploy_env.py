"""PDSERVE_<FLAG> environment variables as flag defaults (pdserve/cli/env.py): typed like the flags, flags win, errors
name the variable; and `pdserve healthcheck`, the images' HEALTHCHECK, against real gRPC health servers."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cli import build_parser, main
from pdserve.cli.env import EnvError, known_variables, parse_args, variable_for

from stack import REPO, free_port


def parse(argv, env):
    return parse_args(build_parser(), argv, env)


def test_variables_are_the_flags_defaults_and_flags_win():
    env = {"PDSERVE_MODEL": "/models/m", "PDSERVE_REDIS_URL": "redis://r:6379/0", "PDSERVE_PORT": "50061",
           "PDSERVE_TRANSFER_TIMEOUT": "12.5", "PDSERVE_NO_PREFIX_CACHE": "true", "PDSERVE_DTYPE": "bfloat16"}
    args = parse(["prefill"], env)
    assert (args.model, args.redis_url, args.port, args.transfer_timeout, args.no_prefix_cache, args.dtype) == \
        ("/models/m", "redis://r:6379/0", 50061, 12.5, True, "bfloat16")
    args = parse(["prefill", "--port", "7", "--model", "/other"], env)
    assert (args.port, args.model, args.redis_url) == (7, "/other", "redis://r:6379/0")
    assert parse(["prefill"], {}).port == 0  # no variable: the flag's own default


def test_each_command_reads_only_its_own_flags():
    env = {"PDSERVE_HTTP_PORT": "8000", "PDSERVE_KV_PORT": "50072", "PDSERVE_PORT": "50051"}
    router = parse(["router", "--prefill", "a:1", "--decode", "b:2"], env)
    assert router.http_port == 8000 and not hasattr(router, "kv_port")
    decode = parse(["decode"], env)
    assert decode.kv_port == 50072 and not hasattr(decode, "http_port")
    assert parse(["healthcheck"], env).port == 50051  # the image's HEALTHCHECK follows PDSERVE_PORT


def test_an_empty_variable_counts_as_unset():
    # compose's `${PDSERVE_INTERNAL_TOKEN:-}` passes an empty string when the operator set nothing
    args = parse(["router", "--prefill", "a:1", "--decode", "b:2"], {"PDSERVE_INTERNAL_TOKEN": "", "PDSERVE_PORT": ""})
    assert (args.internal_token, args.port) == (None, 50051)


def test_repeatable_flags_take_a_list_and_the_command_line_replaces_it():
    env = {"PDSERVE_PREFILL": "p1:1, p2:2", "PDSERVE_DECODE": "d1:1"}
    args = parse(["router"], env)
    assert (args.prefill, args.decode) == (["p1:1", "p2:2"], ["d1:1"])
    args = parse(["router", "--prefill", "p3:3"], env)
    assert (args.prefill, args.decode) == (["p3:3"], ["d1:1"])


@pytest.mark.parametrize("variable, value, says", [
    ("PDSERVE_PORT", "http", "PDSERVE_PORT='http'"),
    ("PDSERVE_DTYPE", "int3", "choose from"),
    ("PDSERVE_NO_PREFIX_CACHE", "maybe", "expected one of"),
    ("PDSERVE_STOP_TOKEN_IDS", "1,x", "PDSERVE_STOP_TOKEN_IDS"),
])
def test_bad_values_name_the_variable(variable, value, says):
    command = ["generate"] if variable == "PDSERVE_STOP_TOKEN_IDS" else ["prefill"]
    with pytest.raises(EnvError, match=says):
        parse(command, {variable: value})


def test_cli_reports_bad_and_unknown_variables():
    env = {**os.environ, "PDSERVE_PORT": "abc", "PDSERVE_REDIS_ULR": "redis://typo", "PDSERVE_TORCH_NORM_ROPE": "1"}
    out = subprocess.run([sys.executable, "-m", "pdserve", "healthcheck"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "PDSERVE_PORT='abc'" in out.stderr
    assert "ignoring PDSERVE_REDIS_ULR" in out.stderr  # a typo is not silently dropped
    assert "PDSERVE_TORCH_NORM_ROPE" not in out.stderr  # a diagnostic switch, read by kernels/norm_rope.py


def test_known_variables_cover_the_serving_flags():
    names = known_variables(build_parser())
    for flag in ("--model", "--redis-url", "--port", "--http-port", "--metrics-port", "--advertise-host",
                 "--kv-host", "--kv-port", "--worker-id", "--host", "--page-size"):
        assert variable_for(flag) in names


# ---- pdserve healthcheck ---------------------------------------------------------------------------------------
@pytest.fixture
def health_server():
    """A real gRPC server with the standard health service; the test flips its status."""
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def healthcheck(capsys, monkeypatch, *args, env=None) -> tuple[int, str]:
    """`pdserve healthcheck ARGS` through the real entry point (in this process: each CLI start costs seconds)."""
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    code = main(["healthcheck", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_healthcheck_exit_codes(health_server, capsys, monkeypatch):
    servicer, port = health_server
    check = lambda *args, env=None: healthcheck(capsys, monkeypatch, *args, env=env)  # noqa: E731
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check("--target", f"127.0.0.1:{port}") == (0, f"127.0.0.1:{port}: SERVING\n")
    assert check(env={"PDSERVE_PORT": str(port)})[0] == 0  # the image's form: no --target
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining after SIGTERM
    assert check("--target", f"127.0.0.1:{port}") == (1, f"127.0.0.1:{port}: NOT_SERVING\n")
    code, out = check("--target", f"127.0.0.1:{port}", "--service", "no.such.Service")
    assert code == 1 and "NOT_FOUND" in out
    code, out = check("--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert code == 1 and "UNAVAILABLE" in out  # 1, never Docker's reserved 2
