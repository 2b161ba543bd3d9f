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
