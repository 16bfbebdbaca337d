"""`pdserve make-tiny-model`: a small random DeepSeek-V3 (or V2) checkpoint in Hugging Face format, with its MTP
layer and a byte-level BPE tokenizer, for the demo and the tests. Written exactly as the real checkpoints are laid
out (per-expert tensors, `model.layers.{L}.*` for NextN, optional block-FP8 with `weight_scale_inv`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.kernels.gemm import FP8_DTYPE, block_quant
from pdserve.model import DeepseekV3
from pdserve.weights import build_model, checkpoint_names, init_dummy_weights, tensor_view

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# A small built-in corpus so the tokenizer is the same on every machine.
_CORPUS = """
pdserve splits inference into a prefill tier and a decode tier. The router sends each request to a prefill worker,
which computes the prompt and ships the compressed latent cache to a decode worker. The decode worker streams tokens
back to the client. Multi-head latent attention stores one small latent vector per token per layer, so the cache is
cheap to move. Mixture-of-experts layers route each token to a few experts chosen by a learned gate.
The quick brown fox jumps over the lazy dog. Hello, world! Once upon a time there was a model that predicted the
next token, and then the token after that. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Naïve café, déjà vu, 東京, 🚀.
def generate(prompt, max_new_tokens=16):\n    return model.generate(prompt, max_new_tokens)\n
"""


# A plain chat template in DeepSeek's spirit (tokens in the tiny vocabulary are plain text), so that
# /v1/chat/completions works on the demo model; real checkpoints bring their own in tokenizer_config.json.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}\n\n"
    "{% else %}{{ raise_exception('roles are system, user and assistant; got ' + message['role']) }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def tiny_config_dict(arch: str = "deepseek_v3", fp8: bool = False, vocab_size: int = 512) -> dict[str, Any]:
    if arch not in ("deepseek_v3", "deepseek_v2"):
        raise ValueError(f"--arch {arch!r} is not supported; choose deepseek_v3 or deepseek_v2")
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if arch == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # DeepSeek's own config style (rope_scaling + rope_theta); transformers 5's style is tested separately.
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if arch == "deepseek_v3":
        cfg.update(q_lora_rank=64, n_shared_experts=1, n_group=4, topk_group=2, topk_method="noaux_tc",
                   scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                   num_nextn_predict_layers=1)
    else:
        cfg.update(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", scoring_func="softmax",
                   norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1)
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def export_hf_state_dict(model: DeepseekV3) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names (the loader's own table, read backwards)."""
    return {name: tensor_view(model, target).contiguous().clone()
            for name, target in checkpoint_names(model).items()}


def train_tokenizer(out_dir: str, vocab_size: int) -> int:
    """Byte-level BPE trained on the built-in corpus; returns the real vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pdserve.common.tokenizer import add_bos_processor

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    add_bos_processor(tok, BOS)  # what add_bos_token says, in the file transformers reads (common/tokenizer.py)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
                   "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast",
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
    return tok.get_vocab_size()


def make_tiny_model(out_dir: str, arch: str = "deepseek_v3", fp8: bool = False, seed: int = 0,
                    std: float = 0.15) -> str:
    """Write config.json, model.safetensors and a tokenizer to out_dir (atomically: all or nothing)."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        vocab = train_tokenizer(tmp, 512)
        raw = tiny_config_dict(arch, fp8, vocab)
        cfg = ModelConfig.from_hf_dict(raw)
        model = build_model(cfg, torch.float32, KernelBackends.create())
        init_dummy_weights(model, seed, std)
        if cfg.scoring_func == "sigmoid":  # a non-zero correction bias, so the tests exercise it
            gen = torch.Generator().manual_seed(seed + 1)
            for layer in model.modules():
                if hasattr(layer, "e_score_correction_bias") and layer.e_score_correction_bias is not None:
                    layer.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts, generator=gen) * 0.1)
        tensors = export_hf_state_dict(model)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        if os.path.exists(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def dequantized_twin(src_dir: str, out_dir: str) -> str:
    """Copy an FP8 checkpoint with every block-FP8 weight dequantized to fp32 and no quantization_config."""
    from safetensors import safe_open

    from pdserve.kernels.gemm import block_dequant
    from pdserve.weights import checkpoint_files

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(src_dir, "config.json")) as f:
        raw = json.load(f)
    block = tuple(raw.pop("quantization_config")["weight_block_size"])
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(src_dir):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for k, v in tensors.items():
        if k.endswith("weight_scale_inv"):
            continue
        if v.dtype == FP8_DTYPE:
            v = block_dequant(v, tensors[k[: -len("weight")] + "weight_scale_inv"], block)
        out[k] = v.contiguous()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src_dir, name)):
            shutil.copy(os.path.join(src_dir, name), out_dir)
    return out_dir


__all__ = ["make_tiny_model", "tiny_config_dict", "export_hf_state_dict", "dequantized_twin", "block_quant"]
