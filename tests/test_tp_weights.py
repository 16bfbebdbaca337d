"""Tensor-parallel weights: each rank holds exactly its shard of every split parameter (heads of q_b/kv_b/q_proj,
columns of o_proj, intermediate rows/columns of every MLP and expert, or with expert parallelism its whole experts,
FP8 block scales with their blocks), the rest replicated; it reads only its slices of the checkpoint; dummy weights
are the shards of a single process's.
Loading needs no collective, so rank r's model loads here with a TPGroup that has no process group."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve import weights
from pdserve.config import ConfigError, ModelConfig, ParallelConfig
from pdserve.kernels import KernelBackends
from pdserve.parallel.group import TPGroup
from pdserve.tiny_model import export_hf_state_dict, tiny_config_dict
from pdserve.weights import build_model, init_dummy_weights, load_model

ROWS = re.compile(r"(q_b_proj|kv_b_proj|q_proj|gate_proj|up_proj)\.weight(_scale_inv)?$")  # column-parallel
COLUMNS = re.compile(r"(o_proj|down_proj)\.weight(_scale_inv)?$")  # row-parallel


def expected_shard(name: str, full: torch.Tensor, rank: int, tp: int, ep: bool = False) -> torch.Tensor:
    """Rank `rank`'s part of the single-process parameter `name`, written out independently of the loader."""
    if ep and re.search(r"mlp\.w(13|2)(_scale_inv)?$", name):  # (E, ...): this rank's experts, whole
        return full.chunk(tp, dim=0)[rank]
    if ROWS.search(name):
        return full.chunk(tp, dim=0)[rank]
    if COLUMNS.search(name):
        return full.chunk(tp, dim=1)[rank]
    if re.search(r"mlp\.w13(_scale_inv)?$", name):  # (E, [gate; up], D): this rank's rows of gate, then of up
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
    if re.search(r"mlp\.w2(_scale_inv)?$", name):  # (E, D, I)
        return full.chunk(tp, dim=2)[rank]
    return full  # replicated


def check_shards(single, ranks, tp, ep=False):
    """Every parameter of every rank is its expected shard of the single-process model's, bit for bit."""
    full = dict(single.named_parameters())
    for rank, model in enumerate(ranks):
        params = dict(model.named_parameters())
        assert params.keys() == full.keys()
        for name, p in params.items():
            want = expected_shard(name, full[name].data, rank, tp, ep)
            assert p.dtype == want.dtype and p.shape == want.shape, f"rank {rank} {name}: {p.shape} vs {want.shape}"
            assert torch.equal(p.data.view(torch.uint8), want.contiguous().view(torch.uint8)), f"rank {rank} {name}"
        # what the model derives from its shards: the absorbed MLA weights of this rank's heads
        attn, attn_full = model.layers[0].self_attn, single.layers[0].self_attn
        heads = attn_full.num_heads // tp
        assert attn.num_heads == heads
        assert torch.equal(attn.w_uk, attn_full.w_uk[rank * heads:(rank + 1) * heads])


class RecordingFile:
    """safe_open, recording what is read: (key, bytes) per read."""

    reads: list[tuple[str, int]] = []

    def __init__(self, path, framework):
        self._f = safe_open(path, framework=framework)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, key):
        t = self._f.get_tensor(key)
        RecordingFile.reads.append((key, t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        return RecordingSlice(self._f.get_slice(key), key)


class RecordingSlice:
    def __init__(self, s, key):
        self._s, self._key = s, key

    def get_shape(self):
        return self._s.get_shape()

    def __getitem__(self, index):
        t = self._s[index]
        RecordingFile.reads.append((self._key, t.numel() * t.element_size()))
        return t


def load_ranks(model_dir, cfg, tp, dtype=torch.float32, load_format="auto", ep=False):
    kernels = KernelBackends.create()
    return [load_model(None if model_dir is None else str(model_dir), cfg, dtype, kernels, load_format,
                       progress=lambda _m: None, tp=TPGroup(r, tp), ep=ep) for r in range(tp)]


@pytest.mark.parametrize("tp, ep", [(2, False), (4, False), (2, True), (4, True)])
def test_each_rank_holds_its_shards(tiny_v3_dir, tp, ep):
    cfg = ModelConfig.from_model_dir(str(tiny_v3_dir))
    single = load_model(str(tiny_v3_dir), cfg, torch.float32, KernelBackends.create(), progress=lambda _m: None)
    check_shards(single, load_ranks(tiny_v3_dir, cfg, tp, ep=ep), tp, ep)


def test_v2_shards_q_proj(tiny_v2_dir):
    """DeepSeek-V2: no q_lora, so q_proj itself is split by heads; two shared experts."""
    cfg = ModelConfig.from_model_dir(str(tiny_v2_dir))
    single = load_model(str(tiny_v2_dir), cfg, torch.float32, KernelBackends.create(), progress=lambda _m: None)
    check_shards(single, load_ranks(tiny_v2_dir, cfg, 2), 2)


@pytest.mark.parametrize("ep", [False, True])
def test_a_rank_reads_only_its_slices(tiny_v3_dir, monkeypatch, ep):
    """Rank 1 of 2 reads half of every split tensor (under EP: all of each of its experts' tensors, nothing of the
    other rank's), all of every replicated one, and nothing more."""
    cfg = ModelConfig.from_model_dir(str(tiny_v3_dir))
    with safe_open(str(tiny_v3_dir / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()}
    monkeypatch.setattr(weights, "safe_open", RecordingFile)
    RecordingFile.reads = []
    load_model(str(tiny_v3_dir), cfg, torch.float32, KernelBackends.create(), progress=lambda _m: None,
               tp=TPGroup(1, 2), ep=ep)
    read: dict[str, int] = {}
    for key, n in RecordingFile.reads:
        read[key] = read.get(key, 0) + n
    experts = {k: int(re.search(r"\.mlp\.experts\.(\d+)\.", k).group(1)) for k in sizes if ".mlp.experts." in k}
    split = {k for k in sizes if ROWS.search(k) or COLUMNS.search(k)} - experts.keys()
    want = {k: sizes[k] // 2 if k in split else sizes[k] for k in sizes if k not in experts}
    if ep:  # experts 4..7 are rank 1's
        want |= {k: sizes[k] for k, x in experts.items() if x >= cfg.n_routed_experts // 2}
    else:
        want |= {k: sizes[k] // 2 for k in experts}
    assert split and experts and read == want
    print(f"rank 1 of 2 read {sum(read.values())} of {sum(sizes.values())} bytes")


@pytest.mark.parametrize("ep", [False, True])
def test_dummy_weights_are_the_shards_of_a_single_process(tiny_v3_dir, ep):
    cfg = ModelConfig.from_model_dir(str(tiny_v3_dir))
    single = load_model(None, cfg, torch.float32, KernelBackends.create(), "dummy")
    check_shards(single, load_ranks(None, cfg, 2, load_format="dummy", ep=ep), 2, ep)


def fp8_checkpoint(out, src_dir, block: int) -> str:
    """A tiny V3 FP8 checkpoint with `block` x `block` weight blocks (small enough to split the tiny model's heads
    and intermediates over 2 ranks in whole blocks); the tokenizer of src_dir."""
    raw = tiny_config_dict("deepseek_v3", fp8=True, vocab_size=ModelConfig.from_model_dir(str(src_dir)).vocab_size)
    raw["quantization_config"]["weight_block_size"] = [block, block]
    cfg = ModelConfig.from_hf_dict(raw)
    model = build_model(cfg, torch.float32, KernelBackends.create())
    init_dummy_weights(model, seed=3, std=0.15)
    out.mkdir()
    save_file(export_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src_dir / name, out / name)
    return str(out)


def test_fp8_block_scales_split_with_their_blocks(tmp_path, tiny_v3_dir):
    model_dir = fp8_checkpoint(tmp_path / "fp8-32", tiny_v3_dir, 32)
    cfg = ModelConfig.from_model_dir(model_dir)
    single = load_model(model_dir, cfg, torch.float32, KernelBackends.create(), progress=lambda _m: None)
    assert single.layers[1].mlp.w13.dtype == torch.float8_e4m3fn
    check_shards(single, load_ranks(model_dir, cfg, 2), 2)
    check_shards(single, load_ranks(model_dir, cfg, 2, ep=True), 2, ep=True)


def test_a_split_that_cuts_fp8_blocks_is_refused(tiny_v3_fp8_dir, tiny_v3_dir):
    """128 x 128 blocks: the tiny model's 2 heads per rank are 96 q_b_proj rows, not whole blocks."""
    with pytest.raises(ConfigError, match=r"--tp 2 leaves 96 q_b_proj rows .* not a multiple of the FP8 weight "
                                          r"block \(128\)"):
        ParallelConfig(tp_size=2).check_model(ModelConfig.from_model_dir(str(tiny_v3_fp8_dir)))
    with pytest.raises(ConfigError, match="--tp 3 does not divide num_attention_heads=4"):
        ParallelConfig(tp_size=3).check_model(ModelConfig.from_model_dir(str(tiny_v3_dir)))
    ParallelConfig(tp_size=4).check_model(ModelConfig.from_model_dir(str(tiny_v3_dir)))  # 4 heads: one each
    with pytest.raises(ConfigError, match=r"--ep 3: expert parallelism splits the routed experts over the --tp "
                                          r"ranks; give --ep 2 \(or 1\)"):
        ParallelConfig(tp_size=2, ep_size=3)
    cfg = ModelConfig.from_model_dir(str(tiny_v3_dir))
    with pytest.raises(ConfigError, match="--ep 16 does not divide n_routed_experts=8"):
        ParallelConfig(tp_size=16, ep_size=16).check_model(dataclasses.replace(cfg, num_attention_heads=16))
