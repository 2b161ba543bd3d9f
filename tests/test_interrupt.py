"""Ctrl-C (issue 35): real SIGINTs to real processes, delivered as a terminal does, to the whole process group.

- train_small.py: a first Ctrl-C finishes the step, writes its checkpoint, prints one line and exits 75
  (stops.STOPPED); --resume then equals the run that was never stopped. A second Ctrl-C during a checkpoint write
  stops at once: one line, exit 130 (stops.INTERRUPTED), no traceback, and the checkpoint before it loads.
- train_full.py on 2 gloo ranks: a Ctrl-C to torchrun (which forwards one SIGINT to each rank: its workers run in
  their own session) stops every rank after the same step, with that step's checkpoint; --resume equals the
  uninterrupted run.
- toy/bandit.py and experiments/toy_ladder.py, with a pool of worker processes: one line, exit 130, no traceback
  from the parent or from any worker.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from support import stops, checkpoint
from test_full_faults import flags as full_flags, inputs, lines as full_lines, ours, torchrun  # noqa: F401 (fixture)
from test_train_small import ROOT, assert_same_run, cache_dir, read_jsonl, two_answer_data, whole_run  # noqa: F401

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def start(cmd):
    """The command in a process group of its own, as a terminal runs a foreground job."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def ctrl_c(proc):
    """What a terminal sends on Ctrl-C: SIGINT to every process of the foreground group (children included)."""
    os.killpg(proc.pid, signal.SIGINT)


def wait_for(proc, ready, what, timeout=600):
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, (
            f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        )
        time.sleep(0.2)


def trained(out):
    return lambda: (out / "metrics.jsonl").exists() and '"train"' in (out / "metrics.jsonl").read_text()


def test_a_ctrl_c_mid_run_stops_after_its_step_with_a_checkpoint_and_resume_equals_the_uninterrupted_run(
    tmp_path, whole_run
):
    flags, whole = whole_run
    out = tmp_path / "interrupted"
    slow = os.path.join(ROOT, "tests", "small_slow_worker.py")  # 1 s after each train line: the Ctrl-C lands mid-run
    proc = start([sys.executable, slow, "1.0"] + flags + ["--out", str(out), "--save-every", "50"])
    wait_for(proc, trained(out), "its first step")  # a step has run: the loop (and its handler) is on
    ctrl_c(proc)  # the grader's children get it too: they leave it to the parent
    err = proc.communicate(timeout=300)[1]
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]  # no --save-every step before 6: Ctrl-C's
    lines = [line for line in err.splitlines() if line.startswith("train_small.py:")]
    assert proc.returncode == stops.STOPPED and lines == [
        f"train_small.py: stopped by SIGINT (Ctrl-C) after step {step}; checkpoint {out / 'checkpoint.pt'}; continue "
        "with --resume"
    ], (proc.returncode, err[-3000:])
    assert "Traceback" not in err and 1 <= step < 6 and not (out / "final").exists()
    assert max(m["step"] for m in read_jsonl(out / "metrics.jsonl")) == step
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_small.py")] + flags + ["--out", str(out), "--resume"],
        cwd=ROOT,
        env=ENV,
        check=True,
        capture_output=True,
    )
    assert_same_run(whole, out)


def test_a_second_ctrl_c_during_the_checkpoint_write_stops_at_once_and_the_previous_checkpoint_loads(
    tmp_path, whole_run
):
    """tests/small_stall_worker.py leaves step 6's checkpoint half written in checkpoint.pt.tmp and waits there (where a
    real write would be when the Ctrl-Cs land); the first Ctrl-C asks for a stop after the step, the second stops now."""
    flags, whole = whole_run
    out = tmp_path / "twice"
    proc = start(
        [sys.executable, os.path.join(ROOT, "tests", "small_stall_worker.py"), "6"] + flags + ["--out", str(out)]
    )
    for line in proc.stderr:  # tqdm's lines end in \r: a \n-ended line is a message
        if "half written, stalled" in line:
            break
    ctrl_c(proc)
    time.sleep(1.0)  # two signals that arrive together are one
    ctrl_c(proc)
    err = proc.stderr.read()
    proc.wait(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("train_small.py:")]
    assert proc.returncode == stops.INTERRUPTED and lines == [
        "train_small.py: stopped at once by a second Ctrl-C (SIGINT); the last checkpoint written is intact; continue "
        "with --resume"
    ], (proc.returncode, err[-3000:])
    assert "Traceback" not in err and (out / "checkpoint.pt.tmp").exists()
    assert checkpoint.read_file(str(out / "checkpoint.pt"), "train_small.py")["step"] == 3  # complete, loadable
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_small.py")] + flags + ["--out", str(out), "--resume"],
        cwd=ROOT,
        env=ENV,
        check=True,
        capture_output=True,
    )
    assert_same_run(whole, out)


def test_a_ctrl_c_to_torchrun_stops_both_gloo_ranks_after_the_same_step_and_resume_equals_the_uninterrupted_run(
    inputs, tmp_path
):  # noqa: F811
    steps = ["--steps", "6", "--save-every", "50"]  # no --save-every step before the end: Ctrl-C's checkpoint
    whole = tmp_path / "whole"
    done = subprocess.run(
        torchrun() + [str(ROOT / pathlib.Path("train_full.py")), *full_flags(inputs, whole, *steps)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "interrupted"
    proc = start(torchrun() + [os.path.join(ROOT, "train_full.py"), *full_flags(inputs, out, *steps)])
    wait_for(proc, trained(out), "its first step")
    ctrl_c(proc)  # torchrun alone is in this group: it forwards one SIGINT to each rank
    err = proc.communicate(timeout=300)[1]
    (stopped,) = os.listdir(out / "checkpoints")
    step = int(stopped.split("_")[1])
    assert 1 <= step < 6 and not stopped.endswith(".tmp"), stopped
    assert ours(err) == [
        f"train_full.py: stopped by SIGINT (Ctrl-C) after step {step}; checkpoint "
        f"{out / 'checkpoints' / stopped}; continue with --resume"
    ], err[-3000:]
    assert not any(f'{name}", line' in err for name in ("train_full.py", "support/run.py", "support/stops.py")), err[
        -3000:
    ]  # no
    # traceback from a rank (torchrun's own SignalException is the launcher's)
    assert sorted(f for f in os.listdir(out / "checkpoints" / stopped) if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # both ranks wrote that step's checkpoint (torchrun, told to stop, lists no exit
    # codes: it forwards the SIGINT, waits for its workers, then raises its own SignalException, exit 1)
    assert [(r["kind"], r["step"]) for r in full_lines(out)][-1] == ("train", step)
    resumed = subprocess.run(
        torchrun() + [os.path.join(ROOT, "train_full.py"), *full_flags(inputs, out, *steps, "--resume")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert full_lines(out) == full_lines(whole)


@pytest.mark.parametrize(
    "script,prog", [("toy/bandit.py", "bandit.py"), ("experiments/toy_ladder.py", "toy_ladder.py")]
)
def test_a_ctrl_c_stops_the_toy_and_an_experiment_with_one_line_and_no_traceback(tmp_path, script, prog):
    proc = start(
        [
            sys.executable,
            os.path.join(ROOT, script),
            "--seeds",
            "4",
            "--workers",
            "2",
            "--steps",
            "2000",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    seen = []
    while "runs:" not in "".join(seen[-8:]):  # the pool's bar: its workers are running
        seen.append(proc.stderr.read(1))
        assert seen[-1] or proc.poll() is None, "".join(seen)
    time.sleep(1.0)
    ctrl_c(proc)
    err = "".join(seen) + proc.communicate(timeout=120)[1]
    assert proc.returncode == stops.INTERRUPTED, (proc.returncode, err[-3000:])
    assert [line for line in err.splitlines() if line.startswith(prog)] == [
        f"{prog}: stopped by Ctrl-C (SIGINT); run the same command again"
    ], err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
