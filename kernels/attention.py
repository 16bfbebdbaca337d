"""MLA attention operations behind a backend registry.

Two shapes of work (see pdserve/model.py, class MLA):
- prefill ("MHA-chunked-KV"): per-head q/k of width 192 and v of width 128 over ragged sequences; the new tokens
  attend causally to themselves and, chunk by chunk, to the decompressed cached prefix; partial results are merged
  by their log-sum-exp.
- decode (absorbed): one query row per token, 512-wide latent query plus 64-wide rope query, attending over the
  paged latent cache [c_kv | k_pe] with a single shared KV head.

LSE convention here is the natural log. (FlashInfer's is base 2: its backend converts.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.common.registry import Registry


class AttentionBackend(ABC):
    # True when CUDA graphs can capture the decode ops: they never synchronise with the host, or (FlashInfer) they
    # do all their host work in a plan that graph_plan hands the graph runner to refresh before each replay.
    graph_safe: bool = False

    def graph_plan(self, rows: int, max_pages: int):
        """None, or for a backend that schedules on the host, the plan holder of one captured graph of `rows` rows:
        `with plan.forward(capturing)` around each warm-up forward and the captured one, and
        `plan.replan(page_table, seq_lens)` (host tensors, the graph's inputs) before every replay."""
        return None

    @abstractmethod
    def ragged_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: list[int],
                       kv_indptr: list[int], causal: bool, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged multi-head attention.

        q (Tq, H, Dqk), k (Tk, H, Dqk), v (Tk, H, Dv); sequence b owns q rows qo_indptr[b]:qo_indptr[b+1] and
        kv rows kv_indptr[b]:kv_indptr[b+1]. With causal=True a sequence's queries are the last q_len positions
        of its kv (query i sees kv rows up to kv_len - q_len + i). Returns out (Tq, H, Dv) in q's dtype and
        lse (Tq, H) fp32; a query with no visible key gets out 0 and lse -inf.
        """

    @abstractmethod
    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                   page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                   sm_scale: float) -> torch.Tensor:
        """Absorbed MLA over a paged latent cache.

        q_latent (B, H, R), q_pe (B, H, P); kv_layer (num_slots, R + P) is one layer of the pool, slot =
        page * page_size + offset; page_table (B, max_pages) int64; seq_lens (B,) = keys visible to each row
        (positions 0..seq_len-1 of that row's page table). Returns (B, H, R) in q's dtype.
        """


def merge_state(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets: o (T, H, D), natural-log lse (T, H).

    Either side may be empty (lse -inf); both empty gives o 0, lse -inf.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (T, H)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]  # (T, H, 1)
    w_b = torch.exp(lse_b - safe)[..., None]
    out = o_a.float() * w_a + o_b.float() * w_b
    return out.to(o_a.dtype), lse


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention")


@ATTENTION_BACKENDS.register("torch")
class TorchAttention(AttentionBackend):
    """Reference: one sequence at a time, scores in fp32."""

    def ragged_prefill(self, q, k, v, qo_indptr, kv_indptr, causal, sm_scale):
        tq, heads, _ = q.shape
        out = q.new_zeros(tq, heads, v.shape[-1])
        lse = torch.full((tq, heads), float("-inf"), dtype=torch.float32, device=q.device)
        for b in range(len(qo_indptr) - 1):
            q0, q1, k0, k1 = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
            if q1 == q0 or k1 == k0:
                continue
            qb = q[q0:q1].float().transpose(0, 1)  # (H, q_len, Dqk)
            kb = k[k0:k1].float().transpose(0, 1)  # (H, kv_len, Dqk)
            vb = v[k0:k1].float().transpose(0, 1)  # (H, kv_len, Dv)
            scores = torch.matmul(qb, kb.transpose(1, 2)) * sm_scale  # (H, q_len, kv_len)
            if causal:
                q_len, kv_len = q1 - q0, k1 - k0
                qpos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
                kpos = torch.arange(kv_len, device=q.device)[None, :]
                scores = scores.masked_fill(kpos > qpos, float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # (H, q_len)
            probs = torch.exp(scores - row_lse.nan_to_num(neginf=0.0)[..., None])
            out[q0:q1] = torch.matmul(probs, vb).transpose(0, 1).to(q.dtype)
            lse[q0:q1] = row_lse.transpose(0, 1)
        return out, lse

    def mla_decode(self, q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale):
        rank = q_latent.shape[-1]
        out = torch.empty_like(q_latent)
        offsets = torch.arange(page_size, device=kv_layer.device)
        for b in range(q_latent.shape[0]):
            n = int(seq_lens[b])
            slots = (page_table[b, : -(-n // page_size)].to(kv_layer.device)[:, None] * page_size
                     + offsets).reshape(-1)[:n]
            kv = kv_layer[slots].float()  # (n, R + P)
            c_kv, k_pe = kv[:, :rank], kv[:, rank:]
            scores = (q_latent[b].float() @ c_kv.T + q_pe[b].float() @ k_pe.T) * sm_scale  # (H, n)
            out[b] = (torch.softmax(scores, dim=-1) @ c_kv).to(q_latent.dtype)  # (H, R)
        return out
