"""A request's state as counters with invariants (vLLM's num_computed_tokens style).

tokens = prompt + output. KV is in the cache for tokens[:num_computed_tokens]; num_cached_tokens of those came
from the prefix cache at admission. A step computes tokens[num_computed_tokens:num_computed_tokens + n]; when that
reaches the end of tokens the step samples the next token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from pdserve.common.values import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    num_preemptions: int = 0
    generator: Any = None  # torch.Generator for seeded sampling (kept opaque: the scheduler never touches torch)
    spec: Any = None  # speculative decoding's draft state (spec_decode.DraftState); cleared when KV is dropped
    block_keys: list = field(default_factory=list)  # prefix-cache keys of its leading full blocks, made once each
    dp_rank: int = 0  # DP attention: the rank whose pool holds its pages and which runs its attention

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty: give at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """all_token_ids[-1] without copying both lists (every decode row needs it, every step)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the newest sampled token lacks KV: the next step is a one-token decode row."""
        return bool(self.output_ids) and self.num_computed_tokens == self.num_tokens - 1

    def advance(self, num_tokens: int, page_size: int) -> None:
        self.num_computed_tokens += num_tokens
        assert self.num_cached_tokens <= self.num_computed_tokens <= self.num_tokens, (
            f"{self.request_id}: cached {self.num_cached_tokens} computed {self.num_computed_tokens} "
            f"tokens {self.num_tokens}")
        assert len(self.pages) * page_size >= self.num_computed_tokens, f"{self.request_id}: KV beyond its pages"
