"""scripts/train_tiny.py in its smoke mode (CPU, 12 steps): it writes a checkpoint pdserve loads, with an MTP layer
that NextN speculation runs on, logits that match the trained model, and its metrics next to it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.spec_decode import SpeculativeConfig

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp("trained") / "model"
    assert script.main(["--out", str(out), "--device", "cpu", "--steps", "12", "--batch-size", "4",
                        "--seq-len", "64", "--max-chars", "300000", "--eval-batches", "2", "--check-prompts", "2"]) == 0
    return out


def test_checkpoint_files_and_metrics(trained):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "train_metrics.json"} <= names
    assert (trained / "model.safetensors").stat().st_size <= 20 << 20
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    m = json.loads((trained / "train_metrics.json").read_text())
    curve = m["loss_curve"]
    assert len(curve) >= 5 and curve[-1]["loss_main"] < curve[0]["loss_main"]  # it learns, even in 12 steps
    assert {"loss_main", "loss_mtp", "top1_main", "top1_mtp"} <= set(m["held_out"])
    assert m["pdserve"]["pdserve_logits_max_abs_diff"] < 1e-4  # the export is the model that was trained
    assert m["pdserve"]["spec_greedy_identical"] is True


def test_pdserve_speculates_on_the_trained_model(trained):
    prompts = ["def main(argv=None):\n    ", "import os\nimport sys\n\n\nclass ", "    return self._"]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cache = CacheConfig(page_size=4, num_pages=256)
    plain = LLMEngine(EngineConfig(str(trained), cache=cache))
    spec = LLMEngine(EngineConfig(str(trained), cache=cache, speculative=SpeculativeConfig("NEXTN", 3)))
    assert spec.model.has_mtp_weights
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert [o.new_text for o in got] == [o.new_text for o in want]
    assert spec.speculator.num_rows > 0
    assert spec.kv_pages_in_use_by_requests() == 0
