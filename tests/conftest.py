"""Shared fixtures: tiny random checkpoints written once per test session by `make_tiny_model`.

The session-scoped directories are shared by every test, so a test must never modify them: one that needs a broken
checkpoint takes `copy_model(src)` and corrupts the copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from pdserve.tiny_model import make_tiny_model

from interpreter_mode import INTERPRETED_FILES

# TRITON_INTERPRET as the session began (this file loads before any test module).
_TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def pytest_collection_finish(session) -> None:
    """The Triton-interpreter modules set TRITON_INTERPRET=1 as they are collected (tests/interpreter_mode.py: triton
    fixes its mode at its first import), for the whole process. Once every module is imported it goes back to how
    the session began, so that the processes other tests and their fixtures start (a stack, a benchmark) do not run
    their kernels interpreted and miss their deadlines. scripts/test.sh runs those modules in a process of their
    own anyway; this covers a plain `pytest tests/`."""
    os.environ.pop("TRITON_INTERPRET", None)
    if _TRITON_INTERPRET_AT_START is not None:
        os.environ["TRITON_INTERPRET"] = _TRITON_INTERPRET_AT_START


def pytest_configure(config) -> None:
    """One torch thread in the test process. The tiny models' kernels take microseconds: intra-op threads only add
    synchronisation, and while the workers a test started (or any other job) hold the cores, each op of a thread pool
    sized to every core waits for a thread that is not running, ten times slower and worse. Every process the tests
    start inherits OMP_NUM_THREADS=1 (unless set): the suite runs such processes side by side (`pdserve generate`s,
    lone workers, benchmarks' children), where pools sized to every core spin against each other (two `generate`s at
    once on two cores took four times as long). `pdserve up` and stack.spawn size their workers' the same way."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _interpreter_modules_keep_it(request, monkeypatch):
    """...but the tests of the modules that entered interpreter mode keep it (a kernel module one of them imports
    late is made interpreted too)."""
    if os.path.abspath(str(request.path)) in INTERPRETED_FILES:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tiny(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    out = tmp_path_factory.mktemp("tiny-models", numbered=True) / name
    make_tiny_model(str(out), **kwargs)
    return out


@pytest.fixture(scope="session")
def tiny_v3_dir(tmp_path_factory) -> Path:
    """DeepSeek-V3 layout: 3 main layers (layer 0 dense) + 1 NextN/MTP layer stored as model.layers.3.*."""
    return _tiny(tmp_path_factory, "tiny-v3", arch="deepseek_v3")


@pytest.fixture(scope="session")
def tiny_v2_dir(tmp_path_factory) -> Path:
    """DeepSeek-V2 layout: no q_lora (plain q_proj), softmax greedy routing, no MTP layer."""
    return _tiny(tmp_path_factory, "tiny-v2", arch="deepseek_v2")


@pytest.fixture(scope="session")
def tiny_v3_fp8_dir(tmp_path_factory) -> Path:
    """tiny V3 with block-FP8 linear weights and their weight_scale_inv, as DeepSeek-V3's checkpoints."""
    return _tiny(tmp_path_factory, "tiny-v3-fp8", arch="deepseek_v3", fp8=True)


TRAINED_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-trained"


@pytest.fixture(scope="session")
def trained_model_dir() -> Path:
    """The committed demo model (scripts/train_tiny.py on a GPU: 4M parameters, MTP top-1 0.55 on held-out code)."""
    assert (TRAINED_MODEL_DIR / "model.safetensors").is_file(), f"{TRAINED_MODEL_DIR} is missing from the checkout"
    return TRAINED_MODEL_DIR


@pytest.fixture(scope="module")
def reference(tiny_v3_dir):
    """The single-process engine's greedy outputs of golden.PROMPTS, and the engine (see golden.py)."""
    from golden import reference_outputs

    return reference_outputs(tiny_v3_dir)


@pytest.fixture(scope="session")
def shared_stack(tiny_v3_dir, tmp_path_factory):
    """A router, a prefill and a decode worker as `stack.start_stack` starts them by default on tiny V3, started at
    its first use and shared by the modules whose tests only send requests through it, check that it returns to idle
    and read its counters as differences (each stack start is seconds of torch imports on every worker). Request ids
    a test writes to the workers directly are its own. A test that signals, kills or reconfigures a process starts a
    stack of its own."""
    from stack import start_stack

    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-shared-stack"))
    yield s
    s.stop()


class DemoUp:
    """`pdserve up --dtype float32 --page-size 4` on the demo model (test_first_contact.Up: its ports and its log),
    shared by the modules that send it requests (test_batched_prompts, test_first_contact): `get()` gives the running
    one, starting it at the first call and again after one was ended (test_first_contact's SIGKILL test ends it)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self.tmp_path_factory, self.current = tmp_path_factory, None

    def get(self):
        from test_first_contact import Up

        if self.current is None or self.current.proc.poll() is not None:
            self.current = Up(self.tmp_path_factory.mktemp("demo-up"), "--dtype", "float32", "--page-size", "4")
            self.current.wait_up()
        return self.current


@pytest.fixture(scope="session")
def demo_up(tmp_path_factory):
    shared = DemoUp(tmp_path_factory)
    yield shared
    if shared.current is not None:
        shared.current.stop()


@pytest.fixture
def cleanup():
    """cleanup(obj): obj.close() after the test, last registered first (receivers, senders)."""
    items = []
    yield items.append
    for item in reversed(items):
        item.close()


@pytest.fixture
def copy_model(tmp_path) -> Callable[..., Path]:
    """copy_model(src, name="model") -> a fresh copy of the model directory src under this test's tmp_path."""

    def copy(src: Path | str, name: str = "model") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available (the device machine); elsewhere they are skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
