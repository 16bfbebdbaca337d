"""The CLI's line between a user's error (one line naming the problem, exit 2) and an internal one (its traceback,
exit 1): an exception from inside a third-party library is internal; a checkpoint the user must fetch again is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pdserve.cli import _raised_by_pdserve
from pdserve.cli.engine_args import UsageError
from pdserve.cli.gpu_layout import place_workers


def test_an_error_raised_inside_a_third_party_library_is_internal(tmp_path):
    # A module under a site-packages folder stands for Triton, torch or gRPC raising from their own code.
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fake_triton.py").write_text("def launch():\n    raise ValueError('Pointer argument (at 0) cannot be "
                                        "accessed from Triton (cpu tensor?)')\n")
    sys.path.insert(0, str(lib))
    try:
        import fake_triton

        with pytest.raises(ValueError) as caught:
            fake_triton.launch()
        assert not _raised_by_pdserve(caught.value)
    finally:
        sys.path.remove(str(lib))
        sys.modules.pop("fake_triton", None)
    with pytest.raises(UsageError) as usage:
        place_workers("cuda", 1, 1, "auto", 1, gpus=(3,))
    assert _raised_by_pdserve(usage.value)
    with pytest.raises(FileNotFoundError) as missing:  # the standard library reading what the user gave
        open(os.path.join(tmp_path, "no-such-file"))
    assert _raised_by_pdserve(missing.value)


def test_the_cli_prints_an_internal_error_with_its_traceback_and_exits_1(tmp_path, monkeypatch, capsys):
    from pdserve import cli
    from pdserve.cli import engine_commands

    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fake_kernel_lib.py").write_text("def launch(*args):\n    raise ValueError('cannot be accessed from "
                                            "Triton')\n")
    monkeypatch.syspath_prepend(str(lib))
    import fake_kernel_lib

    monkeypatch.setattr(engine_commands, "cmd_generate", fake_kernel_lib.launch)
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):  # main re-raises: Python prints it, 1
        cli.main(["generate", "--input-ids", "1,2", "--device", "cpu"])
    monkeypatch.setattr(engine_commands, "cmd_generate", lambda args: place_workers("cpu", 1, 1, "tcp", 0, gpus=(0,)))
    assert cli.main(["generate", "--input-ids", "1,2", "--device", "cpu"]) == 2
    assert "pdserve generate: error: --gpus, --prefill-gpus and --decode-gpus place workers" in capsys.readouterr().err


def test_a_truncated_checkpoint_is_the_users_error_naming_the_file(trained_model_dir, tmp_path):
    """A model.safetensors cut short (an interrupted download): one line naming the file, exit 2, no traceback."""
    model = tmp_path / "model"
    shutil.copytree(trained_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--model", str(model), "--device", "cpu",
                          "--input-ids", "5,6,7", "--max-new-tokens", "2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert f"{weights} cannot be read as safetensors" in out.stderr and "Fetch the file again" in out.stderr


def test_an_internal_error_in_a_real_process_prints_its_traceback_and_exits_1(tmp_path):
    """As the red team simulated it: a RuntimeError raised inside a library during a command's work."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fake_warmup_lib.py").write_text("def run(*args):\n    raise RuntimeError('CUDA error: an illegal memory "
                                            "access was encountered')\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import fake_warmup_lib\n"
              "from pdserve.cli import engine_commands, main\n"
              "engine_commands.cmd_generate = fake_warmup_lib.run\n"
              "sys.exit(main(['generate', '--input-ids', '1,2', '--device', 'cpu']))\n")
    out = subprocess.run([sys.executable, "-c", script, str(lib)], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback (most recent call last)" in out.stderr and "fake_warmup_lib.py" in out.stderr
    assert "an illegal memory access" in out.stderr and "error: CUDA error" not in out.stderr
