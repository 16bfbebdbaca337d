"""Streams long requests at a router for a while and prints, as JSON, when each stream's messages arrived
(time.monotonic, which every process on a machine shares) and how each stream ended. Run as a process of its own,
so that what a test does meanwhile (sending 16 MB messages) does not hold up the readers being timed.

    python tests/stream_gaps.py HOST:PORT STREAMS SECONDS
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc


def max_gap(times: list[float], start: float, end: float) -> float:
    """The longest wait between two arrivals that overlaps [start, end]."""
    return max((b - a for a, b in zip(times, times[1:]) if b > start and a < end), default=0.0)


def main(address: str, streams: int, seconds: float) -> dict:
    end = time.monotonic() + seconds
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    ended: list[str] = ["NO_FINAL_STATUS"] * streams

    def stream(i: int) -> None:
        req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=[5 + i, 6, 7, 8]),
                                     sampling_params=gen_pb.SamplingParams(max_new_tokens=1000, ignore_eos=True))
        with grpc.insecure_channel(address) as ch:
            while time.monotonic() < end:  # one request after another until the time is up
                call = gen_grpc.GenerationStub(ch).Generate(req, timeout=seconds + 30)
                try:
                    for _ in call:
                        arrivals[i].append(time.monotonic())
                        if time.monotonic() >= end:
                            call.cancel()
                            ended[i] = "OK"
                            return
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.CANCELLED:
                        ended[i] = e.code().name
                        return
            ended[i] = "OK"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"arrivals": arrivals, "ended": ended}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))
