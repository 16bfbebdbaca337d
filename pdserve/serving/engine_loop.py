"""The worker's engine thread: one obvious loop that owns the engine.

Everything that touches engine state (admitting requests, aborts, KV arriving from a peer) is a command run on this
thread, so the scheduler, allocator and KV pool need no locks, and GPU work never runs on the gRPC event loop:

    while running:
        run queued commands          # admissions, aborts, received KV
        if work: outputs = step()    # schedule() -> execute() -> update()
        else:    sleep until a command arrives

A worker may hold its next step back (`hold`: seconds until it may run, e.g. a decode worker pacing its steps);
commands still run as they arrive meanwhile.

A step that fails is reported and the loop goes on (a bug in one batch need not take the worker's other requests
down), unless the engine cannot go on after it (`fatal`: e.g. a CUDA error such as an illegal memory access leaves
the device's context unusable, a tensor-parallel rank died or hangs), when every later step would fail the same way.
Then the worker ends, exit status 1, saying why, and the router routes around it.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, step: Callable[[], Any], has_work: Callable[[], bool], name: str = "engine-loop",
                 on_error: Optional[Callable[[BaseException], None]] = None,
                 hold: Optional[Callable[[], float]] = None, idle: Optional[Callable[[], None]] = None,
                 fatal: Optional[Callable[[BaseException], Optional[str]]] = None):
        """hold(): seconds the next step must still wait (<= 0: run it now); asked before every step. idle(): called
        when the loop finds no work, before it sleeps (what a worker held back for its next step goes then).
        fatal(error): asked after a failed step (after on_error), why the engine cannot run another one, or None
        (pdserve.engine.LLMEngine.cannot_go_on)."""
        self._step, self._has_work, self._on_error, self._hold, self._idle = step, has_work, on_error, hold, idle
        self._inbox: queue.SimpleQueue[Optional[tuple[Callable[[], Any], Future]]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # NOTE: the loop's thread runs on the CUDA device current where the loop is built (the engine's, made
        # current when it was built): a new thread would start on device 0, where Triton cannot reach cuda:N's
        # tensors.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._fatal = fatal

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread; the future carries its result or exception."""
        fut: Future = Future()
        if self._stopped.is_set():
            fut.set_exception(RuntimeError("the engine loop has stopped"))
            return fut
        self._inbox.put((fn, fut))
        return fut

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run_commands(self, block: bool, timeout_s: float = 0.05) -> None:
        try:
            item = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller through the future
                    fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while not self._stopped.is_set():
            try:
                idle = not self._has_work()
                if idle and self._idle is not None:
                    self._idle()
                self._run_commands(block=idle)
                if not self._has_work():
                    continue
                wait = self._hold() if self._hold is not None else 0.0
                if wait > 0:  # commands that come meanwhile run at once; then the hold is asked again
                    self._run_commands(block=True, timeout_s=wait)
                    continue
                self._step()
            except BaseException as e:  # a bug in a step: report it, keep the worker alive for other requests
                log.exception("engine step failed")
                if self._on_error:
                    self._on_error(e)
                why = self._fatal(e) if self._fatal is not None else None
                if why:
                    print(f"pdserve: {self._thread.name}: this worker cannot go on: {why}. It stops (exit status 1) "
                          "so that its requests go elsewhere", file=sys.stderr, flush=True)
                    logging.shutdown()
                    os._exit(1)
