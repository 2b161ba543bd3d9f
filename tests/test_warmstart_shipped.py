"""The warm start shipped in weights/ is the one `python scripts/build_warmstart.py` builds, and the default run
starts from it.

A 600-step supervised run ends on different floats on different CPUs (every step rounds, and Adam amplifies the
last bits), so "the shipped weights equal what the command makes" can only be checked bit for bit on a machine of
the kind that built them: D3S_EXACT_GOLDEN=1 rebuilds them there (the CPU named in build.json, ~5 min on 1 thread).
On any machine the tests check what does not depend on the CPU's floating-point paths:
  - the shipped folder is the one train_small.py's defaults ask for (its name is the hash of every input of the
    warm start: model shape, seed, steps, learning rate, batch, template, training data), and the default run
    loads it instead of training;
  - model.safetensors is the file build.json records (sha256);
  - the build recipe is the one that made it: the first supervised steps from the same fresh model give the losses
    build.json recorded, within 1e-3 (before Adam has amplified a rounding difference).
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_small  # noqa: E402
from support import warmstart, mathtask  # noqa: E402


def default_args(cache_dir):
    args = train_small.parse_args(["--cache-dir", str(cache_dir)])
    return args, mathtask.load_data(args)[0]


def shipped_folder(tmp_path):
    args, rows = default_args(tmp_path)
    return pathlib.Path(warmstart.SHIPPED_DIR) / os.path.basename(warmstart.warm_start_path(args, rows))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_default_run_loads_the_shipped_warm_start(tmp_path):
    folder = shipped_folder(tmp_path)
    assert (folder / "warmstart.json").exists(), f"{folder}: missing; build it with `python scripts/build_warmstart.py`"
    args, rows = default_args(tmp_path / "cache")
    model, _, info = warmstart.load_warm_start(args, rows)
    assert info["cached"] and info["path"] == f"weights/{folder.name}"
    assert not (tmp_path / "cache").exists()  # nothing trained, nothing written
    assert info["n_params"] == sum(p.numel() for p in model.parameters())
    other = train_small.parse_args(["--cache-dir", str(tmp_path), "--sft-steps", "599"])  # any other input: not shipped
    assert os.path.basename(warmstart.warm_start_path(other, rows)) != folder.name


def test_the_shipped_weights_are_the_recorded_build(tmp_path):
    folder = shipped_folder(tmp_path)
    build = json.loads((folder / "build.json").read_text())
    assert sha256(folder / "model.safetensors") == build["model_sha256"]
    info = json.loads((folder / "warmstart.json").read_text())
    assert len(build["sft_losses"]) == info["sft_steps"] and build["sft_losses"][0] == info["sft_loss_first"]


@pytest.mark.figures  # build.json's losses, within 1e-3
def test_the_build_recipe_gives_the_recorded_first_steps(tmp_path):
    """5 supervised steps of the default recipe (same fresh model, data order and schedule) against build.json."""
    build = json.loads((shipped_folder(tmp_path) / "build.json").read_text())
    torch.set_num_threads(1)
    args, rows = default_args(tmp_path)
    model, tokenizer = warmstart.load_base_model(args)
    losses = warmstart.supervised_warm_start(model, tokenizer, rows, args, max_steps=5)
    assert losses == pytest.approx(build["sft_losses"][:5], rel=1e-3, abs=1e-5)
    perturbed = train_small.parse_args(["--cache-dir", str(tmp_path), "--sft-lr", "2e-3"])  # the check can fail
    model, tokenizer = warmstart.load_base_model(perturbed)
    losses = warmstart.supervised_warm_start(model, tokenizer, rows, perturbed, max_steps=5)
    assert losses != pytest.approx(build["sft_losses"][:5], rel=1e-3, abs=1e-5)


@pytest.mark.skipif(
    os.environ.get("D3S_EXACT_GOLDEN") != "1",
    reason="bit for bit only on the building machine's CPU (D3S_EXACT_GOLDEN=1)",
)
@pytest.mark.figures
def test_the_build_command_makes_the_shipped_weights(tmp_path):
    folder = shipped_folder(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "scripts/build_warmstart.py", str(tmp_path)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    assert sha256(tmp_path / folder.name / "model.safetensors") == sha256(folder / "model.safetensors")
