"""`pdserve` command line. argparse lives only here; everything below takes typed configs.

Errors a user can fix (bad flags, a broken model directory, bad token ids) print one line naming the problem and
exit with status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from pdserve.kernels import ATTENTION_BACKENDS, MOE_BACKENDS


class UsageError(Exception):
    pass


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs the model (generate, and later the prefill/decode workers)."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + safetensors)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation/weight dtype; auto = the checkpoint's (FP8 weights stay FP8)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights of the configured shapes, no files needed")
    g.add_argument("--attention-backend", default="auto", choices=["auto", *ATTENTION_BACKENDS.names()],
                   help="auto, on a GPU: triton for decoding under CUDA graphs (FlashInfer re-plans on the host "
                        "before every graphed step), else flashinfer, then triton, whichever is installed; torch on "
                        "CPU")
    g.add_argument("--moe-backend", default="auto", choices=["auto", *MOE_BACKENDS.names()],
                   help="auto = deep_gemm or triton on a GPU when installed, torch on CPU")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly (to compare)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=64,
                   help="largest decode batch captured in a CUDA graph (default 64)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--num-pages", type=int, default=2048, help="pages in the latent KV pool (default 2048)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step; longer prompts are prefilled in chunks (default 2048)")
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt prefixes")
    sg = p.add_argument_group("speculative decoding (decode tier and generate; off by default)")
    sg.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=["NEXTN"],
                    help="NEXTN = draft with the checkpoint's MTP layer, verify with the model (lossless)")
    sg.add_argument("--speculative-num-steps", type=int, default=3, metavar="K",
                    help="draft steps chained through the MTP layer per round (default 3)")
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                    help="positions verified per round; must be --speculative-num-steps + 1 (the default)")


def engine_config_from_args(args: argparse.Namespace, prefill_only: bool = False):
    """prefill_only: a prefill worker's engine. It never decodes, so it captures no decode CUDA graphs (memory and
    start-up time for nothing) and those do not steer --attention-backend auto."""
    from pdserve.engine import EngineConfig
    from pdserve.kv_cache import CacheConfig
    from pdserve.scheduler import SchedulerConfig
    from pdserve.spec_decode import SpeculativeConfig

    if not args.model:
        raise UsageError("--model DIR is required")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from pdserve.cuda_graph import CudaGraphConfig
    from pdserve.kernels.backends import resolve_backends

    graphed_decode = not prefill_only and not args.disable_cuda_graph
    attention, moe, gemm = resolve_backends(args.attention_backend, args.moe_backend, device, graphed_decode)
    return EngineConfig(
        model_dir=args.model, dtype=args.dtype, device=device, load_format=args.load_format,
        attention_backend=attention, moe_backend=moe, gemm_backend=gemm,
        cuda_graph=CudaGraphConfig(enabled=graphed_decode, max_bs=args.cuda_graph_max_bs),
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages),
        speculative=SpeculativeConfig(args.speculative_algorithm, args.speculative_num_steps,
                                      args.speculative_num_draft_tokens),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_running_requests=args.max_running_requests,
                                  enable_prefix_cache=not args.no_prefix_cache),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_token_ids, default=[], metavar="1,2")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    from pdserve.sampling import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLMEngine

    if (args.prompt is None) == (args.input_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --input-ids 1,2,3")
    params = sampling_params_from_args(args)  # validate before the (slow) model load
    if args.prompt == "" or args.input_ids == []:
        raise UsageError("the prompt is empty: give at least one token")
    if args.target:
        from pdserve.serve_cli import generate_remote

        return generate_remote(args, params)
    start = time.monotonic()
    engine = LLMEngine(engine_config_from_args(args), progress=_progress)
    _progress(f"model ready in {time.monotonic() - start:.1f}s ({engine.model_config.name}, "
              f"{engine.config.device})")
    prompt = args.prompt if args.prompt is not None else args.input_ids
    out = engine.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"output_ids": out.output_ids, "text": out.new_text, "finish_reason": out.finish_reason,
                          "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
                          "cached_tokens": out.cached_tokens}))
    else:
        print(out.new_text if engine.tokenizer else " ".join(map(str, out.output_ids)))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.tiny_model import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, fp8=args.fp8, seed=args.seed)
    print(f"wrote a tiny {args.arch}{' FP8' if args.fp8 else ''} checkpoint to {args.dir}")
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the server reports SERVING on grpc.health.v1, else 1 (what Docker's HEALTHCHECK expects: 2 is
    reserved there, so even an unreachable server is a plain 1)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = args.target or f"127.0.0.1:{args.port}"
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _progress(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode disaggregated serving for DeepSeek-V3-family models (MLA, MoE, NextN).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
    gen.set_defaults(func=cmd_generate)

    from pdserve import serve_cli

    for role, text in (("prefill", "run a prefill worker (computes prompts, ships their KV to decode workers)"),
                       ("decode", "run a decode worker (receives KV, streams tokens)")):
        w = sub.add_parser(role, help=text, description=text[0].upper() + text[1:] + ".")
        add_engine_args(w)
        serve_cli.add_worker_args(w, role)
        w.set_defaults(func=getattr(serve_cli, f"cmd_{role}"))
    router = sub.add_parser("router", help="run the router (client API; picks workers, relays streams)",
                            description="Run the router: serves pdserve.v1.Generation and routes each request to "
                                        "a prefill and a decode worker.")
    serve_cli.add_router_args(router)
    router.set_defaults(func=serve_cli.cmd_router)

    up = sub.add_parser("up", help="run router + prefill + decode workers locally until interrupted",
                        description="Start a router with N prefill and M decode worker processes on this machine "
                                    "(CPU unless a GPU is there) and stay up until Ctrl-C.")
    add_engine_args(up)
    ug = up.add_argument_group("stack")
    ug.add_argument("--host", default="127.0.0.1")
    ug.add_argument("--port", type=int, default=50051, help="router's client port (default 50051)")
    ug.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    ug.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    ug.add_argument("--redis-url", default=None, help="Redis for discovery and prefix ownership (optional)")
    ug.add_argument("--balance-threshold", type=int, default=4)
    ug.add_argument("--metrics-port", type=int, default=None, help="router /metrics port (workers pick free ones)")
    ug.add_argument("--http-port", type=int, default=None,
                    help="router's OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions; default off)")
    ug.add_argument("--transfer-timeout", type=float, default=300.0)
    ug.add_argument("--kv-transport", default="tcp", choices=serve_cli.kv_transport_names(),
                    help="KV transport of every worker (default tcp); with nccl, worker k runs on cuda:k (NCCL "
                         "pairs two different GPUs)")
    ug.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for workers to start")
    up.set_defaults(func=serve_cli.cmd_up)

    hc = sub.add_parser("healthcheck", help="ask a pdserve server for its grpc.health.v1 status (exit 0 = SERVING)",
                        description="Check a router or worker through grpc.health.v1: exit 0 when SERVING, 1 "
                                    "otherwise (unreachable included). The container images' HEALTHCHECK.")
    hc.add_argument("--target", metavar="HOST:PORT", help="server to check (default: 127.0.0.1:--port)")
    hc.add_argument("--port", type=int, default=50051,
                    help="local port checked without --target; PDSERVE_PORT, so in a container it is the port the "
                         "role was started on (default 50051)")
    hc.add_argument("--service", default="", help="service name to check ('' = the server as a whole)")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    hc.set_defaults(func=cmd_healthcheck)

    from pdserve import bench

    b = sub.add_parser("bench", help="load-test a running router (throughput, TTFT/ITL/TPOT/E2E, errors)",
                       description="Send random token-id prompts to a router (Poisson arrivals or all at once, "
                                   "optional concurrency cap and shared prefixes) and report throughput, latency "
                                   "percentiles and errors by status.")
    bench.add_bench_args(b)
    b.set_defaults(func=bench.cmd_bench)

    tiny = sub.add_parser("make-tiny-model", help="write a small random DeepSeek checkpoint (with MTP + tokenizer)",
                          description="Write a small random checkpoint in Hugging Face format for demos and tests.")
    tiny.add_argument("dir", help="output directory (must not exist or be empty)")
    tiny.add_argument("--arch", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v2"])
    tiny.add_argument("--fp8", action="store_true", help="store linear weights block-quantized (128x128) in FP8")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pdserve.env import EnvError, parse_args

    try:  # PDSERVE_<FLAG> variables are the flags' defaults; flags given here win
        args = parse_args(build_parser(), argv, os.environ)
    except EnvError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    from pdserve.config import ConfigError
    from pdserve.weights import WeightsError

    try:
        return args.func(args)
    except (UsageError, ConfigError, WeightsError, ValueError, FileExistsError, OSError, RuntimeError,
            TimeoutError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
