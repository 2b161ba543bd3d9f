"""train_full.py with --rollout hf (HF generate, no vLLM) on 2 gloo ranks: the fallback path runs
end to end in the main test venv: train, checkpoint, export, and the distributed evaluation."""

import json
import os
import re
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from support import tiny

DEVICE = os.environ.get("D3S_TEST_DEVICE", "cpu")  # cuda on a GPU node: scripts/gpu_check.sh

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "data"  # the repository's own benchmark files


def tiny_model_data_and_port(tmp_path):
    """A tiny model folder, 8 training rows and a free port for torchrun."""
    tokenizer = tiny.build_char_tokenizer()
    model_dir = tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(tmp_path / "tiny"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(8)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return model_dir, data, s.getsockname()[1]


def test_two_ranks_with_hf_rollouts_train_export_and_evaluate(tmp_path):
    model_dir, data, port = tiny_model_data_and_port(tmp_path)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(ROOT / "train_full.py"),
        "--rollout",
        "hf",
        "--model",
        model_dir,
        "--train-data",
        str(data),
        "--eval-data",
        str(DATA / "gsm8k.jsonl"),
        "--eval-limit",
        "3",
        "--eval-samples",
        "2",
        "--eval-pass-k",
        "1,2",
        "--eval-max-tokens",
        "8",
        "--out",
        str(out),
        "--template",
        "plain",
        "--device",
        DEVICE,
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-response-len",
        "12",
        "--max-prompt-len",
        "64",
        "--micro-batch-size",
        "3",
        "--save-every",
        "2",
        "--kl-ref",
        "--mini-batches",
        "2",
        "--lr",
        "1e-2",
        "--min-token-per-response",
        "--explain-every",
        "1",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    records = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2] and [r["kept_samples"] for r in records] == [4, 6]  # from 1
    for r in records:  # the metrics the paper reads, with --kl-ref
        for key in (
            "sur",
            "k_frac",
            "k_real",
            "entropy_mean",
            "entropy_kept",
            "grad_norm",
            "kl_ref",
            "clip_frac_by_minibatch",
        ):
            assert r[key] is not None, key
    assert (
        records[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and records[1]["kl_ref"] >= 0.0
    )  # KL to the start (nothing learned yet)
    assert all(
        len(r["clip_frac_by_minibatch"]) == 2 for r in records
    )  # --mini-batches 2: two optimizer steps (each with a token)
    assert lines[-1]["kind"] == "eval" and lines[-1]["step"] == 2 and "gsm8k_pass@2" in lines[-1]
    assert (out / "checkpoints" / "step_000002" / "trainer_state.json").exists()
    assert (out / "hf_final" / "model.safetensors").exists()
    for step in (1, 2):  # rank 0's page of the global selection, named by the step (1-based)
        page = (out / "explain" / f"step_{step:06d}.html").read_text()
        assert f"Step {step}" in page and "train_full" in page and "ranks" in page
    final = json.loads((out / "eval_final.json").read_text())["results"]
    assert final["gsm8k"]["problems"] == 3 and len(final["gsm8k"]["correct"]) == 3  # 2 + 1 problems over 2 ranks


def test_a_failing_rank_ends_the_whole_job_within_a_minute(tmp_path):
    model_dir, data, port = tiny_model_data_and_port(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(ROOT / "tests" / "full_fail_worker.py"),
        "--rollout",
        "hf",
        "--model",
        model_dir,
        "--train-data",
        str(data),
        "--eval-data",
        "none",
        "--out",
        str(tmp_path / "run"),
        "--template",
        "plain",
        "--device",
        DEVICE,
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-response-len",
        "8",
    ]
    start = time.time()
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    elapsed = time.time() - start
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr and "rank 1 failed" in proc.stderr
    assert re.search(r"(^|\n)train_full\.py: rank 1 failed; ending the job", proc.stderr)  # its own line (issue 46)
    assert elapsed < 120, elapsed  # start-up included; rank 0 waited in a collective that rank 1 never joined


def test_eval_only_with_the_default_eval_data_reads_the_seven_benchmarks_in_the_repo(tmp_path):
    """No --eval-data: the seven benchmark files of the repository's data/ folder (one problem each here)."""
    model_dir, _, _ = tiny_model_data_and_port(tmp_path)
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        str(ROOT / "train_full.py"),
        "--eval-only",
        "--rollout",
        "hf",
        "--model",
        model_dir,
        "--out",
        str(out),
        "--template",
        "plain",
        "--device",
        "cpu",
        "--eval-limit",
        "1",
        "--eval-samples",
        "1",
        "--eval-pass-k",
        "1",
        "--eval-max-tokens",
        "4",
        "--grader-workers",
        "1",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    settings = json.loads((out / "eval_args.json").read_text())
    assert [pathlib.Path(p).parent for p in settings["eval_data"]] == [DATA] * 7  # inside the repo, whatever the cwd
    results = json.loads((out / "eval.json").read_text())["results"]
    assert set(results) == {"aime24", "aime25", "amc23", "gsm8k", "math500", "minerva_math", "olympiadbench", "average"}
    assert all(results[name]["problems"] == 1 for name in results if name != "average")
