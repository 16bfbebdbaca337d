"""kv_transfer/nixl_agent.py with the real NIXL library (UCX) between two processes over DRAM: rows written into
chosen rows of a peer's registered tensor, the notification after them, and the transport UCX picked."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kv_transfer.nixl_agent import NixlAgent, NixlUnavailable, load_api, write_transports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The decode side in a process of its own: registers a (64, 8) float32 pool, prints its metadata and the pool's
# address, then waits for a notification and prints it with the rows the peer wrote.
PEER = textwrap.dedent("""
    import base64, json, sys, time, torch
    from kv_transfer.nixl_agent import NixlAgent
    agent = NixlAgent("decode-peer")
    pool = torch.zeros(64, 8)
    reg = agent.register(pool)
    print(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "addr": reg.addr,
                      "nbytes": reg.nbytes, "mem": reg.mem_type}), flush=True)
    deadline = time.monotonic() + 20
    notes = {}
    while not notes and time.monotonic() < deadline:
        notes = agent.notifications()
        time.sleep(0.001)
    print(json.dumps({"notes": {k: [m.decode() for m in v] for k, v in notes.items()},
                      "rows": pool[[3, 7, 9]].tolist(), "untouched": float(pool.sum() - pool[[3, 7, 9]].sum())}),
          flush=True)
    agent.close()
""")


def read_json(proc: subprocess.Popen) -> dict:
    """The peer's next JSON line (NIXL logs its own lines on stdout too)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the peer ended without its line (exit {proc.wait()})")


def test_a_write_lands_in_the_peers_rows_with_its_notification_after_it():
    load_api()  # NIXL is a test extra: a missing one fails here, it does not skip
    peer = subprocess.Popen([sys.executable, "-c", PEER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        remote = read_json(peer)
        agent = NixlAgent("prefill-test")
        rows = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8) + 1
        agent.register(rows)
        name = agent.add_peer(base64.b64decode(remote["metadata"]))
        assert name == "decode-peer"
        # UCX printed what it picked for writes to this peer (on one host without GPUs: a shared-memory or
        # loopback transport, e.g. 'cma/memory'), parsed from its log, not guessed
        assert agent.transport(name) != "unknown" and "/" in agent.transport(name)
        row_bytes = 8 * 4
        handle = agent.write(name, [(rows[i].data_ptr(), row_bytes, 0) for i in range(3)],
                             [(remote["addr"] + r * row_bytes, row_bytes, 0) for r in (3, 7, 9)], "DRAM",
                             remote["mem"], b"room-7")
        while (state := agent.state(handle)) == "PROC":
            pass
        assert state == "DONE"
        agent.release(handle)
        seen = read_json(peer)
        assert seen["notes"] == {"prefill-test": ["room-7"]}
        assert seen["rows"] == rows.tolist() and seen["untouched"] == 0.0
        agent.close()
    finally:
        peer.kill()
        peer.wait()


def test_the_transport_is_read_from_ucx_tables_for_peers_not_the_agents_loopback():
    table = textwrap.dedent("""\
        [1.1] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.1] [h:1:0]   | pre self cfg#0                                           |
        [1.1] [h:1:0]   | remote memory write by ucp_put* from host memory to host |
        [1.1] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.1] [h:1:0]   | Range  | Description |              Config               |
        [1.1] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.1] [h:1:0]   | 0..inf | zero-copy   | cma/memory                        |
        [1.1] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.2] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.2] [h:1:0]   | pre intra-node cfg#1                                     |
        [1.2] [h:1:0]   | remote memory write by ucp_put* from cuda memory to cuda |
        [1.2] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.2] [h:1:0]   | Range  | Description |              Config               |
        [1.2] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.2] [h:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
        [1.2] [h:1:0]   +--------+-------------+-----------------------------------+
        [1.3] [h:1:0]   | pre intra-node cfg#1                                   |
        [1.3] [h:1:0]   | active message by ucp_am_send* from host memory        |
        [1.3] [h:1:0]   | 0..inf | zero-copy   | tcp/lo                          |
    """)
    assert write_transports(table) == ["cuda_ipc/cuda"]
    assert write_transports("") == []


def test_a_missing_nixl_names_the_extra(monkeypatch):
    def no_nixl(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("importlib.import_module", no_nixl)
    with pytest.raises(NixlUnavailable, match=r"pdserve\[nixl\]"):
        load_api()
