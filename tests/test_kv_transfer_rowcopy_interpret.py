"""The cuda_ipc sender's row-copy kernel (`kv_transfer/row_copy.py`) against its torch reference, on the CPU under
Triton's interpreter (tests/interpreter_mode.py sets TRITON_INTERPRET at collection); tests/test_gpu_kv_ipc.py runs
the same checks compiled."""

from __future__ import annotations

import pytest
import torch

from interpreter_mode import enter_interpreter

rerun = enter_interpreter(__file__, "tests/test_gpu_kv_ipc.py")
if rerun is not None:
    test_interpreted_in_a_fresh_process = rerun
else:
    from rowcopy_checks import CASES, check_copy_rows, check_refused

    @pytest.mark.parametrize("layers, src_slots, dst_slots, tokens, row_elems, dtype, indexed", CASES)
    def test_rows_land_where_the_reference_puts_them(layers, src_slots, dst_slots, tokens, row_elems, dtype,
                                                     indexed):
        check_copy_rows("cpu", layers, src_slots, dst_slots, tokens, row_elems, dtype, indexed)

    def test_rows_the_kernel_cannot_move_are_refused_untouched():
        check_refused("cpu")
