"""A real `redis-server` for tests: own free port (stack.free_port), no persistence, stoppable and restartable on the same port.

    from redis_server import RedisServer, redis_fixture
    redis_server = redis_fixture()            # in a test module: a fixture yielding a running RedisServer

    with RedisServer() as server:             # or directly
        server.stop(); server.restart()

Tests are skipped (not failed) when no redis-server binary is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import pytest
import redis

from stack import free_port

REDIS_SERVER = os.environ.get("PDSERVE_REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    def __init__(self, port: Optional[int] = None, start_timeout_s: float = 10.0):
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client for inspecting the server (TTL, KEYS, ...) in tests."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self) -> "RedisServer":
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                self.proc = None
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err[-2000:]}")
            try:
                with self.client() as c:
                    if c.ping():
                        return self
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {self.start_timeout_s} s")

    def stop(self) -> None:
        """Kill the server (SIGTERM, then SIGKILL); with persistence off its data is gone."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stderr.close()
        self.proc = None

    def restart(self) -> "RedisServer":
        """Start again on the same port, empty."""
        self.stop()
        return self.start()

    def __enter__(self) -> "RedisServer":
        for attempt in range(3):
            try:
                return self.start()
            except RuntimeError:
                if attempt == 2:
                    raise
                self.port = free_port()  # someone took the port between free_port() and bind
        raise AssertionError("unreachable")

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def redis_fixture(scope: str = "function"):
    """A pytest fixture yielding a running, empty RedisServer of its own (stopped at the end of `scope`)."""

    @pytest.fixture(scope=scope)
    def _redis_server():
        if not os.path.exists(REDIS_SERVER):
            pytest.skip(f"redis-server not found at {REDIS_SERVER}")
        with RedisServer() as server:
            yield server

    return _redis_server
