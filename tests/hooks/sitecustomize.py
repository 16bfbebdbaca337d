"""Test hooks for the pdserve processes a test starts: behaviour a test needs (a slow first forward, a slow KV
transfer) that no production config or flag carries.

A test turns hooks on for a process it starts by putting this folder first on the process's PYTHONPATH and setting
the hooks' variables (`stack.hooks_env(...)` builds that environment; `start_stack(..., decode_env=...)` and
`spawn(..., env=...)` take it). Python imports this file at start-up (site.py runs the first `sitecustomize` on
sys.path); it registers a patch for each hook whose variable is set, applied to the module it names right after that
module is first imported. A process that never imports it (the router, `pdserve up` itself) is left as it is, and a
process started without this folder on its path has no hooks at all.

    PDTEST_DECODE_SLOW_FIRST_FORWARD_S=S  a decode worker's engine: its first forward sleeps S seconds (a cold GPU
                                          compiling kernels)
    PDTEST_DECODE_SLOW_KV_ARRIVAL_S=S     a decode worker: each prompt's received KV waits S seconds before the
                                          engine thread takes it (a slow transfer)
    PDTEST_PREFILL_SLOW_FIRST_FORWARD_S=S a prefill worker's engine: its first forward sleeps S seconds
    PDTEST_DECODE_ATTACH_DEADLINE_S=S     a decode worker: a reservation no DecodeStream call attached within S
                                          seconds is released (0: before any router's attach can come)

Adding a hook: a function patch(module, value) and a line in HOOKS naming the variable and the module it patches.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from typing import Any, Callable


# ---- the hooks -----------------------------------------------------------------------------------------------------
def after_init(cls: type, then: Callable[[Any], None]) -> None:
    """cls's instances get then(instance) run at the end of their __init__."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        then(self)

    cls.__init__ = __init__


def slow_first_forward(engine, seconds: float) -> None:
    """An LLMEngine whose first forward sleeps `seconds` first (this engine's runner only)."""
    runner = engine.runner
    execute = runner.execute
    pending = [True]

    def execute_slowly(*args, **kwargs):
        if pending:
            pending.clear()
            time.sleep(seconds)
        return execute(*args, **kwargs)

    runner.execute = execute_slowly


def decode_slow_first_forward(server, seconds: float) -> None:
    after_init(server.DecodeWorker, lambda worker: slow_first_forward(worker.core, seconds))


def prefill_slow_first_forward(server, seconds: float) -> None:
    after_init(server.PrefillWorker, lambda worker: slow_first_forward(worker.core, seconds))


def decode_slow_kv_arrival(server, seconds: float) -> None:
    arrived = server.DecodeWorker._kv_arrived  # the receiver's on_done: hands the request to the engine thread

    def kv_arrived_late(self, request_id: str, aux: dict) -> None:
        threading.Timer(seconds, arrived, (self, request_id, aux)).start()

    server.DecodeWorker._kv_arrived = kv_arrived_late


def decode_attach_deadline(server, seconds: float) -> None:
    server.RESERVATION_ATTACH_S = seconds


# variable -> (module patched once imported, patch(module, the variable's value as a float))
HOOKS: dict[str, tuple[str, Callable[[Any, float], None]]] = {
    "PDTEST_DECODE_SLOW_FIRST_FORWARD_S": ("pdserve.decode_service.server", decode_slow_first_forward),
    "PDTEST_DECODE_SLOW_KV_ARRIVAL_S": ("pdserve.decode_service.server", decode_slow_kv_arrival),
    "PDTEST_PREFILL_SLOW_FIRST_FORWARD_S": ("pdserve.prefill_service.server", prefill_slow_first_forward),
    "PDTEST_DECODE_ATTACH_DEADLINE_S": ("pdserve.decode_service.server", decode_attach_deadline),
}


# ---- the machinery ---------------------------------------------------------------------------------------------------
class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs each module's patches right after the module is first executed."""

    def __init__(self, patches: dict[str, list[Callable[[Any], None]]]):
        self.patches = patches

    def find_spec(self, fullname, path=None, target=None):
        patches = self.patches.pop(fullname, None)
        if patches is None:
            return None
        spec = importlib.util.find_spec(fullname)  # the real finders' spec (ours no longer answers for it)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module  # (a loader of this one module)
        return spec


def _install(environ) -> None:
    patches: dict[str, list[Callable[[Any], None]]] = {}
    for variable, (module, patch) in HOOKS.items():
        if environ.get(variable):
            value = float(environ[variable])
            patches.setdefault(module, []).append(lambda m, patch=patch, value=value: patch(m, value))
    if patches:
        sys.meta_path.insert(0, _PatchAfterImport(patches))


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the environment has one further down the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            with open(candidate) as f:
                exec(compile(f.read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
            return


_install(os.environ)
_chain()
