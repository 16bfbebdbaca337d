"""Run @triton.jit kernels on the CPU through Triton's interpreter with the GPU's arithmetic.

Set TRITON_INTERPRET=1 before triton is first imported, then run the kernels inside `with exact_interpreter():`.
It works around three faults of triton 3.6's interpreter that would otherwise make correct kernels fail (or
wrong ones pass):
- float down-conversions (fp32 -> bf16 / fp8) truncate, round half up without carrying into the exponent, and
  flush fp8 subnormals; the GPU converts with round-to-nearest-even. Replaced by torch's conversions.
- tl.dot on bf16 operands multiplies their raw uint16 bit patterns. Replaced by an fp32 product of the values
  (what the tensor cores compute, exactly, before fp32 accumulation).
- scalars are numpy arrays of shape (1,), which recent numpy (2.4 here) refuses to turn into a Python int, so any
  `for i in range(runtime_value)` loop raises. Replaced by taking the single element.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

try:
    import triton.language as tl
    from triton.runtime import interpreter as _interp
except ImportError:  # the tests using this skip themselves
    tl = _interp = None

_TORCH_DTYPES = {} if tl is None else {
    tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
    tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
}
_SIGNED_BITS = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}


def _convert_float(data, src_dtype, dst_dtype, rounding_mode):
    src_np, _ = _SIGNED_BITS[src_dtype.primitive_bitwidth]
    _, dst_t = _SIGNED_BITS[dst_dtype.primitive_bitwidth]
    bits = torch.from_numpy(np.ascontiguousarray(data).view(src_np).copy())
    out = bits.view(_TORCH_DTYPES[src_dtype]).to(_TORCH_DTYPES[dst_dtype]).view(dst_t).numpy()
    return out.view(getattr(np, f"uint{dst_dtype.primitive_bitwidth}")).reshape(np.shape(data))


@contextlib.contextmanager
def exact_interpreter():
    """Apply the fixes above for the duration of the block."""
    original_dot = _interp.InterpreterBuilder.create_dot
    original_patch_tensor = _interp._patch_lang_tensor
    original_convert = _interp._convert_float

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a = _interp.TensorHandle(_convert_float(a.data, a.dtype, tl.float32, None).view(np.float32), tl.float32)
            b = _interp.TensorHandle(_convert_float(b.data, b.dtype, tl.float32, None).view(np.float32), tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def patch_lang_tensor(tensor, scope):
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._convert_float = _convert_float
    _interp.InterpreterBuilder.create_dot = create_dot
    _interp._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        _interp._convert_float = original_convert
        _interp.InterpreterBuilder.create_dot = original_dot
        _interp._patch_lang_tensor = original_patch_tensor
