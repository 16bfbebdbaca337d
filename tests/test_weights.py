"""Checkpoint and config loading: tiny V3/V2 checkpoints, dummy weights, sharded checkpoints, checkpoints written by
transformers, and every way a model directory can be broken, each error naming the thing that is wrong."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.config import ConfigError, ModelConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels import KernelBackends
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.tiny_model import tiny_config_dict
from pdserve.weights import WeightsError, load_model

from stack import REPO

PROMPTS = [[1, 2, 3], [5, 17, 300, 42, 9, 11, 250], list(range(20, 49))]
GREEDY8 = SamplingParams(max_new_tokens=8, ignore_eos=True)


# ---- helpers --------------------------------------------------------------------------------------------------------
def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def edit_tensors(model_dir, edit) -> None:
    """Rewrite model_dir/model.safetensors after edit(tensors) changed the dict in place."""
    path = model_dir / "model.safetensors"
    tensors = read_tensors(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(model_dir, edit) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def load(model_dir):
    cfg = ModelConfig.from_model_dir(str(model_dir))
    return load_model(str(model_dir), cfg, torch.float32, KernelBackends.create(), progress=lambda msg: None)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), cache=CacheConfig(page_size=4, num_pages=64), **kwargs))


def greedy_tokens(engine: LLMEngine) -> list[list[int]]:
    return [o.output_ids for o in engine.generate(PROMPTS, GREEDY8)]


def load_error(model_dir) -> str:
    with pytest.raises(WeightsError) as e:
        load(model_dir)
    return str(e.value)


# ---- loading ------------------------------------------------------------------------------------------------------
def test_tiny_v3_tensors_land_where_they_belong(tiny_v3_dir):
    ckpt = read_tensors(tiny_v3_dir / "model.safetensors")
    model = load(tiny_v3_dir)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    inter = model.cfg.moe_intermediate_size
    # checkpoint name -> the parameter (or the slice of a stacked expert parameter) it must fill
    expected = {
        "model.embed_tokens.weight": params["embed_tokens.weight"],
        "lm_head.weight": params["lm_head.weight"],
        "model.norm.weight": params["norm.weight"],
        "model.layers.0.self_attn.q_a_proj.weight": params["layers.0.self_attn.q_a_proj.weight"],
        "model.layers.0.mlp.down_proj.weight": params["layers.0.mlp.down_proj.weight"],
        "model.layers.2.self_attn.kv_b_proj.weight": params["layers.2.self_attn.kv_b_proj.weight"],
        "model.layers.1.mlp.experts.2.gate_proj.weight": params["layers.1.mlp.w13"][2, :inter],
        "model.layers.1.mlp.experts.2.up_proj.weight": params["layers.1.mlp.w13"][2, inter:],
        "model.layers.2.mlp.experts.7.down_proj.weight": params["layers.2.mlp.w2"][7],
        "model.layers.1.mlp.gate.e_score_correction_bias": params["layers.1.mlp.gate.e_score_correction_bias"],
        "model.layers.1.mlp.shared_experts.up_proj.weight": params["layers.1.mlp.shared_experts.up_proj.weight"],
        # the NextN/MTP layer, stored after the main layers
        "model.layers.3.enorm.weight": params["mtp.0.enorm.weight"],
        "model.layers.3.eh_proj.weight": params["mtp.0.eh_proj.weight"],
        "model.layers.3.shared_head.norm.weight": params["mtp.0.shared_head_norm.weight"],
        "model.layers.3.self_attn.kv_b_proj.weight": params["mtp.0.block.self_attn.kv_b_proj.weight"],
        "model.layers.3.mlp.experts.5.up_proj.weight": params["mtp.0.block.mlp.w13"][5, inter:],
    }
    for name, param in expected.items():
        torch.testing.assert_close(param, ckpt[name], rtol=0, atol=0, msg=name)
    assert model.cfg.num_hidden_layers == 3 and model.cfg.num_nextn_predict_layers == 1
    assert model.has_mtp_weights is True


def test_tiny_v2_loads_and_runs(tiny_v2_dir):
    ckpt = read_tensors(tiny_v2_dir / "model.safetensors")
    engine = make_engine(tiny_v2_dir)
    cfg, model = engine.model_config, engine.model
    assert cfg.model_type == "deepseek_v2" and cfg.q_lora_rank is None and cfg.scoring_func == "softmax"
    assert model.has_mtp_weights is False  # V2 has no NextN layer: nothing to warn about
    torch.testing.assert_close(model.layers[0].self_attn.q_proj.weight,
                               ckpt["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=0)
    outs = engine.generate(PROMPTS, GREEDY8)
    assert all(len(o.output_ids) == 8 and all(0 <= t < cfg.vocab_size for t in o.output_ids) for o in outs)


def test_dummy_weights_need_no_files(tiny_v3_dir, tmp_path):
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((tiny_v3_dir / "config.json").read_bytes())

    # Without --load-format dummy the missing weights are an error that points at the flag.
    with pytest.raises(WeightsError, match="no safetensors weights.*--load-format dummy"):
        make_engine(only_config)

    engine = make_engine(only_config, load_format="dummy")
    assert engine.tokenizer is None
    tokens = greedy_tokens(engine)
    assert [len(t) for t in tokens] == [8, 8, 8]
    assert all(0 <= t < engine.model_config.vocab_size for out in tokens for t in out)
    w = engine.model.layers[1].mlp.w13
    assert torch.isfinite(w).all() and w.std() > 0  # random, not left as torch.empty garbage or zeros

    # No directory at all (the config given directly), same seed -> the same random model.
    cfg = ModelConfig.from_hf_dict(tiny_config_dict("deepseek_v3"))
    no_dir = LLMEngine(EngineConfig(None, load_format="dummy", cache=CacheConfig(page_size=4, num_pages=64)),
                       model_config=cfg)
    assert greedy_tokens(no_dir) == tokens


# ---- sharded checkpoints --------------------------------------------------------------------------------------------
def shard(model_dir) -> list[str]:
    """Split model.safetensors into two shards with a model.safetensors.index.json, as Hugging Face does."""
    tensors = read_tensors(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for fname, part in zip(files, (names[: len(names) // 2], names[len(names) // 2:])):
        save_file({k: tensors[k] for k in part}, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return files


def test_sharded_checkpoint_gives_the_same_tokens(tiny_v3_dir, copy_model):
    sharded = copy_model(tiny_v3_dir, "sharded")
    shard(sharded)
    assert not (sharded / "model.safetensors").exists()
    messages: list[str] = []
    got = greedy_tokens(LLMEngine(EngineConfig(str(sharded), cache=CacheConfig(page_size=4, num_pages=64)),
                                  progress=messages.append))
    assert any("shard 2/2" in m for m in messages), messages
    assert got == greedy_tokens(make_engine(tiny_v3_dir))


def test_loading_a_model_does_not_import_torch_dynamo(tiny_v3_dir, tiny_v2_dir, tiny_v3_fp8_dir):
    """The model is laid out on the meta device with no random init and no computed buffers there: a meta op that
    torch implements in Python imports torch._dynamo on its first call, about 2 s of every worker's start-up on a
    CPU. A fresh process, since this one may have imported it for other reasons."""
    code = ("import sys\n"
            "from pdserve.engine import EngineConfig, LLMEngine\n"
            f"for d in {[str(tiny_v3_dir), str(tiny_v2_dir), str(tiny_v3_fp8_dir)]!r}:\n"
            "    LLMEngine(EngineConfig(d, device='cpu'))\n"
            "assert 'torch._dynamo' not in sys.modules, 'loading a model imported torch._dynamo'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_missing_shard_is_named(tiny_v3_dir, copy_model):
    sharded = copy_model(tiny_v3_dir, "sharded")
    _, second = shard(sharded)
    (sharded / second).unlink()
    msg = load_error(sharded)
    assert second in msg and "missing" in msg


# ---- broken checkpoints ---------------------------------------------------------------------------------------------
def test_missing_tensor_is_an_error(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    edit_tensors(broken, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    msg = load_error(broken)
    assert "lacks" in msg and "layers.1.self_attn.kv_b_proj.weight" in msg


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.kv_b_proj.weight",
                                  "model.layers.1.mlp.experts.3.up_proj.weight",
                                  "model.layers.3.enorm.weight",
                                  "model.layers.3.mlp.experts.0.gate_proj.weight"])
def test_missing_tensor_error_names_the_checkpoint_tensor(tiny_v3_dir, copy_model, name):
    broken = copy_model(tiny_v3_dir)
    edit_tensors(broken, lambda t: t.pop(name))
    assert name in load_error(broken)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    name = "model.layers.2.self_attn.kv_b_proj.weight"  # (heads * (qk_nope + v), kv_lora) = (256, 64)
    edit_tensors(broken, lambda t: t.__setitem__(name, torch.zeros(256, 48)))
    msg = load_error(broken)
    assert name in msg and "(256, 48)" in msg and "(256, 64)" in msg


def test_shape_mismatch_of_one_expert_is_named(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    name = "model.layers.1.mlp.experts.4.gate_proj.weight"  # (moe_intermediate, hidden) = (128, 128)
    edit_tensors(broken, lambda t: t.__setitem__(name, torch.zeros(96, 128)))
    msg = load_error(broken)
    assert name in msg and "(96, 128)" in msg and "(128, 128)" in msg


def test_unexpected_tensor_is_named(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    edit_tensors(broken, lambda t: t.__setitem__("model.layers.0.foo.weight", torch.zeros(4)))
    msg = load_error(broken)
    assert "model.layers.0.foo.weight" in msg and "match no module" in msg


def test_stray_expert_scale_in_unquantized_checkpoint_is_named(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    edit_tensors(broken, lambda t: t.__setitem__(name, torch.ones(1, 1)))
    assert name in load_error(broken)


def test_duplicate_expert_tensor_does_not_hide_a_missing_one(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    tensors = read_tensors(broken / "model.safetensors")
    (broken / "model.safetensors").unlink()
    tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    dup = {"model.layers.1.mlp.experts.0.up_proj.weight": tensors["model.layers.1.mlp.experts.0.up_proj.weight"]}
    save_file(tensors, str(broken / "model-00001-of-00002.safetensors"))
    save_file({k: v.clone() for k, v in dup.items()}, str(broken / "model-00002-of-00002.safetensors"))
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in tensors},
        "model.layers.1.mlp.experts.0.up_proj.weight": "model-00002-of-00002.safetensors"}}))
    msg = load_error(broken)
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in msg and "twice" in msg


def test_partly_present_mtp_layer_is_an_error(tiny_v3_dir, copy_model):
    broken = copy_model(tiny_v3_dir)
    edit_tensors(broken, lambda t: t.pop("model.layers.3.enorm.weight"))
    msg = load_error(broken)
    assert "partly present" in msg and "enorm.weight" in msg


def test_absent_mtp_layer_loads_with_a_warning(tiny_v3_dir, copy_model, caplog):
    no_mtp = copy_model(tiny_v3_dir)

    def drop_mtp(t):
        for k in [k for k in t if k.startswith("model.layers.3.")]:
            del t[k]

    edit_tensors(no_mtp, drop_mtp)
    with caplog.at_level(logging.WARNING, logger="pdserve.weights"):
        model = load(no_mtp)
    assert model.has_mtp_weights is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("NextN/MTP" in w and "num_nextn_predict_layers=1" in w for w in warnings), warnings
    # The main model is untouched: the same greedy tokens as with the MTP layer present.
    assert greedy_tokens(make_engine(no_mtp)) == greedy_tokens(make_engine(tiny_v3_dir))


def test_fp8_tensor_without_quantization_config_is_an_error(tiny_v3_fp8_dir, copy_model):
    broken = copy_model(tiny_v3_fp8_dir)
    edit_config(broken, lambda raw: raw.pop("quantization_config"))
    msg = load_error(broken)
    assert "FP8" in msg and "quantization_config" in msg and "model.layers." in msg


def test_checkpoint_saved_by_transformers_loads_without_mtp(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=512)
    assert config.num_nextn_predict_layers == 1  # transformers' default, though it never saves that layer
    transformers.DeepseekV3ForCausalLM(config).eval().save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pdserve.weights"):
        engine = make_engine(tmp_path)
    assert engine.model.has_mtp_weights is False
    assert any("NextN/MTP" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.output_ids) == 4


# ---- config.json --------------------------------------------------------------------------------------------------
def _write_config(model_dir, raw_text: str):
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(raw_text)
    return model_dir


_DELETE = object()


def _tiny_with(**changes) -> str:
    raw = tiny_config_dict("deepseek_v3")
    for k, v in changes.items():
        if v is _DELETE:
            del raw[k]
        else:
            raw[k] = v
    return json.dumps(raw)


@pytest.mark.parametrize("text, expected", [
    ("{not json", ["config.json", "not valid JSON"]),
    ("[1, 2]", ["config.json", "JSON object"]),
    (_tiny_with(model_type="llama"), ["model_type", "'llama'", "deepseek_v3"]),
    (_tiny_with(kv_lora_rank=_DELETE), ["kv_lora_rank", "lacks required field"]),
    (_tiny_with(hidden_act="gelu"), ["hidden_act", "'gelu'", "silu"]),
    (_tiny_with(quantization_config={"quant_method": "awq", "bits": 4}), ["quantization_config", "awq", "fp8"]),
], ids=["malformed-json", "not-an-object", "model_type-llama", "missing-kv_lora_rank", "hidden_act-gelu",
        "quant-awq"])
def test_config_errors_name_the_problem(tmp_path, text, expected):
    model_dir = _write_config(tmp_path / "model", text)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_model_dir(str(model_dir))
    for part in expected:
        assert part in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        ModelConfig.from_model_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_model_dir(str(tmp_path / "nope"))


def _yarn(mscale: float) -> dict:
    return {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}


def test_deepseek_v3_config_values():
    """The published DeepSeek-V3 config.json values (FACTS §5), in DeepSeek's own style."""
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": _yarn(1.0), "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.qk_head_dim == 192 and cfg.kv_cache_dim == 576 and cfg.num_kv_layers == 62
    assert cfg.softmax_scale == pytest.approx(0.1352, abs=1e-4)
    m = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.rope.cos_sin_scale == pytest.approx(1.0)  # equal mscale and mscale_all_dim cancel
    assert cfg.fp8 is not None and (cfg.fp8.block_n, cfg.fp8.block_k) == (128, 128)
    assert cfg.is_moe_layer(3) and not cfg.is_moe_layer(2)


def test_deepseek_v2_lite_config_values():
    raw = {
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "topk_method": "greedy",
        "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu",
        "rope_theta": 10000, "rope_scaling": _yarn(0.707), "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.q_lora_rank is None and cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
    assert cfg.num_nextn_predict_layers == 0 and cfg.fp8 is None and cfg.kv_cache_dim == 576
    m = 0.1 * 0.707 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert cfg.rope.cos_sin_scale == pytest.approx(1.0)
