"""The TCP KV transport between CUDA pools on one GPU (what `pdserve up --device cuda` runs today): the sender
gathers each layer on the GPU and reads it off on a side stream without blocking its caller, the receiver writes it
into the decode pool's reserved pages on its own stream; rows arrive bit-identical, even when the prefill pool is
overwritten right after each send (as the next prompt's forward would)."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kv_cache import CacheConfig, LatentKVPool
from pdserve.kv_transfer import KVLayout, TcpKVReceiver, TcpKVSender

pytestmark = pytest.mark.gpu

PAGE, LAYERS, KV_DIM = 16, 5, 576


@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_rows_cross_between_cuda_pools_bit_identical(cleanup, tokens):
    layout = KVLayout("gpu-tcp", PAGE, LAYERS, KV_DIM, "bfloat16")
    prefill = LatentKVPool(LAYERS, KV_DIM, CacheConfig(page_size=PAGE, num_pages=512), torch.bfloat16, "cuda")
    decode = LatentKVPool(LAYERS, KV_DIM, CacheConfig(page_size=PAGE, num_pages=512), torch.bfloat16, "cuda")
    prefill.kv.copy_(torch.randn(prefill.kv.shape, device="cuda").to(torch.bfloat16))
    expected = prefill.kv.clone()
    pages = -(-tokens // PAGE)
    src = torch.randperm(512)[:pages].tolist()
    dst = torch.randperm(512)[:pages].tolist()
    done = threading.Event()
    layers_seen = []
    receiver = TcpKVReceiver(layout, on_layer=lambda room, layer, slots, values: layers_seen.append(values),
                             on_done=lambda room, aux: done.set(), on_failed=lambda room, err: done.set(),
                             kv_buffer=decode.kv)
    cleanup(receiver)
    sender = TcpKVSender(layout, device="cuda")
    cleanup(sender)
    receiver.expect(1, tokens, dst, LAYERS)
    handle = sender.begin(receiver.endpoint, 1, LAYERS)
    slots = prefill.slots_for(src, 0, tokens)
    for layer in range(LAYERS):
        handle.send_rows(layer, prefill.kv[layer], slots)
        prefill.kv[layer].fill_(7)  # the pool moves on at once: the rows sent must be the ones before this
    handle.finish({"first_token_id": 1, "cached_tokens": 0, "hidden": None, "rng_state": b""})
    handle.wait(timeout=30)
    assert done.wait(30) and layers_seen == [None] * LAYERS
    for layer in range(LAYERS):
        got = decode.gather(layer, dst, tokens)
        want = expected[layer][slots]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {layer} differs"
