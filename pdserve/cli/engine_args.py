"""Engine and sampling flags, shared by every command that runs the model (generate, prefill, decode, up).

argparse lives only in `pdserve.cli`; everything below it takes typed configs. Imports no torch: the backend names
the flags accept come from the kernel registries only when a value is checked or help is shown, so the commands
that run no model (router, bench, healthcheck) start without loading torch.
"""

from __future__ import annotations

import argparse
import os

from pdserve.cli.choices import LazyChoices

# pdserve/cli/engine_args.py -> the checkout root, where the demo model models/tiny-trained is committed
CHECKOUT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL_DIR = os.path.join(CHECKOUT_DIR, "models", "tiny-trained")


# Every kernel backend pdserve has, by kind, whether or not its package is installed here (one that cannot run here is
# refused with the reason when the engine is configured, exit 2, not by argparse as an unknown name). Written out
# rather than read from the registries, whose modules import torch: `--help` and a user's error then come at once;
# tests/test_cli_surface.py keeps these equal to the registries.
BACKEND_NAMES = {"attention": ("flashinfer", "torch", "triton"), "moe": ("deep_gemm", "torch", "triton"),
                 "gemm": ("deep_gemm", "scaled_mm", "torch", "triton")}


def backend_names(kind: str) -> list[str]:
    return ["auto", *BACKEND_NAMES[kind]]


def attention_backend_names() -> list[str]:
    return backend_names("attention")


def moe_backend_names() -> list[str]:
    return backend_names("moe")


def gemm_backend_names() -> list[str]:
    return backend_names("gemm")


class UsageError(Exception):
    pass


def resolve_model_dir(path, flag: str = "--model") -> str:
    """The model directory a command runs: `path` as given (relative to the current directory), else relative to the
    pdserve checkout (so `--model models/tiny-trained` works from anywhere), else the demo model when none is given.
    UsageError naming the flag when there is no model there."""
    if path is None:
        path = DEFAULT_MODEL_DIR
    candidates = [path] + ([os.path.join(CHECKOUT_DIR, path)] if not os.path.isabs(path) else [])
    for candidate in candidates:
        if os.path.isdir(candidate):
            if not os.path.isfile(os.path.join(candidate, "config.json")):
                raise UsageError(f"{flag} {path}: {os.path.abspath(candidate)} has no config.json; give a Hugging "
                                 "Face model directory (config.json + safetensors)")
            return os.path.abspath(candidate)
    where = " or ".join(os.path.abspath(c) for c in candidates)
    raise UsageError(f"{flag} {path}: the directory does not exist ({where})")


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs the model (generate, and later the prefill/decode workers)."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + safetensors); a "
                   "relative path not found here is looked up in the pdserve checkout (default: the demo model, "
                   "models/tiny-trained)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation/weight dtype; auto = the checkpoint's (FP8 weights stay FP8)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: the model split over N ranks, one process each (GPUs --device and the "
                        "N-1 after it: cuda:0..N-1 by default); rank 0 schedules, samples and, in a worker, serves "
                        "and moves KV (default 1)")
    g.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallelism: the routed experts split over the --tp ranks, each expert whole on one "
                        "rank, instead of each expert's intermediate; N = --tp (default 1: off)")
    g.add_argument("--dp-attention", action="store_true",
                   help="with --tp N (generate, decode; up: its decode workers): attention data-parallel over "
                        "requests, each rank running its own requests' attention over its own latent-KV pool (the "
                        "--num-pages pool per rank: N times the tokens of --tp alone), the MLP/MoE still split over "
                        "the ranks; each rank's decode rows padded to one CUDA-graph bucket (the NextN draft layer "
                        "runs eagerly)")
    g.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="with --tp N: a collective that waits longer than this for the other ranks fails the "
                        "worker with an error instead of hanging (a rank that is stuck; one that dies fails it at "
                        "once) (default 300)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights of the configured shapes, no files needed")
    g.add_argument("--attention-backend", default="auto", choices=LazyChoices(attention_backend_names),
                   help="auto, on a GPU: triton for decoding under CUDA graphs (FlashInfer re-plans on the host "
                        "before every graphed step), else flashinfer, then triton, whichever is installed; torch on "
                        "CPU")
    g.add_argument("--moe-backend", default="auto", choices=LazyChoices(moe_backend_names),
                   help="auto, on a GPU: deep_gemm where its probe passes (small batches run the Triton MoE "
                        "inside it), else triton; torch on CPU. A backend that cannot run here exits 2 with the "
                        "reason")
    g.add_argument("--gemm-backend", default="auto", choices=LazyChoices(gemm_backend_names),
                   help="dense (block-FP8) GEMMs: auto = deep_gemm where its probe passes, else scaled_mm, on a "
                        "GPU; torch when the MoE backend is torch")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="on a GPU: run decode eagerly, without CUDA graphs (to compare; the CPU has none)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=64,
                   help="on a GPU: largest decode batch captured in a CUDA graph (default 64)")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next (default: the next step is "
                        "launched first, so the host's work per step hides behind the GPU's)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--num-pages", type=int, default=2048, help="pages in the latent KV pool (default 2048)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step; longer prompts are prefilled in chunks (default 2048)")
    g.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoding at once; more wait for a slot (default 64)")
    g.add_argument("--max-model-len", type=int, default=4096, metavar="N",
                   help="tokens per request, prompt and output together (default 4096; at most the model's "
                        "max_position_embeddings, to which a larger value is lowered)")
    g.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt prefixes")
    sg = p.add_argument_group("speculative decoding (generate, and both tiers: decode drafts, prefill computes the "
                              "MTP layer's prompt KV; off by default)")
    sg.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=["NEXTN"],
                    help="NEXTN = draft with the checkpoint's MTP layer, verify with the model (lossless)")
    sg.add_argument("--speculative-num-steps", type=int, default=3, metavar="K",
                    help="draft steps chained through the MTP layer per round (default 3)")
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                    help="positions verified per round; must be --speculative-num-steps + 1 (the default)")


def check_dp_attention(args) -> None:
    """--dp-attention runs where requests decode: a UsageError on a prefill worker."""
    if args.dp_attention and getattr(args, "command", "generate") == "prefill":
        # DP attention's gain is the latent-KV pool of requests that stay (N ranks' pools); a prefill worker's KV
        # leaves after each prompt, and its transfers read one rank's pool
        raise UsageError("--dp-attention: for decode workers (their pools hold the requests' KV while they decode); "
                         "a prefill worker runs plain --tp (pdserve up --dp-attention gives it to the decode tier "
                         "only)")


def engine_config_from_args(args: argparse.Namespace, prefill_only: bool = False):
    """prefill_only: a prefill worker's engine. It never decodes, so it captures no decode CUDA graphs (memory and
    start-up time for nothing) and those do not steer --attention-backend auto."""
    args.model = resolve_model_dir(args.model)  # (the user's mistakes first, before torch is imported)
    check_dp_attention(args)
    from pdserve.engine import EngineConfig
    from pdserve.kv_cache import CacheConfig
    from pdserve.scheduler import SchedulerConfig
    from pdserve.config import ParallelConfig
    from pdserve.spec_decode import SpeculativeConfig

    tp = getattr(args, "tp", 1)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from pdserve.cuda_graph import CudaGraphConfig
    from pdserve.kernels.backends import resolve_backends

    graphed_decode = not prefill_only and not args.disable_cuda_graph
    attention, moe, gemm = resolve_backends(args.attention_backend, args.moe_backend, device, graphed_decode,
                                            gemm=args.gemm_backend)
    return EngineConfig(
        model_dir=args.model, dtype=args.dtype, device=device, load_format=args.load_format,
        attention_backend=attention, moe_backend=moe, gemm_backend=gemm,
        cuda_graph=CudaGraphConfig(enabled=graphed_decode, max_bs=args.cuda_graph_max_bs),
        overlap_schedule=not args.disable_overlap_schedule,
        parallel=ParallelConfig(tp_size=tp, ep_size=getattr(args, "ep", 1), dp_attention=args.dp_attention,
                                collective_timeout_s=args.collective_timeout),
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages),
        speculative=SpeculativeConfig(args.speculative_algorithm, args.speculative_num_steps,
                                      args.speculative_num_draft_tokens),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
                                  enable_prefix_cache=not args.no_prefix_cache),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate, at most (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probabilities add up to this (default 1: all)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_token_ids, default=[], metavar="1,2",
                   help="token ids that end the output, besides the model's end-of-sequence token")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, up to --max-new-tokens")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each new token's log-probability and its N (0-20) most likely alternatives")


def sampling_params_from_args(args: argparse.Namespace):
    from pdserve.common.values import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs)





