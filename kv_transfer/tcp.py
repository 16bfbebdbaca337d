"""The TCP KV transport ("tcp"): pure CPU and sockets, works between processes and machines without GPUs.

Wire format in `wire.py`; the decode side in `tcp_receiver.py`, the prefill side in `tcp_sender.py`.
"""

from __future__ import annotations

from .base import TRANSPORTS, Transport
from .tcp_receiver import TcpKVReceiver
from .tcp_sender import TcpKVSender, TcpSendHandle

TRANSPORTS.register("tcp")(Transport(sender=TcpKVSender, receiver=TcpKVReceiver))

__all__ = ["TcpKVReceiver", "TcpKVSender", "TcpSendHandle"]
