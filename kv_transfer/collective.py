"""The collective KV transports: "nccl" (CUDA pools) and "gloo" (CPU pools, the same code; what the CPU tests and
CI run end to end). The rows move over a torch.distributed process group built per prefill/decode pair (the data
planes of `collective_sender.py` and `collective_receiver.py`); the control channel every transport shares carries
the handshake, room announcements, the aux record, completion, aborts and deadlines.

Why torch.distributed: it ships with torch on every machine pdserve runs on (nccl4py and CuPy do not), and its
ProcessGroupNCCL brings NCCL's communicator setup, streams and abort.

- Binding: the decode receiver hosts a TCPStore; HELLO_OK tells the sender its address and a fresh group name; both
  build `ProcessGroup{Gloo,NCCL}(PrefixStore(name, store), rank, 2)` (decode 0, prefill 1) and exchange one
  element, so the communicator exists before the first room (`collective_pair.py`).
- Destination pages: the prefill worker knows the reserved pages (the router passes them, `begin(dst_pages=...)`);
  a layer's rows, or a run of layers', cross as one contiguous block per LAYER announcement, which the receiver
  checks against its own reservation and scatters into the pages (`pages.py`).
- Ordering: announcement k and its sends leave from one writer thread; the receiver posts its receives while
  reading announcement k on the connection's one reader thread. Both op streams follow the control stream.
- Teardown: a dead peer, a failed op, a protocol error, or a room whose receives are stuck tears the pair down
  (control connection closed, group aborted); the sender's next `begin()` builds a new pair. A cancelled, aborted
  or timed-out room does not: its remaining announced ops are received into scratch.

Memory (NCCL): each pair is its own communicator. NCCL sizes its buffers per peer and channel: about
NCCL_BUFFSIZE (4 MiB by default) per channel for the Simple protocol plus smaller LL/LL128 buffers, times the
channels it opens for the link (NCCL_MAX_P2P_NCHANNELS / NCCL_NCHANNELS_PER_NET_PEER), on both GPUs, plus the
device memory its proxy and work FIFOs take. A decode worker therefore holds one communicator per prefill worker it
has paired with: leave that much free beyond `--num-pages` (`benchmarks/bench_kv_transfer.py` measures it on the
GPU; the pair logs what its communicator took when it is built).
"""

from __future__ import annotations

from .base import TRANSPORTS, Transport
from .collective_receiver import CollectiveReceivePlane
from .collective_sender import CollectivePairing, CollectiveSendPlane
from .control_receiver import KVReceiverChannel
from .control_sender import KVSenderChannel


# The receivers need `kv_buffer` (the decode pool: on the CPU for gloo, a GPU for nccl); `begin` needs `dst_pages`.
class GlooKVSender(KVSenderChannel):
    transport, pairing_cls = "gloo", CollectivePairing


class GlooKVReceiver(KVReceiverChannel):
    transport, plane_cls = "gloo", CollectiveReceivePlane


class NcclKVSender(KVSenderChannel):
    transport, pairing_cls = "nccl", CollectivePairing


class NcclKVReceiver(KVReceiverChannel):
    transport, plane_cls = "nccl", CollectiveReceivePlane


TRANSPORTS.register("gloo")(Transport(sender=GlooKVSender, receiver=GlooKVReceiver, devices=("cpu",)))
TRANSPORTS.register("nccl")(Transport(sender=NcclKVSender, receiver=NcclKVReceiver, devices=("cuda",)))

__all__ = ["CollectivePairing", "CollectiveReceivePlane", "CollectiveSendPlane", "GlooKVReceiver", "GlooKVSender",
           "NcclKVReceiver", "NcclKVSender"]
