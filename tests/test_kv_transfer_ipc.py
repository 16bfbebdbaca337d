"""The "cuda_ipc" and "auto" KV transports on the CPU: what the handshake picks and why (`choose_transport`, fed
fake GPU facts), the refusal messages, the checks on the handle fields and page indices a peer sends, and the
whole control protocol (BEGIN/GRANT, announcements, release on ABORT, draining) over real sockets with a fake
`IpcBackend` whose "mapping" of the decode pool is the pool tensor itself. tests/test_gpu_kv_ipc.py runs the real
CUDA IPC mapping between processes on a GPU."""

from __future__ import annotations

import base64
import itertools
import logging
import threading
import time
import uuid

import pytest
import torch

from pdserve.kv_transfer import (
    TRANSPORTS, AutoKVReceiver, AutoKVSender, CudaIpcKVReceiver, CudaIpcKVSender, KVTransferError, TcpKVReceiver,
    check_transport_device, token_slots,
)
from pdserve.kv_transfer import cuda_ipc_sender
from pdserve.kv_transfer.cuda_ipc_pairing import (
    Facts, IpcBackend, check_export, choose_transport, expandable_segments_on, pool_slots,
)
from pdserve.kv_transfer.base import gather_layers
from pdserve.kv_transfer.pages import (
    CHUNK_BYTES, MAX_CHUNKS, _widest_word, chunk_count, gather_chunks, plan_pages, scatter_pages,
)

from test_kv_transfer_collective import AUX, NUM_PAGES, Decode, wait_until
from test_kv_transfer_tcp import KV_DIM, LAYERS, PAGE, TOKENS, Recorder, make_layout

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


class FakeIpc(IpcBackend):
    """Fake GPU facts; "exporting" a pool registers it, "mapping" it returns that very tensor (both ends live in
    this process), so every write the sender makes lands in the decode pool as a real mapping's would."""

    pools: dict[str, torch.Tensor] = {}

    def __init__(self, gpu: str | None = GPU_A, peers=(), host: str = "host-1", problem: str | None = None,
                 open_error: str | None = None):
        self.gpu, self.peers, self.host, self.problem, self.open_error = gpu, tuple(peers), host, problem, open_error
        self.opened = 0

    def local_facts(self, device) -> Facts:
        return Facts(self.host, self.gpu, (self.gpu, *self.peers) if self.gpu else ())

    def export_problem(self, kv):
        return self.problem

    def export(self, kv):
        key = uuid.uuid4().hex
        FakeIpc.pools[key] = kv
        return {"gpu": self.gpu, "handle": base64.b64encode(key.encode()).decode(),
                "storage_bytes": kv.numel() * kv.element_size(), "storage_offset": 0,
                "counter": base64.b64encode(b"/torch_123_4567_0").decode(), "counter_offset": 0,
                "event": base64.b64encode(bytes(64)).decode(), "event_sync": False, "shape": list(kv.shape),
                "dtype": str(kv.dtype).removeprefix("torch.")}

    def open(self, fields, dtype):
        if self.open_error:
            raise RuntimeError(self.open_error)
        self.opened += 1
        return FakeIpc.pools[base64.b64decode(fields["handle"]).decode()]


# ---- what the handshake picks -----------------------------------------------------------------------------------

def facts(gpu=GPU_A, peers=(), host="host-1"):
    return Facts(host, gpu, (gpu, *peers) if gpu else ())


@pytest.mark.parametrize("prefill_wants, decode_wants, prefill, decode, problem, want, why", [
    ("auto", "auto", facts(), facts(), None, "cuda_ipc", "same GPU"),
    ("auto", "auto", facts(GPU_A, peers=[GPU_B]), facts(GPU_B), None, "cuda_ipc", "peer access"),
    ("auto", "auto", facts(GPU_A), facts(GPU_B), None, "tcp", "has no peer access"),
    ("auto", "auto", facts(host="host-2"), facts(), None, "tcp", "different hosts"),
    ("auto", "auto", facts(None), facts(), None, "tcp", "prefill worker's KV pool is not on a GPU"),
    ("auto", "auto", facts(), facts(None), None, "tcp", "decode worker's KV pool is not on a GPU"),
    ("auto", "auto", facts(), facts(), "runs with expandable_segments", "tcp", "expandable_segments"),
    ("auto", "auto", None, facts(), None, "tcp", "sent no transport facts"),
    ("cuda_ipc", "auto", facts(), facts(), None, "cuda_ipc", "same GPU"),
    ("auto", "cuda_ipc", facts(), facts(), None, "cuda_ipc", "same GPU"),
    ("tcp", "auto", facts(), facts(), None, "tcp", "asked for"),
    ("cuda_ipc", "cuda_ipc", facts(host="host-2"), facts(), None, None, "different hosts (use tcp or auto)"),
    ("cuda_ipc", "tcp", facts(), facts(), None, None, "mismatch: prefill 'cuda_ipc' vs decode 'tcp'"),
    ("nccl", "auto", facts(), facts(), None, None, "mismatch: prefill 'nccl' vs decode 'auto'"),
])
def test_the_handshake_choice(prefill_wants, decode_wants, prefill, decode, problem, want, why):
    got, reason = choose_transport(prefill_wants, decode_wants, prefill, decode, problem)
    assert got == want and why in reason, reason


def test_auto_is_registered_for_every_device_and_cuda_ipc_needs_a_gpu():
    assert {"auto", "cuda_ipc"} <= set(TRANSPORTS.names())
    check_transport_device("auto", "cpu")
    with pytest.raises(ValueError, match="--kv-transport cuda_ipc needs a CUDA device; this worker runs on cpu: "
                                         "use tcp"):
        check_transport_device("cuda_ipc", "cpu")


def test_expandable_segments_refuse_cuda_ipc_with_the_fix(monkeypatch, cleanup):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    assert expandable_segments_on()
    kv = torch.zeros(LAYERS, 8, KV_DIM)
    with pytest.raises(ValueError, match="not on a GPU"):  # the real backend on a CPU pool
        CudaIpcKVReceiver(make_layout(), kv_buffer=kv, on_layer=None, on_done=None, on_failed=None)
    problem = IpcBackend().export_problem(torch.zeros(1, device="meta").expand(1))
    assert "not on a GPU" in problem
    with pytest.raises(ValueError, match="expandable_segments.*unset it for cuda_ipc.*auto/tcp"):
        CudaIpcKVReceiver(make_layout(), kv_buffer=kv, ipc=FakeIpc(problem="the decode worker runs with "
                          "expandable_segments (PYTORCH_CUDA_ALLOC_CONF), ...: unset it for cuda_ipc"),
                          on_layer=None, on_done=None, on_failed=None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments_on()


def test_handle_fields_and_pages_from_the_peer_are_checked():
    layout = make_layout()
    good = FakeIpc().export(torch.zeros(LAYERS, NUM_PAGES * PAGE, KV_DIM))
    check_export(good, layout)
    for change, message in [({"shape": [LAYERS, 64, KV_DIM + 1]}, "does not hold"),
                            ({"shape": [LAYERS - 1, 64, KV_DIM]}, "does not hold"),
                            ({"dtype": "bfloat16"}, "does not hold"),
                            ({"storage_bytes": 100}, "needs"),
                            ({"storage_offset": -1}, "non-negative"),
                            ({"counter": base64.b64encode(b"/etc/passwd").decode()}, "not one of torch's"),
                            ({"handle": ""}, "non-empty"),
                            ({"event": None}, "non-empty"),
                            ({"shape": "big"}, "not \\(layers, slots, kv_dim\\)")]:
        with pytest.raises(ValueError, match=message):
            check_export({**good, **change}, layout)
    pool_slots((LAYERS, NUM_PAGES * PAGE, KV_DIM), [0, NUM_PAGES - 1], PAGE)
    for bad in ([NUM_PAGES], [-1], [True], [2.0]):
        with pytest.raises(ValueError, match="outside the decode pool"):
            pool_slots((LAYERS, NUM_PAGES * PAGE, KV_DIM), [3, *bad], PAGE)


# ---- the page scatter the sender writes with (CPU tensors; the same code runs on the GPU) -------------------------

def random_bits(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern of `dtype` equally likely (NaNs with payloads, infinities, subnormals included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(ints)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=ints, generator=gen).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype, page_size, kv_dim, word", [
    (torch.bfloat16, 4, 576, torch.complex128),  # DeepSeek-V3's latent width: pages move as 16-byte words
    (torch.float16, 16, 12, torch.complex128),
    (torch.bfloat16, 2, 6, torch.int64),  # 24-byte pages
    (torch.bfloat16, 3, 2, torch.int32),  # 12-byte pages
    (torch.bfloat16, 3, 5, None),  # 30-byte pages: no wider word fits, moved as they are
    (torch.float32, 3, 5, None),  # 60-byte pages
])
@pytest.mark.parametrize("case", ["shuffled", "shuffled_partial_last", "contiguous", "contiguous_partial_last",
                                  "one_partial_page", "one_full_page", "last_pool_page", "two_runs"])
def test_scatter_pages_lands_rows_exactly_where_token_slots_says(dtype, page_size, kv_dim, word, case):
    num_pages = 12
    pages, n = {
        "shuffled": ([9, 2, 5, 6, 0, 11, 3], 7 * page_size),  # n a multiple of page_size
        "shuffled_partial_last": ([9, 2, 5, 6, 0, 11, 3], 6 * page_size + 1),
        "contiguous": ([3, 4, 5, 6], 4 * page_size),  # one run: one copy
        "contiguous_partial_last": ([3, 4, 5, 6], 3 * page_size + page_size - 1),
        "one_partial_page": ([7], page_size - 1 if page_size > 1 else 1),
        "one_full_page": ([7], page_size),
        "last_pool_page": ([num_pages - 1, 0], page_size + 2),  # the pool's last page, then a partial one
        "two_runs": ([2, 3, 4, 8, 9], 5 * page_size - 1),
    }[case]
    pool = random_bits((2, num_pages * page_size, kv_dim), dtype, seed=1)  # (layers, slots, kv_dim), poisoned
    want = pool.clone()
    rows = random_bits((n, kv_dim), dtype, seed=2)  # (n, kv_dim)
    assert _widest_word(pool[1].view(-1, page_size * kv_dim)) == word  # what the pages move as
    want[1].index_copy_(0, token_slots(pages, n, page_size), rows)  # the reference: one row per slot
    pool_slots(pool.shape, pages, page_size)  # pages the sender would accept
    for device in ("cpu", None):  # None: copied by runs, as across GPUs
        got = pool.clone()
        plan = plan_pages(pages, n, page_size, device)
        scatter_pages(got[1], rows, plan)
        assert torch.equal(bits(got), bits(want)), f"{case}: rows differ or landed outside the room's slots"
        both = pool.clone()  # a run of layers at once (send_layers): each layer as by itself
        both_rows = torch.stack([random_bits((n, kv_dim), dtype, seed=3), rows])  # (2, n, kv_dim)
        both_want = want.clone()
        both_want[0].index_copy_(0, token_slots(pages, n, page_size), both_rows[0])
        scatter_pages(both, both_rows, plan)
        assert torch.equal(bits(both), bits(both_want)), f"{case}: a run of layers differs from each by itself"
    if len(plan.runs) > 1:  # with a device: whole pages in one scatter, a partial last page by itself
        plan = plan_pages(pages, n, page_size, "cpu")
        assert plan.full_pages.tolist() == pages[:n // page_size]
        assert (plan.tail is None) == (n % page_size == 0)
    else:
        assert plan_pages(pages, n, page_size, "cpu").full_pages is None


@pytest.mark.parametrize("chunks", [1, 2, 3, LAYERS, LAYERS + 5])
@pytest.mark.parametrize("with_slots", [True, False])
def test_a_send_gathered_in_runs_of_layers_holds_exactly_the_rows_of_one_gather(chunks, with_slots):
    """gather_chunks (a send crossing between GPUs, cut so each run's copy starts after its own gather) gives the
    rows gather_layers gives, in runs of consecutive layers that cover every layer once, in order."""
    source = torch.randn(LAYERS, 64, KV_DIM)  # (layers, slots, kv_dim)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(chunks))[:TOKENS] if with_slots else None
    runs = gather_chunks(source if with_slots else source[:, :TOKENS], slots, chunks)
    assert 1 <= len(runs) <= min(chunks, LAYERS) and (chunks == 1 or len(runs) > 1)
    assert [r.first for r in runs] == list(itertools.accumulate([0] + [r.rows.shape[0] for r in runs[:-1]]))
    whole = torch.cat([r.rows for r in runs])
    assert torch.equal(whole, gather_layers(source, slots) if with_slots else source[:, :TOKENS])
    source.fill_(0)  # the runs are the transport's own memory: the caller may reuse its pool at once
    assert torch.equal(torch.cat([r.rows for r in runs]), whole)


def test_a_large_send_is_cut_into_a_few_runs_of_large_blocks():
    assert chunk_count(1) == 1 and chunk_count(CHUNK_BYTES - 1) == 1 and chunk_count(2 * CHUNK_BYTES) == 2
    assert chunk_count(1 << 40) == MAX_CHUNKS


def test_scatter_pages_refuses_rows_that_do_not_match_the_plan():
    pool = torch.zeros(4 * PAGE, KV_DIM)
    plan = plan_pages([3, 1], PAGE + 1, PAGE, "cpu")
    for rows in (torch.zeros(PAGE, KV_DIM), torch.zeros(PAGE + 1, KV_DIM, dtype=torch.float64),
                 torch.zeros(PAGE + 1, KV_DIM + 1), torch.zeros(2, PAGE + 1, KV_DIM)):
        with pytest.raises(ValueError, match="for a plan of"):
            scatter_pages(pool, rows, plan)
    assert not pool.any()


# ---- the protocol over real sockets, fake mapping ----------------------------------------------------------------

def ipc_decode(cleanup, transport="auto", ipc=None, **options) -> Decode:
    return Decode(cleanup, transport=transport, ipc=ipc or FakeIpc(), **options)


def ipc_sender(cleanup, transport="auto", ipc=None, **options):
    cls = {"auto": AutoKVSender, "cuda_ipc": CudaIpcKVSender}[transport]
    s = cls(make_layout(), ipc=ipc or FakeIpc(), **options)
    cleanup(s)
    return s


def rows_of(room: int) -> torch.Tensor:
    return torch.randn(LAYERS, TOKENS, KV_DIM, generator=torch.Generator().manual_seed(room))  # (L, T, D)


def send(s, decode: Decode, room: int, pages=None, layers=range(LAYERS), finish=True):
    pages = decode.reserve(room, TOKENS, pages)
    h = s.begin(decode.receiver.endpoint, room, LAYERS, dst_pages=pages)
    for layer in layers:
        h.send_layer(layer, rows_of(room)[layer])
    if finish:
        h.finish(AUX)
    return h, pages


def landed(decode: Decode, room: int, pages) -> bool:
    slots = token_slots(pages, TOKENS, PAGE)
    return all(torch.equal(decode.pool.kv[layer, slots], rows_of(room)[layer]) for layer in range(LAYERS))


@pytest.mark.parametrize("sender_wants, decode_wants", [("auto", "auto"), ("cuda_ipc", "cuda_ipc"),
                                                        ("cuda_ipc", "auto")])
def test_rows_are_written_into_scattered_pages_by_the_sender(cleanup, caplog, sender_wants, decode_wants):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer")
    decode = ipc_decode(cleanup, decode_wants)
    s = ipc_sender(cleanup, sender_wants)
    decode.pool.allocator.alloc(NUM_PAGES)  # the test hands out its own scattered pages
    dst = [9, 2, 5, 6, 7, 0, 13, 11, 12, 3]
    h, _ = send(s, decode, 42, dst)
    stats = h.wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert h.transport == "cuda_ipc" and stats.bytes_sent >= rows_of(42).numel() * 4
    assert [(room, layer) for room, layer, _, _ in decode.rec.layers] == [(42, 0), (42, 1), (42, 2)]
    assert all(values is None for *_, values in decode.rec.layers)
    assert landed(decode, 42, dst)
    untouched = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool)
    untouched[token_slots(dst, TOKENS, PAGE)] = False
    assert (decode.pool.kv[:, untouched] == -1).all(), "a slot outside the room's pages was written"
    assert "over cuda_ipc (same GPU)" in caplog.text  # logged on both sides at pairing
    assert "paired with prefill" in caplog.text


def test_a_room_opened_without_connecting_is_announced_and_lands_like_any_other(cleanup):
    """begin_if_paired (the prefill worker's open on its event loop, where the pairing exists) sends the same BEGIN
    as begin, and the rows land where the grant says."""
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    assert s.begin_if_paired(decode.receiver.endpoint, 40, LAYERS, dst_pages=[1, 2, 3, 4]) is None  # not paired
    send(s, decode, 41)[0].wait(timeout=5)  # pairs
    pages = decode.reserve(42, TOKENS)
    h = s.begin_if_paired(decode.receiver.endpoint, 42, LAYERS, dst_pages=pages)
    assert h is not None and h.plane_state.granted.wait(5)  # BEGIN went without a row: the decode worker granted it
    for layer in range(LAYERS):
        h.send_layer(layer, rows_of(42)[layer])
    h.finish(AUX)
    h.wait(timeout=5)
    decode.rec.wait_for(lambda: len(decode.rec.done) == 2)
    assert landed(decode, 42, pages)


def test_a_granted_rooms_rows_are_copied_on_the_callers_thread_and_an_ungranted_ones_wait_for_the_grant(
        cleanup, monkeypatch):
    """A room opened ahead (granted while its prompt computed) has its rows copied by send_layers itself, before it
    returns, not by the writer thread later: on a GPU the copy starts without a thread hand-off. A room whose GRANT
    has not come yet leaves the copy to the writer thread, which waits for it."""
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    send(s, decode, 60)[0].wait(timeout=5)  # pairs
    pages = decode.reserve(61, TOKENS)
    h = s.begin(decode.receiver.endpoint, 61, LAYERS, dst_pages=pages)
    assert h.plane_state.granted.wait(5)
    writer = []  # the thread of each copy into the pool
    scatter = cuda_ipc_sender.scatter_pages
    monkeypatch.setattr(cuda_ipc_sender, "scatter_pages",
                        lambda *a: (writer.append(threading.current_thread()), scatter(*a))[1])
    h.send_layers(0, rows_of(61))
    assert writer == [threading.current_thread()] and landed(decode, 61, pages)  # in the pool as it returned
    h.finish(AUX)
    h.wait(timeout=5)

    pages = decode.reserve(62, TOKENS)
    with decode.receiver.lock:  # the decode worker cannot answer BEGIN until the rows were handed over
        h = s.begin(decode.receiver.endpoint, 62, LAYERS, dst_pages=pages)
        h.send_layers(0, rows_of(62))
        assert not h.plane_state.granted.is_set() and len(writer) == 1
    h.finish(AUX)
    h.wait(timeout=5)
    assert len(writer) == 2 and writer[1] is not threading.current_thread()
    assert landed(decode, 62, pages)


def test_a_prompts_layers_go_in_one_copy_and_one_announcement(cleanup):
    """send_layers (the prefill engine's call on a cuda_ipc pairing) gathers a run of layers from the prefill pool
    at once and announces it in one LAYER frame; the send that completes the room is announced by its AUX frame
    (no LAYER frame of its own); the decode worker still hears of every layer, in order."""
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    frames = decode.record_frames()
    prefill_pool = torch.randn(LAYERS, 64, KV_DIM)  # (layers, slots, kv_dim)
    src_slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:TOKENS]
    decode.pool.allocator.alloc(NUM_PAGES)
    dst = [9, 2, 5, 6, 7, 0, 13, 11, 12, 3]
    decode.reserve(7, TOKENS, dst)
    h = s.begin(decode.receiver.endpoint, 7, LAYERS, dst_pages=dst)
    assert h.streams_layers is False
    h.send_layers(0, prefill_pool[:LAYERS - 1], src_slots)  # the main layers, then the MTP layer's (as a prefill)
    with pytest.raises(ValueError, match="out of range"):
        h.send_layers(LAYERS - 1, prefill_pool[LAYERS - 2:], src_slots)  # one past the room: refused, nothing queued
    h.send_layers(LAYERS - 1, prefill_pool[LAYERS - 1:], src_slots)
    h.finish(AUX)
    h.wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert [f for f in frames if f[0] in ("LAYER", "AUX")] == [("LAYER", list(range(LAYERS - 1))), ("AUX", [LAYERS - 1])]
    assert [(room, layer) for room, layer, _, _ in decode.rec.layers] == [(7, layer) for layer in range(LAYERS)]
    slots = token_slots(dst, TOKENS, PAGE)
    for layer in range(LAYERS):
        assert torch.equal(decode.pool.kv[layer, slots], prefill_pool[layer, src_slots])


@pytest.mark.parametrize("layers", [[0, 0], [1, LAYERS], [], "0"])
def test_a_bad_announcement_of_several_layers_fails_only_its_room(cleanup, layers):
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    h, _ = send(s, decode, 8, layers=[], finish=False)
    assert h.plane_state.granted.wait(5)  # (the decode worker granted the room before it answered GRANT)
    h._conn.queue.put((h, "LAYER", h._conn.frame(h, "LAYER", {"layers": layers, "num_tokens": TOKENS}), None))
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "protocol" and "bad LAYER announcement" in str(err.value)
    decode.rec.wait_for(lambda: decode.rec.failed)  # released once the sender's copies are done (its ABORT)
    assert decode.idle and (decode.pool.kv == -1).all()
    h2, pages = send(s, decode, 9)  # the pairing goes on
    h2.wait(timeout=5)
    assert landed(decode, 9, pages)


@pytest.mark.parametrize("layers", [[0], [LAYERS - 1, LAYERS - 1], [LAYERS], "2"])
def test_a_bad_announcement_in_the_aux_fails_only_its_room(cleanup, layers):
    """The AUX frame that announces the room's last layers is checked like a LAYER frame: a layer already announced,
    one outside the room or a malformed list fails that room (protocol), and the pairing goes on."""
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    h, _ = send(s, decode, 8, layers=range(LAYERS - 1), finish=False)  # layers 0 .. L-2 announced by LAYER frames
    h.send_layer(LAYERS - 1, rows_of(8)[LAYERS - 1])
    assert h.aux_layers == [LAYERS - 1]  # the last send: announced by the AUX frame
    h.aux_layers = layers
    h.finish(AUX)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "protocol" and "bad LAYER announcement" in str(err.value)
    decode.rec.wait_for(lambda: decode.rec.failed)
    assert decode.idle and not decode.rec.done
    h2, pages = send(s, decode, 9)
    h2.wait(timeout=5)
    assert landed(decode, 9, pages)


def test_a_decode_worker_that_does_not_take_layers_in_the_aux_gets_every_layer_announced(cleanup, monkeypatch):
    """HELLO_OK without `aux_layers` (a decode worker that only counts LAYER frames): the room's last send gets its
    own LAYER frame as before, and the AUX names no layers."""
    decode = ipc_decode(cleanup)
    pair = decode.receiver.plane.pair
    monkeypatch.setattr(decode.receiver.plane, "pair", lambda peer, hello: (
        lambda plane, fields: (plane, {k: v for k, v in fields.items() if k != "aux_layers"}))(*pair(peer, hello)))
    s = ipc_sender(cleanup)
    frames = decode.record_frames()
    pages = decode.reserve(5, TOKENS)
    h = s.begin(decode.receiver.endpoint, 5, LAYERS, dst_pages=pages)
    h.send_layers(0, rows_of(5))
    h.finish(AUX)
    h.wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert [f for f in frames if f[0] in ("LAYER", "AUX")] == [("LAYER", list(range(LAYERS))), ("AUX", None)]
    assert landed(decode, 5, pages)


def test_the_page_plan_is_made_when_the_grant_arrives(cleanup):
    """The room's page plan is worked out by the connection's reader thread at GRANT (while the prompt computes),
    so the first send only gathers and copies; a GRANT of more tokens than the pages BEGIN named can hold fails the
    room (protocol) and the decode worker is told (ABORT)."""
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    dst = decode.reserve(20, TOKENS)
    h = s.begin(decode.receiver.endpoint, 20, LAYERS, dst_pages=dst)
    assert h.plane_state.granted.wait(5)
    plan = h.plane_state.plan
    assert plan is not None and plan.num_tokens == TOKENS and plan.runs == plan_pages(dst, TOKENS, PAGE).runs
    h.send_layers(0, rows_of(20))
    h.finish(AUX)
    h.wait(timeout=5)
    assert h.plane_state.plan is plan and landed(decode, 20, dst)

    pages = decode.reserve(21, 4 * PAGE, decode.pool.allocator.alloc(4))
    with decode.receiver.lock:  # the real GRANT waits: a forged one, for more rows than the pages hold, comes first
        h = s.begin(decode.receiver.endpoint, 21, LAYERS, dst_pages=pages)
        assert h._conn.plane.on_reply({"kind": "GRANT", "room": 21, "num_tokens": 5 * PAGE}, h)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "protocol" and "does not fit the pages" in str(err.value)
    decode.rec.wait_for(lambda: len(decode.rec.failed) == 1)  # its ABORT released the pages
    assert decode.idle


@pytest.mark.parametrize("sender_ipc, decode_ipc, why", [
    (FakeIpc(GPU_A), FakeIpc(GPU_B), "no peer access"),
    (FakeIpc(host="host-2"), FakeIpc(), "different hosts"),
    (FakeIpc(), FakeIpc(problem="expandable_segments on"), "expandable_segments on"),
    (FakeIpc(open_error="cudaIpcOpenMemHandle: invalid context"), FakeIpc(), "invalid context"),
])
def test_auto_falls_back_to_tcp_and_says_why(cleanup, caplog, sender_ipc, decode_ipc, why):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer")
    decode = ipc_decode(cleanup, ipc=decode_ipc)
    s = ipc_sender(cleanup, ipc=sender_ipc)
    h, pages = send(s, decode, 7)
    h.wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert h.transport == "tcp" and landed(decode, 7, pages) and decode.idle
    assert why in caplog.text and "tcp" in caplog.text
    h, pages = send(s, decode, 8)  # the pairing stays: no second handshake
    h.wait(timeout=5)
    assert len(s._conns) == 1 and h.transport == "tcp"


def test_auto_sender_pairs_over_tcp_with_a_tcp_decode_worker(cleanup):
    rec = Recorder()
    receiver = TcpKVReceiver(make_layout(), on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed)
    cleanup(receiver)
    s = ipc_sender(cleanup)
    receiver.expect(3, TOKENS, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], LAYERS)
    h = s.begin(receiver.endpoint, 3, LAYERS, dst_pages=list(range(10)))
    for layer in range(LAYERS):
        h.send_layer(layer, rows_of(3)[layer])
    h.finish(AUX)
    h.wait(timeout=5)
    assert h.transport == "tcp" and torch.equal(rec.layers[1][3], rows_of(3)[1])


@pytest.mark.parametrize("prefill, decode, message", [
    ("cuda_ipc", "tcp", "mismatch"),
    ("cuda_ipc", "cuda_ipc", "different hosts"),  # the sender is on another host (facts)
])
def test_cuda_ipc_that_cannot_work_is_refused_at_the_handshake(cleanup, prefill, decode, message):
    layout = make_layout()
    kv = torch.zeros(LAYERS, NUM_PAGES * PAGE, KV_DIM)
    rec = Recorder()
    extra = {"ipc": FakeIpc()} if decode != "tcp" else {}
    receiver = TRANSPORTS.get(decode).receiver(layout, kv_buffer=kv, on_layer=rec.on_layer, on_done=rec.on_done,
                                               on_failed=rec.on_failed, **extra)
    cleanup(receiver)
    s = ipc_sender(cleanup, prefill, ipc=FakeIpc(host="host-2"))
    with pytest.raises(KVTransferError) as err:
        s.begin(receiver.endpoint, 1, LAYERS, dst_pages=[0])
    assert err.value.kind == "incompatible" and message in str(err.value)


def test_pages_outside_the_mapped_pool_are_refused_before_any_write(cleanup):
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    decode.reserve(5, TOKENS)
    with pytest.raises(KVTransferError) as err:
        s.begin(decode.receiver.endpoint, 5, LAYERS, dst_pages=[0, 1, 2, 3, 4, 5, 6, 7, 8, NUM_PAGES + 1])
    assert err.value.kind == "protocol" and "outside the decode pool" in str(err.value)
    assert (decode.pool.kv == -1).all()


def test_pages_other_than_the_reservation_are_not_granted(cleanup):
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    pages = decode.reserve(6, TOKENS)
    wrong = [p + 1 for p in pages]  # inside the pool, but not this room's
    h = s.begin(decode.receiver.endpoint, 6, LAYERS, dst_pages=wrong)
    for layer in range(LAYERS):
        h.send_layer(layer, rows_of(6)[layer])
    h.finish(AUX)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "protocol" and "reserved" in str(err.value)
    decode.rec.wait_for(lambda: decode.rec.failed)
    assert (decode.pool.kv == -1).all(), "rows were written without a grant"
    assert decode.idle


def test_decode_cancel_of_a_granted_room_waits_for_the_senders_release(cleanup):
    decode = ipc_decode(cleanup)
    s = ipc_sender(cleanup)
    h, pages = send(s, decode, 11, layers=[0], finish=False)
    assert h.plane_state.granted.wait(5)  # (the decode worker granted the room before it answered GRANT)
    assert decode.cancel(11) is False, "the sender may be writing: the pages are freed on on_failed"
    decode.rec.wait_for(lambda: decode.rec.failed)  # after the sender's ABORT (its copies completed)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "aborted"
    h.send_layer(1, rows_of(11)[1])  # a room that failed takes more calls quietly and writes nothing
    h2, pages2 = send(s, decode, 12)
    h2.wait(timeout=5)
    assert landed(decode, 12, pages2)


def test_ungranted_cancel_frees_at_once(cleanup):
    decode = ipc_decode(cleanup)
    decode.reserve(13, TOKENS)
    assert decode.cancel(13) is True and decode.idle


def test_prefill_abort_and_timeout_release_the_pages(cleanup):
    decode = ipc_decode(cleanup, timeout_s=0.5)
    s = ipc_sender(cleanup)
    h, _ = send(s, decode, 21, layers=[0], finish=False)
    h.abort()
    decode.rec.wait_for(lambda: decode.rec.failed)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle
    h, _ = send(s, decode, 22, layers=[0, 1], finish=False)  # then prefill stalls
    decode.rec.wait_for(lambda: len(decode.rec.failed) == 2, timeout=5)
    assert decode.rec.failed[1][1].kind == "timeout" and decode.idle
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "timeout"


def test_a_sender_that_never_releases_loses_its_pairing(cleanup):
    decode = ipc_decode(cleanup, drain_timeout_s=0.3)
    s = ipc_sender(cleanup)
    h, _ = send(s, decode, 31, layers=[0], finish=False)
    assert h.plane_state.granted.wait(5)  # (the decode worker granted the room before it answered GRANT)
    h._fail = lambda *a: False  # fault: the sender ignores ROOM_FAILED and never answers ABORT
    assert decode.cancel(31) is False
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=5)  # released when the pairing was closed
    assert decode.idle
    # The decode worker records the room's failure before the sender reads the close: a room sent in between would
    # go on the closing pairing and fail with it.
    wait_until(lambda: h._conn.broken is not None)
    h2, pages = send(s, decode, 32)  # the sender pairs again
    h2.wait(timeout=5)
    assert landed(decode, 32, pages)


def test_closing_the_receiver_releases_rooms_still_draining(cleanup):
    decode = ipc_decode(cleanup, drain_timeout_s=60)
    s = ipc_sender(cleanup)
    h, _ = send(s, decode, 41, layers=[0], finish=False)
    assert h.plane_state.granted.wait(5)  # (the decode worker granted the room before it answered GRANT)
    h._fail = lambda *a: False  # the sender never releases the room
    assert decode.cancel(41) is False
    decode.receiver.close()
    decode.rec.wait_for(lambda: decode.rec.failed)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle


# ---- real worker processes ---------------------------------------------------------------------------------------

def test_workers_log_and_label_the_transport_their_pairing_chose(tiny_v3_dir, tmp_path):
    """`pdserve prefill` / `decode` with --kv-transport auto on the CPU: the pair settles on tcp, both
    workers say so and why on stderr, and the prefill worker's transfer metrics carry transport="tcp"."""
    from pdserve.sampling import SamplingParams
    from stack import generate, scrape, start_stack

    stack = start_stack(tiny_v3_dir, tmp_path, engine_args=["--device", "cpu", "--skip-warmup", "--kv-transport", "auto"])
    try:
        result = generate(stack.router.address, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert result.completion_tokens == 3
        prefill_log, decode_log = stack.prefill[0].log_path.read_text(), stack.decode[0].log_path.read_text()
        why = "cuda_ipc impossible: the decode worker's KV pool is not on a GPU"
        assert f"over tcp ({why})" in prefill_log, prefill_log[-2000:]
        assert "paired with prefill" in decode_log and why in decode_log, decode_log[-2000:]
        # Two transfers: the router's warm-up request through the pair (router/warm_pairs.py), then ours; the
        # prefill worker counts a transfer once the decode worker confirmed it, which may come after the tokens.
        done = 'pdserve_kv_transfer_seconds_count{model_name="tiny-v3",role="prefill",transport="tcp"} 2.0'
        deadline = time.monotonic() + 10
        while done not in (metrics := scrape(stack.prefill[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 'pdserve_kv_transfer_bytes_total{model_name="tiny-v3",role="prefill",transport="tcp"}' in metrics
        assert done in metrics
    finally:
        stack.stop()
