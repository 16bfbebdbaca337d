"""benchmarks/grpc_hop.py on the CPU: a real server process, both kinds of message timed after each gap."""

from __future__ import annotations

import json
import subprocess
import sys

from stack import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from grpc_hop import measure  # noqa: E402


def test_each_gap_times_a_unary_call_and_a_stream_message_one_way_and_back():
    rows = measure([0.0, 0.005], calls=8, payload_bytes=2048)
    assert [r["gap_ms"] for r in rows] == [0.0, 5.0]
    for r in rows:
        for kind in ("unary", "stream"):
            one, rtt = r[kind]["one_way_ms"], r[kind]["round_trip_ms"]
            assert 0 < one < rtt < 1000, (kind, r)  # the receipt lies between sending and the reply's arrival


def test_the_cli_prints_a_row_per_gap_and_writes_the_json(tmp_path):
    out = tmp_path / "hop.json"
    proc = subprocess.run([sys.executable, "benchmarks/grpc_hop.py", "--gaps", "0.001", "--calls", "5",
                           "--keep-warm-ms", "2", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unary one way" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].strip().startswith("1 ms |")
    assert "kept warm every 2 ms" in proc.stdout
    data = json.loads(out.read_text())
    assert data["calls"] == 5 and len(data["rows"]) == 1 and data["rows"][0]["stream"]["one_way_ms"] > 0
    assert data["keep_warm_ms"] == 2
    bad = subprocess.run([sys.executable, "benchmarks/grpc_hop.py", "--calls", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--calls must be at least 1" in bad.stderr
