"""The requeue files of docs/train_full.md ("A requeue that resumes"), run as written on 2 gloo ranks on the CPU:
scripts/train_full.sbatch with bash (its #SBATCH lines are comments; without SLURM_JOB_ID it never calls scontrol)
and the container command of scripts/train_full_job.yaml. Each serves three starts with one command line: the first
(stopped after step 1, as a preemption would), the requeue that continues it to the numbers of a run never stopped,
and a start of the finished run (one line, exit 0). What a cluster runs is changed only in the tiny run's flags
(D3S_FLAGS, or appended to the Job's command), 2 ranks for 8 and the run folder."""

import os
import pathlib
import shlex
import socket
import subprocess

import yaml

from test_full_faults import ENV, ROOT, flags, inputs, lines, ours, run, torchrun  # noqa: F401 (inputs: a fixture)

BIN = os.path.dirname(os.path.abspath(__import__("sys").executable))  # torchrun, as on the cluster's PATH


def tiny_flags(inputs, out):
    """The tiny run's flags less --out (the files give their own)."""
    argv = flags(inputs, out, "--steps", "2")
    i = argv.index("--out")
    return argv[:i] + argv[i + 2 :]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_slurm_batch_file_starts_requeues_and_finishes_a_run_with_one_command_line(inputs, tmp_path):
    whole = tmp_path / "whole"
    assert run(torchrun() + ["train_full.py", *flags(inputs, whole, "--steps", "2")]).returncode == 0
    out = tmp_path / "slurm"

    def sbatch(*extra):
        env = {**ENV, "PATH": BIN + os.pathsep + ENV.get("PATH", ""), "GPUS": "2", "OUT": str(out)}
        env.update(D3S_FLAGS=shlex.join(tiny_flags(inputs, out) + list(extra)), PET_MASTER_PORT=free_port())
        return subprocess.run(
            ["bash", "scripts/train_full.sbatch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )

    first = sbatch("--stop-after", "1")
    assert first.returncode == 0 and [r["step"] for r in lines(out)] == [1], first.stderr[-3000:]
    second = sbatch()  # the requeued job: the same command line
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stderr[-3000:]
    assert lines(out) == lines(whole)
    third = sbatch()
    assert third.returncode == 0 and f"the run in {out} already finished its 2 steps" in third.stdout, third
    assert not ours(third.stderr) and lines(out) == lines(whole)


def test_the_kubernetes_jobs_command_starts_continues_and_finishes_a_run(inputs, tmp_path):
    (container,) = yaml.safe_load((ROOT / "scripts" / "train_full_job.yaml").read_text())["spec"]["template"]["spec"][
        "containers"
    ]
    command = container["command"]
    assert command[:3] == ["torchrun", "--nproc_per_node=8", "train_full.py"] and command[-2:] == ["--resume", "auto"]
    out = tmp_path / "job"
    command = [c.replace("--nproc_per_node=8", "--nproc_per_node=2") for c in command]
    command[command.index("--out") + 1] = str(out)
    env = {**ENV, "PATH": BIN + os.pathsep + ENV.get("PATH", "")}
    job = lambda *extra: subprocess.run(
        command + tiny_flags(inputs, out) + list(extra),
        cwd=ROOT,
        env={**env, "PET_MASTER_PORT": free_port()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job("--stop-after", "1").returncode == 0 and [r["step"] for r in lines(out)] == [1]
    restarted = job()
    assert restarted.returncode == 0 and [r["step"] for r in lines(out)] == [1, 2], restarted.stderr[-3000:]
    done = job()
    assert done.returncode == 0 and "already finished its 2 steps" in done.stdout, done.stderr[-3000:]
    assert pathlib.Path(out, "hf_final").is_dir()
