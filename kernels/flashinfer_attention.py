"""The "flashinfer" attention backend: FlashInfer 0.5.3's MLA decode and ragged prefill kernels (FACTS §3).

- mla_decode: `flashinfer.mla.BatchMLAPagedAttentionWrapper` (fa3 on sm90, fa2 elsewhere) over the paged latent
  cache viewed as ckv = (pages, page_size, 576)[..., :512] and kpe = [..., 512:], no copy.
- ragged_prefill: `flashinfer.BatchPrefillWithRaggedKVCacheWrapper` (qk 192 / vo 128 for V3). FlashInfer's LSE is
  base 2; it is converted to the natural log here, so `merge_state` and the other backends agree.

FlashInfer computes in bf16/fp16 only: fp32 inputs are cast to bf16 (the whole kv layer too: a copy, acceptable
for tests only) and the output is cast back. Registered only when `import flashinfer` works; nothing here fails to
import without it. One 128 MB float workspace per device is shared by every wrapper (they run in stream order).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch

from .attention import ATTENTION_BACKENDS, AttentionBackend

try:
    import flashinfer

    FLASHINFER_IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # ImportError without the package; anything else from a broken install
    flashinfer = None  # type: ignore[assignment]
    FLASHINFER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

WORKSPACE_BYTES = 128 * 1024 * 1024
_PREFILL_WRAPPERS = 8  # ragged plans kept per backend: a forward alternates causal self-attention and prefix chunks


@functools.lru_cache(maxsize=None)
def workspace_buffer(device: torch.device) -> torch.Tensor:
    """The float workspace of `device`, allocated once."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def default_mla_backend(device: torch.device) -> str:
    """fa3 on Hopper (sm90), fa2 elsewhere (FACTS §3: cutlass / trtllm-gen are Blackwell-only)."""
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.dtype == torch.float32 else t


class FlashInferMLADecode:
    """One FlashInfer MLA decode plan: `plan()` then `run()`, any number of runs (e.g. every layer) per plan.

    NOTE: plan() syncs with the host (FlashInfer schedules on the CPU), so it never runs inside CUDA-graph capture.
    Eager use: plan each step, run per layer. CUDA graphs: construct with graph_batch_size and max_pages (fixed
    index buffers; batch size fixed per instance, so one instance per captured batch size), plan with dummy
    lengths, warm up, capture run(), then call plan() with the real page table before each replay.
    """

    def __init__(self, device: torch.device | str, *, backend: Optional[str] = None,
                 graph_batch_size: Optional[int] = None, max_pages: Optional[int] = None):
        if flashinfer is None:
            raise RuntimeError(f"flashinfer is not importable ({FLASHINFER_IMPORT_ERROR})")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend or default_mla_backend(self.device)
        self.graph_batch_size = graph_batch_size
        ws = workspace_buffer(self.device)
        if graph_batch_size is None:
            self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=self.backend)
            self._empty_rows: Optional[torch.Tensor] = None
        else:
            if max_pages is None:
                raise ValueError("a CUDA-graph FlashInferMLADecode needs max_pages (page_table width)")
            b, i32 = graph_batch_size, torch.int32
            self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                ws, use_cuda_graph=True,
                qo_indptr=torch.arange(b + 1, dtype=i32, device=self.device),
                kv_indptr=torch.zeros(b + 1, dtype=i32, device=self.device),
                kv_indices=torch.zeros(b * max_pages, dtype=i32, device=self.device),
                kv_len_arr=torch.zeros(b, dtype=i32, device=self.device),
                backend=self.backend)
            self._empty_rows = torch.zeros(b, 1, 1, dtype=torch.bool, device=self.device)  # static: graphs read it
        self._page_size: Optional[int] = None
        self._plan_copied: Optional[torch.cuda.Event] = None  # passed once the last plan's upload has run

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, page_size: int,
             sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, rank: int = 512, rope: int = 64) -> None:
        """page_table (B, max_pages) and seq_lens (B,) as in AttentionBackend.mla_decode. The indices are built
        where the inputs live: device inputs sync with the host; host inputs (a graph's replan) do not."""
        batch, max_pages = page_table.shape
        if self.graph_batch_size is not None and batch != self.graph_batch_size:
            raise ValueError(f"this plan was built for batch {self.graph_batch_size}, got {batch}")
        where = seq_lens.device
        lens = seq_lens.to(dtype=torch.int32)  # (B,)
        pages = (lens + page_size - 1) // page_size  # (B,) pages in use per row
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=where)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        used = torch.arange(max_pages, device=where)[None, :] < pages[:, None]  # (B, max_pages)
        kv_indices = page_table.to(where)[used].to(torch.int32)  # row-major: row b's pages, in order
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=where)
        # NOTE: FlashInfer writes its plan into one pinned host buffer and uploads it asynchronously, in stream
        # order. The engine queues several steps before it reads a result back (NextN: verify, extend, the next
        # chain), so a re-plan could overwrite that buffer before the previous upload ran: wait for it first.
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        self._wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, num_heads, rank, rope, page_size, False,
                           sm_scale, _half_dtype(q_dtype), _half_dtype(kv_dtype))
        if self.device.type == "cuda":
            self._plan_copied = torch.cuda.Event()
            self._plan_copied.record(torch.cuda.current_stream(self.device))
        if self.graph_batch_size is None:  # eager: each plan may have another batch size
            self._empty_rows = (lens == 0)[:, None, None].to(self.device)
        else:  # a graph reads this buffer: refill it in place
            self._empty_rows.copy_((lens == 0)[:, None, None])
        self._page_size = page_size

    def run(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q_latent (B, H, R), q_pe (B, H, P) in bf16/fp16, kv_layer (num_slots, R + P) -> (B, H, R). Capturable."""
        if self._page_size is None:
            raise RuntimeError("FlashInferMLADecode.run() before plan()")
        rank = q_latent.shape[-1]
        kv = kv_layer.view(-1, self._page_size, kv_layer.shape[-1])  # (pages, page_size, R + P)
        ckv, kpe = kv[..., :rank], kv[..., rank:]  # strided views, no copy (FlashInfer takes page/token strides)
        out = self._wrapper.run(q_latent, q_pe, ckv, kpe, out=out)
        # A row with no keys: FlashInfer's output is unspecified; the contract says 0.
        return out.masked_fill_(self._empty_rows, 0.0)


def _run(dec: FlashInferMLADecode, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
    """A planned decode on any input dtype: FlashInfer computes in bf16/fp16, the result comes back in q's dtype."""
    return dec.run(_half(q_latent).contiguous(), _half(q_pe).contiguous(), _half(kv_layer)).to(q_latent.dtype)


def _half_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.float32 else dtype


class FlashInferGraphPlan:
    """FlashInfer MLA decode inside one CUDA graph (AttentionBackend.graph_plan). FlashInfer schedules on the host,
    so a graph cannot plan; the graph owns wrappers with fixed index buffers instead, planned while warming up,
    captured, and re-planned from host tensors before every replay (`replan`). A forward may attend with several
    lengths (a draft chain's steps see lens, lens + 1, ...): one wrapper per distinct seq_lens tensor, in call order,
    each remembering its offset from the first, so that replan needs only the graph's own inputs."""

    def __init__(self, backend: "FlashInferAttention", rows: int, max_pages: int):
        self.backend, self.rows, self.max_pages = backend, rows, max_pages
        self._decodes: list[FlashInferMLADecode] = []
        self._offsets: list[torch.Tensor] = []  # host (rows,): lens of group i minus lens of group 0
        self._plan_args: dict = {}  # FlashInferMLADecode.plan's arguments past the page table and lengths
        self._group, self._lens, self._first_lens, self._capturing = -1, None, None, False

    @property
    def num_plans(self) -> int:
        return len(self._decodes)

    @contextlib.contextmanager
    def forward(self, capturing: bool):
        """Brackets one forward: a warm-up (capturing=False) plans from the device inputs; the capture runs them."""
        previous, self.backend._graph_plan = self.backend._graph_plan, self
        self._group, self._lens, self._capturing = -1, None, capturing
        try:
            yield self
        finally:
            self.backend._graph_plan = previous

    def mla_decode(self, q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale) -> torch.Tensor:
        if seq_lens is not self._lens:  # a new group (every layer of one step passes the same tensors)
            self._group, self._lens = self._group + 1, seq_lens
            if not self._capturing:  # warm-up: a host sync is fine here
                if self._group == len(self._decodes):
                    self._decodes.append(FlashInferMLADecode(q_latent.device, graph_batch_size=self.rows,
                                                             max_pages=self.max_pages))
                    self._offsets.append(None)
                if self._group == 0:
                    self._first_lens = seq_lens
                self._offsets[self._group] = (seq_lens - self._first_lens).cpu()
                self._plan_args = dict(num_heads=q_latent.shape[1], page_size=page_size, sm_scale=sm_scale,
                                       q_dtype=q_latent.dtype, kv_dtype=kv_layer.dtype, rank=q_latent.shape[-1],
                                       rope=q_pe.shape[-1])
                self._decodes[self._group].plan(page_table, seq_lens, **self._plan_args)
        return _run(self._decodes[self._group], q_latent, q_pe, kv_layer)

    def replan(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Before a replay: page_table (rows, width) and seq_lens (rows,) are host copies of the graph's inputs."""
        for dec, offset in zip(self._decodes, self._offsets):
            dec.plan(page_table, seq_lens + offset, **self._plan_args)


class FlashInferAttention(AttentionBackend):
    """FlashInfer kernels, bf16/fp16 (fp32 inputs are cast to bf16 and the outputs cast back)."""

    # Capturable only through graph_plan: DecodeGraphRunner re-plans each graph from the host before its replay.
    graph_safe = True

    def __init__(self) -> None:
        self._decode: dict[torch.device, FlashInferMLADecode] = {}
        self._decode_key: Optional[tuple] = None
        self._graph_plan: Optional[FlashInferGraphPlan] = None  # set while a graph warms up or is captured
        self._prefill: dict[tuple, "flashinfer.BatchPrefillWithRaggedKVCacheWrapper"] = {}
        self._fallback_backend: Optional[AttentionBackend] = None

    def _fallback(self) -> AttentionBackend:
        if self._fallback_backend is None:
            from .attention import TorchAttention
            from .triton_support import triton_installed

            if triton_installed():
                from .triton_attention import TritonAttention

                self._fallback_backend = TritonAttention()
            else:
                self._fallback_backend = TorchAttention()
        return self._fallback_backend

    # ---- decode ----------------------------------------------------------------------------------------------
    def mla_decode(self, q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale):
        if (q_latent.shape[-1], q_pe.shape[-1]) != (512, 64):
            # FlashInfer's MLA kernels are built for DeepSeek's 512 + 64 only (other widths read out of bounds);
            # small test models use our Triton kernel.
            return self._fallback().mla_decode(q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale)
        if self._graph_plan is not None:
            return self._graph_plan.mla_decode(q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale)
        device = q_latent.device
        dec = self._decode.get(device)
        if dec is None:
            dec = self._decode[device] = FlashInferMLADecode(device)
        # Every layer of a step passes the same page_table / seq_lens: plan once per step. Identity plus the
        # tensors' version counters (bumped by any in-place write) tell a new step from another layer; the key
        # holds the tensors, so their memory cannot be reused by new ones while it is the key.
        key = (page_table, page_table._version, seq_lens, seq_lens._version, q_latent.shape, q_pe.shape[-1],
               page_size, sm_scale, q_latent.dtype, kv_layer.dtype, device)
        if self._decode_key is None or not _same_key(self._decode_key, key):
            dec.plan(page_table, seq_lens, q_latent.shape[1], page_size, sm_scale, q_latent.dtype, kv_layer.dtype,
                     rank=q_latent.shape[-1], rope=q_pe.shape[-1])
            self._decode_key = key
        return _run(dec, q_latent, q_pe, kv_layer)

    def graph_plan(self, rows: int, max_pages: int) -> FlashInferGraphPlan:
        return FlashInferGraphPlan(self, rows, max_pages)

    # ---- prefill ---------------------------------------------------------------------------------------------
    def _prefill_wrapper(self, qo_indptr, kv_indptr, heads, dqk, dv, causal, sm_scale, dtype, device):
        key = (tuple(qo_indptr), tuple(kv_indptr), heads, dqk, dv, causal, sm_scale, dtype, device)
        wrapper = self._prefill.get(key)
        if wrapper is None:
            if len(self._prefill) >= _PREFILL_WRAPPERS:
                self._prefill.pop(next(iter(self._prefill)))
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace_buffer(device), "NHD")
            # Host indptrs: FlashInfer plans on the CPU anyway, so this costs no device sync.
            wrapper.plan(torch.tensor(qo_indptr, dtype=torch.int32), torch.tensor(kv_indptr, dtype=torch.int32),
                         heads, heads, dqk, head_dim_vo=dv, causal=causal, sm_scale=sm_scale,
                         q_data_type=dtype, kv_data_type=dtype)
            self._prefill[key] = wrapper
        return wrapper

    def ragged_prefill(self, q, k, v, qo_indptr, kv_indptr, causal, sm_scale):
        tq, heads, dqk = q.shape
        dv = v.shape[-1]
        if (dqk, dv) not in _FLASHINFER_PREFILL_DIMS:
            # FlashInfer's sm90 ragged prefill is built for DeepSeek's 192/128 only (other widths fail its
            # static asserts); other widths (small test models) use our Triton kernel.
            return self._fallback().ragged_prefill(q, k, v, qo_indptr, kv_indptr, causal, sm_scale)
        if qo_indptr[-1] == qo_indptr[0] or kv_indptr[-1] == kv_indptr[0]:  # nothing to attend: skip the plan
            return (q.new_zeros(tq, heads, dv),
                    torch.full((tq, heads), float("-inf"), dtype=torch.float32, device=q.device))
        qh, kh, vh = (_half(t).contiguous() for t in (q, k, v))
        wrapper = self._prefill_wrapper(list(qo_indptr), list(kv_indptr), heads, dqk, dv, bool(causal),
                                        float(sm_scale), qh.dtype, q.device)
        out, lse = wrapper.run(qh, kh, vh, return_lse=True)
        lse = lse * math.log(2.0)  # base 2 -> natural log
        empty = _rows_without_keys(qo_indptr, kv_indptr, causal)
        if empty:  # the contract: out 0, lse -inf (FlashInfer's values there are not specified)
            idx = torch.tensor(empty, dtype=torch.long).pin_memory().to(q.device, non_blocking=True)
            out.index_fill_(0, idx, 0.0)
            lse.index_fill_(0, idx, float("-inf"))
        return out.to(q.dtype), lse


_FLASHINFER_PREFILL_DIMS = {(192, 128), (128, 128), (64, 64), (256, 256)}


def _same_key(a: tuple, b: tuple) -> bool:
    return all((x is y) if isinstance(x, torch.Tensor) else (x == y) for x, y in zip(a, b))


def _rows_without_keys(qo_indptr: list[int], kv_indptr: list[int], causal: bool) -> list[int]:
    """Query rows that see no key: all rows of a sequence with no keys; with causal, the first q_len - kv_len."""
    rows: list[int] = []
    for b in range(len(qo_indptr) - 1):
        q0, q_len, kv_len = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b], kv_indptr[b + 1] - kv_indptr[b]
        blind = q_len if kv_len == 0 else (max(0, q_len - kv_len) if causal else 0)
        rows.extend(range(q0, q0 + blind))
    return rows


if flashinfer is not None:
    ATTENTION_BACKENDS.register("flashinfer")(FlashInferAttention)
