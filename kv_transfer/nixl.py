"""The NIXL KV transport ("nixl"): the prefill worker WRITEs each room's rows straight into memory the decode worker
registered with NIXL (NVIDIA's inference transfer library; UCX underneath: RDMA verbs between hosts, cuda_ipc over
NVLink or PCIe between GPUs of a host, CMA or TCP between host memories). It works between machines, GPU or CPU
pools alike; the control channel every transport shares carries the handshake, rooms, the AUX record and aborts.
Its data planes are `nixl_sender.py` and `nixl_receiver.py`, over `nixl_agent.py`.

Pairing. The decode receiver registers its pool (a staging area, and a small probe) with its NIXL agent once, when
it is built; after the `--internal-token` and layout checks HELLO_OK carries that agent's metadata (base64) and the
registered memory's address, size, device, memory type and shape. The sender loads the metadata (its agent connects
to the decode worker's), WRITEs the probe once (the data path works before a room relies on it, and its set-up is
not the first room's cost) and logs what UCX picked for those WRITEs: "KV pair with decode X: over nixl (UCX:
rc_mlx5/...)", also `SendHandle.link` (the metric label `link`). The decode agent never loads a peer's metadata:
nothing but the authenticated control channel reaches it.

A room:

    BEGIN {room, num_layers, pages} ->        checked against the reservation: nothing is written before the answer
    <- GRANT {room, num_tokens, staging}       staging: the offset of the room's block in the staging area, for pages
                                               scattered into many runs; None: write into the pages themselves
    LAYER {room, layer | layers, num_tokens} -> sent once the WRITE of those layers' rows is DONE (one per send: a
                                               layer as its forward wrote it, or a run of layers); a staged room's
                                               layers are scattered into its pages on arrival
    AUX {...} ->                               after every WRITE of the room resolved: on_done
    ABORT {room} ->                            the sender failed or dropped the room *and* its WRITEs resolved

Cost. NIXL's cost is per descriptor, so a WRITE is one descriptor per layer and page run (pages coalesced, at most
`MAX_DIRECT_RUNS` runs), or one for all its layers into the room's staging block; on the sender the rows wait in a
registered arena, gathered once from the prefill pool.

Configuration. UCX reads its own environment when the agent starts: `UCX_TLS` picks the transports it may use (e.g.
`rc,cuda_copy,cuda_ipc` for RDMA and NVLink, `tcp,cuda_copy` where there is no RDMA NIC), `UCX_NET_DEVICES` the NICs
(`mlx5_0:1`). The NIXL backend is UCX unless the sender and receiver are given `backend=`. A missing NIXL stops a
worker at start with the extra to install (`pip install 'pdserve[nixl]'`).
"""

from __future__ import annotations

from .base import TRANSPORTS, Transport
from .control_receiver import KVReceiverChannel
from .control_sender import KVSenderChannel
from .nixl_agent import load_api
from .nixl_receiver import NixlReceivePlane
from .nixl_sender import NIXL, NixlPairing, NixlSendPlane


class NixlKVSender(KVSenderChannel):
    """See `KVSender`; `begin` needs `dst_pages`. `device`: where the rows live (its arena is there). Options:
    `backend` (NIXL's, "UCX"), `arena_bytes` (the registered memory rows wait in for their WRITE)."""

    transport, pairing_cls = NIXL, NixlPairing

    def close(self) -> None:
        super().close()
        self.pairing.close()


class NixlKVReceiver(KVReceiverChannel):
    """See `KVReceiver`; `kv_buffer` (required): the decode pool. Options: `backend`, `staging_bytes` (the staging
    area for rooms whose pages are scattered), `drain_timeout_s` (how long a failed room waits for its sender's
    ABORT before the pairing is torn down)."""

    transport, plane_cls = NIXL, NixlReceivePlane


TRANSPORTS.register(NIXL)(Transport(sender=NixlKVSender, receiver=NixlKVReceiver, check=load_api))

__all__ = ["NixlKVReceiver", "NixlKVSender", "NixlReceivePlane", "NixlSendPlane"]
