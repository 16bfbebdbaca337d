"""Pieces every layer may import: no torch, no gRPC, no tier.

`registry` (name -> backend), `values` (SamplingParams, KVLayout, FinishReason: the value types the tiers pass
around), `blocks` (prefix block hashes), `tokenizer` (text <-> ids; the router tokenizes too), `stopping` (when a request
ends and the text streamed up to it: the engine's and the router's first token's).
"""
