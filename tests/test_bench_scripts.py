"""Smoke tests of the timing scripts bench/loss_head.py and bench/tiled_mlp.py, at tiny sizes:
they run and print their tables (no timing assertions: times live in docs/benchmarks.md); of
experiments/questions_toy.py on a few steps; and of experiments/dropped_tokens.py on an untrained 1-layer model
(real grader) and, in process with the rewards patched so that every group has spread, its shares,
counts and the gradient check (K = 1 selects every token: cosine 1, norm ratio 1)."""

import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    folder = (
        "experiments"
        if script in ("questions_toy.py", "questions_small.py", "dropped_tokens.py", "headroom.py")
        else "bench"
    )
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, folder, script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_loss_head_bench_times_both_heads_for_both_k():
    out = run("loss_head.py", "--rollouts", "4", "--prompt-len", "4", "--response-len", "4", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("| train_small") or line.startswith("| hidden")]
    assert len(rows) == 8  # 2 models x 2 K x 2 heads
    assert {row.split("|")[3].strip() for row in rows} == {"full logits", "blockwise"}


def test_tiled_mlp_bench_times_whole_and_tiled():
    out = run(
        "tiled_mlp.py", "--hidden", "112", "--layers", "1", "--seq-len", "32", "--chunk-tokens", "32", "--repeats", "1"
    )
    assert "| whole (--mlp-chunk-tokens 0) |" in out
    assert "| tiled, 4 slices (--mlp-chunk-tokens 32) |" in out
    assert "adds 20% to pass 2's FLOPs" in out


def test_questions_toy_writes_a_table_paired_with_each_rows_reference(tmp_path):
    out = run("questions_toy.py", "--question", "7", "--seeds", "2", "--steps", "2", "--out", str(tmp_path))
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[-2].strip(" `")
        for line in out.splitlines()
        if line.startswith("| `")
    }
    assert rows == {
        "grpo": "d3s",
        "d1s-cross": "grpo",
        "dapo-filter": "d1s-cross",
        "d3s": "grpo",
        "dapo-filter-k": "d3s",
    }
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
            lines.append(
                {
                    "kind": "train",
                    "step": step,
                    "reward_mean": 0.6 + 0.01 * seed,
                    "grad_norm": 10.0 if (seed == 1 and step == 15) else 1.0,
                    "kl_ref": 0.002 * step if step % 10 == 0 else None,
                    "kl_ref_all": 0.001 * step if step % 10 == 0 else None,
                }
            )
            if step % 10 == 0:
                lines.append({"kind": "eval", "step": step, "eval_pass1_mean": 0.5 + 0.01 * seed})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_questions_small_reads_the_gap_the_kl_and_the_spikes_from_compare_runs(tmp_path):
    for method in ("d2s", "d3s", "d3s-i"):
        _fake_runs(tmp_path, method, [0, 1, 2])
    out = run("questions_small.py", "--question", "4", "--runs", str(tmp_path), "--plot", str(tmp_path / "q4.png"))
    assert "| d3s | 20 | 0.610 | 0.510 | +0.100 | 0.02000 | 0.04000 |" in out, out
    assert "d3s − d2s in gap, same seed, 95% t interval over 3 seeds: +0.000" in out and (tmp_path / "q4.png").exists()
    out = run(
        "questions_small.py",
        "--question",
        "5",
        "--runs",
        str(tmp_path),
        "--rows",
        "d3s",
        "--plot",
        str(tmp_path / "q5.png"),
    )
    assert (tmp_path / "q5.png").exists()
    assert "| d3s | 3 | 0.3 ± 0.6 | 4.0 ± 5.2 | 0.0200 ± 0.0000 | 0.510 ± 0.010 | +0.000" in out, out
    assert out.splitlines()[-1].endswith("| 1/3 (16) |"), out  # seed 1's spike at step 15: the switch from step 16
    assert out.splitlines()[-2].endswith("| — (no intra-group twin) |"), out  # d3s-i: the rule never acts
    _fake_runs(tmp_path / "other", "d3s", [0, 1, 2])  # rows from other --compare folders: FOLDER/METHOD
    out = run(
        "questions_small.py", "--question", "5", "--runs", str(tmp_path), "--rows", "other/d3s", "--base", "d3s-i"
    )
    assert out.splitlines()[-1].startswith("| other/d3s | 3 |") and out.splitlines()[-1].endswith("| 1/3 (16) |"), out


def test_questions_small_spikes_leave_out_steps_without_signal():
    """A step with no group with spread has grad_norm 0 (or null): it is neither a spike nor in the median, so a
    normal step after a stretch of them is not counted as a spike over a median of 0."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import questions_small

    train = lambda norms: [{"grad_norm": n, "step": i + 1} for i, n in enumerate(norms)]
    assert questions_small.spikes(train([1.0] * 10 + [0.0] * 7 + [1.2, None, 1.1]), 3.0) == (0, 1.2, None)
    assert questions_small.spikes(train([0.0] * 10 + [1.0]), 3.0) == (0, 0.0, None)  # nothing before it to compare with
    count, worst, switch = questions_small.spikes(train([1.0] * 10 + [0.0, 5.0, 1.0]), 3.0)
    assert count == 1 and worst == 5.0 and switch == 13  # the spike is step 12: the switch rule moves step 13 on
    assert questions_small.spikes(train([1.0] * 10 + [5.0]), 3.0) == (1, 5.0, None)  # on the last step: nothing to move


def test_questions_small_pairs_rows_from_different_compare_folders_seed_by_seed(tmp_path):
    """Questions 1, 2, 3, 7: rows are METHOD folders under --runs, each paired with its reference (ROW@REF, else
    --base, else the first row) over the seeds both have; 'to GRPO' interpolates between evals."""
    _fake_runs(tmp_path / "a", "grpo", [0, 1, 2])  # final 0.50, 0.51, 0.52; Pass@1 0.4 at step 0
    _fake_runs(tmp_path / "a", "d3s", [0, 1, 2])
    for seed, finals in ((0, (0.45, 0.53)), (1, (0.46, 0.55)), (2, (0.47, 0.57)), (3, (0.9, 0.9))):  # seed 3: unpaired
        d = tmp_path / "b" / "d3s" / f"seed{seed}"
        d.mkdir(parents=True)
        lines = [{"kind": "eval", "step": 0, "eval_pass1_mean": 0.4}]
        lines += [
            {"kind": "train", "step": s, "kept_tokens": 100, "entropy_kept": 0.3 + 0.02 * s} for s in range(1, 21)
        ]
        lines += [
            {"kind": "eval", "step": 10, "eval_pass1_mean": finals[0]},
            {"kind": "eval", "step": 20, "eval_pass1_mean": finals[1]},
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = run(
        "questions_small.py",
        "--question",
        "1",
        "--runs",
        str(tmp_path),
        "--rows",
        "a/grpo,b/d3s@a/d3s,b/d3s",
        "--plot",
        str(tmp_path / "q1.png"),
    )
    rows = {
        line.split("|")[1].strip(" `") + "|" + line.split("|")[-2].strip(" `"): [
            c.strip() for c in line.split("|")[2:-1]
        ]
        for line in out.splitlines()
        if line.startswith("| `")
    }
    assert rows["a/grpo|a/grpo"][:2] == ["3", "0.510 ± 0.010"] and rows["a/grpo|a/grpo"][2] == "(reference)"
    # b/d3s against a/d3s (final 0.50 + 0.01 s): +0.03, +0.04, +0.05 -> +0.040, an interval that excludes 0
    assert (
        rows["b/d3s|a/d3s"][0] == "4"
        and rows["b/d3s|a/d3s"][2].startswith("+0.040 [")
        and "**≠**" in rows["b/d3s|a/d3s"][2]
    )
    # the mean over the run (steps 10 and 20): b 0.490, 0.505, 0.520 against a 0.500, 0.510, 0.520 -> -0.005
    assert rows["b/d3s|a/d3s"][4].startswith("-0.005 [")
    # to grpo's final (0.50, 0.51, 0.52 by seed): between steps 10 and 20, at 10 + 10 * (0.50 - 0.45) / 0.08 = 16.25,
    # 10 + 10 * 0.05 / 0.09 = 15.6, 10 + 10 * 0.05 / 0.10 = 15; seed 3 has no grpo run
    assert rows["b/d3s|a/d3s"][5] == "16 ± 1 (3/4)" and rows["b/d3s|a/d3s"][6] == "2.0"
    assert (
        rows["b/d3s|a/d3s"][7] == "0.51" and rows["a/grpo|a/grpo"][7] == "—"
    )  # kept-token entropy: 0.3 + 0.02 s, s = 1..20
    assert rows["b/d3s|a/grpo"][2].startswith("+0.040 [")  # no @REF: the first row
    assert (tmp_path / "q1.png").exists()


DROPPED_SMALL = [
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--n-init",
    "2",
    "--n-final",
    "4",
    "--max-new-tokens",
    "12",
    "--batches",
    "1",
    "--train-size",
    "50",
    "--random-draws",
    "2",
]


def tiny_model_dir(path):
    from support import tiny

    tok = tiny.build_char_tokenizer()
    return tiny.save_tiny(tiny.build_tiny_model(tok, hidden_size=32, num_layers=1), tok, str(path))


def md_table(text, heading):
    """The rows of the markdown table under `## heading` as lists of cells (the header row first)."""
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def check_dropped_report(text):
    """The tables are there, each share column sums to 1, and selected + dropped = the forwarded tokens."""
    tokens = {row[0]: row[1:] for row in md_table(text, "1. Selected and dropped tokens")}
    n_sel, n_drop, _, n_all = (int(x) for x in tokens["tokens"])
    forwarded = sum(int(row[1]) for row in md_table(text, "4. Gradient share")[1:] if row[0] != "mean ± std")
    assert n_sel + n_drop == n_all == forwarded > 0
    classes = md_table(text, "3. Character class")
    assert [row[0] for row in classes[1:]] == ["digit", "operator", "format", "eos", "other"]
    assert sum(int(row[4]) for row in classes[1:]) == n_all
    for column, count in ((1, n_sel), (2, n_drop)):
        if count:
            assert abs(sum(float(row[column]) for row in classes[1:]) - 1) < 2e-3, classes
    position = md_table(text, "2. Relative position in the response")
    assert sum(int(row[3]) for row in position[1:]) == n_all
    return n_sel, n_drop, md_table(text, "4. Gradient share")


def test_dropped_tokens_runs_on_an_untrained_model_and_prints_the_tables(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    out, example = tmp_path / "report.md", tmp_path / "example.md"
    text = run("dropped_tokens.py", "--model", model, *DROPPED_SMALL, "--out", str(out), "--explain-out", str(example))
    assert out.read_text() in text
    n_sel, n_drop, grad = check_dropped_report(text)
    assert n_sel == math.ceil(0.05 * (n_sel + n_drop) - 1e-9)  # d3s at step 1: K = 5% of the forwarded tokens
    assert example.read_text().startswith("# Worked example")


def test_dropped_tokens_shares_counts_and_the_gradient_of_every_token(tmp_path, monkeypatch, capsys):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import dropped_tokens
    import train_small

    threads = torch.get_num_threads()
    model = tiny_model_dir(tmp_path / "tiny")
    # 0/1 rewards alternating within each group: every group has spread, so A != 0 and the gradients are not zero
    monkeypatch.setattr(
        train_small,
        "grade",
        lambda batch, problems, grader: torch.tensor([float(i % 2) for i in range(len(batch["texts"]))]).view(
            len(problems), -1
        ),
    )
    try:
        dropped_tokens.main(
            ["--model", model, *DROPPED_SMALL, "--k-init", "0.3", "--explain-out", str(tmp_path / "e.md")]
        )
        n_sel, n_drop, grad = check_dropped_report(capsys.readouterr().out)
        assert n_sel and n_drop and "[[" in (tmp_path / "e.md").read_text()
        row = dict(zip(grad[0], grad[1]))
        assert all(-1 <= float(row[f"cos({x}, all)"]) <= 1 for x in ("sel", "rand", "drop"))
        # the summed gradients add up: n_all g_all = n_sel g_sel + n_drop g_drop, so the triangle inequality holds
        assert float(row["sum ‖sel‖ / ‖all‖"]) + float(row["sum ‖drop‖ / ‖all‖"]) >= 1 - 1e-3
        for flags in (["--k", "1.0"], ["--method", "d1s-cross"]):  # every forwarded token selected
            dropped_tokens.main(["--model", model, *DROPPED_SMALL, *flags])
            n_sel, n_drop, grad = check_dropped_report(capsys.readouterr().out)
            assert n_drop == 0
            row = dict(zip(grad[0], grad[1]))
            assert abs(float(row["cos(sel, all)"]) - 1) < 1e-5 and abs(float(row["cos(rand, all)"]) - 1) < 1e-5, row
            assert (
                abs(float(row["‖sel‖ / ‖all‖ (per token)"]) - 1) < 1e-5
                and abs(float(row["sum ‖sel‖ / ‖all‖"]) - 1) < 1e-5
            )
            assert row["cos(drop, all)"] == row["sum ‖drop‖ / ‖all‖"] == "–"  # no dropped token: no gradient to compare
    finally:
        torch.set_num_threads(threads)


def test_vs_trl_warm_start_snippet_imports_every_name_it_uses(tmp_path):
    """bench/vs_trl.py builds its warm start in a `python -c` snippet, which no linter reads: the moves of issue 44 left
    it importing a top-level `warmstart` that no longer exists (found by running the benchmark). Here: ruff's
    undefined-name check on the snippet, and the snippet itself up to train_small's --help."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "bench", "vs_trl.py")).read())
    (snippet,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "WARM_START_SNIPPET"
    ]
    path = tmp_path / "snippet.py"
    path.write_text(snippet.replace("{WORK}", str(tmp_path)))
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    lint = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "F821,F401", str(path)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout
    res = subprocess.run(  # as vs_trl.py runs it
        [sys.executable, "-c", path.read_text(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "usage: " in res.stdout, res.stderr[-3000:]
