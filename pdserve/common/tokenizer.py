"""Text <-> token ids for a model directory (`tokenizer.json` + `tokenizer_config.json`), and streaming decode.

Only the `tokenizers` library is used at serving time; transformers is not needed. A text is encoded as a client's
`AutoTokenizer.from_pretrained(model_dir)(text)` encodes it: the special tokens around it (a BOS in front, for the
DeepSeek models) are those tokenizer.json's post-processor adds, which is what transformers applies too (version 5
reads nothing else; tokenizer_config.json's `add_bos_token` should agree, and a warning says when it does not). So a
client that tokenizes on its side (lm-eval's loglikelihood) scores the same sequence as a text request.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Sequence

import tokenizers
from tokenizers import processors

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes of an unfinished UTF-8 character


def _token_content(value: Any) -> Optional[str]:
    # tokenizer_config.json stores special tokens either as a string or as an AddedToken dict with "content".
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"expected a token string or a dict with 'content', got {value!r}")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def add_bos_processor(tok: tokenizers.Tokenizer, bos_token: str) -> None:
    """Makes `tok` put `bos_token` in front of every text it encodes with special tokens (a TemplateProcessing
    post-processor in tokenizer.json, as DeepSeek-V3's has): transformers and pdserve then both add it."""
    special = [(bos_token, tok.token_to_id(bos_token))]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A",
                                                       pair=f"{bos_token} $A {bos_token} $B", special_tokens=special)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bos/eos tokens that live in tokenizer_config.json."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        bos_token: Optional[str] = None,
        eos_tokens: Sequence[str] = (),
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self._tok = tok
        self._max_token_chars: Optional[int] = None
        self._bos_id = None if bos_token is None else self._id_of(bos_token, "bos_token")
        self._eos_ids = frozenset([self._id_of(t, "eos_token") for t in eos_tokens] + list(extra_eos_token_ids))
        # What the post-processor puts around a text: [bos] for DeepSeek's tokenizer.json, [] without one.
        around = tok.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(around) and around[0] == self._bos_id

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> Optional["Tokenizer"]:
        """Loads the tokenizer of a model directory; None when it has no tokenizer.json (token ids only).

        eos ids are the union of tokenizer_config.json's eos_token and generation_config.json's eos_token_id
        (an int or a list), since either may be the one the model was trained to stop on.
        """
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            return None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        eos = _token_content(cfg.get("eos_token"))
        tokenizer = cls(
            tokenizers.Tokenizer.from_file(tok_file),
            bos_token=_token_content(cfg.get("bos_token")),
            eos_tokens=() if eos is None else (eos,),
            extra_eos_token_ids=[] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else gen_eos),
        )
        said = cfg.get("add_bos_token")
        if said is not None and bool(said) != tokenizer.add_bos_token:
            log.warning("%s: tokenizer_config.json sets add_bos_token %s but tokenizer.json's post_processor %s "
                        "BOS; pdserve, like transformers, follows tokenizer.json (texts are encoded %s BOS): make the "
                        "two agree", path, str(bool(said)).lower(), "adds" if tokenizer.add_bos_token else "adds no",
                        "with" if tokenizer.add_bos_token else "without")
        return tokenizer

    def _id_of(self, token: str, field: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{field} {token!r} from tokenizer_config.json is not in the tokenizer's vocabulary")
        return tid

    def encode(self, text: str, release_gil: bool = False) -> list[int]:
        """Token ids of `text`, with the special tokens tokenizer.json's post-processor adds (bos in front for the
        DeepSeek models), as transformers encodes it. release_gil: let other Python threads (an event loop) run
        meanwhile, for long texts encoded on a worker thread.

        Special-token strings in the text (e.g. a chat template's own bos) are parsed as special tokens; bos is
        not prepended a second time when the text already starts with it (a rendered chat template does; this is
        where pdserve differs from `AutoTokenizer(text)`, which would double it).
        """
        if release_gil:  # encode_batch runs without the GIL; encode holds it for the whole text
            ids = self._tok.encode_batch([text], add_special_tokens=True)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos_token and len(ids) > 1 and ids[1] == self._bos_id:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_ids)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def max_token_chars(self) -> int:
        """Characters in the longest token of the vocabulary (added tokens included): a text longer than this times
        n tokens cannot encode to fewer than n tokens (before normalization)."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (a model's embedding may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, emitting each character once it is complete.

    Decoding the whole output after every token costs O(length). Instead two offsets are kept (as in TGI and
    vLLM): text is decoded for tokens[prefix:read] and tokens[prefix:], and the difference is new. The prefix
    window gives decoders that depend on context (leading-space stripping, byte merging) the same left context
    in both decodes. While the new text ends in U+FFFD a multi-byte character is split across tokens, so it is
    held back until the next token completes it, or until `flush`.
    """

    PREFIX_WINDOW = 5  # prompt tokens decoded as left context before the first output token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Only tokens from the prefix offset on are kept, so memory and cost per token stay O(window).
        self._ids = list(prompt_ids[max(len(prompt_ids) - self.PREFIX_WINDOW, 0) :])
        self._read = len(self._ids)  # offset into self._ids; tokens before it have been emitted (or are prompt)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Appends generated ids; returns the text that became final ("" while a character is incomplete)."""
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns whatever is still held back (an unfinished character decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[: self._read])
        full_text = self._decode(self._ids)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        if full_text.startswith(prefix_text):
            new_text = full_text[len(prefix_text) :]
        else:
            # The prompt ended inside a character that the output completed: the character goes to the output.
            new_text = full_text[len(prefix_text.rstrip(REPLACEMENT_CHAR)) :]
        # The emitted tokens become the left context of the next window.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return new_text
