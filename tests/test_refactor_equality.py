"""A refactor keeps the numbers: the three rungs, driven through their command lines, give the metrics
recorded in tests/golden/refactor.json.

Recorded (2026-11-25, before the reader's-path restructuring, issue 29) on fixed seeds:
  - toy/bandit.py: every train and eval line of grpo and d3s, 8 steps, seed 0; and of the other rows,
    token rules and schedules (TOY_VARIANTS);
  - train_small.py: metrics.jsonl of grpo, d3s and d3s-i, 3 steps with --mini-batches 2, from one cached
    warm start on a two-answer task (every group has mixed rewards, so every step really trains);
  - train_full.py: one step of d3s on 2 gloo ranks (torchrun, --rollout hf, --kl-ref, --mini-batches 2),
    from that warm start.

Two forms of the comparison:
  - bit for bit, with D3S_EXACT_GOLDEN=1, on the machine that recorded the file (per-seed numbers move
    between CPUs: RL amplifies a last-bit difference). Every value of every line, and a checksum of the
    weights train_small exports, must be equal.
  - on any machine (the default, in CI): eval line 0 and train line 1 of every run, where nothing has yet
    amplified a rounding difference: counts equal, floats within 1e-3 (relative) or 1e-5.
D3S_RECORD_GOLDEN=1 writes the file anew (only when the numbers are meant to change, with the reason in the
commit).
"""

import glob
import json
import math
import os
import pathlib
import platform
import socket
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "refactor.json"
RECORD, EXACT = os.environ.get("D3S_RECORD_GOLDEN") == "1", os.environ.get("D3S_EXACT_GOLDEN") == "1"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--hidden-size", "32", "--num-layers", "1", "--sft-steps", "40", "--sft-lr", "3e-2", "--sft-batch", "32",
         "--eval-size", "6", "--eval-samples", "2", "--pass-k", "2", "--prompts-per-step", "4", "--group-size", "4",
         "--n-init", "2", "--n-final", "4", "--max-new-tokens", "12", "--eval-every", "3", "--save-every", "3",
         "--threads", "1", "--lr", "3e-3", "--steps", "3", "--mini-batches", "2", "--explain-every", "0"]
SMALL_METHODS = ("grpo", "d3s", "d3s-i")
TOY_METHODS = ("grpo", "d3s")
TOY_VARIANTS = {  # the other rows and rules, on the toy (a second each): what moves to variants.py must keep them
    "rows": ["--methods", "d1s", "d1s-cross", "d2s", "d3s-i", "pods", "random", "dapo-filter", "dapo-filter-k"],
    "entropy-cosine": ["--methods", "d3s", "--token-rule", "entropy", "--schedule", "cosine"],
    "adv-adaptive": ["--methods", "d3s", "--token-rule", "adv", "--schedule", "adaptive", "--steps", "30"],
    "random-step-sequence": ["--methods", "d3s", "--token-rule", "random", "--schedule", "step", "--token-scope", "sequence"],
}


def wall_clock(key):
    """Keys whose value is a time, a rate or a memory reading: they differ from run to run."""
    return (key.endswith(("_s", "_per_s", "_gb")) or key in ("mfu",))


def clean(line):
    """A metrics line without its clock readings and without paths of the machine that ran it."""
    out = {k: v for k, v in line.items() if not wall_clock(k)}
    if "warm_start" in out:
        out["warm_start"] = {k: v for k, v in out["warm_start"].items() if k not in ("path", "sft_s")}
    return out


def read_jsonl(path):
    with open(path) as f:
        return [clean(json.loads(line)) for line in f if line.strip()]


def weights_checksum(folder):
    """Per tensor of an exported model: its sum and the sum of its squares, in float64 (order of the file)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    return {name: [float(t.double().sum()), float(t.double().square().sum())] for name, t in sorted(tensors.items())}


def two_answer_data(folder):
    """Problems whose answer is 1 or 2 at random: the warm-started tiny model guesses, so groups have mixed rewards."""
    gen = torch.Generator().manual_seed(0)
    paths = []
    for name, n in (("train.jsonl", 64), ("eval.jsonl", 6)):
        with open(folder / name, "w") as f:
            for i in range(n):
                answer = str(1 + int(torch.randint(2, (1,), generator=gen)))
                f.write(json.dumps({"problem": f"Pick {name[0]}{i}.", "answer": answer}) + "\n")
        paths.append(str(folder / name))
    return paths


def run(cmd, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    """Run the three rungs once; returns {"toy": lines, "small": {method: lines}, "small_weights": {...}, "full": lines}."""
    base = tmp_path_factory.mktemp("refactor")
    train, held_out = two_answer_data(base)
    result = {"small": {}, "small_weights": {}}
    run([sys.executable, "toy/bandit.py", "--methods", *TOY_METHODS, "--seeds", "1", "--steps", "8", "--workers", "1",
         "--out", str(base / "toy")])
    result["toy"] = read_jsonl(base / "toy" / "metrics.jsonl")
    result["toy_variants"] = {}
    for name, flags in TOY_VARIANTS.items():
        run([sys.executable, "toy/bandit.py", "--seeds", "1", "--steps", "8", "--workers", "1", *flags,
             "--out", str(base / name)])
        result["toy_variants"][name] = read_jsonl(base / name / "metrics.jsonl")
    cache = base / "cache"
    for method in SMALL_METHODS:
        out = base / "small" / method
        run([sys.executable, "train_small.py", "--method", method, "--train-file", train, "--eval-file", held_out,
             "--cache-dir", str(cache), "--out", str(out), *SMALL])
        result["small"][method] = read_jsonl(out / "metrics.jsonl")
        result["small_weights"][method] = weights_checksum(out / "final")
    (warm,) = glob.glob(str(cache / "warmstart-*"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = base / "full"
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "train_full.py",
         "--rollout", "hf", "--device", "cpu", "--model", warm, "--train-data", train, "--eval-data", "none",
         "--template", "plain", "--out", str(out), "--steps", "1", "--prompts-per-step", "4", "--group-size", "4",
         "--n-init", "2", "--n-final", "4", "--mini-batches", "2", "--micro-batch-size", "3", "--max-response-len", "12",
         "--max-prompt-len", "64", "--lr", "1e-2", "--kl-ref", "--grader-workers", "1"])
    result["full"] = read_jsonl(out / "metrics.jsonl")
    return result


def test_the_recorded_runs_are_meaningful():
    """What the file holds: every small run trains on every step (mixed groups), d3s selects tokens, the full step
    trains on 2 ranks, and the toy's two rows differ."""
    golden = json.loads(GOLDEN.read_text())
    for method, lines in golden["small"].items():
        train = [m for m in lines if m["kind"] == "train"]
        assert len(train) == 3 and all(m["groups_mixed"] > 0 and m["updates"] >= 1 for m in train), method
        assert all(len(m["clip_frac_by_minibatch"]) >= 1 for m in train)
    assert all(m["k_frac"] < 1 for m in golden["small"]["d3s"] if m["kind"] == "train")
    (full,) = [m for m in golden["full"] if m["kind"] == "train"]
    assert full["updates"] >= 1 and full["kl_ref"] is not None and full["k_frac"] < 1
    toy = {m: [x for x in golden["toy"] if x["kind"] == "train" and x["method"] == m] for m in TOY_METHODS}
    assert [len(v) for v in toy.values()] == [8, 8] and toy["grpo"][0]["kept_tokens"] > toy["d3s"][0]["kept_tokens"]


def close(a, b, where):
    """Equal structure; equal counts, strings and booleans; floats within 1e-3 relative or 1e-5 absolute."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and (math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5)), f"{where}: {a} vs {b}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def first_lines(lines):
    """Eval line 0 and train line 1 of each run in `lines`."""
    return [m for m in lines if (m["kind"] == "eval" and m["step"] == 0) or (m["kind"] == "train" and m["step"] == 1)]


def test_the_rungs_give_the_recorded_numbers(now):
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        machine = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
                   "recorded": "2026-11-25"}
        GOLDEN.write_text(json.dumps({"machine": machine, **now}, indent=0) + "\n")
    golden = json.loads(GOLDEN.read_text())
    if EXACT:
        for part in ("toy", "toy_variants", "small", "small_weights", "full"):
            assert now[part] == golden[part], part
        return
    close(first_lines(now["toy"]), first_lines(golden["toy"]), "toy")
    for name in TOY_VARIANTS:
        close(first_lines(now["toy_variants"][name]), first_lines(golden["toy_variants"][name]), f"toy.{name}")
    for method in SMALL_METHODS:
        close(first_lines(now["small"][method]), first_lines(golden["small"][method]), f"small.{method}")
    close(first_lines(now["full"]), first_lines(golden["full"]), "full")

