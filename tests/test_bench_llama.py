"""bench/memory.py's llama3-8b preset (issue 55): Llama-3.1-8B's shapes, simulated as the Qwen 7B is.

The full 8B simulation takes minutes on a CPU (its figures: docs/train_full.md); here the preset's parameter count
is checked against Llama-3.1-8B's (built on the meta device: no memory), and a Llama-shaped model scaled down to
a few layers goes through the script's whole fake step, FSDP2 per LlamaDecoderLayer included."""

import json
import subprocess
import sys

import torch

from tests.test_bench_memory import ROOT, SCRIPT, _load_bench  # bench/memory.py, loaded as its own tests load it


def test_the_llama3_8b_preset_has_llama_3_1_8bs_parameters():
    from transformers import AutoModelForCausalLM

    config = _load_bench().load_config("llama3-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "LlamaForCausalLM"
    # 2 x 128256 x 4096 (embedding, untied head) + 32 x (attention 4096 x (4096 + 1024 + 1024 + 4096), MLP 3 x 4096
    # x 14336, two norms of 4096) + the final norm: 8,030,261,248, Llama-3.1-8B's count
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_a_scaled_down_llama_goes_through_the_fake_step(tmp_path):
    fields = dict(_load_bench().PRESETS["llama3-8b"])
    fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    fields.update(num_key_value_heads=2, vocab_size=259, max_position_embeddings=1024)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    cmd = [sys.executable, SCRIPT, "--preset", str(tmp_path), "--ranks", "2", "--micro-batch-size", "2"]
    cmd += ["--response-len", "48", "--prompt-len", "16", "--method", "d3s-i"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peak_gib"] > 0 and result["ranks"] == 2 and result["method"] == "d3s-i"
