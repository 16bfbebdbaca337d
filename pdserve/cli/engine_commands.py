"""Commands that run the model in this process: `generate` (one prompt through the single-process engine, or
through a running router with --target) and `make-tiny-model`."""

from __future__ import annotations

import argparse
import json
import time

from pdserve.cli.engine_args import UsageError, engine_config_from_args, sampling_params_from_args
from pdserve.common.progress import say as _progress


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.input_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --input-ids 1,2,3")
    params = sampling_params_from_args(args)  # validate before the (slow) model load
    if args.prompt == "" or args.input_ids == []:
        raise UsageError("the prompt is empty: give at least one token")
    if args.target:  # a client of a running router: no torch, no engine (their import alone takes seconds)
        from pdserve.cli.serve import generate_remote

        return generate_remote(args, params)
    start = time.monotonic()
    config = engine_config_from_args(args)  # (a mistake in the flags is said before the engine's import)
    from pdserve.engine import LLMEngine

    engine = LLMEngine(config, progress=_progress)
    _progress(f"model ready in {time.monotonic() - start:.1f}s ({engine.model_config.name}, "
              f"{engine.config.device})")
    prompt = args.prompt if args.prompt is not None else args.input_ids
    out = engine.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"output_ids": out.output_ids, "text": out.new_text, "finish_reason": out.finish_reason,
                          "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
                          "cached_tokens": out.cached_tokens}
                         | ({"logprobs": [{"token_id": lp.token_id, "logprob": lp.logprob,
                                           "top": [list(t) for t in lp.top]} for lp in out.logprobs]}
                            if out.logprobs is not None else {})))
    else:
        print(out.new_text if engine.tokenizer else " ".join(map(str, out.output_ids)))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.tiny_model import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, fp8=args.fp8, seed=args.seed)
    print(f"wrote a tiny {args.arch}{' FP8' if args.fp8 else ''} checkpoint to {args.dir}")
    return 0


