"""`pdserve` command line. argparse lives only here; everything below takes typed configs.

Errors a user can fix (bad flags, a broken model directory, bad token ids, a port in use) print one line naming the
problem and exit with status 2; nothing is half-written. An error raised inside a third-party library pdserve runs
(Triton, torch, FlashInfer, gRPC) is an internal one: it prints its traceback and exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Optional, Sequence

from pdserve.cli import bench, engine_commands, serve
from pdserve.cli import up as up_command
from pdserve.cli.choices import ArgumentParser, LazyChoices
from pdserve.cli.gpu_layout import gpu_list
from pdserve.common.progress import stderr_line
from pdserve.cli.engine_args import (  # noqa: F401  (the CLI's API: tests and tools build configs with them)
    UsageError, add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args,
    _token_ids,
)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pdserve",
        description="Prefill/decode disaggregated serving for DeepSeek-V3-family models (MLA, MoE, NextN).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="`pdserve COMMAND --help` lists its flags")

    gen = sub.add_parser("generate", help="run a prompt through the single-process engine and print the output",
                         description="Run one prompt through the single-process engine (greedy by default).")
    add_engine_args(gen)
    src = gen.add_argument_group("input")
    src.add_argument("--prompt", help="text prompt (needs tokenizer.json in the model directory)")
    src.add_argument("--input-ids", type=_token_ids, metavar="1,2,3", help="prompt as token ids")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: output_ids, text, finish_reason and token counts")
    gen.add_argument("--target", metavar="HOST:PORT", help="send the request to a running router instead of "
                     "loading the model here (then the engine flags are ignored)")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a --target (default 600)")
    gen.add_argument("--api-key", default=None, metavar="KEY",
                     help="sent to the --target router as 'authorization: Bearer KEY' (a router started with "
                          "--api-key requires it)")
    gen.set_defaults(func=engine_commands.cmd_generate)

    for role, text in (("prefill", "run a prefill worker (computes prompts, ships their KV to decode workers)"),
                       ("decode", "run a decode worker (receives KV, streams tokens)")):
        w = sub.add_parser(role, help=text, description=text[0].upper() + text[1:] + ".")
        add_engine_args(w)
        serve.add_worker_args(w, role)
        w.set_defaults(func=getattr(serve, f"cmd_{role}"))
    router = sub.add_parser("router", help="run the router (client API; picks workers, relays streams)",
                            description="Run the router: serves pdserve.v1.Generation and routes each request to "
                                        "a prefill and a decode worker.")
    serve.add_router_args(router)
    router.set_defaults(func=serve.cmd_router)

    up = sub.add_parser("up", help="run router + prefill + decode workers locally until interrupted",
                        description="Start a router with N prefill and M decode worker processes on this machine "
                                    "(CPU unless a GPU is there) and stay up until Ctrl-C. By default: gRPC on "
                                    "127.0.0.1:50051, the OpenAI HTTP API on :8000, router metrics on :9100 and "
                                    "worker metrics on :9101 and up; every port is checked before any worker "
                                    "starts, and the endpoints are listed once the stack is up.")
    add_engine_args(up)
    ug = up.add_argument_group("stack")
    ug.add_argument("--host", default="127.0.0.1",
                    help="address the router's gRPC, HTTP and metrics ports listen on (0.0.0.0 for all; default "
                         "127.0.0.1)")
    ug.add_argument("--port", type=int, default=50051, help="router's client port (default 50051)")
    ug.add_argument("--prefill", type=int, default=1, metavar="N",
                    help="prefill workers (default 1), each a process with its own model copy and KV pool; they "
                         "run on --device, or on the GPUs of --gpus / --prefill-gpus. Where the prefill forward is "
                         "host-bound (a small model), a second one on the same GPU takes in more prompts, for a "
                         "longer TPOT while they come in")
    ug.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    ug.add_argument("--gpus", type=gpu_list, default=None, metavar="0,1",
                    help="GPUs of this machine the stack uses: the prefill workers take the first half of the list "
                         "(rounded up), the decode workers the rest (one GPU: both tiers share it); a tier's "
                         "workers go round robin over its GPUs. Default: every worker on --device (with "
                         "--kv-transport nccl, worker k on cuda:k)")
    ug.add_argument("--prefill-gpus", type=gpu_list, default=None, metavar="0",
                    help="the prefill workers' GPUs (the decode workers take the rest of --gpus, or --decode-gpus)")
    ug.add_argument("--decode-gpus", type=gpu_list, default=None, metavar="1",
                    help="the decode workers' GPUs (a GPU may be in both lists: its workers share it)")
    ug.add_argument("--redis-url", default=None, help="Redis for discovery and prefix ownership (optional)")
    ug.add_argument("--balance-threshold", type=int, default=4, metavar="N",
                    help="extra requests tolerated on the prefill worker that holds a prompt's prefix before load "
                         "decides (default 4)")
    ug.add_argument("--metrics-port", type=int, default=9100, metavar="PORT",
                    help="router's Prometheus /metrics port (default 9100); worker k (prefill workers first) serves "
                         "its own on PORT+1+k (9101, 9102, ...); 0 = free ports for all, listed at start-up")
    ug.add_argument("--no-metrics", action="store_true", help="serve no /metrics endpoints")
    ug.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                    help="router's OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                         "/health, /metrics; default 8000)")
    ug.add_argument("--no-http", action="store_true", help="serve no OpenAI HTTP API (gRPC only)")
    ug.add_argument("--transfer-timeout", type=float, default=300.0, metavar="S",
                    help="seconds a KV transfer may take before the request fails (default 300)")
    ug.add_argument("--internal-token", default=None, metavar="TOKEN",
                    help="shared secret of the internal endpoints: the workers require it, the router sends it "
                         "(handed to the workers through their environment, never their command line)")
    ug.add_argument("--api-key", action="append", default=[], metavar="KEY",
                    help="require 'authorization: Bearer KEY' from clients of the router (repeatable: any of them)")
    ug.add_argument("--kv-transport", default="auto", choices=LazyChoices(serve.kv_transport_names),
                    help=serve.KV_TRANSPORT_HELP)
    ug.add_argument("--nixl-backend", default=None, metavar="NAME", help=serve.NIXL_BACKEND_HELP)
    ug.add_argument("--no-kv-layerwise", action="store_true",
                    help="prefill workers send a prompt's KV after its whole forward instead of layer by layer (to "
                         "measure what layer-wise streaming saves in TTFT)")
    ug.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for workers to start")
    serve.add_min_step_interval_arg(ug, "--decode-min-step-interval-ms")
    ug.add_argument("--decode-gpu-share", type=serve.up_gpu_share, default="auto", metavar="auto|SHARE",
                    help=serve.GPU_SHARE_HELP + ". auto (default): a third when a decode worker shares its GPU with "
                    "a prefill worker (one GPU, any transport but nccl), else 1 (no limit)")
    serve.add_stream_interval_arg(ug)
    serve.add_warmup_args(ug)
    up.set_defaults(func=up_command.cmd_up)

    hc = sub.add_parser("healthcheck", help="ask a pdserve server for its grpc.health.v1 status (exit 0 = SERVING)",
                        description="Check a router or worker through grpc.health.v1: exit 0 when SERVING, 1 "
                                    "otherwise (unreachable included). The container images' HEALTHCHECK.")
    hc.add_argument("--target", metavar="HOST:PORT", help="server to check (default: 127.0.0.1:--port)")
    hc.add_argument("--port", type=int, default=50051,
                    help="local port checked without --target; PDSERVE_PORT, so in a container it is the port the "
                         "role was started on (default 50051)")
    hc.add_argument("--service", default="", help="service name to check ('' = the server as a whole)")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    hc.set_defaults(func=serve.cmd_healthcheck)

    b = sub.add_parser("bench", help="load-test a running router (throughput, TTFT/ITL/TPOT/E2E, errors)",
                       description="Send random token-id prompts to a router (Poisson arrivals or all at once, "
                                   "optional concurrency cap and shared prefixes) and report throughput, latency "
                                   "percentiles and errors by status.")
    bench.add_bench_args(b)
    b.set_defaults(func=bench.cmd_bench)

    tiny = sub.add_parser("make-tiny-model", help="write a small random DeepSeek checkpoint (with MTP + tokenizer)",
                          description="Write a small random checkpoint in Hugging Face format for demos and tests.")
    tiny.add_argument("dir", help="output directory (must not exist or be empty)")
    tiny.add_argument("--arch", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v2"],
                      help="model_type of the checkpoint: deepseek_v3 (with an MTP layer) or deepseek_v2 "
                           "(default deepseek_v3)")
    tiny.add_argument("--fp8", action="store_true", help="store linear weights block-quantized (128x128) in FP8")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    tiny.set_defaults(func=engine_commands.cmd_make_tiny_model)
    return parser


SERVER_COMMANDS = ("up", "router", "prefill", "decode")


class StopRequested(KeyboardInterrupt):
    """Ctrl-C (SIGINT) on a server: a normal stop, exit status 0.

    A subclass on purpose. Under `python -m`, CPython (3.11 at least) ends the process with SIGINT (status -2),
    after every handler and `finally` has run, if a plain KeyboardInterrupt ever left an exec/eval of a string.
    Dataclass and namedtuple creation inside a lazy import do that, so a caught Ctrl-C that lands there turns
    into a signal death. CPython only checks for the exact KeyboardInterrupt type."""


def stop_on_ctrl_c() -> None:
    import signal

    def _raise(signum, frame):
        raise StopRequested()

    signal.signal(signal.SIGINT, _raise)


_OWN_CODE = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d, "")
                  for d in ("pdserve", "prefill_service", "decode_service", "router", "kv_transfer", "kernels"))


def _raised_by_pdserve(error: BaseException) -> bool:
    """Whether `error` is about the user's input: raised by pdserve's own checks (a flag, the model directory, a
    port, a peer) or by the standard library reading what the user gave (a file, JSON, a socket), as opposed to
    an error inside a third-party library pdserve runs (Triton, torch, FlashInfer, gRPC): an internal error, whose
    traceback is what a bug report needs."""
    if isinstance(error, UsageError):
        return True
    tb = error.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if where.startswith(_OWN_CODE):
        return True
    return not any(part in ("site-packages", "dist-packages") for part in where.split(os.sep))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pdserve.cli.env import EnvError, parse_args

    try:  # PDSERVE_<FLAG> variables are the flags' defaults; flags given here win
        args = parse_args(build_parser(), argv, os.environ)
    except EnvError as e:
        stderr_line(f"pdserve: error: {e}")
        return 2
    if args.command in SERVER_COMMANDS:
        stop_on_ctrl_c()
    try:
        status = args.func(args)
        if args.command in SERVER_COMMANDS:
            # NOTE: a server's process ends here, and the interpreter's exit walks every object left (torch and the
            # model leave many), which a stop on SIGTERM should not wait for: frozen objects are skipped.
            gc.freeze()
        return status
    except (UsageError, ValueError, OSError, RuntimeError) as e:  # (FileExistsError, TimeoutError: OSErrors)
        if not _raised_by_pdserve(e):
            raise  # an internal error: its traceback, exit 1
        stderr_line(f"pdserve {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:  # servers stop on Ctrl-C as asked; a one-off command was interrupted
        return 0 if args.command in SERVER_COMMANDS else 130


if __name__ == "__main__":
    sys.exit(main())
