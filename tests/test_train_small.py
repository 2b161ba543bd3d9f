"""train_small.py as a specification: the reward, bad input, a 1-minute run, resume after a kill.

Every run here uses a 1-layer, 32-wide model and a few RL steps, so the file takes a few
minutes on a loaded 2-core CPU. The runs share one cached warm start (module fixture).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import d3s
import train_small
from support import sampler  # noqa: E402
from support import methods, warmstart, mathtask
from support.grading import Grader
from support.mathtask import arithmetic_problems, load_problems, step_problems, stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")  # the real benchmarks, in the repo (data/README.md)

# A run small enough for a test: tiny model, 2 prompts x 4 rollouts, a handful of steps.
TINY = [
    "--hidden-size",
    "32",
    "--num-layers",
    "1",
    "--sft-steps",
    "60",
    "--sft-lr",
    "3e-2",
    "--sft-batch",
    "32",
    "--train-size",
    "200",
    "--eval-size",
    "6",
    "--eval-samples",
    "2",
    "--pass-k",
    "2",
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
    "--eval-every",
    "3",
    "--save-every",
    "3",
    "--threads",
    "1",
    "--lr",
    "3e-3",
    "--grade-timeout",
    "5",
]


@pytest.fixture(autouse=True)
def restore_torch_threads():
    threads = torch.get_num_threads()  # --threads 1 sets it for this whole process
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


@pytest.fixture(scope="module")
def two_answer_data(tmp_path_factory):
    """Problems whose answer is 1 or 2 at random: a barely trained model guesses, so every group has
    mixed rewards and every step really updates the weights (what the resume test needs)."""
    folder = tmp_path_factory.mktemp("data")
    gen = torch.Generator().manual_seed(0)
    for name, n in (("train.jsonl", 64), ("eval.jsonl", 6)):
        with open(folder / name, "w") as f:
            for i in range(n):
                f.write(
                    json.dumps(
                        {
                            "problem": f"Pick {name[0]}{i}.",
                            "answer": str(1 + int(torch.randint(2, (1,), generator=gen))),
                        }
                    )
                    + "\n"
                )
    return str(folder / "train.jsonl"), str(folder / "eval.jsonl")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timings(lines):
    """Metrics lines minus the wall-clock fields (everything else must reproduce exactly)."""
    return [{k: v for k, v in m.items() if not k.endswith("_s")} for m in lines]


def load_state(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


# ---------------------------------------------------------------------------------------------
# The reward: math-verify on real gold answers, adversarial completions under the time limit
# ---------------------------------------------------------------------------------------------
def _wrong_answer(gold):
    try:
        return str(float(gold.replace(",", "")) + 1)
    except ValueError:
        return gold + "+1"


@pytest.mark.parametrize("name", ["math500.jsonl", "gsm8k.jsonl"])
def test_reward_is_1_for_the_boxed_gold_answer_and_0_for_a_wrong_one(name):
    path = os.path.join(DATA, name)
    rows, _ = load_problems(path)
    golds = [r["answer"] for r in rows]
    with Grader(timeout_s=10.0) as grader:
        right = grader.score_batch([f"So the answer is \\boxed{{{g}}}." for g in golds], golds)
        wrong = grader.score_batch([f"So the answer is \\boxed{{{_wrong_answer(g)}}}." for g in golds], golds)
    assert [g for g, r in zip(golds, right) if r != 1.0] == []
    assert [g for g, r in zip(golds, wrong) if r != 0.0] == []


ADVERSARIAL = {
    "huge power tower": "\\boxed{9^{9^{9^{9^{9^{9}}}}}}",
    "huge factorial": "\\boxed{(10^{10^{10}})!}",
    "deeply nested braces": "\\boxed{" + "{" * 50_000 + "7" + "}" * 50_000 + "}",
    "100k characters of text": "7 " * 50_000,
    "100k characters of \\boxed{": "\\boxed{" * 14_300,
    "100k-digit number": "\\boxed{" + "9" * 100_000 + "}",
}


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_adversarial_completion_scores_0_within_the_time_limit(case):
    timeout = 2.0
    with Grader(timeout_s=timeout) as grader:
        grader.score("\\boxed{1}", "1")  # start the grader child outside the timed part
        t0 = time.time()
        reward = grader.score_batch([ADVERSARIAL[case]], ["7"])
        elapsed = time.time() - t0
        assert reward == [0.0]
        assert elapsed < timeout + 3.0, f"{case}: {elapsed:.1f} s"
        assert grader.score("\\boxed{8}", "8") == 1.0  # and the grader still works afterwards


def test_arithmetic_train_and_eval_problems_are_disjoint_and_cover_every_level():
    train, held_out = arithmetic_problems(2000), arithmetic_problems(400, "eval")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held_out}
    assert {r["level"] for r in held_out} == {1, 2, 3, 4}
    assert all(int(r["answer"]) >= 0 for r in train + held_out)


def test_the_steps_task_works_each_step_out_and_its_targets_grade_correct():
    """The default task: disjoint splits over every level, each solution's arithmetic right and
    chained (the next step starts from the last result), the answer its last result, a mean
    response (solution + \\boxed{answer}) of at least 20 characters (= tokens of the tiny model),
    and mathtask's grader scoring the SFT target 1 and a wrong intermediate result 0."""
    import re

    train, held_out = step_problems(2000), step_problems(400, "eval")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held_out}
    assert [r["level"] for r in held_out[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]
    for r in train + held_out:
        steps = re.findall(r"(\d+)([+-])(\d+)=(\d+)\.", r["solution"])
        assert len(steps) == (1 if r["level"] == 1 else 2), r
        for a, op, b, result in steps:
            assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b)), r
        assert all(steps[i + 1][0] == steps[i][3] for i in range(len(steps) - 1)), r
        assert steps[-1][3] == r["answer"] and int(r["answer"]) >= 0
    targets = [warmstart.sft_target(r) for r in held_out]
    assert sum(map(len, targets)) / len(targets) >= 20
    with Grader(timeout_s=5.0) as grader:
        assert grader.score_batch(targets[:8], [r["answer"] for r in held_out[:8]]) == [1.0] * 8
        wrong = (
            held_out[1]["solution"].rsplit("=", 1)[0]
            + f"={int(held_out[1]['answer']) + 1}. \\boxed{{{int(held_out[1]['answer']) + 1}}}"
        )
        assert grader.score(wrong, held_out[1]["answer"]) == 0.0


# ---------------------------------------------------------------------------------------------
# Bad input stops before training with one line that names the file:line or the flag
# ---------------------------------------------------------------------------------------------
def _bad_input(tmp_path, capsys, extra):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train_small.main(TINY + ["--out", str(out), "--cache-dir", str(tmp_path / "cache")] + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (out / "metrics.jsonl").exists()  # nothing was trained
    return err


def test_a_row_without_problem_or_answer_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    err = _bad_input(tmp_path, capsys, ["--train-file", str(bad)])
    assert f"{bad}:2" in err and "'answer'" in err
    bad.write_text('{"answer": "2"}\n')
    err = _bad_input(tmp_path, capsys, ["--eval-file", str(bad)])
    assert f"{bad}:1" in err and "'problem'" in err


def test_an_empty_file_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert str(empty) in _bad_input(tmp_path, capsys, ["--train-file", str(empty)])


def test_n_larger_than_the_group_size_names_the_flags(tmp_path, capsys):
    err = _bad_input(tmp_path, capsys, ["--n-final", "8"])  # G = 4
    assert "--n-final 8 > --group-size 4" in err


def test_an_unknown_method_is_named(tmp_path, capsys):
    assert "--method 'ppo'" in _bad_input(tmp_path, capsys, ["--method", "ppo"])
    assert "--compare" in _bad_input(tmp_path, capsys, ["--compare", "grpo,dss"])  # experiments/small_ladder.py's flag


def test_a_model_path_that_does_not_exist_is_named(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert f"--model {missing}" in _bad_input(tmp_path, capsys, ["--model", missing])


def test_help_documents_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        train_small.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for flag in (
        "--method",
        "--loss",
        "--steps",
        "--resume",
        "--model",
        "--train-file",
        "--eval-file",
        "--out",
        "--group-size",
        "--prompts-per-step",
        "--n-init",
        "--n-final",
        "--k-init",
        "--k-final",
        "--static-n",
        "--static-k",
        "--schedule",
        "--token-rule",
        "--token-scope",
        "--min-token-per-response",
        "--lr",
        "--clip-low",
        "--clip-high",
        "--loss-agg",
        "--mini-batches",
        "--kl-coef",
        "--temperature",
        "--max-new-tokens",
        "--eval-every",
        "--eval-samples",
        "--save-every",
        "--seed",
        "--rl-seed",
    ):
        assert flag in text
    assert "(default: d3s)" in text and "a summary: 8" in text
    assert "linear (a summary's)" in text and "(default: linear)" in text and "(|A| * H, the abstract's)" in text
    assert "[inferred] from a summary's N_final = 32" in text and "DAPO's clip-higher" in text and "[recipe]" in text
    for method in ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random", "dapo-filter", "dapo-filter-k"):
        assert method in text


def test_the_knobs_beyond_the_paper_and_the_warm_starts_are_declared_where_they_live():
    """The warm start's knobs come from support/warmstart.py, the switch rule's, schedules' and token rules' from
    support/methods.py: each declared once, the rung adds them with one call (the same help, default and type)."""
    rung = {a.option_strings[0]: a for a in train_small.build_parser()._actions if a.option_strings}
    for name, declared in [*warmstart.FLAGS, *methods.FLAGS]:
        got = rung[name]
        assert (got.help, got.default, got.type, got.choices) == (
            declared["help"],
            declared["default"],
            declared.get("type"),
            declared.get("choices"),
        ), name
    assert len(warmstart.FLAGS) == 15 and len(methods.FLAGS) == 5


@pytest.mark.parametrize("compare", [False, True])
def test_a_second_train_small_on_a_busy_out_stops_with_one_line_and_touches_nothing(tmp_path, capsys, compare):
    import small_ladder

    """While one train_small.py holds OUT/.lock (here: this test), another run or --compare into OUT stops
    before any work: two compares on one folder would interleave their runs. The lock goes with its holder."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "eval", "step": 0}\n')  # the busy run's file
    extra = ["--compare", "d3s", "--seeds", "1"] if compare else []
    entry = small_ladder.main if compare else train_small.main
    with open(out / ".lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as exit_info:
            entry(TINY + ["--steps", "1", "--out", str(out), "--cache-dir", str(tmp_path / "cache")] + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    prog = "small_ladder.py" if compare else "train_small.py"
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: --out {out}: another train_small.py"), err
    assert (out / "metrics.jsonl").read_text() == '{"kind": "eval", "step": 0}\n' and sorted(os.listdir(out)) == [
        ".lock",
        "metrics.jsonl",
    ]
    assert not (tmp_path / "cache").exists()  # stopped before the warm start


BAD_FLAGS = [  # (flags added to a valid tiny run, a fragment of the one line)
    (["--lr", "nan"], "--lr nan: must be in (0, 1]"),
    (["--lr", "-1"], "--lr -1: must be"),
    (["--lr", "inf"], "--lr inf"),
    (["--sft-lr", "0"], "--sft-lr 0: must be"),
    (["--clip-low", "-0.5"], "--clip-low -0.5: must be in [0, 1)"),
    (["--clip-high", "nan"], "--clip-high nan"),
    (["--max-grad-norm", "-1"], "--max-grad-norm -1: must be a finite number > 0"),
    (["--max-grad-norm", "inf"], "--max-grad-norm inf"),
    (["--kl-coef", "-0.1"], "--kl-coef -0.1"),
    (["--temperature", "0"], "--temperature 0: must be"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--k-init", "0"], "--k-init 0: must be a fraction"),
    (["--k-final", "1.5"], "--k-final 1.5"),
    (["--steps", "0"], "--steps 0: must be an int >= 1"),
    (["--steps", "x"], "--steps 'x': must be an int >= 1"),
    (["--group-size", "1"], "--group-size 1"),
    (["--mini-batches", "0"], "--mini-batches 0"),
    (["--eval-samples", "0"], "--eval-samples 0"),
    (["--mid-eval-samples", "0"], "--mid-eval-samples 0"),
    (["--pass-k", "3"], "--pass-k 3: must be an int in [1, --eval-samples 2]"),
    (["--warmup-steps", "-1"], "--warmup-steps -1"),
    (["--grade-timeout", "0"], "--grade-timeout 0: must be"),
    (["--hidden-size", "30"], "--hidden-size 30: must be a multiple of 4"),
    (["--num-layers", "0"], "--num-layers 0"),
    (["--stop-after", "9"], "--stop-after 9: must be an int in [1, --steps 3]"),
    (["--seed", "-1"], "--seed -1"),
    (["--threads", "-2"], "--threads -2"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--kl-every", "-1"], "--kl-every -1"),
    (["--loss", "ppo"], "--loss 'ppo'"),
    (["--task", "chess"], "--task 'chess'"),
    (
        ["--schedule", "cubic"],
        "--schedule 'cubic': not a choice; choose from 'linear', 'cosine', 'step', 'constant', 'adaptive'",
    ),
    (["--token-rule", "h"], "--token-rule 'h': not a choice; choose from 'adv-entropy', 'entropy', 'adv', 'random'"),
    (["--token-scope", "response"], "--token-scope 'response': not a choice; choose from 'batch', 'sequence'"),
    (["--switch-on-spike", "0.5"], "--switch-on-spike 0.5: must be 0 (off) or a number > 1"),
    (["--switch-on-spike", "nan"], "--switch-on-spike nan"),
    (
        ["--method", "grpo", "--switch-on-spike", "3"],
        "--switch-on-spike 3: moves a cross-group row to its intra-group twin",
    ),
    (["--out", "{file}"], "is a file, not a folder; pass a folder"),
    (["--out", ""], "--out '': empty"),
    (["--cache-dir", "{file}"], "--cache-dir {file}: is a file"),
    (["--train-file", "{dir}"], "--train-file {dir}: is a folder"),
    (["--eval-file", "{missing}"], "missing.jsonl"),
    (["--train-file", "{latin1}"], "latin1.jsonl:1: byte 0xe9 at column 17 is not UTF-8"),
    (["--model", "{file}"], "--model {file}: is a file"),
    (["--model", "{dir}"], "has no config.json"),
    (["--resume"], "--resume: no checkpoint at"),
]


@pytest.mark.parametrize("extra, fragment", BAD_FLAGS, ids=[" ".join(c[0]) for c in BAD_FLAGS])
def test_bad_flags_and_paths_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, extra, fragment):
    paths = {
        "file": tmp_path / "a_file.txt",
        "dir": tmp_path / "a_dir",
        "missing": tmp_path / "missing.jsonl",
        "latin1": tmp_path / "latin1.jsonl",
    }
    paths["file"].write_text("x")
    paths["dir"].mkdir()
    paths["latin1"].write_bytes('{"problem": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    err = _bad_input(tmp_path, capsys, ["--steps", "3"] + [e.format(**paths) for e in extra])
    assert err.startswith("train_small.py: error: ") and fragment.format(**paths) in err, err


def test_fuzzed_flags_pass_the_checks_or_fail_with_one_usage_line(capsys):
    """Any value of any flag: one line naming a flag and exit 2, or accepted, never another exception (parse_args
    does no work, so thousands of cases are cheap)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    numeric = [
        a.option_strings[-1]
        for a in train_small.build_parser()._actions
        if a.option_strings and getattr(a.type, "__name__", None) in ("int", "float")
    ]
    assert len(numeric) > 30
    values = st.one_of(
        st.integers(-(10**12), 10**12).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(["", "x", "1e999", "-inf", "nan", "0", "1", "0.5"]),
    )

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(numeric), values), min_size=1, max_size=4))
    def check(pairs):
        argv = [x for pair in pairs for x in pair]
        capsys.readouterr()
        try:
            train_small.parse_args(argv)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2 and err.count("\n") == 1 and err.startswith("train_small.py: error: --"), err

    check()


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def test_one_minute_run_trains_evaluates_and_saves(tmp_path, cache_dir):
    out = tmp_path / "run"
    summary = train_small.main(TINY + ["--steps", "3", "--out", str(out), "--cache-dir", cache_dir])
    lines = read_jsonl(out / "metrics.jsonl")
    train = [m for m in lines if m["kind"] == "train"]
    evals = [m for m in lines if m["kind"] == "eval"]
    assert [m["step"] for m in train] == [1, 2, 3] and [m["step"] for m in evals] == [0, 3]
    for key in (
        "reward_mean",
        "acc_train",
        "n_keep",
        "k_frac",
        "k_real",
        "kept_samples",
        "kept_tokens",
        "kept_tokens_frac",
        "kept_adv_var",
        "sur",
        "grad_norm",
        "entropy_mean",
        "entropy_kept",
        "kl_ref",
        "clip_frac",
        "clip_frac_by_minibatch",
        "loss",
        "skipped",
        "gen_s",
        "train_s",
    ):
        assert key in train[0]
    for key in ("eval_greedy_pass1", "eval_pass1_mean", "eval_passk", "k"):
        assert key in evals[-1]
    # d3s: N*P rollouts kept (N = 2 at step 1), and token selection keeps a fraction of their tokens
    assert train[0]["n_keep"] == 2 and train[0]["kept_samples"] == 2 * 2
    assert train[0]["k_frac"] == 0.05 and train[0]["kept_tokens"] <= train[0]["fwd_tokens"]
    assert "warm_start" in evals[0] and summary["warm_start"]["greedy_pass1"] == evals[0]["eval_greedy_pass1"]
    assert (out / "checkpoint.pt").exists() and (out / "summary.json").exists()
    assert set(load_state(out / "final")) == set(load_state(evals[0]["warm_start"]["path"]))  # HF-loadable
    page = (out / "explain" / "step_000001.html").read_text()  # --explain-every's default: step 1 and every 25th
    assert "train_small" in page and "d3s" in page and (out / "explain" / "step_000001.png").exists()
    assert not (out / "explain" / "step_000002.html").exists()


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, cache_dir, two_answer_data):
    """6 uninterrupted steps (checkpoints at 3 and 6): what a stopped or killed run must equal once resumed."""
    train_file, eval_file = two_answer_data
    flags = TINY + ["--steps", "6", "--train-file", train_file, "--eval-file", eval_file, "--cache-dir", cache_dir]
    out = tmp_path_factory.mktemp("whole") / "run"
    train_small.main(flags + ["--out", str(out)])
    return flags, out


def assert_same_run(whole, resumed):
    whole_lines, resumed_lines = read_jsonl(whole / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert without_timings(resumed_lines) == without_timings(whole_lines)
    a, b = load_state(whole / "final"), load_state(resumed / "final")
    warm = load_state(whole_lines[0]["warm_start"]["path"])
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[name], warm[name]) for name in a)  # the steps really trained


def test_stop_after_then_resume_equals_the_uninterrupted_run(tmp_path, whole_run):
    flags, whole = whole_run
    out = tmp_path / "stopped"
    assert train_small.main(flags + ["--out", str(out), "--stop-after", "4"]) is None  # a clean stop, exit 0
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 4  # its own checkpoint (not --save-every's)
    train_small.main(flags + ["--out", str(out), "--resume"])
    assert_same_run(whole, out)


def test_a_sigkill_while_the_checkpoint_is_written_then_resume_equals_the_uninterrupted_run(tmp_path, whole_run):
    """Killed at step 6 with its checkpoint half written: the step-3 checkpoint is intact, the
    half-written file is ignored, the metrics after step 3 are dropped, and the resumed run is the same."""
    import signal

    flags, whole = whole_run
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "small_stall_worker.py"), "6"] + flags + ["--out", str(out)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # tqdm's lines end in \r: a \n-ended line is a message
        if "half written, stalled" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (out / "checkpoint.pt.tmp").exists() and max(m["step"] for m in read_jsonl(out / "metrics.jsonl")) == 6
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 3
    train_small.main(flags + ["--out", str(out), "--resume"])
    assert_same_run(whole, out)


def test_a_sigterm_mid_run_stops_after_its_step_with_a_checkpoint_and_resume_equals_the_uninterrupted_run(
    tmp_path, whole_run
):
    """A preemption notice (SIGTERM, as SLURM and Kubernetes send before a kill) while step s runs: the step finishes,
    its checkpoint is written (here no --save-every step falls before the end), one line says so, exit 75; --resume
    then gives the numbers and the weights of the run that was never stopped."""
    import signal

    flags, whole = whole_run
    out = tmp_path / "preempted"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train_small.py")] + flags + ["--out", str(out), "--save-every", "50"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    trained = lambda: (out / "metrics.jsonl").exists() and "train" in (out / "metrics.jsonl").read_text()
    deadline = time.time() + 600
    while not trained():  # a step has run: the loop (and its SIGTERM handler) is on
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    lines = [line for line in err.splitlines() if line.startswith("train_small.py:")]  # a line of its own
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert proc.returncode == 75 and lines == [
        f"train_small.py: stopped by SIGTERM after step {step}; checkpoint "
        f"{out / 'checkpoint.pt'}; continue with --resume"
    ], (proc.returncode, err[-2000:])
    assert 1 <= step < 6 and not (out / "final").exists()
    train_small.main(flags + ["--out", str(out), "--resume"])
    assert_same_run(whole, out)


def test_a_full_disk_stops_with_one_line_keeps_the_last_checkpoint_and_resume_continues(
    tmp_path, whole_run, small_disk, capsys
):
    """--out on a disk that holds one checkpoint but not a second beside it: the step-6 checkpoint's write fails, the
    run stops with one line and exit 74, the step-3 checkpoint is intact; with space again, --resume finishes the run
    with the numbers of the uninterrupted one."""
    flags, whole = whole_run
    disk, resize = small_disk
    size = (whole / "checkpoint.pt").stat().st_size
    resize(int(1.5 * size) + 65536)
    out = disk / "run"
    with pytest.raises(SystemExit) as exit_:
        train_small.main(flags + ["--out", str(out), "--explain-every", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        exit_.value.code == 74
        and err[-1].startswith("train_small.py: error: no space left on the device while writing ")
        and "continue with --resume" in err[-1]
    ), err[-3:]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 3
    resize(64 * size + 2**24)
    train_small.main(flags + ["--out", str(out), "--explain-every", "0", "--resume"])
    assert_same_run(whole, out)


def test_an_incomplete_model_folder_is_named_before_any_work(tmp_path, capsys):
    """Weights, tokenizer or config missing, or a tokenizer that encodes a prompt to nothing: one line, exit 2."""
    import shutil

    from support import tiny
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = tiny.build_char_tokenizer()
    whole = tiny.save_tiny(
        tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, str(tmp_path / "m")
    )
    capsys.readouterr()  # save_pretrained's progress bar
    cases = {
        "config.json": "has no config.json",
        "model.safetensors": "has no weights",
        "tokenizer.json": "has no tokenizer",
    }
    for missing, fragment in cases.items():
        folder = tmp_path / missing
        shutil.copytree(whole, folder)
        for name in os.listdir(folder):
            if name == missing or (missing == "tokenizer.json" and name in ("vocab.json", "tokenizer.model")):
                os.remove(folder / name)
        err = _bad_input(tmp_path, capsys, ["--model", str(folder)])
        assert f"--model {folder}: {fragment}" in err, err
    empty = tmp_path / "empty-tokenizer"
    shutil.copytree(whole, empty)
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab={"<|endoftext|>": 0}, merges=[])), eos_token="<|endoftext|>"
    ).save_pretrained(empty)
    err = _bad_input(tmp_path, capsys, ["--model", str(empty)])
    assert f"--model {empty}: its tokenizer encodes a prompt to no tokens" in err, err


class NotATensor:
    """A Python object, pickled by reference: torch.load(weights_only=True) must refuse it."""


def test_a_bad_checkpoint_is_one_line_naming_the_file_and_the_fix(tmp_path, capsys, whole_run):
    import shutil

    flags, whole = whole_run
    good = whole / "checkpoint.pt"  # step 6 of 6
    damages = {
        "truncated": (lambda p: p.write_bytes(good.read_bytes()[: good.stat().st_size // 2]), "truncated or corrupt"),
        "empty": (lambda p: p.write_bytes(b""), "truncated or corrupt"),
        "pickled object": (
            lambda p: torch.save({**torch.load(good, weights_only=True), "x": NotATensor()}, p),
            "refused: it holds a pickled Python object",
        ),
        "older format": (  # format 3 (before 2026-11-28) held the RNG state: refused in one line, not read in part
            lambda p: torch.save({**torch.load(good, weights_only=True), "format": 3}, p),
            "checkpoint format 3 (this train_small.py reads format 4 only)",
        ),
        "a folder": (lambda p: p.mkdir(), "is a folder, not a checkpoint file"),
    }
    for name, (damage, fragment) in damages.items():
        path = tmp_path / name.replace(" ", "_") / "checkpoint.pt"
        path.parent.mkdir()
        damage(path)
        with pytest.raises(SystemExit) as e:
            train_small.main(flags + ["--steps", "6", "--out", str(tmp_path / "x"), "--resume", str(path)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and fragment in err and str(path) in err, (name, err)
    finished_copy = tmp_path / "finished"
    shutil.copytree(whole, finished_copy)
    for extra, fragment in (
        (["--resume"], "already finished its 6 steps"),
        (["--resume", "--lr", "1e-3"], "--lr 0.001: "),
        (["--resume", str(tmp_path / "missing.pt")], "no checkpoint at"),
        (["--resume", "--steps", "8"], "--steps 8: "),
    ):
        with pytest.raises(SystemExit) as e:
            train_small.main(flags + ["--out", str(finished_copy)] + extra)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and fragment in err, (extra, err)


def test_a_fresh_run_into_a_folder_that_holds_a_run_is_refused_and_changes_nothing(tmp_path, capsys, whole_run):
    """A forgotten --resume loses nothing: the second fresh run into the same --out is one line naming --resume and
    another --out, exit 2, and every file of the first run is byte for byte what it was; with no --out, each run gets
    a new folder (runs/small/METHOD__SEED__TIME), so the README's first command runs twice in a row."""
    import shutil

    flags, whole = whole_run
    first = tmp_path / "first"
    shutil.copytree(whole, first)
    before = {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    for method in ("d3s", "grpo"):  # the same run again, or another method into the same folder
        with pytest.raises(SystemExit) as e:
            train_small.main(flags + ["--out", str(first), "--method", method])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"--out {first}: holds an earlier run (metrics.jsonl, checkpoint.pt)" in err and "--resume" in err, err
    assert {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()} == before
    names = {train_small.parse_args([]).out for _ in range(2)} | {train_small.parse_args(["--method", "grpo"]).out}
    assert all(n.startswith(os.path.join("runs", "small", "")) for n in names) and len(names) >= 2, names
    assert any("grpo__0__" in n for n in names) and any("d3s__0__" in n for n in names), names
    with pytest.raises(SystemExit) as e:
        train_small.parse_args(["--resume"])  # whose run? --resume names its folder
    assert e.value.code == 2 and "--resume: pass --out" in capsys.readouterr().err


def test_resume_auto_starts_continues_and_finishes_with_one_command_line(tmp_path, capsys, whole_run):
    """--resume auto (a requeue's one command line): a fresh start into an empty folder, a continuation from the newest
    checkpoint to the uninterrupted run's numbers and weights, and on a finished run one line and exit 0."""
    flags, whole = whole_run
    out = tmp_path / "auto"
    command = flags + ["--out", str(out), "--resume", "auto"]
    assert train_small.main(command + ["--stop-after", "4"]) is None  # fresh: nothing in --out yet
    assert json.loads((out / "args.json").read_text())["run"]["steps"] == 6  # the run's flags, for the next start
    train_small.main(command)
    assert_same_run(whole, out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_small.main(command)
    assert e.value.code == 0 and f"the run in {out} already finished its 6 steps" in capsys.readouterr().out


def test_a_run_logged_to_a_file_has_plain_lines(tmp_path, cache_dir, two_answer_data):
    """Without a terminal (a SLURM .out, nohup, | tee), progress is a plain line now and then, never a carriage
    return: stdout and stderr to files hold no \\r, and the step lines are bounded (run.progress_bar)."""
    train_file, eval_file = two_answer_data
    out = tmp_path / "logged"
    flags = TINY + ["--steps", "4", "--train-file", train_file, "--eval-file", eval_file, "--cache-dir", cache_dir]
    with open(tmp_path / "out.log", "w") as stdout, open(tmp_path / "err.log", "w") as stderr:
        proc = subprocess.run(
            [sys.executable, "train_small.py", *flags, "--out", str(out)], cwd=ROOT, stdout=stdout, stderr=stderr
        )
    text = (tmp_path / "out.log").read_text() + (tmp_path / "err.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text, text[-3000:]
    steps = [line for line in text.splitlines() if line.startswith("d3s (grpo, seed 0): ")]
    assert 1 <= len(steps) <= 4 and steps[-1].startswith("d3s (grpo, seed 0): 4/4"), steps


def test_a_config_file_relaunches_a_run_number_for_number_and_a_bad_key_or_value_is_one_line(
    tmp_path, capsys, whole_run
):
    """--config FILE: OUT/args.json of a finished run relaunches it into another --out with the same metrics, bit for
    bit; a YAML file's keys are flags the command line overrides; an unknown key, a bad value, a switch that is not
    true/false and a file that is not YAML are one line each naming the file and the key, exit 2."""
    flags, whole = whole_run
    again = tmp_path / "again"
    train_small.main(["--config", str(whole / "args.json"), "--out", str(again)])
    assert without_timings(read_jsonl(again / "metrics.jsonl")) == without_timings(read_jsonl(whole / "metrics.jsonl"))
    capsys.readouterr()
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("lr: 1.0e-4\nmax-grad-norm: 0.5\nmethod: grpo\ndrop_long_prompts: true\n")
    args = train_small.parse_args(["--config", str(yaml_file), "--method", "d3s-i"])
    assert (args.lr, args.max_grad_norm, args.method, args.drop_long_prompts) == (1e-4, 0.5, "d3s-i", True)  # CLI wins
    for text, fragment in (
        ("lrr: 0.1\n", "unknown key 'lrr'"),
        ("lr: -1\n", "lr: -1: must be in (0, 1]"),
        ("method: ppo\n", "--method 'ppo': unknown method"),  # refused after parsing: the line names the file too
        ("drop_long_prompts: 3\n", "drop_long_prompts: 3 must be true or false"),
        ("lr: [0.1\n", "not valid YAML"),
    ):
        yaml_file.write_text(text)
        with pytest.raises(SystemExit) as e:
            train_small.parse_args(["--config", str(yaml_file)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and f"--config {yaml_file}" in err, err
        assert fragment in err, (text, err)


def test_a_nan_loss_skips_the_update_and_is_logged(tmp_path, cache_dir, two_answer_data, monkeypatch):
    train_file, eval_file = two_answer_data
    real_loss = d3s.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(train_small.d3s, "policy_loss", nan_loss)
    out = tmp_path / "nan"
    summary = train_small.main(
        TINY
        + [
            "--steps",
            "2",
            "--train-file",
            train_file,
            "--eval-file",
            eval_file,
            "--cache-dir",
            cache_dir,
            "--out",
            str(out),
        ]
    )
    train = [m for m in read_jsonl(out / "metrics.jsonl") if m["kind"] == "train"]
    assert [m["skipped"] for m in train] == [True, True] and summary["skipped_updates"] == 2
    assert any(m["kept_adv_var"] > 0 for m in train)  # there was a gradient to apply
    final, warm = load_state(out / "final"), load_state(summary["warm_start"]["path"])
    assert all(torch.equal(final[name], warm[name]) for name in warm)  # ... and it was not applied


# ---------------------------------------------------------------------------------------------
# The paper's pieces on this rung: realised K, mini-batches (clipping and GSPO act), KL, --seeds
# ---------------------------------------------------------------------------------------------
def _run(tmp_path, cache_dir, data, name, extra):
    train_file, eval_file = data
    out = tmp_path / name
    train_small.main(
        TINY
        + ["--train-file", train_file, "--eval-file", eval_file, "--cache-dir", cache_dir, "--out", str(out)]
        + extra
    )
    return [m for m in read_jsonl(out / "metrics.jsonl") if m["kind"] == "train"], load_state(out / "final")


def test_the_dapo_filter_trains_on_every_rollout_of_the_groups_with_spread(tmp_path, cache_dir, two_answer_data):
    """--n-final 8 > G = 4 is no error here: the filter keeps whole groups and has no N."""
    train, _ = _run(
        tmp_path,
        cache_dir,
        two_answer_data,
        "dapo",
        ["--steps", "2", "--method", "dapo-filter-k", "--n-final", "8", "--schedule", "step"],
    )
    P, G = 2, 4
    for m in train:
        assert m["kept_samples"] == round(m["groups_mixed"] * P) * G and m["n_keep"] == G
    assert [m["k_frac"] for m in train] == [0.05, 0.2]  # --schedule step: K_init for the first half, K_final after


def test_the_switch_rule_moves_d3s_to_intra_group_samples_from_the_step_after_the_first_spike(
    tmp_path, cache_dir, two_answer_data, monkeypatch, capsys
):
    """A synthetic spike in the logged signal: step 11's grad_norm is made 10x what it was. With --switch-on-spike 3
    the run is d3s up to step 11, number for number, and selects its samples as d3s-i from step 12 on; stopped
    after step 11 and resumed, it reads the norms back from metrics.jsonl and switches at the same step."""
    common = [
        "--steps",
        "13",
        "--eval-every",
        "13",
        "--method",
        "d3s",
        "--switch-on-spike",
        "3",
        "--explain-every",
        "12",
    ]
    plain, _ = _run(tmp_path, cache_dir, two_answer_data, "plain", common)
    assert {m["sample_rule"] for m in plain} == {"cross"}  # the run's own norms have no spike: it never fires
    real_metrics, real_select = train_small.step_metrics, d3s.select_samples
    selected_with = []

    def spiked(step, *args):
        m = real_metrics(step, *args)
        return {**m, "grad_norm": 10 * m["grad_norm"]} if step == 11 else m

    def select(rewards, n_keep, method, **kwargs):
        selected_with.append(method)
        return real_select(rewards, n_keep, method, **kwargs)

    monkeypatch.setattr(train_small, "step_metrics", spiked)
    monkeypatch.setattr(train_small.d3s, "select_samples", select)
    switched, _ = _run(tmp_path, cache_dir, two_answer_data, "switched", common)
    assert selected_with == ["cross"] * 11 + ["intra"] * 2  # what the selection itself was called with
    assert [m["sample_rule"] for m in switched] == ["cross"] * 11 + ["intra"] * 2
    ratios = train_small.methods.spike_ratios([m["grad_norm"] for m in switched])  # the rule, replayed on the log
    assert [i + 1 for i, r in enumerate(ratios) if r is not None and r > 3] == [11]
    same = lambda lines: [{k: v for k, v in m.items() if not k.endswith("_s") and k != "grad_norm"} for m in lines]  # noqa
    assert same(switched[:11]) == same(plain[:11])  # off until it fires
    summary = lambda name: json.loads((tmp_path / name / "summary.json").read_text())
    assert summary("switched")["switched_at_step"] == 12 and summary("plain")["switched_at_step"] is None
    page = (tmp_path / "switched" / "explain" / "step_000012.html").read_text()  # the page names the row that selected
    assert (
        "fired: --method d3s runs as d3s-i" in page
        and "fired" not in (tmp_path / "plain" / "explain" / "step_000012.html").read_text()
    )
    # stop after the spike, resume: the history comes back from the checkpoint, and the switch with it
    train_file, eval_file = two_answer_data
    flags = (
        TINY
        + common
        + [
            "--train-file",
            train_file,
            "--eval-file",
            eval_file,
            "--cache-dir",
            cache_dir,
            "--out",
            str(tmp_path / "stopped"),
        ]
    )
    train_small.main(flags + ["--stop-after", "11", "--save-every", "11"])
    train_small.main(flags + ["--resume"])
    resumed = [m for m in read_jsonl(tmp_path / "stopped" / "metrics.jsonl") if m["kind"] == "train"]
    assert without_timings(resumed) == without_timings(switched)


def test_realised_token_fraction_is_the_scheduled_k_within_one_token(tmp_path, cache_dir, two_answer_data):
    train, _ = _run(tmp_path, cache_dir, two_answer_data, "k", ["--steps", "3", "--method", "d3s"])
    for m in train:
        assert abs(m["k_real"] * m["fwd_tokens"] - m["k_frac"] * m["fwd_tokens"]) < 1.0, m
        assert m["kept_tokens"] == round(m["k_real"] * m["fwd_tokens"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_with_one_mini_batch_gspo_and_grpo_give_the_same_update(tmp_path, cache_dir, two_answer_data, agg):
    common = ["--steps", "2", "--method", "grpo", "--mini-batches", "1", "--loss-agg", agg]
    grpo_train, grpo = _run(tmp_path, cache_dir, two_answer_data, "grpo", common + ["--loss", "grpo"])
    gspo_train, gspo = _run(tmp_path, cache_dir, two_answer_data, "gspo", common + ["--loss", "gspo"])
    assert all(m["clip_frac"] == 0.0 for m in grpo_train + gspo_train)  # on-policy: the ratio is 1
    for name in grpo:
        torch.testing.assert_close(grpo[name], gspo[name], rtol=1e-6, atol=1e-7)


def test_with_several_mini_batches_gspo_clips_on_the_later_ones_and_differs_from_grpo(
    tmp_path, cache_dir, two_answer_data
):
    common = ["--steps", "2", "--method", "grpo", "--mini-batches", "2", "--loss-agg", "token-mean"]
    _, grpo = _run(tmp_path, cache_dir, two_answer_data, "grpo", common + ["--loss", "grpo"])
    gspo_train, gspo = _run(tmp_path, cache_dir, two_answer_data, "gspo", common + ["--loss", "gspo"])
    for m in gspo_train:
        assert len(m["clip_frac_by_minibatch"]) == 2 and m["updates"] == 2
        assert m["clip_frac_by_minibatch"][0] == 0.0  # the first mini-batch is on-policy
        assert m["clip_frac_by_minibatch"][1] > 0.0  # the second sees the updated policy: GSPO's 3e-4/4e-4 binds
    assert any(not torch.allclose(grpo[name], gspo[name], rtol=1e-4, atol=1e-6) for name in grpo)


def test_kl_to_the_warm_start_is_zero_before_training_and_grows(tmp_path, cache_dir, two_answer_data):
    train, _ = _run(
        tmp_path, cache_dir, two_answer_data, "kl", ["--steps", "3", "--method", "grpo", "--mini-batches", "1"]
    )
    assert train[0]["kl_ref"] == 0.0  # step 1, one mini-batch: the policy is still the warm start
    assert train[-1]["kl_ref"] > 0.0


def test_kl_on_all_response_tokens_equals_the_selected_tokens_kl_for_grpo_and_is_measured_on_the_same_steps(
    tmp_path, cache_dir, two_answer_data
):
    """kl_ref_all: every response token of every rollout. grpo with one mini-batch selects all of them and its
    kl_ref is taken before the update, so the two agree; d3s selects a few, so its two differ."""
    common = ["--steps", "4", "--mini-batches", "1", "--kl-every", "2"]
    grpo, _ = _run(tmp_path, cache_dir, two_answer_data, "grpo", common + ["--method", "grpo"])
    d3s_, _ = _run(tmp_path, cache_dir, two_answer_data, "d3s", common + ["--method", "d3s"])
    for train in (grpo, d3s_):
        assert (
            [m["kl_ref_all"] is not None for m in train]
            == [m["kl_ref"] is not None for m in train]
            == [True, True, False, True]
        )
        assert train[0]["kl_ref_all"] == pytest.approx(0.0, abs=1e-7) and train[-1]["kl_ref_all"] > 0.0
    for m in grpo:
        if m["kl_ref"] is not None:
            assert m["kl_ref_all"] == pytest.approx(m["kl_ref"], rel=1e-4, abs=1e-8)
    assert any(m["kl_ref"] != pytest.approx(m["kl_ref_all"], rel=1e-2) for m in d3s_[1:] if m["kl_ref"] is not None)


# ---------------------------------------------------------------------------------------------
# Only the work a step needs: the sampler, pass 1 and the KL schedule change no number
# ---------------------------------------------------------------------------------------------
def _tiny_policy(seed=0):
    import copy

    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=seed)
    return model, copy.deepcopy(model), tokenizer


@torch.no_grad()
def _hf_generate(model, tokenizer, prompts, group_size, max_new_tokens, greedy):
    """The rollout of the previous version: transformers' own generate on every prompt repeated G times."""
    from transformers import GenerationConfig

    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    ids, mask = enc.input_ids.repeat_interleave(group_size, 0), enc.attention_mask.repeat_interleave(group_size, 0)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_token_ids(tokenizer, model.generation_config),
        **sampling,
    )
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    is_eos = torch.isin(out, torch.tensor(stop_token_ids(tokenizer, model.generation_config)))
    return torch.where((is_eos.cumsum(-1) - is_eos.long()) > 0, tokenizer.pad_token_id, out)  # padding after EOS


def test_the_sampler_gives_generates_greedy_tokens_and_with_the_same_seed_its_samples(cache_dir):
    warm_dir = warmstart.load_warm_start(
        train_small.parse_args(TINY + ["--cache-dir", cache_dir]), arithmetic_problems(200, "train")
    )[2]["path"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        warm_dir
    )  # a warm start: answers that end with EOS at different lengths
    tokenizer = AutoTokenizer.from_pretrained(warm_dir, padding_side="left")
    prompts = [mathtask.format_prompt(r["problem"], "plain") for r in arithmetic_problems(8, "eval")]
    greedy = sampler.sample(model, tokenizer, prompts, 1, 12, greedy=True)
    expected = _hf_generate(model, tokenizer, prompts, 1, 12, greedy=True)
    assert torch.equal(greedy["response_ids"], expected[:, : greedy["response_ids"].shape[1]])
    assert (expected[:, greedy["response_ids"].shape[1] :] == tokenizer.pad_token_id).all()
    same = 0
    for seed in range(3):  # sampling: torch.multinomial on the same logits, so the same draws up to rounding
        torch.manual_seed(seed)
        mine = sampler.sample(model, tokenizer, prompts, 8, 12)["response_ids"]
        torch.manual_seed(seed)
        theirs = _hf_generate(model, tokenizer, prompts, 8, 12, greedy=False)[:, : mine.shape[1]]
        same += int((mine == theirs).all(-1).sum())
    assert same >= 0.9 * 3 * 64, same  # measured: all but a few rows, where prefill rounding moves a draw


def _plain_forward(model, batch, temperature):
    """The reference: prompt + response forwarded per row, logits for the last T + 1 positions only."""
    T = batch["response_ids"].shape[1]
    model.train()
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)  # [B, Lp + T]
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = (
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1)
        .logits[:, :-1]
        .float()
        / temperature
    )  # position Lp-1+t predicts o_t
    logp = logits.log_softmax(-1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    return logp, d3s.token_entropy(logits)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_shared_prompt_forward_equals_the_row_by_row_forward_in_log_probs_entropy_and_gradients(temperature):
    """sampler.logprobs_entropy forwards each distinct prompt once and every response on its prompt's keys
    and values; the plain forward runs prompt + response per row. Same log-probs, entropies and gradients
    (fp32 rounding), on prompts of three lengths (left padding), whole groups and a subset of rows
    (d3s's N of G: prompts with 1, 2 and 4 rollouts), responses that end at different lengths."""
    model, _, tokenizer = _tiny_policy(seed=3)
    torch.manual_seed(0)
    batch = sampler.sample(model, tokenizer, ["1+2=", "Ann had 23 pens", "x"], 4, 10)
    assert batch["response_mask"].sum(-1).unique().numel() > 1  # responses of several lengths
    for rows in (torch.arange(12), torch.tensor([0, 4, 5, 8, 9, 10, 11])):
        part = sampler.take_rows(batch, rows)
        mask = part["response_mask"].bool()
        results = []
        for share in (False, True):
            model.zero_grad(set_to_none=True)
            forward = sampler.logprobs_entropy if share else _plain_forward
            logp, entropy = forward(model, part, temperature)
            (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp))[mask].sum().backward()  # every row weighs in
            results.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
        (plain_logp, plain_entropy, plain_grads), (logp, entropy, grads) = results
        torch.testing.assert_close(logp[mask], plain_logp[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[mask], plain_entropy[mask], rtol=1e-5, atol=1e-5)
        for (name, _), got, want in zip(model.named_parameters(), grads, plain_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert max(float(g.abs().max()) for g in grads) > 1e-3  # the gradients are not all ~0


def test_two_runs_on_two_threads_give_the_same_numbers(tmp_path):
    """README's first command runs on torch's default threads (2 on a 2-core machine). sampler.logprobs_entropy gives
    each row its prompt's keys and values with index_select, whose backward adds the rows up in a fixed order; the
    indexing it replaced (cache.batch_select_indices) gave other gradients from step 1 on, run to run, on 2 threads
    (2026-11-27: four runs of the default command ended at Pass@1 0.554-0.573). Two fresh processes, the default
    model and warm start, 2 steps: the same metrics and weights."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        flags = ["--threads", "2", "--steps", "2", "--eval-every", "100", "--eval-samples", "1", "--pass-k", "1"]
        flags += ["--explain-every", "0", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
        proc = subprocess.run([sys.executable, "train_small.py", *flags], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((without_timings(read_jsonl(out / "metrics.jsonl")), load_state(out / "final")))
    (lines_a, weights_a), (lines_b, weights_b) = runs
    assert [m["kind"] for m in lines_a] == ["eval", "train", "train", "eval"] and lines_a[1]["updates"] > 0
    assert lines_a == lines_b
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name


def test_the_shared_kv_attention_gives_sdpa_s_floats_and_reads_keys_in_place_only_without_gradient(monkeypatch):
    """sampler.shared_kv_attention (every model train_small loads runs it): the same sampled tokens, log-probs,
    entropies and gradients as transformers' "sdpa", bit for bit. Without a gradient its kernel reads each key/value
    head in place (repeat_kv, the copy, is never called); with one it copies as "sdpa" does."""
    import transformers.integrations.sdpa_attention as sdpa

    policy, plain, tokenizer = _tiny_policy(seed=3)
    assert policy.config.num_attention_heads > policy.config.num_key_value_heads  # grouped-query attention
    sampler.shared_kv_attention(policy)
    assert (policy.config._attn_implementation, plain.config._attn_implementation) == (sampler.SHARED_KV, "sdpa")
    copies, repeat_kv = [], sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: copies.append(torch.is_grad_enabled()) or repeat_kv(*a))
    results = {}
    for name, model in (("sdpa", plain), ("shared", policy)):
        copies.clear()
        torch.manual_seed(0)
        batch = sampler.sample(model, tokenizer, ["1+2=", "Ann had 23 pens", "x"], 4, 10)
        with torch.no_grad():
            no_grad = sampler.logprobs_entropy(model, batch)
        no_grad_copies = len(copies)
        logp, entropy = sampler.logprobs_entropy(model, batch)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp))[batch["response_mask"].bool()].sum().backward()
        results[name] = [batch["response_ids"], *no_grad, logp.detach(), entropy]
        results[name] += [p.grad for p in model.parameters()]
        assert any(copies[no_grad_copies:])  # with a gradient both copy
        assert (no_grad_copies == 0) == (name == "shared")  # without a gradient only "sdpa" copies
    assert results["sdpa"][0].shape[1] > 1 and batch["response_mask"].sum(-1).unique().numel() > 1
    for want, got in zip(results["sdpa"], results["shared"]):
        assert torch.equal(want, got)


@pytest.mark.parametrize("mini_batches,k_frac", [(1, 1.0), (1, 0.3), (2, 0.3), (3, 1.0)])
def test_the_update_without_pass_1_for_mini_batch_1_equals_the_update_with_it(mini_batches, k_frac):
    """Pass 1 over every kept rollout (the old way) against forward_kept + update_policy, which forward mini-batch 1
    once, with grad, and use its detached log-probs as the old ones (M = 1: no pass 1 at all)."""
    import copy

    model, ref_model, tokenizer = _tiny_policy()
    args = train_small.parse_args(["--mini-batches", str(mini_batches)])
    torch.manual_seed(0)
    kept = sampler.sample(model, tokenizer, ["1+2=", "Ann had 23 pens", "x"], 4, 8)
    kept = sampler.take_rows(kept, torch.arange(12))
    kept_adv = torch.randn(12)

    # SGD, so that a parameter moves by lr x its gradient: Adam would turn a 1e-7 rounding difference in a
    # near-zero gradient into a visible step (g / (|g| + eps))
    expected = copy.deepcopy(model)
    opt = torch.optim.SGD(expected.parameters(), lr=1.0)
    with torch.no_grad():
        old_logp, entropy = sampler.logprobs_entropy(expected, kept)
    token_keep = d3s.select_tokens(d3s.token_scores(kept_adv, entropy), kept["response_mask"], k_frac)
    for rows in torch.arange(12).tensor_split(mini_batches):
        part = sampler.take_rows(kept, rows)
        logp, _ = sampler.logprobs_entropy(expected, part, with_entropy=False)
        w = logp.shape[1]
        loss, _ = d3s.policy_loss(
            logp,
            old_logp[rows, :w],
            kept_adv[rows],
            token_keep[rows, :w],
            clip_low=args.clip_low,
            clip_high=args.clip_high,
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), args.max_grad_norm)
        opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    parts = [rows for rows in torch.arange(12).tensor_split(mini_batches) if len(rows)]
    sel = train_small.Selection(
        method_row="d3s",
        n_keep=12,
        k_frac=k_frac,
        keep=torch.ones(3, 4, dtype=torch.bool),
        adv=kept_adv.view(3, 4),
        kept_rows=torch.arange(12),
        kept=kept,
        kept_adv=kept_adv,
        parts=parts,
    )
    pass1 = train_small.forward_kept(model, None, sel, 1.0)
    entropy_2, ref_logp = pass1.entropy, pass1.ref_logp
    sel.token_keep = token_keep_2 = d3s.select_tokens(
        d3s.token_scores(kept_adv, entropy_2), kept["response_mask"], k_frac
    )
    update = train_small.update_policy(model, opt, sel, pass1, args)
    # M = 1 forwards the very same batch: bit for bit. M > 1 forwards the later mini-batches on their own
    # (another batch shape, so another rounding): fp32 tolerance.
    exact = dict(rtol=0, atol=0) if mini_batches == 1 else dict(rtol=1e-5, atol=1e-6)
    assert torch.equal(token_keep_2, token_keep)
    torch.testing.assert_close(entropy_2, entropy, **exact)
    assert len(update["grad_norms"]) == mini_batches and update["kl_ref"] is None and ref_logp is None
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, **exact, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))  # it did train


def test_the_kl_measured_every_e_steps_equals_the_kl_measured_every_step(tmp_path, cache_dir, two_answer_data):
    every, _ = _run(tmp_path, cache_dir, two_answer_data, "every", ["--steps", "5", "--kl-every", "1"])
    sched, _ = _run(tmp_path, cache_dir, two_answer_data, "sched", ["--steps", "5", "--kl-every", "2"])
    assert [m["kl_ref"] is not None for m in sched] == [True, True, False, True, True]  # step 1, 2, 4 and the last
    for a, b in zip(every, sched):
        if b["kl_ref"] is not None:
            assert a["kl_ref"] == b["kl_ref"]
        strip = lambda m: {k: v for k, v in m.items() if not k.endswith("_s") and not k.startswith("kl_ref")}
        assert strip(a) == strip(b)  # the reference forward changes nothing else
