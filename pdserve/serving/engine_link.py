"""How a worker's gRPC side reaches its engine: on a thread of the same process, or in a process of its own.

A worker has two halves. Its engine side (`side`) owns the engine and runs everything on its EngineLoop's thread
(decode_service/engine_side.py); its gRPC side holds the servicers, the open calls and health. They meet through a
link with one interface either way:

    await link.call("reserve", rid, ids, params)   # side.reserve(...) on the engine thread; its result or error
    link.tell("drop", rid)                          # the same, nobody waits; runs after every command sent before
    deliver(items), fail_all(error)                 # what the side hands back (on the gRPC side's event loop)

EngineOnThread keeps the side in this process (the default): one GIL for the engine thread and the event loop.
EngineProcess puts it in a child process (`pdserve decode --engine-process on`), so that neither waits for the other's
GIL. On an H200 (demo model, NextN, c=1) a decode worker's engine thread waited for the GIL in 12.6% of its step's
samples on a thread and in none in its own process, yet the stack's TPOT did not move beyond the spread between
stacks, nor did output at c=32 and c=128 (benchmarks/results/h200/engine_process_ab.md), while the worker's start
took ~8 s longer (the child imports torch anew). Hence the default.
Over the pipe:

    gRPC side -> engine    ("call", id, method, args) | ("tell", None, method, args) | ("stop",)
    engine -> gRPC side    ("ready", info) once built and warmed up | ("failed", traceback)
                           ("reply", id, ok, result or error) | ("event", kind, payload, metric ops)

Commands run on the engine thread in the order they were sent (a call's undo told after it finds what it made), as
EngineLoop runs them in one process. The pipe (multiprocessing's, pickled messages) is a socketpair between the
worker and the child it spawned, reachable by no one else: nothing on it comes from a client or a peer. Outputs cross
as tuples (pack_items), errors as themselves when they pickle whole (portable_error), and what the side records in
Metrics as ops on a MetricsRecorder, applied to the worker's one registry here. The engine process ends when its pipe
does: a gRPC side that dies leaves no engine holding the GPU.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import signal
import threading
import traceback
from typing import Any, Callable, Optional

import grpc

from pdserve.engine import RequestOutput
from pdserve.serving.grpc_shell import ServiceError
from pdserve.serving.metrics import Metrics, MetricsRecorder

log = logging.getLogger(__name__)

Items = list[tuple[str, Any]]  # (request id, RequestOutput or exception), as StreamHub.deliver takes them


class LoopOutbox:
    """The side's way out when it shares the process: straight onto the gRPC side's event loop."""

    def __init__(self, aio_loop: asyncio.AbstractEventLoop, deliver: Callable[[Items], None],
                 fail_all: Callable[[BaseException], None]):
        self._loop, self._deliver, self._fail_all = aio_loop, deliver, fail_all

    def deliver(self, items: Items) -> None:
        self._loop.call_soon_threadsafe(self._deliver, items)

    def fail_all(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._fail_all, error)

    def flush(self) -> None:
        """(Metrics are recorded in place here: nothing waits to be sent.)"""


class EngineOnThread:
    """The engine side on its own thread of this process."""

    def __init__(self, side):
        self.side = side

    def wait_ready(self):
        """Warm the side up (on this thread, before the port opens; the side's config says whether) and describe
        it."""
        self.side.warm_up()
        return self.side.describe()

    def start(self, aio_loop: asyncio.AbstractEventLoop, deliver: Callable[[Items], None],
              fail_all: Callable[[BaseException], None], on_exit: Callable[[str], None]) -> None:
        self.side.outbox = LoopOutbox(aio_loop, deliver, fail_all)
        self.side.loop.start()

    def call(self, method: str, *args) -> asyncio.Future:
        return asyncio.wrap_future(self.side.loop.submit(functools.partial(getattr(self.side, method), *args)))

    def tell(self, method: str, *args) -> None:
        self.side.loop.submit(functools.partial(getattr(self.side, method), *args))

    async def stop(self) -> None:
        self.side.loop.stop()
        self.side.close()


# ---- outputs and errors across the pipe -------------------------------------------------------------------------------
def pack_items(items: Items) -> list[tuple]:
    """RequestOutputs as tuples (pickled several times faster than dataclasses). Of output_ids, which grows with
    every token, only a finished request's crosses: the gRPC side reads it for the usage at the end alone."""
    return [(rid, (o.new_token_ids, o.new_text, o.finished, o.output_ids if o.finished else None, o.finish_reason,
                   o.prompt_tokens, o.cached_tokens, o.logprobs, o.prompt_logprobs))
            if isinstance(o, RequestOutput) else (rid, portable_error(o)) for rid, o in items]


def unpack_items(rows: list[tuple]) -> Items:
    return [(rid, RequestOutput(rid, o[0], o[1], o[2], o[3] or [], *o[4:]) if type(o) is tuple else o)
            for rid, o in rows]


def portable_error(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe whole (a builtin exception, or one that says how it pickles: ServiceError,
    KVTransferError), else an INTERNAL ServiceError (the text goes to this process's log)."""
    kind = type(error)
    if kind.__module__ == "builtins" or kind.__reduce__ is not BaseException.__reduce__:
        return error
    log.error("engine error %r cannot cross to the gRPC side; it gets INTERNAL", error, exc_info=error)
    return ServiceError(grpc.StatusCode.INTERNAL, "internal error (the worker's log has the details)")


class PipeOutbox:
    """The side's way out from its engine process: one message per hand-off, with the metrics recorded since."""

    def __init__(self, conn, metrics: MetricsRecorder):
        self.conn, self.metrics = conn, metrics
        self._lock = threading.Lock()  # the engine thread sends; a reply can also complete on the reader thread

    def send(self, msg: tuple) -> None:
        with self._lock:
            self.conn.send(msg)

    def deliver(self, items: Items) -> None:
        self.send(("event", "deliver", pack_items(items), self.metrics.take()))

    def fail_all(self, error: BaseException) -> None:
        self.send(("event", "fail_all", portable_error(error), self.metrics.take()))

    def flush(self) -> None:
        """Metrics recorded with no hand-off to carry them (an idle engine's gauges)."""
        ops = self.metrics.take()
        if ops:
            self.send(("event", "metrics", None, ops))

    def reply(self, call_id: int, fut) -> None:
        error = fut.exception()
        try:
            self.send(("reply", call_id, error is None, fut.result() if error is None else portable_error(error)))
        except OSError:  # the pipe is gone: so is the gRPC side
            raise
        except Exception as e:  # a result that does not pickle: a bug, said as one
            log.error("the reply to call %d cannot cross to the gRPC side: %r", call_id, e)
            self.send(("reply", call_id, False, ServiceError(grpc.StatusCode.INTERNAL,
                                                             "internal error (the worker's log has the details)")))


# ---- the engine process -----------------------------------------------------------------------------------------------
def _engine_main(build: Callable[[MetricsRecorder], Any], conn, setup: Optional[Callable[[], None]]) -> None:
    """The engine process: build the side (model load, warm-up), say so, then run its commands until told to stop or
    the pipe closes (the gRPC side is gone)."""
    # A Ctrl-C in the terminal reaches the whole process group: the worker drains and then stops this process; a
    # signal of its own here would end the engine under requests the drain lets finish.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if setup is not None:
        setup()
    recorder = MetricsRecorder()
    try:
        side = build(recorder)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise SystemExit(1)
    outbox = side.outbox = PipeOutbox(conn, recorder)
    outbox.send(("ready", side.describe()))
    side.loop.start()
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, call_id, method, args = msg
            fut = side.loop.submit(functools.partial(getattr(side, method), *args))
            if call_id is not None:
                fut.add_done_callback(functools.partial(outbox.reply, call_id))
    except (EOFError, OSError):  # the gRPC side's end closed: it exited or died
        pass
    finally:
        side.loop.stop()
        side.close()


class EngineProcessDied(ServiceError):
    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class EngineProcess:
    """The engine side in a child process (spawned: CUDA does not survive a fork). `build(metrics)` runs there and
    returns the side, warmed up; `setup()` runs there first (logging)."""

    def __init__(self, build: Callable[[MetricsRecorder], Any], name: str, metrics: Metrics,
                 setup: Optional[Callable[[], None]] = None):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.metrics, self.name = metrics, name
        self.process = ctx.Process(target=_engine_main, args=(build, child_conn, setup), name=name)
        self.process.start()
        child_conn.close()  # ours is closed: the child's recv sees EOF when this process goes
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._aio_loop: Optional[asyncio.AbstractEventLoop] = None
        self._deliver = self._fail_all = self._on_exit = None

    def wait_ready(self):
        """Blocks until the engine process is built and warmed up (its own lines show its progress); its
        description. The process failing or exiting first raises RuntimeError with why."""
        while True:
            if self.conn.poll(0.5):
                try:
                    msg = self.conn.recv()
                except EOFError:
                    msg = ("failed", None)
                if msg[0] == "ready":
                    return msg[1]
                self.process.join(10)
                raise RuntimeError(f"the {self.name} process failed to start (exit code {self.process.exitcode})"
                                   + (f":\n{msg[1]}" if msg[1] else "; its output above says why"))
            if not self.process.is_alive():
                raise RuntimeError(f"the {self.name} process exited with code {self.process.exitcode} before it "
                                   "was ready; its output above says why")

    def start(self, aio_loop: asyncio.AbstractEventLoop, deliver: Callable[[Items], None],
              fail_all: Callable[[BaseException], None], on_exit: Callable[[str], None]) -> None:
        """Read the engine's messages on `aio_loop`; on_exit(why) when the engine process is gone."""
        self._aio_loop, self._deliver, self._fail_all, self._on_exit = aio_loop, deliver, fail_all, on_exit
        aio_loop.add_reader(self.conn.fileno(), self._readable)

    def call(self, method: str, *args) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.conn.closed:
            fut.set_exception(EngineProcessDied(f"the {self.name} process has exited"))
            return fut
        call_id = next(self._ids)
        self._calls[call_id] = fut
        try:
            self.conn.send(("call", call_id, method, args))
        except OSError:  # the engine process is gone; its EOF is on its way to _readable
            del self._calls[call_id]
            fut.set_exception(EngineProcessDied(f"the {self.name} process has exited"))
        return fut

    def tell(self, method: str, *args) -> None:
        try:
            if not self.conn.closed:
                self.conn.send(("tell", None, method, args))
        except OSError:  # the engine process is gone: _exited fails what it held
            pass

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                try:
                    self._handle(msg)
                except Exception:  # one bad hand-off must not stop the reading
                    log.exception("handling the %s process's %r message failed", self.name, msg[0])
        except (EOFError, OSError):
            self._exited()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "reply":
            _, call_id, ok, value = msg
            fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
            return
        _, kind, payload, ops = msg
        if ops:
            self.metrics.apply(ops)
        if kind == "deliver":
            self._deliver(unpack_items(payload))
        elif kind == "fail_all":
            self._fail_all(payload)

    def _exited(self) -> None:
        self._aio_loop.remove_reader(self.conn.fileno())
        self.conn.close()
        self.process.join(1.0)
        why = f"the {self.name} process exited (code {self.process.exitcode})"
        error = EngineProcessDied(why)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()
        self._on_exit(why)

    async def stop(self, timeout_s: float = 10.0) -> None:
        if not self.conn.closed:
            self._aio_loop.remove_reader(self.conn.fileno())
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        await asyncio.to_thread(self.process.join, timeout_s)
        if self.process.is_alive():
            log.warning("the %s process did not stop within %.0f s; terminating it", self.name, timeout_s)
            self.process.terminate()
            await asyncio.to_thread(self.process.join, 5.0)
        if not self.conn.closed:
            self.conn.close()


__all__ = ["EngineOnThread", "EngineProcess", "EngineProcessDied", "pack_items", "unpack_items"]
