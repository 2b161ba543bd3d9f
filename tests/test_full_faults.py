"""train_full.py against the faults of a cluster (issue 30): a preemption notice, a full disk; on CPU.

- SIGTERM or SIGUSR1 (what SLURM and Kubernetes send before they stop a job) to ONE rank of two: every rank
  finishes the step, the checkpoint of that step is written, rank 0 prints one line, every rank exits 75
  (stops.STOPPED); --resume then gives the metrics of the run that was never stopped, the evaluation that the
  stop skipped included.
- A disk that fills up right before a write (the checkpoint, the metrics line, an HF export, an explain page):
  one line, exit 74 (stops.DISK_FULL), the checkpoint before it intact; once the space is free, --resume
  continues to the metrics of the uninterrupted run. The disk is a small tmpfs (mounting one needs root, as in
  CI; skipped where refused) that tests/full_disk_worker.py fills just before the write, so the write meets a
  real ENOSPC.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(root / "tiny"))
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(16)))
    return model, str(data)


def flags(inputs, out, *extra):
    model, data = inputs
    return [
        "--model",
        model,
        "--train-data",
        data,
        "--eval-data",
        "none",
        "--out",
        str(out),
        "--template",
        "plain",
        "--rollout",
        "hf",
        "--device",
        "cpu",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-response-len",
        "12",
        "--max-prompt-len",
        "64",
        "--micro-batch-size",
        "3",
        "--mini-batches",
        "2",
        "--lr",
        "1e-2",
        "--grader-workers",
        "1",
        *extra,
    ]


def torchrun(nproc=2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]


def run(cmd, timeout=600):
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def lines(out):
    """metrics.jsonl without the clock, rate and memory readings (they differ from run to run)."""
    rows = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.endswith("_s") or "per_s" in k or k.startswith(("mem_", "gpu_", "mfu")))}
        for r in rows
    ]


def ours(stderr):
    """The lines train_full.py itself printed (torchrun adds its own summary)."""
    return [line for line in stderr.splitlines() if line.startswith("train_full.py:")]


# ---------------------------------------------------------------------------------------------
# A preemption notice
# ---------------------------------------------------------------------------------------------
def test_a_notice_to_one_rank_stops_every_rank_after_its_step_and_resume_equals_the_uninterrupted_run(inputs, tmp_path):
    import psutil

    steps = [
        "--steps",
        "6",
        "--save-every",
        "50",  # no --save-every step before the end: the notice's checkpoint
        "--eval-data",
        inputs[1],
        "--eval-every",
        "1",
        "--eval-limit",
        "2",
        "--eval-samples",
        "2",
        "--eval-max-tokens",
        "8",
        "--eval-pass-k",
        "1,2",
    ]  # the evaluation due at the stopped step runs first thing after --resume
    whole = tmp_path / "whole"
    done = run(torchrun() + [str(ROOT / "train_full.py"), *flags(inputs, whole, *steps)])
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        torchrun() + [str(ROOT / "train_full.py"), *flags(inputs, out, *steps)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and '"train"' in metrics.read_text()):  # step 1 is done: the loop (and its handler) on
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.1)
    workers = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children()}
    workers["1"].send_signal(signal.SIGUSR1)  # rank 1 alone: the ranks must agree at the step's end
    err = proc.communicate(timeout=300)[1]
    stopped = sorted(d for d in os.listdir(out / "checkpoints"))
    assert len(stopped) == 1 and not stopped[0].endswith(".tmp"), stopped
    step = int(stopped[0].split("_")[1])
    assert 1 <= step < 6, step
    assert ours(err) == [
        f"train_full.py: stopped by SIGUSR1 after step {step}; checkpoint {out / 'checkpoints' / stopped[0]}; "
        "continue with --resume"
    ], err[-3000:]
    assert err.count("exitcode  : 75") == 2 or "exitcode: 75" in err or "exit code 75" in err, err[-3000:]  # both ranks
    kinds = [(r["kind"], r["step"]) for r in lines(out)]
    assert kinds == [("eval", 0)] + [(k, s) for s in range(1, step) for k in ("train", "eval")] + [("train", step)], (
        kinds
    )
    assert not (out / "hf_final").exists()
    resumed = run(torchrun() + [str(ROOT / "train_full.py"), *flags(inputs, out, *steps, "--resume")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert lines(out) == lines(whole)


# ---------------------------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------------------------
EVERY_WRITE = [
    "--steps",
    "3",
    "--save-every",
    "1",
    "--keep-checkpoints",
    "3",
    "--export-every",
    "1",
    "--explain-every",
    "1",
]


@pytest.fixture(scope="module")
def whole_run(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    done = run([sys.executable, str(ROOT / "train_full.py"), *flags(inputs, out, *EVERY_WRITE)])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("what", ["checkpoint", "metrics", "export", "explain"])
def test_a_full_disk_stops_the_run_with_one_line_keeps_the_last_checkpoint_and_resume_continues(
    inputs, whole_run, small_disk, what
):
    out, filler = small_disk[0] / "run", small_disk[0] / "filler"
    cmd = [sys.executable, str(ROOT / "tests" / "full_disk_worker.py"), what, "2", str(filler)]
    failed = run(cmd + flags(inputs, out, *EVERY_WRITE))
    assert failed.returncode == 74, (failed.returncode, failed.stderr[-3000:])
    (line,) = ours(failed.stderr)
    assert line.startswith("train_full.py: error: no space left on the device while writing ") and line.endswith(
        f"(No space left on device); the last checkpoint in {out} is intact: free space, then continue with --resume"
    ), line
    assert "Traceback" not in failed.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001"]  # step 2's: not written, its .tmp removed
    assert [r["step"] for r in lines(out)][0] == 1 and not (out / "hf_final").exists()
    filler.unlink()  # the space is free again
    resumed = run([sys.executable, str(ROOT / "train_full.py"), *flags(inputs, out, *EVERY_WRITE, "--resume")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert lines(out) == lines(whole_run)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001", "step_000002", "step_000003"]
    assert (out / "hf_step_000002").is_dir() and (out / "explain" / "step_000002.html").exists()


def test_a_full_disk_at_rank_0s_metrics_line_stops_both_ranks_with_one_line(inputs, small_disk):
    """Only rank 0 writes metrics.jsonl: rank 1 learns of the full disk at the step's end (one all-reduce) and
    stops there too, instead of waiting in the next collective."""
    out, filler = small_disk[0] / "run", small_disk[0] / "filler"
    start = time.time()
    failed = run(
        torchrun()
        + [str(ROOT / "tests" / "full_disk_worker.py"), "metrics", "2", str(filler), *flags(inputs, out, *EVERY_WRITE)]
    )
    assert failed.returncode != 0 and time.time() - start < 240
    assert len(ours(failed.stderr)) == 1 and "no space left on the device" in ours(failed.stderr)[0], failed.stderr[
        -3000:
    ]
    assert "exitcode  : 74" in failed.stderr and "failed; ending the job" not in failed.stderr, failed.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001"]


# ---------------------------------------------------------------------------------------------
# What counts as a full disk (stops.disk_full, shared by both trainers)
# ---------------------------------------------------------------------------------------------
def test_a_full_disk_is_recognised_in_each_form_its_writers_raise_and_nothing_else_is(tmp_path, monkeypatch):
    import errno
    import shutil

    from support import stops

    enospc = OSError(errno.ENOSPC, "No space left on device", "x.pt")
    assert stops.disk_full(enospc) is enospc
    assert stops.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")).errno == errno.EDQUOT
    assert (
        stops.disk_full(Exception("I/O error: No space left on device (os error 28)"), "m").filename == "m"
    )  # safetensors
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = enospc
    assert stops.disk_full(wrapped) is enospc
    dcp = BaseException("CheckpointException ranks:dict_keys([1])")
    dcp.failures = {1: (enospc, "traceback")}  # DCP: each rank's (exception, traceback)
    assert stops.disk_full(dcp) is enospc
    for other in (
        OSError(errno.EACCES, "Permission denied"),
        ValueError("No space"),
        RuntimeError("unexpected pos 64"),
    ):
        assert stops.disk_full(other, str(tmp_path)) is None  # not a full disk: raised on as it is
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=stops.NEARLY_FULL - 1))
    full = stops.disk_full(RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64"), str(tmp_path / "c"))
    assert full.errno == errno.ENOSPC and full.filename == str(tmp_path / "c")  # torch.save's zip writer on a full disk
    assert stops.disk_full(KeyError("step"), str(tmp_path)) is None  # a nearly full disk does not make every error one
