"""Where the Triton per-token-group quantization differs from the torch reference on a GPU (diagnostic)."""
import torch

from pdserve.kernels import triton_fp8
from pdserve.kernels.gemm import per_token_group_quant

x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16) * 4
q, s = triton_fp8.per_token_group_quant(x)
rq, rs = per_token_group_quant(x)
print("scale shapes", tuple(s.shape), tuple(rs.shape), "strides", s.stride(), rs.stride())
d = (s != rs)
print("scales differing:", int(d.sum()), "of", s.numel(), "max rel diff", float(((s - rs).abs() / rs).max()))
print("codes differing:", int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()), "of", q.numel())
