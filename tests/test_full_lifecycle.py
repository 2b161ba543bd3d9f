"""train_full.py under what a cluster and a person do to it (issue 46), with real processes and real signals on CPU.

- One writer per run folder: a second launch into the --out of a running run, fresh or --resume, stops with one line
  and exit 2 on every rank; the first run finishes whole (each metrics line once).
- A finished run is refused on --resume; a run killed between its last checkpoint and its end (OUT/hf_final, the
  final evaluation) finishes what is missing on --resume, once.
- torchrun killed: its orphaned ranks stop after the step they are in, with its checkpoint, and exit.
- SIGHUP to torchrun (a closed terminal): a notice, as SIGTERM.
- Ctrl-C in the first seconds (torch still importing, the process group forming): one line, no traceback, every
  rank gone.
- --eval-only on a model with NaN weights: one line naming it, exit 2.
- --eval-temperature 0 with --rollout hf and --eval-samples above 1: one greedy answer counted n times, said so.
(A rank's failure line starting on its own line: tests/test_full_hf_rollout.py.)
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from support import tiny
from test_full_faults import ENV, ROOT, flags, inputs, lines, ours, run, torchrun  # noqa: F401 (inputs: a fixture)

WORKER = str(ROOT / "tests" / "full_lifecycle_worker.py")
TRAIN_FULL = str(ROOT / "train_full.py")


def start(cmd):
    """A command in a process group of its own (as a terminal runs a foreground job), stderr piped."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_step(proc, out, step=1, timeout=300):
    """Until metrics.jsonl holds the train line of `step`: the run is in its loop."""
    deadline, metrics = time.time() + timeout, out / "metrics.jsonl"
    while not (metrics.exists() and any(r["kind"] == "train" and r["step"] >= step for r in lines(out))):
        assert proc.poll() is None and time.time() < deadline, f"the run ended first: {proc.communicate()[1][-3000:]}"
        time.sleep(0.2)


def kinds(out):
    return [(r["kind"], r["step"]) for r in lines(out)]


def gone(pids, timeout):
    """Whether every process of `pids` has ended within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.5)
    return False


def test_a_second_launch_into_a_running_runs_out_stops_with_one_line_and_the_first_finishes_whole(inputs, tmp_path):
    out, steps, hold = tmp_path / "run", ["--steps", "6", "--save-every", "2"], tmp_path / "hold"
    hold.touch()  # the first run waits after its step 1 until the second launches are done
    first = start(torchrun() + [WORKER, "held", str(hold), *flags(inputs, out, *steps)])
    wait_for_step(first, out)
    for extra in ([], ["--resume"]):  # fresh, and --resume (the first's step-2 checkpoint may be there or not)
        second = run(torchrun() + [TRAIN_FULL, *flags(inputs, out, *steps, *extra)])
        assert second.returncode != 0 and "exitcode  : 2" in second.stderr, second.stderr[-3000:]
        (line,) = set(ours(second.stderr))  # rank 0's line (another rank's, the same, if torchrun let it print)
        assert line == (
            f"train_full.py: error: --out {out}: another train_full.py is writing there now ({out / '.lock'}); "
            "wait for it to end, or use another --out"
        ), line
    hold.unlink()
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    assert kinds(out) == [("train", s) for s in range(1, 7)], kinds(out)  # each once: no second writer (no eval data)
    assert (out / "hf_final").is_dir() and sorted(os.listdir(out / "checkpoints")) == ["step_000004", "step_000006"]


def test_a_finished_run_is_refused_and_one_killed_before_its_end_finishes_it_once(inputs, tmp_path):
    out = tmp_path / "run"
    evals = ["--eval-data", inputs[1], "--eval-limit", "2", "--eval-samples", "2", "--eval-max-tokens", "8"]
    steps = ["--steps", "2", "--save-every", "1", *evals, "--eval-pass-k", "1,2"]
    killed = run([sys.executable, WORKER, "killed-at-the-end", *flags(inputs, out, *steps)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert kinds(out) == [("train", 1), ("train", 2)] and not (out / "hf_final").exists()  # --eval-every 0: the end's
    finished = run([sys.executable, TRAIN_FULL, *flags(inputs, out, *steps, "--resume")])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert kinds(out) == [("train", 1), ("train", 2), ("eval", 2)] and (out / "hf_final").is_dir()
    again = run([sys.executable, TRAIN_FULL, *flags(inputs, out, *steps, "--resume")])
    assert again.returncode == 2 and ours(again.stderr) == [
        f"train_full.py: error: --resume {out / 'checkpoints' / 'step_000002'}: the run already finished its 2 steps "
        "(OUT/hf_final and its final evaluation are written); start a new run with another --out"
    ], again.stderr[-3000:]
    assert kinds(out) == [("train", 1), ("train", 2), ("eval", 2)]  # nothing appended


@pytest.mark.parametrize("how", ["SIGKILL to torchrun", "SIGHUP to torchrun"])
def test_a_rank_whose_launcher_died_or_hung_up_stops_after_its_step_with_a_checkpoint(inputs, tmp_path, how):
    out = tmp_path / "run"
    proc = start(torchrun() + [WORKER, "slow", "2", *flags(inputs, out, "--steps", "40", "--save-every", "50")])
    wait_for_step(proc, out)
    ranks = [p.pid for p in psutil.Process(proc.pid).children()]
    assert len(ranks) == 2
    proc.send_signal(signal.SIGKILL if "KILL" in how else signal.SIGHUP)  # the launcher only, as nohup or a crash
    assert gone(ranks, 120), f"{how}: a rank still runs"
    err = proc.communicate(timeout=60)[1]
    (stopped,) = os.listdir(out / "checkpoints")
    step = int(stopped.split("_")[1])
    assert sorted(f for f in os.listdir(out / "checkpoints" / stopped) if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # both ranks wrote the checkpoint of the same step
    notice = "the end of its launcher (torchrun's process is gone)" if "KILL" in how else "SIGHUP"
    assert f"train_full.py: stopped by {notice} after step {step}; checkpoint {out / 'checkpoints' / stopped}" in err
    assert kinds(out)[-1] == ("train", step) and step < 40


def started_ranks(proc, ranks=2, timeout=60):
    """The pids of torchrun's rank processes, as soon as it has started them."""
    deadline = time.time() + timeout
    while len(children := psutil.Process(proc.pid).children()) < ranks:
        assert proc.poll() is None and time.time() < deadline, "torchrun started no ranks"
        time.sleep(0.05)
    return [p.pid for p in children]


def test_a_ctrl_c_in_the_first_seconds_ends_every_rank_with_one_line_and_no_traceback(inputs, tmp_path):
    # after the ranks start: torch importing; the data, the process group forming. (Before train_full.py's first line
    # runs, in the interpreter's own start, about 0.1 s, a Ctrl-C is Python's: docs/train_full.md)
    for delay in (0.5, 1.5, 3.0):
        out = tmp_path / f"run{delay}"
        proc = start(torchrun() + [TRAIN_FULL, *flags(inputs, out, "--steps", "40")])
        ranks = started_ranks(proc)  # (a Ctrl-C before: torchrun's own, while it imports torch itself)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: torchrun forwards one SIGINT to each rank
        assert gone(ranks, 30), f"after {delay} s: a rank still runs"
        err = proc.communicate(timeout=60)[1]
        assert "KeyboardInterrupt" not in err and 'train_full.py", line' not in err, err[-3000:]
        # before the loop: the line of a Ctrl-C; in it (a fast start), the notice's after its step
        assert len(set(ours(err))) <= 1 and all(line.startswith("train_full.py: stopped by") for line in ours(err))


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    return tiny.save_tiny(model, tokenizer, str(tmp_path_factory.mktemp("nan") / "model"))


def test_eval_only_names_a_model_with_nan_weights_before_it_evaluates(inputs, nan_model, tmp_path):
    _, data = inputs
    done = run(
        [sys.executable, TRAIN_FULL, "--eval-only", "--model", nan_model, "--eval-data", data, *eval_flags(tmp_path)]
    )
    assert done.returncode == 2 and ours(done.stderr) == [
        f"train_full.py: error: --model {nan_model}: its weights hold NaN or inf (model.layers.0.mlp.down_proj.weight); "
        "its weights are damaged or were saved from a diverged run: pass another model"
    ], done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "eval" / "eval.md")


def eval_flags(tmp_path):
    return ["--out", str(tmp_path / "eval"), "--template", "plain", "--rollout", "hf", "--device", "cpu"] + [
        "--eval-limit",
        "3",
        "--eval-max-tokens",
        "8",
        "--grader-workers",
        "1",
    ]


def test_greedy_evaluation_with_the_hf_engine_counts_one_answer_n_times(inputs, tmp_path):
    model, data = inputs
    done = run(
        [sys.executable, TRAIN_FULL, "--eval-only", "--model", model, "--eval-data", data]
        + eval_flags(tmp_path)
        + ["--eval-temperature", "0", "--eval-samples", "4", "--eval-pass-k", "1,4"]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "eval" / "eval.md").read_text()
    assert "One greedy answer per problem (--eval-temperature 0), counted as all 4 samples" in report
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]
    row = next(r for name, r in results.items() if name != "average")
    assert row["pass@1"] == row["pass@4"] and set(row["correct"]) <= {0, 4}  # each problem: all right or all wrong
