"""The set-up every Triton-interpreter test module shares (import this before anything imports triton).

Triton picks compiled vs interpreted when it is first imported (its own tl.max / tl.sum included), so
TRITON_INTERPRET=1 is set at collection, before anything imports triton (pdserve.kernels does not). With CUDA
present the module skips without setting it, so GPU tests in the same run stay compiled; if triton was already
imported compiled, the module only reruns itself in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Optional

import pytest
import torch


def _triton_imported_compiled() -> bool:
    # NOTE: asks triton itself, not TRITON_INTERPRET: an earlier test module may have set the variable after
    # something (transformers' DeepSeek-V3 model) had already imported triton compiled.
    language = sys.modules.get("triton.language")
    return language is not None and type(language.max).__name__ != "InterpretedFunction"


# The modules that turned the interpreter on (their tests keep TRITON_INTERPRET=1; see tests/conftest.py).
INTERPRETED_FILES: set[str] = set()


def enter_interpreter(test_file: str, gpu_twin: str) -> Optional[Callable[[], None]]:
    """Skip the calling module on a CUDA machine (gpu_twin runs its kernels compiled), else turn the interpreter on.
    Returns None when the module's kernels will run interpreted here, or a test that reruns test_file alone in a
    fresh interpreted process (assign it to a module-level test_* name) when triton was already imported compiled."""
    if torch.cuda.is_available():
        pytest.skip(f"CUDA present: {gpu_twin} runs these kernels compiled", allow_module_level=True)
    compiled = _triton_imported_compiled()
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETED_FILES.add(os.path.abspath(test_file))
    pytest.importorskip("triton")
    if not compiled:
        return None

    def test_interpreted_in_a_fresh_process():
        """Something imported triton compiled before this module: run this module alone, interpreted."""
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]

    return test_interpreted_in_a_fresh_process
