"""--reward FILE.py:FUNCTION (issue 55): your reward function, called as TRL calls one, in the grader's process pool.

The functions under test live in a file each test writes (tmp_path/my_reward.py), as a user's would: they append
each value they return to REWARD_LOG, so a test can hold metrics.jsonl's reward_mean to the function's own values.
"""

import json
import os
import pathlib
import subprocess

import pytest
import torch

import train_small
from support import mathtask, reward_function, tiny, warmstart
from support.grading import Grader
from tests.test_full_faults import ENV, flags, torchrun

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "integrations" / "closeness_reward.py")
FUNCTIONS = """
import json, math, os, time

def _log(values):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write("".join(json.dumps(v) + "\\n" for v in values))
    return values

def length(prompts, completions, answer, **columns):
    return _log([len(c) / 10 + (0.5 if a is not None else 0.0) for c, a in zip(completions, answer)])

def raises(prompts, completions, **columns):
    return [1 / 0]

def raises_later(prompts, completions, **columns):  # from its 9th call on: step 2 of a run of 2 x 4 rollouts
    with open(os.environ["REWARD_LOG"], "a+") as f:
        f.seek(0)
        calls = len(f.read().splitlines())
        f.write("call\\n")
    if calls >= 8:
        raise KeyError("no such thing")
    return [0.5]

def nan(prompts, completions, **columns):
    return [math.nan]

def two(prompts, completions, **columns):
    return [1.0, 0.0]

def even(prompts, completions, **columns):  # 0/1
    return _log([float(len(c) % 2 == 0) for c in completions])

def hangs(prompts, completions, **columns):
    if "HANG" in completions[0]:
        time.sleep(600)
    return [0.25]
"""


@pytest.fixture
def rewards_file(tmp_path, monkeypatch):
    path = tmp_path / "my_reward.py"
    path.write_text(FUNCTIONS)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log.jsonl"))  # the grader's children inherit it
    return str(path)


def run(cmd):
    """tests/test_full_faults.py's run, with REWARD_LOG in the ranks' environment."""
    env = {**ENV, "REWARD_LOG": os.environ["REWARD_LOG"]}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def logged(tmp_path):
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


ROWS = [{"problem": "1+1?", "answer": "2", "where": "mine.jsonl:1", "level": 1}]


def test_the_function_is_called_as_trls_with_the_rows_columns(rewards_file, tmp_path):
    with Grader(timeout_s=30, reward=f"{rewards_file}:length") as grader:
        got = grader.rewards(["abc", "\\boxed{2}"], ROWS * 2)
    assert got == [0.8, 1.4] == logged(tmp_path)
    with Grader(timeout_s=30, reward=f"{EXAMPLE}:closeness") as grader:  # the worked example, real-valued
        assert grader.rewards(["\\boxed{2}", "\\boxed{3}", "\\boxed{12}", "none"], ROWS * 4) == [1.0, 0.5, 1 / 11, 0.0]


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("raises", "raised ZeroDivisionError: division by zero"),
        ("nan", "returned nan (a reward must be a finite float)"),
        ("two", "returned 2 values for 1 completion (one float per completion)"),
    ],
)
def test_a_reward_that_fails_is_one_line_naming_the_function_and_the_row(rewards_file, name, fragment):
    with Grader(timeout_s=30, reward=f"{rewards_file}:{name}") as grader:
        with pytest.raises(reward_function.RewardError) as e:
            grader.rewards(["x", "y"], ROWS * 2)
    message = str(e.value)
    assert message == f"--reward {rewards_file}:{name}: {fragment} on the row mine.jsonl:1 (completion 0)", message


def test_a_reward_that_hangs_is_cut_at_the_time_limit_scored_0_and_counted(rewards_file):
    with Grader(timeout_s=3, workers=2, reward=f"{rewards_file}:hangs") as grader:
        assert grader.rewards(["ok", "HANG", "ok"], ROWS * 3) == [0.25, 0.0, 0.25]
        assert grader.timeouts == 1
        assert grader.score_batch(["\\boxed{2}"], ["2"]) == [1.0]  # math-verify still answers (the evaluations)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("{file}", "expected FILE.py:FUNCTION or module:function"),
        ("{dir}/missing.py:f", "no such file"),
        ("{file}:nothing", "has no function nothing"),
        ("no_such_module_55:f", "importing no_such_module_55 failed (ModuleNotFoundError"),
    ],
)
def test_a_reward_that_does_not_load_is_one_line_before_any_work(rewards_file, tmp_path, capsys, spec, fragment):
    spec = spec.format(file=rewards_file, dir=tmp_path)
    with pytest.raises(SystemExit) as e:
        train_small.parse_args(["--reward", spec, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"train_small.py: error: --reward {spec}: ") and fragment in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


SMALL = (
    "--hidden-size 32 --num-layers 1 --sft-steps 0 --train-size 40 --eval-size 2 --eval-samples 2 --pass-k 2 "
    "--prompts-per-step 2 --group-size 4 --n-init 2 --n-final 4 --max-new-tokens 8 --eval-every 10 --threads 1 "
    "--explain-every 0"
).split()


def small(args):
    threads = torch.get_num_threads()
    try:
        return train_small.main([*SMALL, *args])
    finally:
        torch.set_num_threads(threads)


def test_train_small_trains_on_the_functions_rewards(rewards_file, tmp_path):
    out = tmp_path / "run"
    small(["--reward", f"{rewards_file}:length", "--steps", "3", "--out", str(out), "--cache-dir", str(tmp_path)])
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "train"]
    values = logged(tmp_path)
    assert len(values) == 3 * 8
    for i, line in enumerate(train):  # each step's P x G = 8 rewards, in the order they were called
        assert line["reward_mean"] == pytest.approx(sum(values[8 * i : 8 * i + 8]) / 8, abs=1e-6)
        assert "acc_train" not in line  # correctness: math-verify's 0/1 only
    assert len(set(values)) > 2  # real-valued


def test_train_small_stops_on_a_failing_reward_with_one_line_and_the_checkpoint_intact(rewards_file, tmp_path, capsys):
    out = tmp_path / "run"
    spec = f"{rewards_file}:raises_later"
    with pytest.raises(SystemExit) as e:
        small(["--reward", spec, "--steps", "3", "--save-every", "1", "--out", str(out), "--cache-dir", str(tmp_path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_small.py")]
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"train_small.py: error: --reward {spec}: raised KeyError: 'no such thing' on the row ")
    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 1  # the last checkpoint: step 1's, intact


def test_train_full_on_two_gloo_ranks_trains_on_the_functions_rewards(rewards_file, tmp_path):
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.save_tiny(
        tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, str(tmp_path / "m")
    )
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "level": i % 3}) + "\n" for i in range(8)))  # no answer
    out = tmp_path / "full"
    cmd = flags((model, str(data)), out, "--steps", "2", "--save-every", "2", "--reward", f"{rewards_file}:length")
    done = run(torchrun(2) + ["train_full.py", *cmd])
    assert done.returncode == 0, done.stderr[-3000:]
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in m]
    values = logged(tmp_path)  # both ranks' children: the 2 x 4 rollouts of each step, step after step
    assert len(train) == 2 and len(values) == 16
    for i, line in enumerate(train):
        assert line["reward_mean"] == pytest.approx(sum(values[8 * i : 8 * i + 8]) / 8, abs=1e-6)
        assert "acc_train" not in line
    os.remove(tmp_path / "log.jsonl")
    cmd[cmd.index("--out") + 1], cmd[-1] = str(tmp_path / "bad"), f"{rewards_file}:nan"
    refused = run(torchrun(2) + ["train_full.py", *cmd])
    ours = sorted({line for line in refused.stderr.splitlines() if line.startswith("train_full.py:")})
    assert refused.returncode != 0 and len(ours) == 1, refused.stderr[-3000:]
    assert f"--reward {rewards_file}:nan: returned nan" in ours[0] and "on the row " in ours[0]


def answerless(path, n=12, answer_every=0):
    """A JSONL of n problems without an answer column (every answer_every-th row has one)."""
    rows = [
        {"problem": f"{i}+{i}", **({"answer": str(2 * i)} if answer_every and i % answer_every == 0 else {})}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_warm_start_learns_from_the_rows_with_an_answer_and_refuses_data_without_any(
    rewards_file, tmp_path, capsys
):
    spec = ["--reward", f"{rewards_file}:length", "--steps", "1", "--cache-dir", str(tmp_path / "cache")]
    none, some = answerless(tmp_path / "none.jsonl"), answerless(tmp_path / "some.jsonl", answer_every=3)
    with pytest.raises(SystemExit) as e:  # the tiny model's warm start (--sft-steps 3) on rows without any answer
        small([*spec, "--sft-steps", "3", "--train-file", none, "--out", str(tmp_path / "none")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_small.py")]
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "train_small.py: error: --sft-steps 3: the supervised warm start needs rows with an answer"
    )
    assert "pass --sft-steps 0" in err[0] and not (tmp_path / "none").exists()
    rows = [json.loads(line) for line in open(some)]
    assert [r["problem"] for r in warmstart.sft_rows(rows)] == ["0+0", "3+3", "6+6", "9+9"]
    small([*spec, "--sft-steps", "3", "--train-file", some, "--out", str(tmp_path / "some")])  # 4 rows of 12 teach
    (info,) = [json.load(open(p)) for p in (tmp_path / "cache").glob("warmstart-*/warmstart.json")]
    assert info["sft_steps"] == 3 and info["sft_loss_first"] > 0
    with pytest.raises(SystemExit) as e:  # math-verify's held-out evaluation on a row without an answer
        small([*spec, "--sft-steps", "0", "--train-file", none, "--eval-file", some, "--out", str(tmp_path / "ev")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_small.py")]
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (
        f"train_small.py: error: {some}:2: no answer, which the held-out evaluation by math-verify needs; pass "
        "--eval-reward train (your --reward's function) or an --eval-file with answers"
    )


def test_train_small_evaluates_with_the_function_when_asked(rewards_file, tmp_path, capsys):
    out, data = tmp_path / "run", answerless(tmp_path / "none.jsonl")
    spec = ["--reward", f"{rewards_file}:length", "--eval-reward", "train", "--sft-steps", "0", "--steps", "1"]
    small([*spec, "--train-file", data, "--eval-file", data, "--out", str(out), "--cache-dir", str(tmp_path)])
    evals = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "eval"]
    values = logged(tmp_path)  # eval 0: 2 greedy, 2 x 2 sampled; step 1: 2 x 4 rollouts; eval 1: 2 + 4
    assert len(evals) == 2 and len(values) == 6 + 8 + 6
    for line, at in zip(evals, (0, 14)):
        assert line["eval_scorer"] == f"--reward {rewards_file}:length"
        assert line["eval_greedy_pass1"] == pytest.approx(sum(values[at : at + 2]) / 2)
        assert line["eval_pass1_mean"] == pytest.approx(sum(values[at + 2 : at + 6]) / 4)
        samples = values[at + 2 : at + 6]  # Pass@2 of real values: the expected best of 2 of each problem's 2
        assert line["eval_passk"] == pytest.approx((max(samples[:2]) + max(samples[2:])) / 2)
    printed = capsys.readouterr().out  # the summary names rewards as rewards, not as Pass@k
    assert "held-out greedy reward" in printed and "best-of-2" in printed and "Pass@" not in printed


def test_train_full_evaluates_with_the_function_when_asked_on_two_gloo_ranks(rewards_file, tmp_path):
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.save_tiny(
        tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, str(tmp_path / "m")
    )
    data, out = answerless(tmp_path / "none.jsonl", n=8), tmp_path / "full"
    cmd = flags((model, data), out, "--steps", "1", "--reward", f"{rewards_file}:length", "--eval-reward", "train")
    cmd[cmd.index("--eval-data") + 1] = data  # answerless too: read as --train-data is
    cmd += ["--eval-samples", "2", "--eval-pass-k", "1,2", "--eval-max-tokens", "8", "--eval-limit", "4"]
    done = run(torchrun(2) + ["train_full.py", *cmd])
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "eval"]
    values = logged(tmp_path)[8:]  # after step 1's 2 x 4 rollouts: 4 problems x 2 samples (2 a rank)
    assert len(values) == 8 and line["eval_scorer"] == f"--reward {rewards_file}:length"
    assert line["none_reward_mean"] == pytest.approx(sum(values) / 8) == line["average_reward_mean"]
    assert not [key for key in line if "pass@" in key]  # real-valued: no Pass@k
    assert "reward_mean = the mean reward of a sample" in (out / "eval_final.md").read_text()
    os.remove(tmp_path / "log.jsonl")
    ev = tmp_path / "ev"  # --eval-only on the export, with a 0/1 function: Pass@k as well
    cmd[cmd.index("--out") + 1], cmd[cmd.index("--model") + 1] = str(ev), str(out / "hf_final")
    cmd[cmd.index("--reward") + 1] = f"{rewards_file}:even"
    done = run(torchrun(2) + ["train_full.py", *cmd, "--eval-only"])
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.load(open(ev / "eval.json"))["results"]["none"]
    values = logged(tmp_path)
    assert len(values) == 8 and set(values) <= {0.0, 1.0}
    assert results["reward_mean"] == pytest.approx(sum(values) / 8)
    assert results["pass@1"] == pytest.approx(100 * sum(values) / 8) and "pass@2" in results


# A run learns under the worked example's reward: the default tiny model from its shipped warm start (weights/), D3S,
# 20 steps of 8 prompts x 8 rollouts at --lr 5e-5, about 20 s; the held-out closeness (--eval-reward train, 64
# problems) before and after. On the 2-core EPYC (2026-11-28), greedy 0.451 -> 0.708 and sampled 0.495 -> 0.592 on
# ATen's native path, 0.753 / 0.608 on its default path, 0.789 / 0.610 on avx2; a --lr 1e-12 control over 30 steps:
# greedy 0.451 -> 0.451, sampled 0.495 -> 0.466 (another step's sampling seeds).
LEARN = (
    "--reward {example}:closeness --eval-reward train --steps 20 --prompts-per-step 8 --group-size 8 --n-init 4 "
    "--n-final 8 --lr 5e-5 --warmup-steps 0 --eval-every 1000 --eval-size 64 --eval-samples 4 --pass-k 4 "
    "--explain-every 0 --threads 1"
)


def test_a_train_small_run_learns_under_the_closeness_reward(tmp_path):
    out = tmp_path / "run"
    train_small.main([*LEARN.format(example=EXAMPLE).split(), "--out", str(out), "--cache-dir", str(tmp_path)])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = [m for m in lines if m["kind"] == "eval"]
    assert first["warm_start"]["path"].startswith("weights/warmstart-")  # the shipped warm start, not a new one
    assert first["eval_scorer"] == last["eval_scorer"] == f"--reward {EXAMPLE}:closeness"
    assert last["eval_greedy_pass1"] > first["eval_greedy_pass1"] + 0.15, (first, last)
    assert last["eval_pass1_mean"] > first["eval_pass1_mean"] + 0.05, (first, last)


# The same on train_full.py: the shipped warm start as --model (an HF folder), --rollout hf on 2 gloo ranks, D3S, 20
# steps of 8 x 8 at --lr 5e-5, the held-out closeness (--eval-reward train: 64 problems x 4 samples at 0.6) before and
# after. On the 2-core EPYC (2026-11-28, ~30 s): 0.508 -> 0.703 on ATen's native, default and avx2 paths alike; a
# --lr 1e-12 control: 0.508 -> 0.508 (the evaluation's samples are seeded per problem).
LEARN_FULL = (
    "--template plain --rollout hf --device cpu --reward {example}:closeness --eval-reward train --steps 20 "
    "--prompts-per-step 8 --group-size 8 --n-init 4 --n-final 8 --lr 5e-5 --max-response-len 48 --eval-max-tokens 48 "
    "--eval-every 20 --eval-samples 4 --eval-pass-k 1 --save-every 1000"
)


def test_a_train_full_run_on_two_gloo_ranks_learns_under_the_closeness_reward(tmp_path):
    (model,) = pathlib.Path(warmstart.SHIPPED_DIR).glob("warmstart-*")  # the shipped warm start: an HF folder
    for split, n in (("train", 400), ("eval", 64)):  # the tiny model's task, as files
        rows = [{"problem": r["problem"], "answer": r["answer"]} for r in mathtask.step_problems(n, split, seed=0)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, data = (
        tmp_path / "full",
        ["--train-data", str(tmp_path / "train.jsonl"), "--eval-data", str(tmp_path / "eval.jsonl")],
    )
    cmd = [
        "train_full.py",
        "--model",
        str(model),
        *data,
        "--out",
        str(out),
        *LEARN_FULL.format(example=EXAMPLE).split(),
    ]
    done = subprocess.run(torchrun(2) + cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "eval"]
    assert (first["step"], last["step"]) == (0, 20) and last["eval_scorer"] == f"--reward {EXAMPLE}:closeness"
    assert last["eval_reward_mean"] > first["eval_reward_mean"] + 0.1, (first, last)
