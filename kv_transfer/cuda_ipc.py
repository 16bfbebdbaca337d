"""The same-node KV transports: "cuda_ipc" (the prefill worker writes straight into the decode worker's pages
through a CUDA IPC mapping of its pool) and "auto" (the handshake picks cuda_ipc where it can work, tcp otherwise).
Their data planes are `cuda_ipc_sender.py` and `cuda_ipc_receiver.py` (tcp's where the handshake picks tcp).

Pairing. The sender's HELLO carries its facts (`local_facts`: host boot id, the GPU its rows live on, the GPUs that
one can reach peer to peer). After the `--internal-token` and layout checks the decode receiver decides with
`choose_transport` and answers HELLO_OK {transport, reason, ipc}: for cuda_ipc, `ipc` holds the fields of its pool's
IPC handle. The choice is logged on both sides and is the `transport` label of the transfer metrics.

Handle. The decode worker calls torch's own export, `UntypedStorage._share_cuda_()` on the pool (what
`torch.multiprocessing.reductions.reduce_tensor` calls: cudaIpcGetMemHandle of the pool's cudaMalloc block, its
offset in it, torch's IPC reference-counter file and an IPC event), once, when the receiver is built (before the
decode engine runs: the export re-wraps the storage's data pointer), and hands the same fields to every pairing.
Only those fields travel, as JSON (bytes base64) over the authenticated control connection: pdserve never unpickles
peer data, so `reduce_tensor`'s (function, args) pair is not sent. The prefill worker checks them (sizes, shape against the
layout, counter file name) and rebuilds the storage with torch's `UntypedStorage._new_shared_cuda`, the call
`rebuild_cuda_tensor` makes; torch then owns the mapping's lifetime: cudaIpcCloseMemHandle once the last tensor on
it is gone (the connection drops it when it ends, after its copies finished).

Memory. `LatentKVPool` allocates the pool once at start-up through torch's caching allocator: a plain cudaMalloc
block, which cudaIpcGetMemHandle exports. With `expandable_segments` (PYTORCH_CUDA_ALLOC_CONF) torch shares such
memory through POSIX file descriptors fetched with pidfd_getfd instead, which needs ptrace rights over the decode
process and fails in many containers: pdserve does not rely on it. A decode worker with expandable segments refuses
cuda_ipc (the worker exits with the reason) and `auto` pairs over tcp, saying why.

GPUs. Both workers on one GPU: the writes are device copies inside that GPU. On two GPUs of one host the same
handle maps the pool into the prefill worker's context and cudaIpcOpenMemHandle enables peer access; without peer
access (`torch.cuda.can_device_access_peer` false) `auto` pairs over tcp and logs why, and cuda_ipc is refused.
"""

from __future__ import annotations

from .base import TRANSPORTS, Transport
from .control_receiver import KVReceiverChannel
from .control_sender import KVSenderChannel
from .cuda_ipc_pairing import AUTO, IPC, Facts, IpcBackend, choose_transport
from .cuda_ipc_receiver import IpcReceivePlane
from .cuda_ipc_sender import IpcPairing, IpcSendPlane


# `ipc=` (both sides): the GPU facts and calls (`IpcBackend`; the CPU tests pass fakes). The receivers need
# `kv_buffer`; a sender on a cuda_ipc pairing needs `dst_pages` in `begin`.
class CudaIpcKVSender(KVSenderChannel):
    transport, pairing_cls = IPC, IpcPairing


class AutoKVSender(KVSenderChannel):
    transport, pairing_cls = AUTO, IpcPairing


class CudaIpcKVReceiver(KVReceiverChannel):
    transport, plane_cls = IPC, IpcReceivePlane


class AutoKVReceiver(KVReceiverChannel):
    transport, plane_cls = AUTO, IpcReceivePlane


TRANSPORTS.register("cuda_ipc")(Transport(sender=CudaIpcKVSender, receiver=CudaIpcKVReceiver, devices=("cuda",)))
TRANSPORTS.register("auto")(Transport(sender=AutoKVSender, receiver=AutoKVReceiver))

__all__ = ["AutoKVReceiver", "AutoKVSender", "CudaIpcKVReceiver", "CudaIpcKVSender", "Facts", "IpcBackend",
           "IpcPairing", "IpcReceivePlane", "IpcSendPlane", "choose_transport"]
