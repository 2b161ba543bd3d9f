"""Smoke tests of the timing scripts bench/loss_head.py and bench/tiled_mlp.py, at tiny sizes:
they run and print their tables (no timing assertions: times live in docs/benchmarks.md); and of
bench/questions_toy.py on a few steps."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_loss_head_bench_times_both_heads_for_both_k():
    out = run("loss_head.py", "--rollouts", "4", "--prompt-len", "4", "--response-len", "4", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("| train_small") or line.startswith("| hidden")]
    assert len(rows) == 8  # 2 models x 2 K x 2 heads
    assert {row.split("|")[3].strip() for row in rows} == {"full logits", "blockwise"}


def test_tiled_mlp_bench_times_whole_and_tiled():
    out = run("tiled_mlp.py", "--hidden", "112", "--layers", "1", "--seq-len", "32", "--chunk-tokens", "32",
              "--repeats", "1")
    assert "| whole (--mlp-chunk-tokens 0) |" in out
    assert "| tiled, 4 slices (--mlp-chunk-tokens 32) |" in out
    assert "adds 20% to pass 2's FLOPs" in out


def test_questions_toy_writes_a_table_paired_with_each_rows_reference(tmp_path):
    out = run("questions_toy.py", "--question", "7", "--seeds", "2", "--steps", "2", "--out", str(tmp_path))
    rows = {line.split("|")[1].strip(" `"): line.split("|")[-2].strip(" `") for line in out.splitlines()
            if line.startswith("| `")}
    assert rows == {"grpo": "d3s", "d1s-cross": "grpo", "dapo-filter": "d1s-cross", "d3s": "grpo", "dapo-filter-k": "d3s"}
    assert (tmp_path / "q7.md").read_text().split("\n\n")[0] in out and (tmp_path / "q7.png").exists()
    numbers = json.loads((tmp_path / "q7.json").read_text())["numbers"]
    assert len(numbers["dapo-filter"]["final"]) == 2


def _fake_runs(root, method, seeds):
    """METHOD/seedS/metrics.jsonl as train_small.py --compare writes them: 20 train steps, evals at 0, 10 and 20.
    The train reward is 0.6 + 0.01 * seed, held-out Pass@1 0.5 + 0.01 * seed (a gap of 0.1); seed 1's grad_norm
    jumps tenfold at step 15."""
    for seed in seeds:
        d = root / method / f"seed{seed}"
        d.mkdir(parents=True)
        lines = [{"kind": "eval", "step": 0, "eval_pass1_mean": 0.4}]
        for step in range(1, 21):
            lines.append({"kind": "train", "step": step, "reward_mean": 0.6 + 0.01 * seed,
                          "grad_norm": 10.0 if (seed == 1 and step == 15) else 1.0,
                          "kl_ref": 0.002 * step if step % 10 == 0 else None,
                          "kl_ref_all": 0.001 * step if step % 10 == 0 else None})
            if step % 10 == 0:
                lines.append({"kind": "eval", "step": step, "eval_pass1_mean": 0.5 + 0.01 * seed})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_questions_small_reads_the_gap_the_kl_and_the_spikes_from_compare_runs(tmp_path):
    for method in ("d2s", "d3s", "d3s-i"):
        _fake_runs(tmp_path, method, [0, 1, 2])
    out = run("questions_small.py", "--question", "4", "--runs", str(tmp_path), "--plot", str(tmp_path / "q4.png"))
    assert "| d3s | 20 | 0.610 | 0.510 | +0.100 | 0.02000 | 0.04000 |" in out, out
    assert "d3s − d2s in gap, same seed, 95% t interval over 3 seeds: +0.000" in out and (tmp_path / "q4.png").exists()
    out = run("questions_small.py", "--question", "5", "--runs", str(tmp_path), "--rows", "d3s")
    assert "| d3s | 3 | 0.3 ± 0.6 | 4.0 ± 5.2 | 0.0200 ± 0.0000 | 0.510 ± 0.010 | +0.000" in out, out
