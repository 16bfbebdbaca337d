"""Value types the tiers pass to each other, in a module without torch (the router imports them).

`SamplingParams` (per-request decoding settings), `FinishReason`, and `KVLayout` (what a prefill and a decode
worker must agree on before KV moves).
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

FINISH_STOP = "stop"  # eos (unless ignore_eos), a stop token id or a stop string
FINISH_LENGTH = "length"  # max_new_tokens reached
GREEDY_BELOW_TEMPERATURE = 1e-5
# What the wire types of generate.proto's SamplingParams hold: larger values cannot be sent to a worker, so they are
# refused here, naming the field, instead of failing later as protobuf's "Value out of range".
INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
MAX_LOGPROBS = 20  # alternatives per position a request may ask for (OpenAI's chat limit)
FLOAT32_MAX = 3.4028234663852886e38


def _as_float32(value: float) -> float:
    """`value` as the 32-bit float the wire carries (pdserve.v1 SamplingParams)."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI/vLLM semantics). Lists are accepted and stored as tuples."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off; -1 is normalised to 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of each generated token plus its `logprobs` most likely alternatives (None: not computed;
    # 0: the chosen token's alone). `prompt_logprobs` likewise for every prompt token after the first (OpenAI's
    # `echo`); computed on the prefill worker, and such a prompt is computed in full (no prefix-cache reuse).
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        # NOTE: a bare string would otherwise become a tuple of one-character stop strings.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if not 1 <= self.max_new_tokens <= UINT32_MAX:
            raise ValueError(f"max_new_tokens must be in [1, {UINT32_MAX}], got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1) or _as_float32(self.top_p) == 0:
            raise ValueError(f"top_p must be in (0, 1] and not round to 0 as the 32-bit float it travels as "
                             f"(>= 1e-45), got {self.top_p}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in [1, {INT32_MAX}], or 0 / -1 to disable, got {self.top_k}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64) or None, got {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must contain only non-empty strings, got {stop!r}")
        bad = [t for t in self.stop_token_ids if not 0 <= t <= UINT32_MAX]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad[:5]!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                                 f"got {value!r}")

    @property
    def wants_logprobs(self) -> bool:
        """Logprobs of the generated tokens or of the prompt: the first token's and the prompt's come from the
        prefill worker's answer, so such a request's first token waits for the decode worker's stream."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def is_greedy(self) -> bool:
        # As in vLLM: dividing by a temperature this small overflows float32 logits to inf (then NaN).
        return self.temperature < GREEDY_BELOW_TEMPERATURE



@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the distribution it was drawn from (log-softmax of the logits divided by the
    temperature when sampling, of the raw logits when greedy; top-k/top-p not applied), and the `top` most likely
    tokens of that distribution as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens, or the model's context is full
    ABORT = "abort"  # cancelled by the client or the operator


# torch dtype names a KV pool may use (torch's own names, so `getattr(torch, name)` is the dtype).
KV_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on before any KV byte moves (checked at the handshake)."""

    model_fingerprint: str  # identifies model weights + config (same model on both sides)
    page_size: int
    num_kv_layers: int
    kv_dim: int  # latent row width, 576 for DeepSeek-V3 (512 + 64 rope)
    dtype: str  # torch dtype name of the KV rows, e.g. "bfloat16"

    def __post_init__(self) -> None:
        for name in ("page_size", "num_kv_layers", "kv_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name}={getattr(self, name)} must be positive")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVLayout.dtype={self.dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")

    @property
    def torch_dtype(self):
        import torch  # NOTE: here, not at the top: the router imports this module and must not load torch

        return getattr(torch, self.dtype)

    def mismatch(self, other: KVLayout, names: tuple[str, str] = ("prefill", "decode")) -> str | None:
        """None if compatible, else one line naming every differing field with both values, e.g.
        "page_size: prefill 16 vs decode 4". `self` is described as names[0], `other` as names[1]."""
        diffs = [
            f"{f.name}: {names[0]} {getattr(self, f.name)!r} vs {names[1]} {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "; ".join(diffs) if diffs else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise ValueError(f"KVLayout is missing field(s) {', '.join(missing)}")
        return cls(**{f.name: d[f.name] for f in fields(cls)})
