"""A request's first token, sent to its client as soon as the prefill worker answers.

The prefill worker answers a prompt once it sampled the first token and handed the KV to the transport. The decode
worker's stream starts with that same token, but only after the KV arrived, its engine thread admitted the request
and its event loop sent the update; the prefill worker's answer reaches the router sooner. So the router sends the
token itself, with its text made here by the engine's own stop check (`StopChecker`: same detokenizer, same stop
strings, same EOS), and takes that token and text off the front of the decode worker's first update.

Not done (the decode worker's stream then brings the first token with the rest): when the first token already ends
the request (EOS, a stop token or string, max_new_tokens 1: the decode worker reports the finish with its usage), and
for requests with logprobs (the first token's come in the prefill worker's answer, the rest from the decode worker).
"""

from __future__ import annotations

import logging
from typing import Collection, Optional

import grpc

from pdserve.common.stopping import StopChecker
from pdserve.common.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.common.values import SamplingParams
from pdserve.serving.grpc_shell import ServiceError
from pdserve.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)


class EarlyFirstToken:
    """One request's: `update_for` the prefill worker's first token, then `strip` the decode worker's updates."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_token_ids: Collection[int],
                 tokenizer: Optional[Tokenizer]):
        self._params, self._prompt_ids, self._tokenizer = params, prompt_ids, tokenizer
        self._eos = () if params.ignore_eos else eos_token_ids
        self._sent: Optional[tuple[int, str]] = None  # the token and text sent, until the decode worker's come

    def update_for(self, first_token_id: int) -> Optional[pb.DecodeUpdate]:
        """The update the decode worker's stream will begin with, made now; None when the token ends the request."""
        detok = IncrementalDetokenizer(self._tokenizer, self._prompt_ids) if self._tokenizer else None
        step = StopChecker(self._params, self._eos, detok).update([first_token_id])
        if step.finish_reason is not None:
            return None
        self._sent = (first_token_id, step.text)
        return pb.DecodeUpdate(token_ids=[first_token_id], text=step.text)

    def strip(self, update: pb.DecodeUpdate) -> None:
        """Takes the token sent (and its text) off the decode worker's first update for the request."""
        if self._sent is None or update.HasField("failure"):
            return
        token, text = self._sent
        self._sent = None
        if not update.token_ids or update.token_ids[0] != token:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the decode worker's first token {list(update.token_ids[:1])}"
                                                         f" is not the prefill worker's {token}")
        del update.token_ids[0]
        if update.text.startswith(text):
            update.text = update.text[len(text):]
        else:  # a router whose tokenizer is not the workers' (another --model): the text the client got stays
            log.warning("the first token's text here (%r) differs from the decode worker's (%r): is the router's "
                        "--model the workers'?", text, update.text)
