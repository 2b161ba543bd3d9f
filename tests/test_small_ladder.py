"""experiments/small_ladder.py: train_small.py's methods over RL seeds from one warm start, compare.md and compare.png,
in process and in worker processes, and the numbers of its tables on a hand-made fixture."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "experiments"), os.path.join(ROOT, "tests")]
import small_ladder  # noqa: E402
import stats  # noqa: E402
from test_train_small import TINY, cache_dir, read_jsonl, restore_torch_threads, two_answer_data, without_timings  # noqa: E402,F401


def test_compare_over_seeds_writes_the_ladder_tables_and_plot(tmp_path, cache_dir, two_answer_data):
    train_file, eval_file = two_answer_data
    out = tmp_path / "cmp"
    summaries = small_ladder.main(
        TINY
        + [
            "--steps",
            "3",
            "--train-file",
            train_file,
            "--eval-file",
            eval_file,
            "--cache-dir",
            cache_dir,
            "--out",
            str(out),
            "--compare",
            "grpo,d3s",
            "--seeds",
            "2",
        ]
    )
    assert set(summaries) == {"grpo", "d3s"} and all(len(runs) == 2 for runs in summaries.values())
    for method in ("grpo", "d3s"):
        for seed in (0, 1):
            assert (out / method / f"seed{seed}" / "summary.json").exists()
    assert summaries["grpo"][0]["rl_seed"] == 0 and summaries["grpo"][1]["rl_seed"] == 1
    assert summaries["grpo"][0]["warm_start"]["path"] == summaries["d3s"][1]["warm_start"]["path"]  # one warm start
    table = (out / "compare.md").read_text()
    for heading in (
        "Held-out Pass@1 at the last step",
        "Training speed-up",
        "by level",
        "Costs and the paper's metrics",
        "Where a step's time goes",
    ):
        assert heading in table
    d3s_row = next(line for line in table.splitlines() if line.startswith("| d3s |"))
    assert " ± " in d3s_row and "[" in d3s_row  # mean ± std, and the paired interval
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_with_workers_runs_each_run_in_its_own_process_with_the_same_numbers(
    tmp_path, cache_dir, two_answer_data
):
    """--workers 2: the runs go to train_small.py subprocesses, two at a time; each run's metrics equal
    those of the same run made in-process (only wall-clock fields differ), and a rerun with --resume
    reuses the finished runs."""
    train_file, eval_file = two_answer_data
    flags = TINY + [
        "--steps",
        "2",
        "--train-file",
        train_file,
        "--eval-file",
        eval_file,
        "--cache-dir",
        cache_dir,
        "--compare",
        "grpo,d3s",
        "--seeds",
        "2",
        "--switch-on-spike",
        "3",  # grpo has no twin: its runs get 0
        "--eval-samples",
        "4",
    ]  # the ladder's evaluations before the last take 2 samples (--mid-eval-samples)
    summaries = small_ladder.main(flags + ["--out", str(tmp_path / "par"), "--workers", "2"])
    assert [s["rl_seed"] for s in summaries["d3s"]] == [0, 1]
    evals = [m for m in read_jsonl(tmp_path / "par" / "d3s" / "seed1" / "metrics.jsonl") if m["kind"] == "eval"]
    assert [(m["step"], m["n"], m["k"]) for m in evals] == [(0, 2, 2), (2, 4, 2)]
    assert summaries["d3s"][1]["warm_start"]["n"] == 2 and summaries["d3s"][1]["final"]["n"] == 4
    small_ladder.main(flags + ["--out", str(tmp_path / "seq")])
    for run in ("grpo/seed0", "d3s/seed1"):
        par, seq = (
            read_jsonl(tmp_path / "par" / run / "metrics.jsonl"),
            read_jsonl(tmp_path / "seq" / run / "metrics.jsonl"),
        )
        assert without_timings(par) == without_timings(seq), run
    assert (tmp_path / "par" / "d3s" / "seed1.log").exists() and (tmp_path / "par" / "compare.md").exists()
    before = (tmp_path / "par" / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns
    small_ladder.main(flags + ["--out", str(tmp_path / "par"), "--workers", "2", "--resume"])
    assert (tmp_path / "par" / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns == before  # not run again


def test_ladder_rows_paired_intervals_and_speed_ups_on_a_hand_made_fixture():
    """3 seeds, evaluations at steps 0, 10, 20. grpo ends at 0.5, 0.6, 0.7 (mean 0.6); 'fast' ends
    0.1 higher on every seed but 0.2 -> 0.4 -> 0.6... (see below), 'flat' never gets there."""

    def run(finals, mids, secs):  # finals and mids per seed; secs = (update s, whole-step s) at steps 10 and 20
        return [
            {
                "final": {"pass1_mean": f},
                "evals": [
                    {"step": 0, "pass1_mean": 0.2, "update_s": 0.0, "rl_s": 0.0},
                    {"step": 10, "pass1_mean": m, "update_s": secs[0][0], "rl_s": secs[0][1]},
                    {"step": 20, "pass1_mean": f, "update_s": secs[1][0], "rl_s": secs[1][1]},
                ],
            }
            for f, m in zip(finals, mids)
        ]

    summaries = {
        "grpo": run([0.5, 0.6, 0.7], [0.4, 0.4, 0.4], ((10, 20), (20, 40))),
        "fast": run([0.62, 0.69, 0.83], [0.6, 0.6, 0.6], ((5, 15), (10, 30))),
        "flat": run([0.3, 0.3, 0.3], [0.3, 0.3, 0.3], ((10, 20), (20, 40))),
    }
    target, rows = small_ladder.ladder_rows(summaries, ["grpo", "fast", "flat"], "grpo")
    assert target == pytest.approx(0.6)
    # fast - grpo per seed: +0.12, +0.09, +0.13: mean 0.1133, sd 0.0208, t(0.975, 2) = 4.3027 -> half 0.0517
    d, lo, hi = rows["fast"]["diff"]
    assert d == pytest.approx(0.34 / 3) and hi - d == pytest.approx(4.3027 * 0.020817 / 3**0.5, rel=1e-3)
    assert rows["fast"]["verdict"] == "better" and rows["flat"]["verdict"] == "worse"
    # grpo's mean curve 0.2, 0.4, 0.6 reaches 0.6 at step 20, update 20 s, whole-step 40 s; fast's (0.2, 0.6, 0.713)
    # at step 10 (5 s, 15 s): speed-ups 2x, 4x, 2.67x; flat never
    assert rows["grpo"]["to_target"] == pytest.approx({"step": 20.0, "update_s": 20.0, "step_s": 40.0})
    assert rows["fast"]["to_target"] == pytest.approx({"step": 10.0, "update_s": 5.0, "step_s": 15.0})
    assert rows["fast"]["speedup"] == pytest.approx({"step": 2.0, "update_s": 4.0, "step_s": 40 / 15})
    assert rows["flat"]["to_target"]["step"] is None and rows["flat"]["speedup"]["step"] is None
    # interpolation between evaluations: a curve 0.2 -> 0.5 -> 0.7 reaches 0.6 halfway from step 10 to 20
    assert stats.crossing([0, 10, 20], [0.2, 0.5, 0.7], 0.6) == pytest.approx(15.0)
    assert stats.crossing([0, 10], [0.2, 0.5], 0.6) is None
    # flat - grpo: -0.2, -0.3, -0.4: sd 0.1, half-width 4.3027 * 0.1 / sqrt(3) = 0.248: [-0.548, -0.052]
    assert rows["flat"]["diff"] == pytest.approx((-0.3, -0.3 - 0.24842, -0.3 + 0.24842), abs=1e-4)
