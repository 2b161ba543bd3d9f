"""--report-to end to end (issue 54): train_small and train_full on 2 gloo ranks send every metrics.jsonl line to
TensorBoard, wandb (offline, no credentials) and trackio at once, and what each stored, read back with its own reader
(tests/test_track.py's), equals metrics.jsonl key for key and step for step; the explain page's figure is there at
its step. A resume after a run that logged past its checkpoint (the state a SIGKILL leaves: the step-3 checkpoint and
metrics up to step 5) shows each step once: TensorBoard and trackio with the resumed run's values; wandb, which does
not rewrite a run's history, as a second launch of the same run id holding the resumed steps (support/track.py)."""

import json
import os
import shutil
import subprocess
import sys

from test_full_faults import ENV, ROOT, flags, inputs, torchrun  # noqa: F401 (inputs: a fixture)
from test_track import expected, offline, read_tensorboard, read_trackio, read_wandb, same, trackio_dir  # noqa: F401
from test_track import wandb_runs
from test_train_small import TINY, cache_dir, two_answer_data  # noqa: F401 (fixtures)

import train_small

TRACKERS = ["--report-to", "tensorboard", "wandb", "trackio", "--project", "runs"]


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]


def scalars_and_images(got):
    """A reader's {(key, step): value} split into the scalars and the steps of the explain figure."""
    image = lambda key: key == "explain" or key.startswith("explain.")  # wandb: the image's fields
    return {k: v for k, v in got.items() if not image(k[0])}, {step for key, step in got if image(key)}


def test_train_small_sends_every_line_to_each_tracker_and_a_resume_shows_each_step_once(
    tmp_path, cache_dir, two_answer_data, offline, trackio_dir
):
    train_file, eval_file = two_answer_data
    out = tmp_path / "small"
    run = TINY + ["--steps", "6", "--train-file", train_file, "--eval-file", eval_file, "--cache-dir", cache_dir]
    run += ["--out", str(out), "--explain-every", "2", "--run-name", "small", *TRACKERS]
    train_small.main(run + ["--stop-after", "3"])
    shutil.copy(out / "checkpoint.pt", tmp_path / "step3.pt")
    train_small.main(run + ["--resume", "--stop-after", "5"])  # logs steps 4 and 5 ...
    shutil.copy(tmp_path / "step3.pt", out / "checkpoint.pt")  # ... and is "killed" before their checkpoint
    train_small.main(run + ["--resume"])  # continues from step 3 to 6
    lines = metrics(out)
    assert [m["step"] for m in lines if m["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    want = expected(lines)
    board, images = read_tensorboard(out)
    same(board, want, float32=True)  # each (key, step) once: read_tensorboard fails on a repeat
    assert {("explain", 2), ("explain", 4), ("explain", 6)} <= images
    got, shown = scalars_and_images(read_trackio("runs", "small"))
    same(got, want)
    assert {2, 4, 6} <= shown
    launches = [read_wandb(d) for d in wandb_runs(out)]
    assert len(launches) == 3 and len({run["run_id"] for _, run in launches}) == 1  # one run, launched 3 times
    resumed = [m for m in lines if m["step"] > 3 or (m["kind"] == "eval" and m["step"] == 6)]
    same(scalars_and_images(launches[-1][0])[0], expected(resumed))


def test_train_full_on_two_ranks_sends_rank_0s_lines_to_each_tracker(inputs, tmp_path, offline, trackio_dir):
    out = tmp_path / "full"
    argv = flags(inputs, out, "--steps", "2", "--explain-every", "1", "--run-name", "full", *TRACKERS)
    env = {**ENV, "HOME": os.environ["HOME"], "TRACKIO_DIR": trackio_dir}
    env = {k: v for k, v in env.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        torchrun() + [str(ROOT / "train_full.py"), *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = expected(metrics(out))
    board, images = read_tensorboard(out)
    same(board, want, float32=True)
    assert {("explain", 1), ("explain", 2)} <= images
    assert len(os.listdir(out / "tensorboard")) == 1 and len(wandb_runs(out)) == 1  # rank 0 alone writes
    for got in (read_wandb(wandb_runs(out)[0])[0], read_trackio("runs", "full")):
        got, shown = scalars_and_images(got)
        same(got, want)
        assert shown == {1, 2}
    assert sum("wandb sync" in line for line in proc.stdout.splitlines()) == 1, proc.stdout  # offline: one line
    assert sys.executable  # (the venv's python ran torchrun)


def test_the_toy_ladder_sends_each_run_to_the_trackers_as_method_and_seed_in_one_group(tmp_path, trackio_dir):
    """experiments/toy_ladder.py --report-to: one tracker run per method and seed (METHOD__SEED), its lines those of
    metrics.jsonl, the ladder one trackio group."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import toy_ladder

    out = tmp_path / "toy"
    argv = ["--seeds", "2", "--steps", "3", "--methods", "grpo", "d3s", "--workers", "1", "--out", str(out)]
    toy_ladder.main(argv + ["--report-to", "tensorboard", "trackio", "--project", "toy"])
    lines = metrics(out)
    for method in ("grpo", "d3s"):
        for seed in (0, 1):
            want = expected([m for m in lines if m["method"] == method and m["seed"] == seed])
            same(read_tensorboard(out / "track" / f"{method}__{seed}")[0], want, float32=True)
            same(read_trackio("toy", f"{method}__{seed}"), want)
    from trackio.sqlite_storage import SQLiteStorage

    assert sorted(SQLiteStorage.get_runs("toy")) == ["d3s__0", "d3s__1", "grpo__0", "grpo__1"]
