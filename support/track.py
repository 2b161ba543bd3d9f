"""support/track.py: where a run's metrics go besides metrics.jsonl: TensorBoard, wandb, trackio (--report-to).

metrics.jsonl stays the record; a tracker is a view of it. Every line a run logs goes to each tracker of --report-to
at its step, under the keys docs/metrics.md lists ("The keys as each tracker shows them": an eval line's get `eval/`,
bools 0 / 1, lists KEY/i; None, strings and objects are left out; the explain figure is the image `explain`).
Where each keeps its run: tensorboard OUT/tensorboard/ (float32 scalars); wandb OUT/wandb/, offline unless the user
has said online (WANDB_MODE=online or credentials: never a prompt), then one line naming `wandb sync`; trackio its
local store under TRACKIO_DIR, one SQLite file per project shared by every run (docs/train_full.md, "Trackers").

Resume (start_step > 0) continues the SAME tracker run, and a step the killed run logged past its checkpoint is there
once, with the resumed run's values:
    tensorboard   SummaryWriter(purge_step=start_step + 1): the reader drops what earlier files hold from there
    wandb         the run id kept in OUT/trackers.json, wandb.init(id=..., resume="allow"). wandb does not rewrite
                  history: an ONLINE run keeps the killed run's values of those steps and drops the resumed run's
                  ("Tried to log to step %d that is less than the current step", wandb-core 0.31; not tested here:
                  it needs wandb's server). Offline, each launch is a folder with the same id, synced in order.
    trackio       trackio.init(name=--run-name, resume="allow"), then the run's rows after start_step are deleted
                  from the local store (SQL on its table `metrics`, under its lock; not for a Space or server).
A tracker that fails (at its start or mid-run) costs one line, `track: NAME failed (...); metrics.jsonl stays the
record`, and is dropped; the run goes on.

    FLAGS          --report-to, --run-name, --run-group, --project: add to a rung's flags with *track.FLAGS
    check          at parse time: a tracker not installed, 'none' beside a tracker, names (one line, exit 2)
    Trackers       one per run, rank 0's writes (is_main=False: nothing)

The packages are optional (requirements/track.txt): nothing here imports one before a run names it.
"""

import contextlib
import importlib.util
import io
import json
import os
import random
import re
import string
import sys
import threading

from support import cli

TRACKERS = ("tensorboard", "wandb", "trackio")
STATE = "trackers.json"  # OUT/trackers.json: the wandb run id, the trackio run, so that a resume continues them
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # wandb.Settings.mode's values
IMAGE_KEY = "explain"

FLAGS = [
    cli.flag(
        "--report-to",
        ["none"],
        ["none", *TRACKERS],
        "where the metrics go besides metrics.jsonl (several at once allowed): TensorBoard (OUT/tensorboard), "
        "wandb (offline without credentials), trackio (its local store); pip install -r requirements/track.txt",
        nargs="+",
        metavar="TRACKER",
    ),
    cli.flag("--run-name", None, None, "the run's name in the trackers (default: --out's folder name)"),
    cli.flag("--run-group", None, None, "a group that shows several runs in one view (wandb, trackio)"),
    cli.flag("--project", "d3s", None, "the wandb and trackio project the run goes to"),
]


def check(p, args):
    """--report-to and its names, before any work: a tracker not installed, 'none' beside a tracker, an empty name
    or a bad WANDB_MODE is one line (p.error: exit 2). Leaves args.report_to without repeats and fills
    args.run_name from --out's folder name when it is None (Trackers does when --out is not known yet)."""
    given = list(dict.fromkeys(args.report_to))
    if "none" in given and len(given) > 1:
        p.error(f"--report-to {' '.join(args.report_to)}: 'none' beside a tracker; pass none alone, or the trackers")
    for name in given:
        if name != "none" and importlib.util.find_spec(name) is None:
            p.error(
                f"--report-to {name}: the package {name} is not installed; "
                f"pip install -r requirements/track.txt (or pip install {name})"
            )
    args.report_to = given
    if args.run_name is None and getattr(args, "out", None):
        args.run_name = os.path.basename(os.path.normpath(args.out))
    for flag, value in (("--run-name", args.run_name), ("--run-group", args.run_group), ("--project", args.project)):
        if value is not None and not re.fullmatch(r"[\w.@=+-]{1,128}", value):
            p.error(f"{flag} {value!r}: use 1 to 128 letters, digits and . _ - @ = +")
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in given and mode is not None and mode not in WANDB_MODES:
        p.error(f"--report-to wandb: WANDB_MODE={mode!r} is not a mode of wandb; unset it or set one of {WANDB_MODES}")


def scalars(line):
    """The numbers of one metrics.jsonl line as the trackers get them: {key: float}, eval keys under `eval/`.

    >>> scalars({"kind": "train", "step": 3, "sur": 0.5, "skipped": False, "kl_ref": None, "sample_rule": "cross",
    ...          "clip_frac_by_minibatch": [0.0, 0.25]})
    {'sur': 0.5, 'skipped': 0, 'clip_frac_by_minibatch/0': 0.0, 'clip_frac_by_minibatch/1': 0.25}
    >>> scalars({"kind": "eval", "step": 0, "eval_pass1_mean": 0.25, "n": 4, "warm_start": {"sft_steps": 5}})
    {'eval/eval_pass1_mean': 0.25, 'eval/n': 4}
    """
    prefix = "eval/" if line["kind"] == "eval" else ""
    out = {}
    for key, value in line.items():
        if key in ("kind", "step"):
            continue
        if isinstance(value, bool):
            out[prefix + key] = int(value)
        elif isinstance(value, (int, float)):
            out[prefix + key] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.update({f"{prefix}{key}/{i}": v for i, v in enumerate(value)})
    return out


def json_safe(args):
    """The run's flags as a tracker's config: vars(args), JSON-safe (a value JSON cannot hold as text)."""
    return json.loads(json.dumps(vars(args), default=str))


def read_state(out):
    path = os.path.join(out, STATE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_state(out, state):
    path = os.path.join(out, STATE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def say(line):
    print(line, flush=True)


def warn(name, error):
    text = " ".join(f"{type(error).__name__}: {error}".split())
    print(f"track: {name} failed ({text[:300]}); metrics.jsonl stays the record", file=sys.stderr, flush=True)


class Trackers:
    """The trackers of one run (args.report_to), opened on rank 0; is_main=False: every method does nothing.

    args: the run's flags (report_to, run_name, run_group, project; all of vars(args) is each tracker's config).
    out: the run folder. start_step: the steps its checkpoint holds (0: a fresh run). group: overrides --run-group
    (the ladders: one group per ladder, one run per method and seed)."""

    def __init__(self, args, out, start_step, is_main=True, group=None):
        self.open = {}
        if not is_main:
            return
        names = [name for name in args.report_to if name != "none"]
        if not names:
            return
        os.makedirs(out, exist_ok=True)
        state = read_state(out) if start_step > 0 else {}
        run = {
            "out": out,
            "name": args.run_name or os.path.basename(os.path.normpath(out)),
            "group": group or getattr(args, "run_group", None),
            "project": getattr(args, "project", None) or "d3s",
            "config": json_safe(args),
            "start_step": start_step,
        }
        for name in names:
            try:
                self.open[name] = OPENERS[name](run, state)
            except Exception as error:  # a tracker never stops the run
                warn(name, error)
        write_state(out, state)

    def log(self, line):
        """One metrics.jsonl line (docs/metrics.md) to each tracker, at line["step"] (module docstring: the keys)."""
        if self.open:
            values = scalars(line)
            self.each(lambda tracker: tracker.scalars(line["step"], values))

    def image(self, step, path):
        """A PNG (the explain page's figure) at `step`, under the key `explain`, to each tracker."""
        if self.open:
            self.each(lambda tracker: tracker.image(step, path))

    def close(self):
        """Flush and close each tracker (a run that is killed skips this: what reached the disk stays)."""
        self.each(lambda tracker: tracker.close())
        self.open = {}

    def each(self, call):
        for name, tracker in list(self.open.items()):
            try:
                call(tracker)
            except Exception as error:  # a tracker never stops the run
                warn(name, error)
                self.open.pop(name)
                with contextlib.suppress(Exception):
                    tracker.close()


class TensorBoard:
    """torch's SummaryWriter into OUT/tensorboard; a resume purges what the earlier files hold past start_step."""

    def __init__(self, run, state):
        from torch.utils.tensorboard import SummaryWriter

        quiet_writer_threads()
        self.dir = os.path.join(run["out"], "tensorboard")
        purge = run["start_step"] + 1 if run["start_step"] > 0 else None
        self.writer = SummaryWriter(log_dir=self.dir, purge_step=purge, flush_secs=10)
        self.writer.add_text("config", "    " + json.dumps(run["config"], indent=1).replace("\n", "\n    "), 0)
        say(f"track: TensorBoard logs in {self.dir} (tensorboard --logdir {self.dir})")

    def scalars(self, step, values):
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def image(self, step, path):
        import numpy as np
        from PIL import Image

        with Image.open(path) as picture:
            self.writer.add_image(IMAGE_KEY, np.asarray(picture.convert("RGB")), global_step=step, dataformats="HWC")

    def close(self):
        self.writer.close()


def quiet_writer_threads():
    """TensorBoard's writer thread re-raises the error it met (a full disk) as it dies, and Python prints its
    traceback; the same error reaches the run's thread at its next write, where it costs our one line. So the
    traceback of that thread (tensorboard's _AsyncWriterThread) is left out; every other thread's is printed."""
    if getattr(threading.excepthook, "track_quiet", False):
        return
    previous = threading.excepthook

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.track_quiet = True
    threading.excepthook = hook


def wandb_has_credentials():
    """Whether wandb would log in without asking: an API key or identity token in the environment, or a `wandb
    login` (the host's entry in the netrc file). Reads files only, never the network."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    from wandb.sdk.lib.wbauth import wbnetrc

    try:
        return bool(wbnetrc.read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))
    except Exception:  # an unreadable netrc is no login
        return False


class Wandb:
    """A wandb run in OUT/wandb; its id in OUT/trackers.json, so that a resume continues it."""

    def __init__(self, run, state):
        import wandb

        offline = "WANDB_MODE" not in os.environ and not wandb_has_credentials()
        if "wandb" not in state:  # a fresh run: a new id (a resume: the id and project it continues)
            run_id = "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))
            state["wandb"] = {"id": run_id, "project": run["project"]}
        settings = wandb.Settings(
            console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True, init_timeout=60
        )
        self.run = wandb.init(
            project=state["wandb"].get("project", run["project"]),
            name=run["name"],
            group=run["group"],
            id=state["wandb"]["id"],
            resume="allow",
            config=run["config"],
            dir=run["out"],
            mode="offline" if offline else None,
            settings=settings,
            reinit="create_new",
        )
        self.wandb = wandb
        if self.run.settings._offline:
            folders = os.path.join(run["out"], "wandb", "offline-run-*")
            say(
                f"track: wandb runs offline (no WANDB_API_KEY or wandb login; WANDB_MODE unset): the run is in "
                f"{self.run.settings.sync_dir}; upload it with `wandb sync {folders}`"
            )

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def image(self, step, path):
        self.run.log({IMAGE_KEY: self.wandb.Image(path)}, step=step)

    def close(self):
        self.run.finish()


class Trackio:
    """A trackio run named --run-name in the project; a resume continues it and drops its rows past start_step."""

    def __init__(self, run, state):
        import trackio

        self.trackio = trackio
        resume = run["start_step"] > 0
        name = state.get("trackio", {}).get("name", run["name"])  # a resume: the run it continues
        with contextlib.redirect_stdout(io.StringIO()):  # trackio's own lines; ours below
            self.run = trackio.init(
                project=state.get("trackio", {}).get("project", run["project"]),
                name=name,
                group=run["group"],
                config=run["config"],
                resume="allow" if resume else "never",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        if resume and self.run._is_local:
            self.purge(self.run.project, self.run.id, run["start_step"])
        state["trackio"] = {"project": self.run.project, "name": self.run.name, "id": self.run.id}
        from trackio.utils import TRACKIO_DIR

        say(f"track: trackio run {self.run.name} in {TRACKIO_DIR} (trackio show --project {self.run.project})")

    @staticmethod
    def purge(project, run_id, start_step):
        """Delete the run's rows after start_step from trackio's local store (what a killed run logged past its
        checkpoint), under trackio's own lock."""
        from trackio.sqlite_storage import SQLiteStorage

        db = SQLiteStorage.get_project_db_path(project)
        if not db.exists():
            return
        with SQLiteStorage._get_process_lock(project), SQLiteStorage._get_connection(db) as conn:
            conn.execute("DELETE FROM metrics WHERE run_id = ? AND step > ?", (run_id, start_step))
            conn.commit()

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def image(self, step, path):
        self.run.log({IMAGE_KEY: self.trackio.Image(path)}, step=step)

    def close(self):
        with contextlib.redirect_stdout(io.StringIO()):  # trackio.finish: the current run, which atexit would finish
            (self.trackio.finish if self.trackio.context_vars.current_run.get() is self.run else self.run.finish)()


OPENERS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}
