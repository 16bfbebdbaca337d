"""What a prefill worker's step costs beyond the engine's own prefill, in one process (no gRPC, no peer):

  engine        LLMEngine.step() on one fresh prompt, no hooks (what bench_serving's "engine prefill" times)
  + mtp kv      the same with the MTP layer's prompt KV (StepHooks.computes_mtp_kv) and the MTP step at the last
                position once the first token is known: what a prefill worker computes for a decode tier that can
                speculate
  worker        the prefill worker's own engine (PrefillEngine, no --speculative-algorithm: for a decode tier that
                does not speculate, so the main layers only) with a transport that gathers the prompt's rows as
                cuda_ipc does (every layer at once, after the forward) and drops them: everything but the wire

Each: median wall time of --iters steps after one warm-up step per length (a step ends with the sampled token on
the host); then, with --profile, torch.profiler's top CUDA kernels and CPU ops of one `worker` step.

    python benchmarks/bench_prefill_stages.py --out DIR [--lengths 1024 4096 16384] [--v3-layers 4]
    python benchmarks/bench_prefill_stages.py --out DIR --device cpu --model models/tiny-trained --lengths 32 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.engine import LLMEngine, StepHooks  # noqa: E402
from pdserve.kv_transfer.base import SendHandle, TransferState, gather_rows  # noqa: E402
from pdserve.prefill_service.engine import PrefillEngine, PrefillJob  # noqa: E402
from pdserve.sampling import SamplingParams  # noqa: E402


class MtpKV(StepHooks):
    """The prefill worker's model work without its transfer: the MTP layer's prompt KV and last position."""

    computes_mtp_kv = True

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def on_prefilled(self, prompts, first_tokens, hidden) -> None:
        self.engine.runner.mtp_decode(prompts, first_tokens, hidden)


class GatherOnly(SendHandle):
    """A room whose rows are gathered out of the pool (each transport's one copy) and then dropped: all layers of a
    prompt in one gather after the forward, as cuda_ipc (the transport on one machine)."""

    room = 0
    streams_layers = False

    def send_rows(self, layer: int, source: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        gather_rows(source, slots, source.device)

    def send_layers(self, first_layer: int, source: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        source.index_select(1, slots) if slots is not None else source.clone()

    def finish(self, aux: dict[str, Any]) -> None:
        pass

    def wait(self, timeout=None):
        return None

    def poll(self) -> TransferState:
        return TransferState.DONE

    def abort(self) -> None:
        pass


def engine_for(args) -> LLMEngine:
    from pdserve.cli import build_parser
    from pdserve.cli.engine_args import engine_config_from_args

    flags = ["prefill", "--model", args.model, "--device", args.device, "--load-format", args.load_format,
             "--max-num-batched-tokens", str(max(args.lengths)), "--max-model-len", str(max(args.lengths) + 16),
             "--num-pages", str(4 * -(-max(args.lengths) // 16) + 64), "--no-prefix-cache"]
    config = engine_config_from_args(build_parser().parse_args(flags), prefill_only=True)
    print(f"[stages] kernels: attention {config.attention_backend}, moe {config.moe_backend}, gemm "
          f"{config.gemm_backend}", flush=True)
    return LLMEngine(config)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(engine: LLMEngine, submit, step, n: int, iters: int, device: str, vocab: int) -> list[float]:
    """Wall seconds of `iters` steps, each prefilling one new prompt of n random token ids (after a warm-up)."""
    times = []
    for i in range(iters + 1):
        submit([random.randrange(vocab) for _ in range(n)])
        sync(device)
        t0 = time.perf_counter()
        while engine.has_unfinished:
            step()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for prefill_stages.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="model folder (default: a V3 slice with dummy FP8 weights)")
    p.add_argument("--v3-layers", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of one worker step per length")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.load_format = "auto"
    if args.model is None:
        from benchmarks.bench_serving import write_v3_config

        args.model, args.load_format = write_v3_config(os.path.join(args.out, "model"), args.v3_layers), "dummy"
    engine = engine_for(args)
    vocab = engine.model_config.vocab_size
    greedy = SamplingParams(max_new_tokens=1, ignore_eos=True)
    plain = StepHooks()
    mtp = MtpKV(engine)
    worker = PrefillEngine(engine, sender=None)  # sets engine.hooks; jobs get a GatherOnly handle
    ids = iter(range(10**9))

    def submit_worker(prompt):
        rid = f"w{next(ids)}"
        worker.add(PrefillJob(rid, prompt, greedy))
        worker.bind(rid, GatherOnly(), ships_mtp=False)

    def submit_engine(prompt):
        engine.add_request(prompt, greedy, f"e{next(ids)}", detokenize=False)

    rows = []
    for n in args.lengths:
        row: dict[str, Any] = {"prompt_tokens": n}
        for name, hooks, submit, step in (("engine", plain, submit_engine, engine.step),
                                          ("mtp_kv", mtp, submit_engine, engine.step),
                                          ("worker", worker, submit_worker, worker.step)):
            engine.hooks = hooks
            row[name + "_ms"] = 1e3 * statistics.median(time_steps(engine, submit, step, n, args.iters,
                                                                   args.device, vocab))
        rows.append(row)
        print(f"[stages] {n:6d} tokens: engine {row['engine_ms']:8.2f} ms | + mtp kv {row['mtp_kv_ms']:8.2f} ms "
              f"({row['mtp_kv_ms'] / row['engine_ms']:.2f}x) | worker {row['worker_ms']:8.2f} ms "
              f"({row['worker_ms'] / row['engine_ms']:.2f}x)", flush=True)
        if args.profile:
            engine.hooks = worker
            submit_worker([random.randrange(vocab) for _ in range(n)])
            sync(args.device)
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
            with torch.profiler.profile(activities=acts) as prof:
                while engine.has_unfinished:
                    worker.step()
                sync(args.device)
            key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    out = os.path.join(args.out, "prefill_stages.json")
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "device": args.device, "rows": rows,
                   "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}, f, indent=1)
    print(f"[stages] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
