"""The experiments (experiments/): the paired statistics, the verdicts, and docs/toy.md's tables and figure."""

import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "toy"), os.path.join(ROOT, "experiments")]
import bandit  # noqa: E402
import stats  # noqa: E402
import toy_ladder  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The paired table: 95% t intervals, verdicts only where an interval excludes 0
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "df, t",
    [  # Student's t quantiles at 0.975, from printed tables
        (1, 12.7062),
        (2, 4.3027),
        (3, 3.1824),
        (5, 2.5706),
        (9, 2.2622),
        (29, 2.0452),
        (30, 2.0423),
        (100, 1.9840),
    ],
)
def test_the_paired_interval_is_the_mean_plus_minus_t_sd_over_root_n(df, t):
    diffs = [float(i % 3) for i in range(df + 1)]  # n = df + 1 values, not all equal
    m, sd = stats.mean_std(diffs)
    mean, lo, hi = stats.paired_interval(diffs)
    half = t * sd / math.sqrt(len(diffs))
    assert (
        mean == pytest.approx(m) and lo == pytest.approx(m - half, abs=1e-4) and hi == pytest.approx(m + half, abs=1e-4)
    )


def test_paired_interval():
    m, lo, hi = stats.paired_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t_{0.975, 2} = 4.3027
    assert (
        m == 2.0
        and lo == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-4)
        and hi == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-4)
    )
    assert stats.paired_interval([0.5]) == (0.5, None, None)  # one seed: no interval
    assert stats.paired_interval([0.2] * 5)[1:] == (0.2, 0.2)


def fake_log(rewards):
    """The keys summarize reads, for a run whose expected reward is `rewards` at steps 0, 1, ..."""
    steps = len(rewards) - 1
    log = {
        k: [0.5] * steps
        for k in ("grad_norm", "grad_norm_grpo_scale", "sur", "kept_samples", "kept_tokens", "k_real", "k_frac")
    }
    return {
        **log,
        "step": list(range(1, steps + 1)),
        "eval_step": list(range(steps + 1)),
        "eval_reward": list(rewards),
        "eval_solved": [0] * (steps + 1),
    }


def test_the_verdict_needs_an_interval_that_excludes_zero():
    args = bandit.parse_args(["--seeds", "4", "--target", "0.5", "0.8"])
    base = [[0.1, 0.5, 0.6, 0.7], [0.1, 0.4, 0.6, 0.8], [0.1, 0.5, 0.7, 0.8], [0.1, 0.3, 0.5, 0.6]]
    logs = {
        "grpo": [fake_log(r) for r in base],
        "later": [fake_log([r[0], r[0]] + r[1:-1]) for r in base],  # one step later everywhere: reward lower
        "noise": [fake_log(r[:-1] + [r[-1] + d]) for r, d in zip(base, (0.05, -0.05, 0.04, -0.04))],
    }
    table = toy_ladder.summarize(logs, args)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[-2:]}
    assert rows["later"][-1] == "lower final reward, lower mean reward over the run, slower to 0.5"
    assert rows["later"][3].startswith("+1.0 [+1.0, +1.0] (4/4)")  # steps to 0.5: exactly one later on every seed
    assert rows["noise"][-1] == "no" and rows["noise"][1] == "2/4"
    assert "− grpo's" in table and "95%" in table


def test_an_interval_that_touches_zero_as_printed_is_no_difference():
    assert not stats.excludes_zero(0.0002, 0.053, "%+.3f")  # printed [+0.000, +0.053]
    assert stats.excludes_zero(0.0006, 0.053, "%+.3f") and stats.excludes_zero(-0.9, -0.06, "%+.1f")
    assert not stats.excludes_zero(-0.9, -0.04, "%+.1f") and not stats.excludes_zero(None, None, "%+.3f")


def test_crossing_interpolates_between_evaluations():
    assert stats.crossing([0, 10, 20], [0.1, 0.3, 0.5], 0.4) == pytest.approx(15.0)
    assert stats.crossing([0, 10], [0.5, 0.6], 0.4) == 0.0 and stats.crossing([0, 10], [0.1, 0.2], 0.4) is None


# ---------------------------------------------------------------------------------------------
# docs/toy.md's table: experiments/toy_ladder.py
# ---------------------------------------------------------------------------------------------
def test_the_toy_ladder_writes_table_metrics_and_plot(tmp_path, capsys):
    import json

    out = tmp_path / "toy"
    toy_ladder.main(["--seeds", "2", "--steps", "4", "--methods", "grpo", "d3s", "--workers", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    results = (out / "results.md").read_text()
    table = results.split("\n\n")[:2]  # per method; paired with grpo; then the notes and the command
    assert "\n\n".join(table) in printed
    rows = [line for line in results.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["method", "grpo", "d3s", "method", "d3s"]
    assert "95% t interval" in results and "--seeds 2 --steps 4" in results
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 * 2 * (4 + 4 + 1)
    assert (out / "toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_toy_ladder_has_the_toys_flags_and_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        toy_ladder.main(["--steps", "-3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "toy_ladder.py: error: --steps -3: must be an int in [1, 100000]"
