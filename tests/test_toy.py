"""The toy bandit (toy/bandit.py): every method learns, the numbers it reports mean what they say, and the
script writes its metrics; bad flags get one line. (Its tables and figure: tests/test_experiments.py.)"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "toy"), os.path.join(ROOT, "experiments")]
import bandit  # noqa: E402
from toy_ladder import columns  # noqa: E402  (a run's lines as one list per key)

from support import methods  # noqa: E402


def run(method, seed, args):
    """bandit.run as one list per metrics key."""
    return columns(bandit.run(method, seed, args))


SHORT = ["--steps", "30", "--workers", "1"]  # a few seconds per method


@pytest.fixture(scope="module")
def short_runs():
    """Every method, seeds 0 and 1, 30 steps: {method: [log_seed0, log_seed1]}."""
    torch.set_num_threads(1)
    args = bandit.parse_args(SHORT)
    return {m: [run(m, seed, args) for seed in (0, 1)] for m in methods.NAMES}


@pytest.mark.figures  # a verdict of the toy: checked again on another float path (docs/tests.md, Figures)
@pytest.mark.parametrize("method", list(methods.NAMES))
def test_every_method_raises_the_expected_reward(short_runs, method):
    # The reward is exact (no sampling noise) and starts at ~0.14; 30 updates of a method that
    # learns add > 0.1 (observed: 0.15 to 0.3), one that does nothing or climbs the wrong way does not.
    initial = sum(log["eval_reward"][0] for log in short_runs[method]) / 2
    final = sum(log["eval_reward"][-1] for log in short_runs[method]) / 2
    assert 0.1 < initial < 0.2
    assert final > initial + 0.1, f"{method}: {initial:.3f} -> {final:.3f}"


def test_every_method_starts_from_the_same_policy(short_runs):
    first = {m: logs[0]["eval_reward"][0] for m, logs in short_runs.items()}
    assert len(set(first.values())) == 1, first


@pytest.mark.figures
def test_methods_train_on_the_rollouts_and_tokens_they_claim(short_runs):
    args = bandit.parse_args(SHORT)
    P, G, L = args.batch_prompts, args.group_size, args.length
    grpo, d3s_run = short_runs["grpo"][0], short_runs["d3s"][0]
    assert grpo["kept_samples"] == [P * G] * args.steps and grpo["kept_tokens"] == [P * G * L] * args.steps
    for static in ("pods", "d1s", "d1s-cross", "d2s"):  # the static rows: N fixed at the schedule's midpoint
        assert short_runs[static][0]["kept_samples"] == [P * args.static_n] * args.steps, static
    assert short_runs["d1s"][0]["kept_tokens"] == [P * args.static_n * L] * args.steps  # d1s: every token
    assert d3s_run["kept_samples"] == [P * n for n in d3s_run["n_keep"]]  # cross-group: N * P in all
    assert d3s_run["n_keep"][0] == args.n_init and d3s_run["n_keep"] == sorted(d3s_run["n_keep"])
    # Top K of |A| * H: exactly ceil(K * tokens) by default (no floor of one token per response).
    for tokens, samples, k in zip(d3s_run["kept_tokens"], d3s_run["kept_samples"], d3s_run["k_frac"]):
        assert tokens == math.ceil(k * samples * L - 1e-9)
    # At the start the high-entropy positions are the decisions: token selection trains mostly
    # on them, GRPO on all positions (decisions are 2 of 8 on average).
    early_share = lambda log: sum(log["decision_share"][:3]) / 3
    assert early_share(grpo) < 0.35 and early_share(d3s_run) > 0.6


def test_the_dapo_filter_trains_on_every_rollout_of_the_groups_with_spread(short_runs):
    args = bandit.parse_args(SHORT)
    P, G, L = args.batch_prompts, args.group_size, args.length
    for log in short_runs["dapo-filter"]:
        assert log["kept_samples"] == [round(mixed * P) * G for mixed in log["groups_mixed"]]
        assert log["kept_tokens"] == [n * L for n in log["kept_samples"]] and all(s == 1.0 for s in log["sur"] if s)
        assert log["updates"] == [int(n > 0) for n in log["kept_samples"]]  # no group with spread: no update
    for log in short_runs["dapo-filter-k"]:  # the same rollouts, D3S's token level
        assert log["kept_samples"] == [round(mixed * P) * G for mixed in log["groups_mixed"]]
        assert all(
            t == math.ceil(k * n * L - 1e-9) for t, k, n in zip(log["kept_tokens"], log["k_frac"], log["kept_samples"])
        )


@pytest.mark.parametrize("method", ["d2s", "d3s", "d3s-i"])
def test_realised_token_fraction_is_the_scheduled_k_within_one_token(short_runs, method):
    args = bandit.parse_args(SHORT)
    for log in short_runs[method]:
        for k_real, k_frac, samples in zip(log["k_real"], log["k_frac"], log["kept_samples"]):
            tokens = samples * args.length
            assert abs(k_real * tokens - k_frac * tokens) < 1.0


def test_a_floor_of_one_token_per_response_inflates_the_kept_fraction():
    """The option the issue turned off: with L = 8, K = 5% the floor keeps >= 1/8 of the tokens."""
    args = bandit.parse_args(["--steps", "2", "--workers", "1", "--min-token-per-response"])
    log = run("d3s", 0, args)
    assert log["k_frac"][0] == pytest.approx(0.05) and log["k_real"][0] >= 1 / args.length


@pytest.mark.figures
def test_the_metrics_the_paper_reads_are_logged_every_step(short_runs):
    grpo, d3s_run, d1s_cross = short_runs["grpo"][0], short_runs["d3s"][0], short_runs["d1s-cross"][0]
    for log in (grpo, d3s_run):
        for key in ("sur", "k_frac", "k_real", "entropy_mean", "entropy_kept", "grad_norm", "kl_ref"):
            assert len(log[key]) == len(log["grad_norm"]) and all(math.isfinite(v) for v in log[key]), key
    assert grpo["kl_ref"][0] == pytest.approx(0.0, abs=1e-9) and grpo["kl_ref"][-1] > 0  # KL to the initial policy
    # GRPO trains on groups without spread (SUR < 1); cross-group selection drops them first.
    mean = lambda values: sum(values) / len(values)
    assert mean(grpo["sur"]) < 0.9 < mean(d1s_cross["sur"])
    # Token selection keeps the high-entropy tokens.
    assert all(kept > mean for kept, mean in zip(d3s_run["entropy_kept"][:5], d3s_run["entropy_mean"][:5]))


def test_expected_reward_is_exact():
    """The forward-algorithm E[R | p] agrees with sampling from a perturbed policy."""
    torch.manual_seed(0)
    args = bandit.parse_args([])
    task = bandit.make_task(args, seed=3)
    policy = bandit.Policy(task["prior"], args.hidden)
    torch.nn.init.normal_(policy.mlp[-1].weight, std=0.5)  # away from the prior
    exact = bandit.expected_reward(policy, task)  # [prompts]
    prompt_ids = torch.arange(args.prompts).repeat_interleave(4000)
    tokens, _ = policy.sample(prompt_ids, args.length, torch.Generator().manual_seed(0))
    sampled = bandit.reward(task, prompt_ids, tokens).view(args.prompts, 4000).mean(1)
    sigma = (exact * (1 - exact) / 4000).sqrt() + 1e-3
    assert ((sampled - exact).abs() < 5 * sigma).all(), (exact, sampled)


def test_a_run_is_deterministic_given_its_seed():
    args = bandit.parse_args(["--steps", "5", "--workers", "1"])
    assert bandit.run("d3s", 7, args) == bandit.run("d3s", 7, args)
    assert run("d3s", 7, args)["eval_reward"] != run("d3s", 8, args)["eval_reward"]


def test_main_writes_the_metrics_of_every_run(tmp_path, capsys):
    out = tmp_path / "toy"
    bandit.main(["--seeds", "2", "--steps", "4", "--methods", "grpo", "d3s", "--workers", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "grpo" in printed and "d3s" in printed and "final expected reward" in printed
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 * 2 * (
        4 + 4 + 1
    )  # methods x seeds x (train lines + eval lines, the first before training)
    assert {(m["method"], m["seed"]) for m in metrics} == {(m, s) for m in ("grpo", "d3s") for s in (0, 1)}
    one_run = [(m["kind"], m["step"]) for m in metrics if (m["method"], m["seed"]) == ("d3s", 1)]
    assert one_run == [("eval", 0)] + [(kind, s) for s in range(1, 5) for kind in ("train", "eval")]  # steps from 1
    assert all("eval_reward" in m for m in metrics if m["kind"] == "eval")
    assert all("grad_norm" in m and "loss" in m for m in metrics if m["kind"] == "train")
    assert not (out / "results.md").exists()  # the tables are experiments/toy_ladder.py's


def test_parallel_workers_give_the_same_numbers(tmp_path):
    common = ["--seeds", "2", "--steps", "3", "--methods", "random", "d3s"]
    bandit.main(common + ["--workers", "1", "--out", str(tmp_path / "one")])
    bandit.main(common + ["--workers", "2", "--out", str(tmp_path / "two")])
    one, two = ((tmp_path / d / "metrics.jsonl").read_text() for d in ("one", "two"))
    assert one == two


def test_d3s_at_the_full_budget_trains_exactly_as_grpo():
    """N = G and K = 1: cross-group selection keeps every rollout and top-K every token, so the run is
    GRPO's, number for number (what the ablations in docs/toy.md vary starts from here)."""
    args = bandit.parse_args(
        ["--steps", "4", "--workers", "1", "--n-init", "32", "--n-final", "32", "--k-init", "1", "--k-final", "1"]
    )
    full, grpo = run("d3s", 3, args), run("grpo", 3, args)
    assert full["eval_reward"] == grpo["eval_reward"] and full["grad_norm"] == grpo["grad_norm"]


@pytest.mark.figures
def test_ablation_switches_do_what_they_say():
    def run(method, *flags):
        return columns(bandit.run(method, 2, bandit.parse_args(["--steps", "3", "--workers", "1", *flags])))

    base = run("d3s")
    # The loss at GRPO's normalizer: D3S's gradient norm is the logged "at GRPO's normalizer" one.
    at_grpo_scale = run("d3s", "--normalizer", "all")
    assert at_grpo_scale["grad_norm"][0] == pytest.approx(base["grad_norm_grpo_scale"][0], rel=1e-5)
    assert at_grpo_scale["grad_norm"] == at_grpo_scale["grad_norm_grpo_scale"]
    # No clipping: the same as clipping at a norm no step reaches; clipping at 1.0 does bind for D3S.
    assert run("d3s", "--max-grad-norm", "0") == run("d3s", "--max-grad-norm", "1e6")
    assert base["grad_norm"][0] > 1.0 and run("d3s", "--max-grad-norm", "0")["eval_reward"] != base["eval_reward"]
    # The token rule moves the rows that select tokens, never the others (their rollouts stay the same).
    assert run("grpo", "--token-rule", "random") == run("grpo")
    assert run("d3s", "--token-rule", "random")["eval_reward"] != base["eval_reward"]
    # The token scope and the schedule's shape move the rows they concern, never grpo; linear is the default.
    assert run("d3s", "--token-scope", "sequence")["eval_reward"] != base["eval_reward"]
    assert run("grpo", "--token-scope", "sequence") == run("grpo") == run("grpo", "--schedule", "step")
    assert run("d3s", "--schedule", "linear") == base
    assert run("d3s", "--schedule", "constant")["n_keep"] == [8, 8, 8] != base["n_keep"]
    # SGD keeps the gradient's scale: the same first gradient, a different first step.
    sgd = run("d3s", "--optimizer", "sgd", "--lr", "0.1")
    assert sgd["grad_norm"][0] == base["grad_norm"][0] and sgd["eval_reward"][1] != base["eval_reward"][1]


# ---------------------------------------------------------------------------------------------
# Bad input: one line `bandit.py: error: --flag VALUE: what; fix` on stderr, exit 2, before any work
# ---------------------------------------------------------------------------------------------
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy", "bandit.py")
A_FILE = os.path.abspath(__file__)  # an existing file: not a folder for --out
BAD = [  # (argv, a fragment the one line must contain)
    (["--steps", "-3"], "--steps -3"),
    (["--steps", "abc"], "--steps 'abc'"),
    (["--steps", "2.5"], "--steps '2.5'"),
    (["--steps", "10000000"], "--steps"),
    (["--seeds", "0"], "--seeds 0"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr", "-1"], "--lr -1"),
    (["--lr", "inf"], "--lr inf"),
    (["--lr", "0"], "--lr 0"),
    (["--lr=-inf"], "--lr -inf"),
    (["--lr", "-1e-3"], "--lr -1e-3"),
    (["--lr"], "--lr=VALUE"),
    (["--lr", ""], "--lr ''"),
    (["--out", A_FILE], "is a file"),
    (["--out", os.path.join(A_FILE, "sub")], "cannot be made"),
    (["--out", ""], "--out ''"),
    (["--prompts", "0"], "--prompts 0"),
    (["--batch-prompts", "-2"], "--batch-prompts -2"),
    (["--batch-prompts", "17"], "--batch-prompts 17"),
    (["--group-size", "1"], "--group-size 1"),
    (["--length", "0"], "--length 0"),
    (["--vocab", "1"], "--vocab 1"),
    (["--hidden", "0"], "--hidden 0"),
    (["--max-decisions", "9"], "--max-decisions 9"),
    (["--k-init", "0"], "--k-init 0"),
    (["--k-final", "1.5"], "--k-final 1.5"),
    (["--static-k", "nan"], "--static-k nan"),
    (["--n-init", "33", "--methods", "d3s"], "--n-init 33"),
    (["--static-n", "64", "--methods", "pods"], "--static-n 64"),
    (["--hint", "nan"], "--hint nan"),
    (["--filler-logit", "inf"], "--filler-logit inf"),
    (["--hint", "1e9"], "--hint 1e9"),
    (["--max-grad-norm", "-1"], "--max-grad-norm -1"),
    (["--target", "0.5", "1.5"], "--target 1.5"),
    (["--workers", "0"], "--workers 0"),
    (["--explain-every", "-1"], "--explain-every -1"),
    (["--methods", "nope"], "--methods"),
    (["--methods", "grpo", "grpo"], "named twice"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--token-rule", "x"], "--token-rule"),
    (["--schedule", "cubic"], "--schedule"),
    (["--token-scope", "response"], "--token-scope"),
    (["--group-size", "4096", "--vocab", "256", "--batch-prompts", "16"], "tensor elements"),
    (["--no-such-flag"], "--no-such-flag"),
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD argv run as a script, a few at a time (each costs an interpreter start). In front of
    each, a tiny valid setting (a later flag wins): should a bad value slip through, it runs for a second."""
    from concurrent.futures import ThreadPoolExecutor

    tiny = [
        "--seeds",
        "1",
        "--steps",
        "1",
        "--workers",
        "1",
        "--methods",
        "grpo",
        "--out",
        str(tmp_path_factory.mktemp("bad")),
    ]

    def one(argv):
        return subprocess.run([sys.executable, SCRIPT, *tiny, *argv], capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((tuple(a) for a, _ in BAD), pool.map(one, [a for a, _ in BAD])))


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_input_gets_one_line_and_exit_2(bad_runs, argv, fragment):
    result = bad_runs[tuple(argv)]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith("bandit.py: error: ") and fragment in lines[0], lines[0]
    assert result.stdout == ""  # nothing ran


def test_a_run_that_goes_non_finite_stops_with_one_line(tmp_path, monkeypatch, capsys):
    def diverging(method, seed, args):
        raise bandit.Diverged(f"{method} seed {seed}: the policy went non-finite after step 3")

    monkeypatch.setattr(bandit, "run", diverging)
    with pytest.raises(SystemExit) as exit_:
        bandit.main(["--seeds", "1", "--steps", "4", "--methods", "grpo", "--workers", "1", "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "runs:" not in line]
    assert exit_.value.code == 2 and len(lines) == 1
    assert (
        lines[0].startswith("bandit.py: error: --lr 0.01: grpo seed 0: the policy went non-finite")
        and "lower --lr" in lines[0]
    )


WIDE = st.one_of(  # wider than any flag's valid range
    st.integers(-10, 10),
    st.integers(10**6, 10**12),
    st.integers(-(10**12), -(10**6)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "abc", "1e999", "-inf", "0x10", "DIR", "FILE"]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flags=st.dictionaries(
        st.sampled_from(
            [
                "--steps",
                "--seeds",
                "--lr",
                "--hint",
                "--max-grad-norm",
                "--group-size",
                "--n-init",
                "--k-init",
                "--target",
                "--out",
            ]
        ),
        WIDE,
        max_size=3,
    )
)
def test_fuzzed_flags_run_or_fail_with_one_line(tmp_path_factory, flags):
    """In this process (an interpreter start per example would cost more than the runs): any value
    either runs (tiny settings) or exits 2 with one line; another exception would fail the test."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "a_file").write_text("")
    argv = [
        "--steps",
        "1",
        "--seeds",
        "1",
        "--methods",
        "grpo",
        "d3s",
        "--workers",
        "1",
        "--prompts",
        "4",
        "--batch-prompts",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--length",
        "4",
        "--vocab",
        "4",
        "--hidden",
        "8",
        "--out",
        str(folder / "out"),
    ]
    for flag, value in flags.items():
        value = {"DIR": str(folder), "FILE": str(folder / "a_file")}.get(value, value)
        argv += [flag, str(value)]
    err, here = io.StringIO(), os.getcwd()
    os.chdir(folder)  # a relative --out ("41308667") lands in the temporary folder, not in the repository
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            bandit.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            os.chdir(here)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code in (0, 2), (argv, code, err.getvalue())
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("bandit.py: error: "), (argv, err.getvalue())
