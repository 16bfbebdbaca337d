"""Model configuration: Hugging Face `config.json` of DeepSeek-V2/V3 read into frozen dataclasses.

Both config styles load: DeepSeek's own (`rope_scaling` + `rope_theta`, no `rope_interleave`) and transformers 5's
(`rope_parameters`, `rope_interleave`). Values we cannot compute exactly are rejected with a message naming the
setting, rather than silently producing a different model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A model config that pdserve cannot run; the message names the setting and what is accepted."""


SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction m = 0.1 * mscale * ln(scale) + 1 (1 when not scaled)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # True: rotary pairs are (x0, x1), (x2, x3), ... as in DeepSeek's checkpoints; False: (x_i, x_{i+d/2}).
    interleave: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """Scale applied to cos/sin (YaRN attention factor); 1.0 for DeepSeek's equal mscale settings."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)

    @property
    def softmax_mscale_squared(self) -> float:
        """Factor m^2 on the softmax scale (FACTS §5): m = yarn_mscale(factor, mscale_all_dim)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class Fp8Config:
    """Block-wise FP8 quantization as in DeepSeek-V3's checkpoints (weight_scale_inv per 128x128 block)."""

    block_n: int = 128
    block_k: int = 128
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    scoring_func: str  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"
    fp8: Optional[Fp8Config] = None
    name: str = "deepseek"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim  # 192 for V3

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent c_kv plus the shared rope key (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim) times the YaRN m^2 correction; the same for absorbed and non-absorbed MLA."""
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale_squared

    @property
    def num_kv_layers(self) -> int:
        """Layers that own a latent KV cache: the main layers plus the NextN/MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    # ---- loading --------------------------------------------------------------------------------------------
    @classmethod
    def from_model_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"model directory {path!r} does not exist")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path} is missing: a model directory needs a Hugging Face config.json")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_path} must hold a JSON object")
        return cls.from_hf_dict(raw, name=os.path.basename(os.path.normpath(path)))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "deepseek") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; pdserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        is_v3 = model_type == "deepseek_v3"

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"config.json lacks required field {key!r} for model_type {model_type}")
            return raw[key]

        def reject_unless(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"config.json field {key}={raw.get(key)!r} is not supported (allowed: {allowed})")

        reject_unless("hidden_act", raw.get("hidden_act", "silu") == "silu", "'silu'")
        reject_unless("attention_bias", not raw.get("attention_bias", False), "false")
        reject_unless("mlp_bias", not raw.get("mlp_bias", False), "false")
        reject_unless("moe_layer_freq", raw.get("moe_layer_freq", 1) == 1, "1")
        reject_unless("pretraining_tp", raw.get("pretraining_tp", 1) in (1, None), "1")

        n_routed = int(raw.get("n_routed_experts") or 0)
        if is_v3:
            scoring = raw.get("scoring_func", "sigmoid")
            topk_method = raw.get("topk_method", "noaux_tc")
            reject_unless("scoring_func", scoring == "sigmoid", "'sigmoid' for deepseek_v3")
            reject_unless("topk_method", topk_method == "noaux_tc", "'noaux_tc' for deepseek_v3")
        else:
            scoring = raw.get("scoring_func", "softmax")
            topk_method = raw.get("topk_method", "greedy")
            reject_unless("scoring_func", scoring == "softmax", "'softmax' for deepseek_v2")
            reject_unless("topk_method", topk_method in ("greedy", "group_limited_greedy"),
                          "'greedy' or 'group_limited_greedy' for deepseek_v2")
        n_group = int(raw.get("n_group") or 1)
        topk_group = int(raw.get("topk_group") or n_group)
        top_k = int(raw.get("num_experts_per_tok") or 0)
        uses_groups = is_v3 or topk_method == "group_limited_greedy"
        if n_routed:
            if top_k < 1 or top_k > n_routed:
                raise ConfigError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={n_routed}]")
            if uses_groups:
                if n_routed % n_group:
                    raise ConfigError(f"n_routed_experts={n_routed} must be divisible by n_group={n_group}")
                if not 1 <= topk_group <= n_group:
                    raise ConfigError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
                if is_v3 and n_routed // n_group < 2:
                    raise ConfigError("deepseek_v3 group routing sums the top-2 scores of each group: "
                                      f"n_routed_experts/n_group must be >= 2 (got {n_routed}/{n_group})")
                if top_k > topk_group * (n_routed // n_group):
                    raise ConfigError(f"num_experts_per_tok={top_k} exceeds the experts in topk_group={topk_group} "
                                      "groups")

        rope = _read_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        fp8 = _read_quantization(raw.get("quantization_config"))
        nextn = int(raw.get("num_nextn_predict_layers") or 0)
        if nextn > 1:
            raise ConfigError(f"num_nextn_predict_layers={nextn}: pdserve runs at most 1 NextN/MTP layer")

        heads = int(need("num_attention_heads"))
        cfg = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=top_k,
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if is_v3 else 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(need("max_position_embeddings")),
            rope=rope,
            num_nextn_predict_layers=nextn,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            fp8=fp8,
            name=name,
            extra=dict(raw),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config.json field {key}={getattr(self, key)} must be positive")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.n_routed_experts and self.moe_intermediate_size <= 0:
            raise ConfigError("moe_intermediate_size must be positive when n_routed_experts > 0")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                              f"num_hidden_layers={self.num_hidden_layers}")
        if self.fp8 is not None and self.n_routed_experts and self.moe_intermediate_size % self.fp8.block_n:
            # Gate and up projections are stacked into one [2I, H] expert weight whose scale grid must not
            # straddle the boundary between them.
            raise ConfigError(f"FP8 checkpoints need moe_intermediate_size ({self.moe_intermediate_size}) to be a "
                              f"multiple of the weight block ({self.fp8.block_n})")


@dataclass(frozen=True)
class ParallelConfig:
    """How one worker spans devices: tensor parallelism over `tp_size` ranks, one process per device.

    Rank 0 owns the scheduler, the loop and sampling; ranks 1.. run the model forwards rank 0 hands them (see
    pdserve.parallel). Under TP, attention heads, MLP and expert intermediates are split across the ranks; the latent
    KV cache (one head) is the same on every rank. With ep_size = tp_size (expert parallelism) the routed experts are
    split over the ranks instead, each expert whole on one rank."""

    tp_size: int = 1
    rank: int = 0
    ep_size: int = 1  # 1, or tp_size: the MoE's routed experts split over the tensor-parallel ranks
    # DP attention: attention data-parallel over requests (each rank its own requests and latent KV pool), the
    # MLP/MoE still split over the tp_size ranks (pdserve.parallel.dp_attention).
    dp_attention: bool = False
    # A collective that waits longer than this fails the worker (a rank hung, not dead: a dead one fails it at once).
    collective_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"--tp {self.tp_size}: the tensor-parallel size must be at least 1")
        if not 0 <= self.rank < self.tp_size:
            raise ConfigError(f"ParallelConfig.rank={self.rank} must be in [0, tp_size={self.tp_size})")
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"--ep {self.ep_size}: expert parallelism splits the routed experts over the --tp ranks; "
                              f"give --ep {self.tp_size} (or 1)")
        if self.dp_attention and self.tp_size == 1:
            raise ConfigError("--dp-attention spreads requests over the --tp ranks; give --tp 2 or more")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"--collective-timeout {self.collective_timeout_s:g}: must be a positive number of "
                              "seconds")

    @property
    def dp_size(self) -> int:
        """Ranks that attend over requests of their own: tp_size under DP attention, else 1."""
        return self.tp_size if self.dp_attention else 1

    def check_model(self, cfg: ModelConfig) -> None:
        """ConfigError naming the setting when the model cannot be split over tp_size ranks: every split dimension
        must divide evenly, and under block-FP8 each rank's part must hold whole weight blocks (the scales are split
        with their blocks)."""
        tp = self.tp_size
        if tp == 1:
            return
        splits = {"num_attention_heads": cfg.num_attention_heads}
        if cfg.first_k_dense_replace > 0 or not cfg.n_routed_experts:
            splits["intermediate_size"] = cfg.intermediate_size
        if cfg.n_routed_experts and self.ep_size > 1:
            splits["n_routed_experts"] = cfg.n_routed_experts  # whole experts; the shared ones split as under TP
            if cfg.n_shared_experts:
                splits["moe_intermediate_size x n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        elif cfg.n_routed_experts:
            splits["moe_intermediate_size"] = cfg.moe_intermediate_size
        for key, value in splits.items():
            if value % tp:
                flag = "--ep" if key == "n_routed_experts" else "--tp"
                raise ConfigError(f"{flag} {tp} does not divide {key}={value} of {cfg.name}: choose a {flag} that does")
        if cfg.fp8 is None:
            return
        heads = cfg.num_attention_heads // tp
        # (what is split, its size per rank, the block edge it must be a multiple of)
        per_rank = [("q_b_proj rows (heads x (qk_nope_head_dim + qk_rope_head_dim))", heads * cfg.qk_head_dim,
                     cfg.fp8.block_n),
                    ("kv_b_proj rows (heads x (qk_nope_head_dim + v_head_dim))",
                     heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.fp8.block_n),
                    ("o_proj columns (heads x v_head_dim)", heads * cfg.v_head_dim, cfg.fp8.block_k)]
        for key in ("intermediate_size", "moe_intermediate_size", "moe_intermediate_size x n_shared_experts"):
            if key in splits:
                size = splits[key] // tp
                per_rank += [(key, size, cfg.fp8.block_n), (key, size, cfg.fp8.block_k)]
        for what, size, block in per_rank:
            if size % block:
                raise ConfigError(f"--tp {tp} leaves {size} {what} per rank, not a multiple of the FP8 weight block "
                                  f"({block}): each rank must hold whole blocks; choose a smaller --tp")


def _read_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); DeepSeek's own configs write `rope_scaling` + `rope_theta`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope type {rope_type!r} is not supported (allowed: 'default', 'yarn')")
    interleave = bool(raw.get("rope_interleave", True))
    if raw.get("model_type") == "deepseek_v2" and not interleave:
        raise ConfigError("rope_interleave=false is not supported for deepseek_v2 (its rotary is always interleaved)")
    if rope_type == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if params.get("factor") is None:
        raise ConfigError("yarn rope scaling needs 'factor'")
    if params.get("attention_factor") is not None:
        raise ConfigError("yarn 'attention_factor' is not supported: DeepSeek derives it from mscale/mscale_all_dim")
    if params.get("truncate", True) is not True:
        raise ConfigError("yarn 'truncate'=false is not supported")
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
        ),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        interleave=interleave,
    )


def _read_quantization(q: Any) -> Optional[Fp8Config]:
    if not q:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config {q!r} is not supported (allowed: quant_method 'fp8')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt={q.get('fmt')!r} is not supported (allowed: 'e4m3')")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError("quantization_config.activation_scheme must be 'dynamic'")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2):
        raise ConfigError("quantization_config.weight_block_size must be [n, k] (DeepSeek-V3 uses [128, 128]); "
                          "per-tensor FP8 is not supported")
    return Fp8Config(block_n=int(block[0]), block_k=int(block[1]))
