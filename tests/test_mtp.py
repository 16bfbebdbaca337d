"""The NextN/MTP draft step against a straightforward reference of FACTS §5:

    h = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i))) -> decoder block -> shared_head.norm -> lm_head

computed from the raw checkpoint tensors, with transformers' own DeepseekV3DecoderLayer as the block.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

from pdserve.engine import EngineConfig, LLMEngine  # noqa: E402
from pdserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from pdserve.kv_cache import CacheConfig  # noqa: E402


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(model_dir, tokens_next, prev_hidden):
    """tokens_next (n,), prev_hidden (n, D) for positions 0..n-1 -> draft logits (n, vocab)."""
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    L = config.num_hidden_layers
    p = f"model.layers.{L}."
    layer = hf_v3.DeepseekV3DecoderLayer(config, layer_idx=L).eval()
    state = {k[len(p):]: v for k, v in t.items() if k.startswith(p) and ".experts." not in k}
    e = range(config.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([t[f"{p}mlp.experts.{i}.gate_proj.weight"], t[f"{p}mlp.experts.{i}.up_proj.weight"]]) for i in e])
    state["mlp.experts.down_proj"] = torch.stack([t[f"{p}mlp.experts.{i}.down_proj.weight"] for i in e])
    layer.load_state_dict({k: v for k, v in state.items() if not k.split(".")[0] in (
        "enorm", "hnorm", "eh_proj", "shared_head")}, strict=True)

    emb = t["model.embed_tokens.weight"][tokens_next]  # (n, D)
    h = torch.cat([rms(emb, t[p + "enorm.weight"]), rms(prev_hidden, t[p + "hnorm.weight"])], -1) @ t[p + "eh_proj.weight"].T
    n = h.shape[0]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = hf_v3.DeepseekV3RotaryEmbedding(config)(h[None], pos)
        h = layer(h[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]
    return rms(h, t[p + "shared_head.norm.weight"]) @ t["lm_head.weight"].T


def test_mtp_draft_matches_reference(tiny_v3_dir):
    engine = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=32)))
    model, pool = engine.model, engine.pool
    assert model.has_mtp_weights
    tokens = [2, 40, 7, 300, 12, 90, 91, 5, 66, 1]
    n = len(tokens)
    pages = pool.allocator.alloc(-(-n // pool.page_size))
    main = ForwardBatch(ForwardMode.EXTEND, torch.tensor(tokens), torch.arange(n), pool.slots_for(pages, 0, n),
                        pool.page_size, qo_indptr=[0, n], prefix_lens=[0], page_tables=[pages])
    hidden = model(main, pool.kv)  # (n, D) before the final norm

    # Draft over positions 0..n-3 (EXTEND: input t_{i+1} with h_i), then one DECODE step at position n-2.
    m = n - 2
    draft = ForwardBatch(ForwardMode.EXTEND, torch.tensor(tokens[1:m + 1]), torch.arange(m),
                         pool.slots_for(pages, 0, m), pool.page_size, qo_indptr=[0, m], prefix_lens=[0],
                         page_tables=[pages])
    kv_before = pool.kv.clone()
    none, h_kv_only = model.mtp_forward(draft, hidden[:m], pool.kv, logits=False)  # a prompt's MTP KV alone
    kv_only = pool.kv.clone()
    pool.kv.copy_(kv_before)
    logits_extend, h_extend = model.mtp_forward(draft, hidden[:m], pool.kv)
    assert none is None and torch.equal(h_kv_only, h_extend) and torch.equal(kv_only, pool.kv)
    step = ForwardBatch(ForwardMode.DECODE, torch.tensor([tokens[m + 1]]), torch.tensor([m]),
                        pool.slots_for(pages, m, m + 1), pool.page_size, page_table=pool.page_table_tensor([pages]),
                        seq_lens=torch.tensor([m + 1]))
    logits_step, _ = model.mtp_forward(step, hidden[m:m + 1], pool.kv)

    ref = reference_mtp(str(tiny_v3_dir), torch.tensor(tokens[1:m + 2]), hidden[:m + 1])
    got = torch.cat([logits_extend, logits_step])
    diff = (got - ref).abs().max().item()
    print(f"MTP draft vs reference: max abs logit diff {diff:.3e}")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    pool.allocator.decref(pages)


def test_mtp_unavailable_is_a_clear_error(tiny_v3_dir):
    engine = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=8)))
    engine.model.has_mtp_weights = False
    with pytest.raises(RuntimeError, match="no NextN/MTP weights"):
        engine.model.mtp_forward(None, None, engine.pool.kv)
