"""DeepSeek-V2/V3 (MLA + DeepSeekMoE + NextN/MTP), mirroring the DeepSeek-V3 technical report.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn.kv_b_proj, ...) so weights load by
name; experts are stacked per layer (w13, w2) for grouped kernels. Every heavy operation goes through
`KernelBackends` (pdserve.kernels) so GPU kernels can replace the torch references without touching this file.

Tensor parallelism (`tp`, pdserve.parallel) splits the layers, not the model: each rank holds H/tp of the attention
heads (q_b_proj and kv_b_proj column-parallel, o_proj row-parallel + all-reduce) and I/tp of every MLP's and
expert's intermediate (gate/up column-parallel, down row-parallel, one all-reduce per MoE), or with expert
parallelism (`ep`) E/tp whole routed experts; the embedding, the router, the latent projections (so the latent KV
cache) and lm_head are replicated. With DP attention (`dp_attention`) MLA is whole on every rank and runs over that
rank's own requests only (pdserve.parallel.dp_attention). At tp size 1 nothing is split.

Shapes: T = tokens in the batch, H = attention heads (of this rank), R = kv_lora_rank (512), P = qk_rope_head_dim
(64), N = qk_nope_head_dim (128), V = v_head_dim (128), D = hidden_size, E = routed experts, I = intermediate size
(of this rank).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kernels import KernelBackends
from pdserve.kernels.attention import merge_state
from pdserve.kernels.moe import RoutingConfig
from pdserve.kernels.norm_rope import apply_rope, rms_norm, rope_cos_sin, yarn_inv_freq
from pdserve.kv_cache import token_slots
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.parallel.linear import ColumnParallelLinear, Linear, RowParallelLinear, Shard, load_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """YaRN RoPE (DeepSeek's variant): cos/sin scaled by the YaRN attention factor."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        r = cfg.rope
        dim = cfg.qk_rope_head_dim
        # NOTE: computed on the CPU even while build_model lays the model out on the meta device (it moves the
        # rotary to the model's device): a meta arange runs torch's Python reference, whose first call imports
        # torch._dynamo, seconds of every worker's start-up.
        with torch.device("cpu"):
            if r.rope_type == "yarn":
                inv_freq = yarn_inv_freq(dim, r.theta, r.factor, r.original_max_position_embeddings, r.beta_fast,
                                         r.beta_slow)
            else:
                inv_freq = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (P/2,)
        self.scale = r.cos_sin_scale
        self.interleave = r.interleave

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.scale)  # (T, P/2) each


class MLA(nn.Module):
    """Multi-head Latent Attention.

    The KV cache holds, per token, only c_kv (R, after kv_a_layernorm) and the roped shared key k_pe (P).
    Prefill (EXTEND) decompresses the latent through kv_b_proj into per-head k_nope (N) and v (V) and runs plain
    MHA with qk width N+P; decode (DECODE) absorbs W_UK into the query and W_UV into the output and attends
    over the latent directly with one KV head. Both paths compute the same function (tests check each other).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelBackends, prefix_chunk_tokens: int,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.layer_idx, self.kernels = cfg, layer_idx, kernels
        self.prefix_chunk_tokens = prefix_chunk_tokens
        h, n, p, v, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.rank = h // tp.size, n, p, v, r
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, h * (n + p), cfg, kernels, tp)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, cfg, kernels)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, h * (n + p), cfg, kernels, tp)  # this rank's heads
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, r + p, cfg, kernels)  # the latent: the same on every rank
        self.kv_a_layernorm = RMSNorm(r, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(r, h * (n + v), cfg, kernels, tp)
        self.o_proj = RowParallelLinear(h * v, cfg.hidden_size, cfg, kernels, tp)  # + all-reduce over the heads
        self.softmax_scale = cfg.softmax_scale
        # Absorbed weights, derived from kv_b_proj after loading (see absorb_weights).
        self.w_uk: Optional[torch.Tensor] = None  # (H, N, R)
        self.w_uv: Optional[torch.Tensor] = None  # (H, V, R)

    def absorb_weights(self) -> None:
        """Split kv_b_proj (H*(N+V), R) into W_UK and W_UV for the absorbed decode path."""
        dtype = self.kv_a_layernorm.weight.dtype
        w = self.kv_b_proj.dequantized_weight(dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()  # (H, N, R)
        self.w_uv = w[:, self.nope_dim:].contiguous()  # (H, V, R)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv_layer: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = cos_sin
        interleave = self.cfg.rope.interleave
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)  # (T, H, N+P)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # (T, H, N), (T, H, P)
        q_pe = apply_rope(q_pe, cos, sin, interleave)

        latent = self.kv_a_proj_with_mqa(x)  # (T, R+P)
        c_kv, k_pe = latent.split([self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # (T, R)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin, interleave)[:, 0]  # (T, P), one shared rope key
        # The cache stores exactly what decode attends over: [c_kv | roped k_pe], 576 wide for V3.
        kv_layer.index_copy_(0, batch.out_slots, torch.cat([c_kv, k_pe], dim=-1).to(kv_layer.dtype))

        if batch.mode is ForwardMode.EXTEND:
            out = self._extend(q_nope, q_pe, c_kv, k_pe, batch, kv_layer)  # (T, H, V)
        else:
            out = self._decode_absorbed(q_nope, q_pe, batch, kv_layer)  # (T, H, V)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    # ---- prefill: MHA over decompressed KV, cached prefix in chunks ---------------------------------------------
    def _decompress(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.nope_dim + self.v_dim)  # (Tk, H, N+V)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)  # (Tk, H, N+P)
        return k, v

    def _extend(self, q_nope, q_pe, c_kv, k_pe, batch: ForwardBatch, kv_layer) -> torch.Tensor:
        attn = self.kernels.attention
        q = torch.cat([q_nope, q_pe], dim=-1)  # (T, H, N+P)
        k, v = self._decompress(c_kv, k_pe)
        # New tokens attend causally to themselves.
        out, lse = attn.ragged_prefill(q, k, v, batch.qo_indptr, batch.qo_indptr, True, self.softmax_scale)
        # ... and to the cached prefix, decompressed chunk by chunk so the per-head K/V of a long prefix never
        # materialise at once; partial results merge by log-sum-exp.
        longest = max(batch.prefix_lens, default=0)
        for start in range(0, longest, self.prefix_chunk_tokens):
            slots, kv_indptr = [], [0]
            for pages, prefix_len in zip(batch.page_tables, batch.prefix_lens):
                end = min(start + self.prefix_chunk_tokens, prefix_len)
                if end > start:
                    slots.append(token_slots(pages, end, batch.page_size, start))
                kv_indptr.append(kv_indptr[-1] + max(end - start, 0))
            chunk = kv_layer[torch.cat(slots).to(kv_layer.device)].to(q.dtype)  # (Tc, R+P)
            k_c, v_c = self._decompress(*chunk.split([self.rank, self.rope_dim], dim=-1))
            out_c, lse_c = attn.ragged_prefill(q, k_c, v_c, batch.qo_indptr, kv_indptr, False, self.softmax_scale)
            out, lse = merge_state(out, lse, out_c, lse_c)
        return out

    # ---- decode: absorbed MLA over the paged latent cache -------------------------------------------------------
    def _decode_absorbed(self, q_nope, q_pe, batch: ForwardBatch, kv_layer) -> torch.Tensor:
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)  # (T, H, R)
        o_latent = self.kernels.attention.mla_decode(q_latent, q_pe, kv_layer, batch.page_table, batch.seq_lens,
                                                     batch.page_size, self.softmax_scale)  # (T, H, R)
        return torch.einsum("thr,hvr->thv", o_latent, self.w_uv)  # (T, H, V)


class MLP(nn.Module):
    """SwiGLU feed-forward: dense layers and shared experts. reduce=False: the output is this rank's partial sum
    (the MoE adds it to its experts' before one all-reduce)."""

    def __init__(self, cfg: ModelConfig, intermediate: int, kernels: KernelBackends, tp: TPGroup = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, intermediate, cfg, kernels, tp)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, intermediate, cfg, kernels, tp)
        self.down_proj = RowParallelLinear(intermediate, cfg.hidden_size, cfg, kernels, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: scores in fp32; V3 sigmoid + e_score_correction_bias with group-limited top-k, V2 softmax."""

    def __init__(self, cfg: ModelConfig, kernels: KernelBackends):
        super().__init__()
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if cfg.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.routing = RoutingConfig(cfg.num_experts_per_tok, cfg.scoring_func, cfg.topk_method, cfg.n_group,
                                     cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # (T, E); the weight is stored in fp32 (build_model)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return self.kernels.moe.select_experts(logits, bias, self.routing)  # (T, k) weights, (T, k) ids


class MoE(nn.Module):
    """DeepSeekMoE: top-k of E routed experts (stacked weights) plus always-on shared experts. Under TP every rank
    routes every token (the gate is replicated) through its I/tp slice of each expert, or with ep through its E/tp
    whole experts; one all-reduce sums the ranks' partial outputs, shared experts (split as under TP) included."""

    def __init__(self, cfg: ModelConfig, kernels: KernelBackends, tp: TPGroup = SINGLE, ep: bool = False):
        super().__init__()
        self.kernels, self.tp = kernels, tp
        self.ep = ep and tp.size > 1
        e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if self.ep:
            e //= tp.size
        else:
            i //= tp.size
        self.num_experts, self.first_expert = cfg.n_routed_experts, tp.rank * e if self.ep else 0  # global ids
        self.gate = Gate(cfg, kernels)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d), requires_grad=False)  # [gate_proj; up_proj] per expert
        self.w2 = nn.Parameter(torch.empty(e, d, i), requires_grad=False)  # down_proj per expert
        self.block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else None
        if self.block:
            bn, bk = self.block
            self.w13_scale_inv = nn.Parameter(torch.ones(e, 2 * i // bn, -(-d // bk)), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.ones(e, -(-d // bn), -(-i // bk)), requires_grad=False)
        else:
            self.w13_scale_inv = self.w2_scale_inv = None
        self.shared_experts = (MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, kernels, tp, reduce=False)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # (T, k), (T, k)
        if self.ep:
            weights, ids = self._experts_here(weights, ids)
        y = self.kernels.moe.experts(x, weights, ids, self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv,
                                     self.block, absent=self.ep)  # (T, D); under TP or EP this rank's partial sum
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y) if self.tp.size > 1 else y

    def _experts_here(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the (token, slot) pairs in this rank's local expert ids; a pair of another rank's
        expert becomes the absent id E/tp (weight 0), which the MoE backend skips: this rank computes only its
        experts' pairs, and the all-reduce adds the other ranks'.

        NOTE: every rank routes every token (the gate is replicated) and the all-reduce sums outputs of all tokens,
        rather than dispatching each token to the ranks of its experts (all-to-all) and combining back: on one
        host the MoE's input is already on every rank (TP's all-reduce or DP attention's all-gather put it there),
        so a dispatch would move no less data, and the one all-reduce is the one TP already does."""
        here_n = self.w13.shape[0]
        local = ids - self.first_expert  # (T, k)
        here = (local >= 0) & (local < here_n)
        return weights * here, torch.where(here, local, here_n)

    def shard(self, name: str, dest: torch.Tensor) -> Optional[Shard]:
        """Under TP w13 (and its scales) split along the intermediate rows of gate and of up, w2 along its columns;
        `dest` is one expert's gate or up rows, or all of w13 or of one expert's (gate and up, stacked). Under EP
        the experts split: a stacked tensor along its experts, one expert's tensors not at all."""
        if self.tp.size == 1:
            return None
        if self.ep:
            return Shard(0, self.tp.rank, self.tp.size) if dest.dim() == getattr(self, name).dim() else None
        if name.startswith("w2"):
            return Shard(-1, self.tp.rank, self.tp.size)
        both = dest.shape[-2] == getattr(self, name).shape[-2]
        return Shard(-2, self.tp.rank, self.tp.size, stacked=2 if both else 1)

    def weight_loader(self, name: str, dest: torch.Tensor, loaded) -> None:
        load_shard(dest, loaded, self.shard(name, dest))


class Block(nn.Module):
    """Pre-norm decoder layer: x + MLA(norm(x)), then + FFN(norm(.)); FFN dense for the first k layers.

    dp_attention: attention is data-parallel over requests (MLA whole on every rank, each over its own requests'
    tokens), the FFN tensor/expert-parallel over every rank's tokens (pdserve.parallel.dp_attention)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelBackends, prefix_chunk_tokens: int,
                 tp: TPGroup = SINGLE, ep: bool = False, dp_attention: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLA(cfg, layer_idx, kernels, prefix_chunk_tokens, SINGLE if dp_attention else tp)
        self.mlp = (MoE(cfg, kernels, tp, ep) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg, cfg.intermediate_size, kernels, tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        dp = batch.dp
        if dp is None:
            x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch, kv_cache[self.layer_idx])
            return x + self.mlp(self.post_attention_layernorm(x))
        if x.shape[0]:  # a DP rank without requests this step has no attention to run, but joins the collectives
            x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch, kv_cache[self.layer_idx])
        # every rank's tokens through the TP/EP FFN (its all-reduce gives each rank the whole output), ours back
        return x + dp.slice(self.mlp(dp.gather(self.post_attention_layernorm(x))))  # (T_rank, D)


class MTP(nn.Module):
    """NextN / multi-token prediction module (DeepSeek-V3 report §2.2), used as the speculative draft.

    h = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) -> Block -> shared_head.norm -> lm_head, where h_i is the
    main model's last hidden state (before the final norm) at position i. Embedding and lm_head are shared with
    the main model; the block has its own attention and so its own KV cache layer.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelBackends, prefix_chunk_tokens: int,
                 tp: TPGroup = SINGLE, ep: bool = False, dp_attention: bool = False):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, cfg, kernels)
        self.block = Block(cfg, layer_idx, kernels, prefix_chunk_tokens, tp, ep, dp_attention)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor, cos_sin, batch: ForwardBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1))  # (T, D)
        return self.block(h, cos_sin, batch, kv_cache)  # (T, D), before shared_head.norm


class DeepseekV3(nn.Module):
    """The whole model. forward() returns the last hidden states before the final norm (the MTP input);
    logits() applies the final norm and lm_head to the rows that need them.

    tp: this process's tensor-parallel rank (pdserve.parallel), ep: its MoEs split their experts (not each expert's
    intermediate); embed_tokens and lm_head are replicated, so every rank's forward ends in the same hidden states
    and rank 0 alone computes logits."""

    def __init__(self, cfg: ModelConfig, kernels: KernelBackends, prefix_chunk_tokens: int = 4096,
                 tp: TPGroup = SINGLE, ep: bool = False, dp_attention: bool = False):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.kernels = kernels  # the CUDA-graph runner asks its attention backend for per-graph plans
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(
            [Block(cfg, i, kernels, prefix_chunk_tokens, tp, ep, dp_attention) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # NOTE: replicated, not vocab-parallel, on purpose: rank 0 alone samples, and sampling (top-p, seeded
        # generators, logprobs with their top alternatives) needs each row's whole vocabulary; a vocab-parallel head
        # would split the matmul only to gather (rows, vocab) fp32 logits back to rank 0 every step, while a
        # replicated one lets the other ranks skip the head entirely (they compute no logits). The price is the
        # head's memory on every rank.
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.embed_tokens.weight.requires_grad_(False)
        # Its KV layer index follows the main layers: cache layer num_hidden_layers + j.
        self.mtp = nn.ModuleList(
            [MTP(cfg, cfg.num_hidden_layers + j, kernels, prefix_chunk_tokens, tp, ep, dp_attention)
             for j in range(cfg.num_nextn_predict_layers)])
        self.has_mtp_weights = bool(cfg.num_nextn_predict_layers)  # the loader clears it when absent

    def post_load(self) -> None:
        """Derive what the checkpoint does not store (absorbed MLA weights)."""
        for module in self.modules():
            if isinstance(module, MLA):
                module.absorb_weights()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache (num_kv_layers, num_slots, R+P). Returns hidden states (T, D) before the final norm."""
        x = self.embed_tokens(batch.input_ids)  # (T, D)
        cos_sin = self.rotary(batch.positions)
        for layer in self.layers:
            x = layer(x, cos_sin, batch, kv_cache)
            if batch.layer_done is not None:
                batch.layer_done(layer.layer_idx)
        return x if batch.dp is None else batch.dp.gather(x)  # DP attention: every rank's rows, for rank 0

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()  # (rows, vocab)

    @torch.no_grad()
    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_cache: torch.Tensor,
                    depth: int = 0, logits: bool = True) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """One draft step. batch.input_ids are the tokens t_{i+1}; prev_hidden (T, D) the main model's h_i at the
        same positions i. Returns (draft logits (T, vocab) fp32, MTP hidden (T, D) for a further step).
        logits=False: only the layer's KV and hidden (a prompt's MTP KV: its T x vocab fp32 logits would cost more
        than the layer itself)."""
        if not self.has_mtp_weights:
            raise RuntimeError("this checkpoint has no NextN/MTP weights: speculative decoding is unavailable")
        mtp = self.mtp[depth]
        h = mtp(self.embed_tokens(batch.input_ids), prev_hidden, self.rotary(batch.positions), batch, kv_cache)
        if batch.layer_done is not None:
            batch.layer_done(mtp.block.layer_idx)
        if batch.dp is not None:
            h = batch.dp.gather(h)  # DP attention: every rank's rows
        return (self.lm_head(mtp.shared_head_norm(h)).float() if logits else None), h
