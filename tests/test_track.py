"""support/track.py with the real packages (requirements/track.txt), on CPU, offline: what each tracker stored, read
back with its own reader (TensorBoard's EventAccumulator, wandb's `wandb leet inspect --json` of the offline run's
transaction log, trackio's SQLiteStorage), against the metrics.jsonl lines that went in; a resume; check(); a
tracker that fails mid-run; wandb without credentials; rank 0 only. The end-to-end runs (train_small, train_full)
are the lead's."""

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from support import cli, track

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
installed = {name: importlib.util.find_spec(name) is not None for name in track.TRACKERS}
needs = {
    name: pytest.mark.skipif(not ok, reason=f"pip install -r requirements/track.txt ({name})")
    for name, ok in installed.items()
}


def train_line(step, rng):
    """A train_small train line with the keys of docs/metrics.md (small): floats, ints, a bool, None, a str, a list."""
    kept = rng.randint(8, 64)
    return {
        "kind": "train",
        "step": step,
        "reward_mean": rng.random(),
        "acc_train": rng.random(),
        "groups_mixed": rng.random(),
        "n_keep": 8,
        "k_frac": 0.5,
        "k_real": rng.random(),
        "kept_samples": kept,
        "sur": rng.random(),
        "kept_tokens": rng.randint(100, 5000),
        "fwd_tokens": rng.randint(5000, 9000),
        "gen_tokens": rng.randint(9000, 20000),
        "kept_tokens_frac": rng.random(),
        "kept_adv_var": rng.random(),
        "grad_norm": rng.random() * 3,
        "entropy_mean": rng.random(),
        "entropy_kept": rng.random(),
        "kl_ref": None if step % 2 else rng.random() / 100,
        "kl_ref_all": None,
        "sample_rule": "cross",
        "clip_frac": rng.random() / 10,
        "loss": rng.random() - 0.5,
        "updates": 2,
        "skipped": step == 2,
        "response_len": 30 + rng.random() * 10,
        "clip_frac_by_minibatch": [0.0, rng.random() / 10],
        "grader_timeouts": 0,
        "gen_s": rng.random(),
        "reward_s": rng.random() / 10,
        "train_s": rng.random(),
        "pass1_s": rng.random() / 5,
    }


def eval_line(step, rng):
    line = {
        "kind": "eval",
        "step": step,
        "eval_greedy_pass1": rng.random(),
        "eval_pass1_mean": rng.random(),
        "eval_passk": rng.random(),
        "k": 4,
        "n": 8,
        "eval_pass1_mean_level1": rng.random(),
        "eval_s": rng.random() * 10,
        "samples": 64 * step,
        "tokens": 3000 * step,
        "fwd_tokens": 7000 * step,
        "gen_s": rng.random() * step,
        "train_s": rng.random() * step,
        "skipped": 1,
    }
    if step == 0:
        line["warm_start"] = {"sft_steps": 40, "loss": 0.7, "path": "weights/x"}
    return line


def run_lines(steps, seed=0, first=1):
    """eval 0 (on a fresh run), train first..steps, eval at the last step: the order train_small writes them."""
    rng = random.Random(seed)
    lines = [eval_line(0, rng)] if first == 1 else []
    return lines + [train_line(s, rng) for s in range(first, steps + 1)] + [eval_line(steps, rng)]


def expected(lines):
    """{(key, step): value}: what each tracker should show (track.scalars: the module docstring's rules)."""
    return {(key, line["step"]): value for line in lines for key, value in track.scalars(line).items()}


def make_args(out, report_to, **more):
    p = cli.parser("test", "test", [cli.flag("--out", None), cli.flag("--seed", 0), *track.FLAGS])
    args = p.parse_args(["--out", str(out), "--report-to", *report_to, *more.pop("argv", [])])
    track.check(p, args)
    return args


def png(path):
    from PIL import Image

    Image.fromarray(np.full((24, 32, 3), 200, dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No wandb credentials: HOME in tmp (no ~/.netrc, no ~/.config/wandb), no WANDB_* from the caller."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, at its import: set it into tmp before, so that nothing goes to ~."""
    path = str(tmp_path_factory.mktemp("trackio"))
    if "trackio" in sys.modules:
        from trackio.utils import TRACKIO_DIR

        assert str(TRACKIO_DIR) == os.environ.get("TRACKIO_DIR"), "trackio was imported before its dir was set"
        return str(TRACKIO_DIR)
    os.environ["TRACKIO_DIR"] = path
    import trackio.utils

    assert str(trackio.utils.TRACKIO_DIR) == path
    return path


# ---- readers: each tracker's own ----


def read_tensorboard(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert (tag, event.step) not in got, f"{tag} at step {event.step} twice"
            got[tag, event.step] = event.value
    images = {(tag, e.step) for tag in acc.Tags()["images"] for e in acc.Images(tag)}
    return got, images


def read_wandb(sync_dir):
    """The history of one offline run folder, through `wandb leet inspect --json` (wandb-core reading the .wandb
    transaction log): ({(key, step): value}, the run record)."""
    wandb_bin = os.path.join(os.path.dirname(sys.executable), "wandb")
    (log,) = [f for f in os.listdir(sync_dir) if f.endswith(".wandb")]
    out = subprocess.run(
        [wandb_bin, "leet", "inspect", "--json", os.path.join(sync_dir, log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    got, run = {}, None
    for r in records:
        if r["type"] == "run":
            run = r["run"]
        if r["type"] == "history":
            step = r["history"]["step"].get("num", 0)
            for key, value in r["history"]["item"].items():
                if not key.startswith("_"):
                    assert (key, step) not in got, f"{key} at step {step} twice"
                    got[key, step] = value
    return got, run


def wandb_runs(out):
    base = os.path.join(out, "wandb")
    return sorted(os.path.join(base, d) for d in os.listdir(base) if d.startswith("offline-run-"))


def read_trackio(project, name):
    from trackio.sqlite_storage import SQLiteStorage

    got, count = {}, {}
    for row in SQLiteStorage.get_logs(project, run=name):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                count[key, row["step"]] = count.get((key, row["step"]), 0) + 1
                got[key, row["step"]] = value
    twice = [k for k, c in count.items() if c > 1]
    assert not twice, f"twice: {twice[:5]}"
    return got


def same(got, want, float32=False):
    """got holds every (key, step) of want, nothing else, with its value (float32: as TensorBoard rounds it)."""
    assert set(got) == set(want), (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    for k, v in want.items():
        if float32:
            assert got[k] == np.float32(v), (k, got[k], v)
        else:
            assert got[k] == v, (k, got[k], v)


# ---- each tracker: what went in comes back ----


@needs["tensorboard"]
def test_tensorboard_stores_every_line(tmp_path):
    lines = run_lines(12)
    trackers = track.Trackers(make_args(tmp_path, ["tensorboard"]), str(tmp_path), 0)
    for line in lines:
        trackers.log(line)
    trackers.image(12, png(tmp_path / "page.png"))
    trackers.close()
    got, images = read_tensorboard(tmp_path)
    same(got, expected(lines), float32=True)  # TensorBoard's scalars are float32
    assert ("reward_mean", 1) in got and ("eval/eval_pass1_mean", 0) in got and ("clip_frac_by_minibatch/1", 3) in got
    assert ("sample_rule", 1) not in got and ("kl_ref", 1) not in got and ("kl_ref", 2) in got
    assert images == {("explain", 12)}


@needs["wandb"]
def test_wandb_stores_every_line(tmp_path, offline):
    lines = run_lines(12)
    args = make_args(tmp_path, ["wandb"], argv=["--run-group", "ladder-1"])
    trackers = track.Trackers(args, str(tmp_path), 0)
    for line in lines:
        trackers.log(line)
    trackers.image(12, png(tmp_path / "page.png"))
    trackers.close()
    (sync_dir,) = wandb_runs(tmp_path)
    got, run = read_wandb(sync_dir)
    image = {(key, step): got.pop((key, step)) for key, step in list(got) if key.startswith("explain.")}
    assert image[("explain._type", 12)] == "image-file" and image[("explain.width", 12)] == 32, image
    same(got, expected(lines))  # JSON: the float64 values
    assert run["run_id"] == json.load(open(tmp_path / "trackers.json"))["wandb"]["id"]
    assert run["display_name"] == tmp_path.name and run["run_group"] == "ladder-1"
    assert run["config"]["update"]["report_to"] == ["wandb"] and run["config"]["update"]["out"] == str(tmp_path)


@needs["trackio"]
def test_trackio_stores_every_line(tmp_path, trackio_dir):
    lines = run_lines(12)
    args = make_args(tmp_path, ["trackio"], argv=["--project", "every-line", "--run-name", "m__0__t"])
    trackers = track.Trackers(args, str(tmp_path), 0)
    for line in lines:
        trackers.log(line)
    trackers.image(12, png(tmp_path / "page.png"))
    trackers.close()
    got = read_trackio("every-line", "m__0__t")
    image = got.pop(("explain", 12))
    assert image["_type"] == "trackio.image", image
    same(got, expected(lines))
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_run_config("every-line", "m__0__t")["report_to"] == ["trackio"]


# ---- resume: the same tracker run, each step once, the resumed run's values ----


def resume_lines():
    """A run logs steps 1..5 (its checkpoint is after step 3), is killed; the resume logs 4..6."""
    first = [train_line(s, random.Random(s)) for s in range(1, 6)]
    second = [train_line(s, random.Random(100 + s)) for s in range(4, 7)]
    return first, second, first[:3] + second


@needs["tensorboard"]
def test_tensorboard_resume_purges_what_the_killed_run_logged_past_its_checkpoint(tmp_path):
    first, second, want = resume_lines()
    trackers = track.Trackers(make_args(tmp_path, ["tensorboard"]), str(tmp_path), 0)
    for line in first:
        trackers.log(line)
    trackers.close()
    time.sleep(1.1)  # a new events file (they are named by the second)
    trackers = track.Trackers(make_args(tmp_path, ["tensorboard"]), str(tmp_path), 3)
    for line in second:
        trackers.log(line)
    trackers.close()
    same(read_tensorboard(tmp_path)[0], expected(want), float32=True)


@needs["tensorboard"]
def test_tensorboard_resume_after_sigkill(tmp_path):
    """The first run dies by SIGKILL after its events reached the disk (no close)."""
    first, second, want = resume_lines()
    code = f"""
        import json, os, signal, sys
        sys.path.insert(0, {ROOT!r})
        from support import cli, track
        p = cli.parser("t", "t", [cli.flag("--out", None), *track.FLAGS])
        args = p.parse_args(["--out", {str(tmp_path)!r}, "--report-to", "tensorboard"])
        track.check(p, args)
        trackers = track.Trackers(args, args.out, 0)
        for line in json.loads({json.dumps(json.dumps(first))}):
            trackers.log(line)
        trackers.open["tensorboard"].writer.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert ("reward_mean", 5) in read_tensorboard(tmp_path)[0]  # the killed run's step 5 reached the disk
    time.sleep(1.1)
    trackers = track.Trackers(make_args(tmp_path, ["tensorboard"]), str(tmp_path), 3)
    for line in second:
        trackers.log(line)
    trackers.close()
    same(read_tensorboard(tmp_path)[0], expected(want), float32=True)


@needs["wandb"]
def test_wandb_resume_continues_the_same_run(tmp_path, offline):
    """Offline, each launch is a folder of its own with the run id of OUT/trackers.json; the second resumes it and
    holds the resumed run's steps 4..6 (wandb's server keeps one value per step: track's docstring)."""
    first, second, _ = resume_lines()
    for start, lines in ((0, first), (3, second)):
        trackers = track.Trackers(make_args(tmp_path, ["wandb"]), str(tmp_path), start)
        for line in lines:
            trackers.log(line)
        trackers.close()
        time.sleep(1.1)  # offline-run-YYYYmmdd_HHMMSS-ID: a folder per second
    run_id = json.load(open(tmp_path / "trackers.json"))["wandb"]["id"]
    (got1, run1), (got2, run2) = [read_wandb(d) for d in wandb_runs(tmp_path)]
    assert run1["run_id"] == run2["run_id"] == run_id and run2.get("resume") is True
    same(got1, expected(first))
    same(got2, expected(second))


@needs["trackio"]
def test_trackio_resume_keeps_each_step_once(tmp_path, trackio_dir):
    first, second, want = resume_lines()
    argv = ["--project", "resume", "--run-name", "r"]
    for start, lines in ((0, first), (3, second)):
        trackers = track.Trackers(make_args(tmp_path, ["trackio"], argv=argv), str(tmp_path), start)
        for line in lines:
            trackers.log(line)
        trackers.close()
    same(read_trackio("resume", "r"), expected(want))
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_runs("resume") == ["r"]  # one run, continued


# ---- check(): one line, exit 2 ----


def parse(argv, capsys):
    p = cli.parser("train_small.py", "t", [cli.flag("--out", None), *track.FLAGS])
    args = p.parse_args(argv)
    with pytest.raises(SystemExit) as stop:
        track.check(p, args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    return err


def test_check_names_what_to_install(capsys, monkeypatch):
    """A tracker that is not installed (find_spec answers None for that name only: our branch)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    err = parse(["--out", "runs/x", "--report-to", "tensorboard", "wandb"], capsys)
    assert err.startswith("train_small.py: error: --report-to wandb: the package wandb is not installed;")
    assert "pip install -r requirements/track.txt" in err


def test_check_not_installed_in_a_python_without_it(tmp_path):
    """The same in a real interpreter where the package is absent: python -I -S (no site-packages)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs the venv")
    code = f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from support import cli, track
        p = cli.parser("train_full.py", "t", [cli.flag("--out", None), *track.FLAGS])
        track.check(p, p.parse_args(["--report-to", "trackio"]))
    """
    done = subprocess.run([sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        "train_full.py: error: --report-to trackio: the package trackio is not installed; "
        "pip install -r requirements/track.txt (or pip install trackio)"
    ]


def test_check_none_beside_a_tracker(capsys):
    err = parse(["--report-to", "none", "tensorboard"], capsys)
    assert "--report-to none tensorboard: 'none' beside a tracker" in err


def test_check_bad_name_and_wandb_mode(capsys, monkeypatch):
    assert "--run-name 'a/b'" in parse(["--run-name", "a/b"], capsys)
    monkeypatch.setenv("WANDB_MODE", "")
    assert "WANDB_MODE=''" in parse(["--report-to", "wandb"], capsys)


def test_check_fills_the_run_name():
    args = make_args("runs/small/d3s__0__20261127-101010/", ["none"])
    assert args.run_name == "d3s__0__20261127-101010" and args.report_to == ["none"]
    assert make_args("runs/x", ["none"], argv=["--run-name", "mine"]).run_name == "mine"


# ---- a tracker that fails mid-run: one line, the run goes on ----


@needs["tensorboard"]
def test_a_full_disk_costs_one_line(tmp_path):
    """The events file may grow by 64 KB only (RLIMIT_FSIZE; SIGXFSZ ignored: a write fails with EFBIG, as on a full
    disk): one warning, then every log() returns."""
    code = f"""
        import resource, signal, sys
        sys.path.insert(0, {ROOT!r})
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from support import cli, track
        from test_track import run_lines
        p = cli.parser("t", "t", [cli.flag("--out", None), *track.FLAGS])
        args = p.parse_args(["--out", {str(tmp_path)!r}, "--report-to", "tensorboard"])
        track.check(p, args)
        trackers = track.Trackers(args, args.out, 0)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        for line in run_lines(400):
            trackers.log(line)
            if "tensorboard" in trackers.open:
                trackers.open["tensorboard"].writer.flush()
        trackers.close()
        print("still running", sorted(trackers.open))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "still running []"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("track: ")]
    assert len(warnings) == 1 and done.stderr.strip() == warnings[0], done.stderr
    assert warnings[0].startswith("track: tensorboard failed (") and "File too large" in warnings[0]
    assert warnings[0].endswith("; metrics.jsonl stays the record")


@needs["wandb"]
def test_a_finished_wandb_run_costs_one_line(tmp_path, offline, capsys):
    trackers = track.Trackers(make_args(tmp_path, ["wandb", "tensorboard"]), str(tmp_path), 0)
    lines = run_lines(6)
    trackers.log(lines[0])
    trackers.open["wandb"].run.finish()  # what a dead wandb process leaves: a run that takes no more
    capsys.readouterr()
    for line in lines[1:]:
        trackers.log(line)
    trackers.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("track: wandb failed (") and "metrics.jsonl stays the record" in err[0]
    same(read_tensorboard(tmp_path)[0], expected(lines), float32=True)  # the other tracker went on


# ---- wandb without credentials: offline, one line, no network ----


@needs["wandb"]
def test_wandb_without_credentials_runs_offline_without_the_network(tmp_path):
    """In a network namespace of its own (unshare -n: no interface but lo), HOME in tmp, no WANDB_*: the run ends in
    seconds, offline, and prints one line naming `wandb sync`."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode:
        pytest.skip("unshare -n is not allowed here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env["HOME"] = str(tmp_path / "home")
    code = f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from support import cli, track
        from test_track import run_lines
        p = cli.parser("t", "t", [cli.flag("--out", None), *track.FLAGS])
        args = p.parse_args(["--out", {str(tmp_path / "run")!r}, "--report-to", "wandb"])
        track.check(p, args)
        trackers = track.Trackers(args, args.out, 0)
        for line in run_lines(20):
            trackers.log(line)
        trackers.close()
    """
    start = time.time()
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    seconds = time.time() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert seconds < 30, seconds
    assert done.stderr == "", done.stderr
    (line,) = done.stdout.splitlines()
    (sync_dir,) = wandb_runs(tmp_path / "run")
    assert line.startswith("track: wandb runs offline") and sync_dir in line and "`wandb sync " in line
    assert ("reward_mean", 20) in read_wandb(sync_dir)[0]


# ---- rank 0 only ----


@needs["tensorboard"]
@needs["wandb"]
def test_only_the_main_rank_writes(tmp_path, offline):
    out = tmp_path / "run"
    trackers = track.Trackers(make_args(out, ["tensorboard", "wandb"]), str(out), 0, is_main=False)
    for line in run_lines(3):
        trackers.log(line)
    trackers.image(3, png(tmp_path / "page.png"))
    trackers.close()
    assert not out.exists() and trackers.open == {}


# ---- bench/track.py ----


def test_bench_prints_each_trackers_share_of_a_step(tmp_path):
    """bench/track.py at a small size: a row per tracker and the total against the step (timing is not asserted)."""
    names = [name for name, ok in installed.items() if ok] or pytest.skip("no tracker installed")
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "track.py"), "--lines", "20", "--report-to", *names],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {*names, "all"} and rows["all"].endswith("%  (target: <= 2%)"), done.stdout
    assert all(re.search(r" \d+\.\d{3}%$", rows[name]) for name in names), done.stdout
