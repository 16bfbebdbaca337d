"""pdserve.kv_transfer: moves a prompt's latent KV rows from a prefill worker into a decode worker's pages.

`TRANSPORTS.get(name)` gives a `Transport(sender, receiver)` pair; `TRANSPORTS.names()` feeds the CLI choices.
The contract is in `base.py` (`rooms.py`: the decode worker's view of it, by request id). Every transport is the
control channel (`control_sender.py`, `control_receiver.py`) plus its data plane (`plane.py`): "tcp" in `tcp.py`,
"nccl" and "gloo" in `collective.py`, "cuda_ipc" and "auto" (cuda_ipc where the peers can map each other's memory,
tcp otherwise) in `cuda_ipc.py`, "nixl" (NIXL WRITEs, between hosts too) in `nixl.py`.
"""

from .base import (
    ERROR_KINDS, TRANSPORTS, KVLayout, KVReceiver, KVSender, KVTransferError, SendHandle, Transport, TransferState,
    TransferStats, TransferStatus, check_transport_device, page_runs, token_slots,
)
from .rooms import RequestReceiver
from .control_receiver import KVReceiverChannel
from .control_sender import KVSenderChannel
from .plane import ReceivePlane, SendPairing, SendPlane
from .collective import GlooKVReceiver, GlooKVSender, NcclKVReceiver, NcclKVSender
from .tcp import TcpKVReceiver, TcpKVSender
from .cuda_ipc import AutoKVReceiver, AutoKVSender, CudaIpcKVReceiver, CudaIpcKVSender
from .nixl import NixlKVReceiver, NixlKVSender

__all__ = [
    "ERROR_KINDS", "TRANSPORTS", "KVLayout", "KVReceiver", "KVSender", "KVTransferError", "SendHandle", "Transport",
    "TransferState", "TransferStats", "TransferStatus", "check_transport_device", "page_runs", "token_slots",
    "RequestReceiver", "KVReceiverChannel", "KVSenderChannel", "ReceivePlane", "SendPairing", "SendPlane",
    "TcpKVReceiver", "TcpKVSender", "GlooKVReceiver", "GlooKVSender", "NcclKVReceiver", "NcclKVSender",
    "AutoKVReceiver", "AutoKVSender", "CudaIpcKVReceiver", "CudaIpcKVSender", "NixlKVReceiver", "NixlKVSender",
]
