"""bench/track.py: what --report-to costs a run: Trackers.log's time per metrics.jsonl line, per tracker, against
the time of a train_small step (issue 54's target: at most 2%).

    python bench/track.py                                 # 200 lines to each installed tracker, a 1.0 s step
    python bench/track.py --lines 500 --step-s 0.8 --report-to tensorboard

The lines have every key docs/metrics.md lists for train_small (an eval line every 10 steps). Offline: wandb with
WANDB_MODE=offline, trackio's store and every run folder in a temporary folder, removed at the end.
"""

import contextlib
import importlib.util
import io
import os
import random
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from support import cli, track  # noqa: E402


def small_lines(steps, eval_every=10, seed=0):
    """metrics.jsonl lines with the keys and types docs/metrics.md lists for train_small, made-up values."""
    rng, tables, kind = random.Random(seed), {}, None
    with open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8") as f:
        for row in f:
            if heading := re.match(r"## (Train|Eval) lines", row):
                kind = heading[1].lower()
            elif kind and (cells := re.match(r"\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|", row)):
                key, type_, rungs = cells[1], cells[2].strip().rstrip("?"), cells[3]
                if key not in ("kind", "step") and ("small" in rungs or "all" in rungs):
                    tables.setdefault(kind, []).append((key, type_))
    value = {
        "float": rng.random,
        "float or null": rng.random,
        "int": lambda: rng.randint(0, 5000),
        "bool": lambda: False,
        "str": lambda: "cross",
        "list": lambda: [rng.random(), rng.random()],
        "object": lambda: {"sft_steps": 40},
    }

    def line(kind, step):
        keys = [
            (k.replace("<L>", str(level)), t) for k, t in tables[kind] for level in ((1, 2, 3) if "<L>" in k else (0,))
        ]
        return {"kind": kind, "step": step, **{k: value[t]() for k, t in keys}}

    lines = [line("eval", 0)]
    for step in range(1, steps + 1):
        lines.append(line("train", step))
        if step % eval_every == 0 or step == steps:
            lines.append(line("eval", step))
    return lines


def bench(name, lines, folder):
    """Seconds to open the tracker, per line of log() (mean and max), to close it (which waits for what a tracker
    writes in a thread or process of its own: wandb-core, trackio's sender)."""
    p = cli.parser("track.py", "", [cli.flag("--out", None), *track.FLAGS])
    out = os.path.join(folder, name)
    args = p.parse_args(["--out", out, "--report-to", name])
    track.check(p, args)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the tracker's line: where it writes
        trackers = track.Trackers(args, out, 0)
    opened = time.perf_counter()
    each = []
    for line in lines:
        t = time.perf_counter()
        trackers.log(line)
        each.append(time.perf_counter() - t)
    t = time.perf_counter()
    trackers.close()
    return opened - start, sum(each) / len(each), max(each), time.perf_counter() - t


def main(argv=None):
    installed = [name for name in track.TRACKERS if importlib.util.find_spec(name) is not None]
    n = cli.number
    flags = [
        cli.flag("--lines", 200, n(int, 1, 10**6), "train lines to log (an eval line every 10)"),
        cli.flag(
            "--step-s",
            1.0,
            n(float, 0, low_open=True),
            "seconds of one train_small step to compare with ([measured] about 0.5-1.5 s on the tiny model, 2 CPUs)",
        ),
        cli.flag("--report-to", installed or ["tensorboard"], list(track.TRACKERS), "the trackers to time", nargs="+"),
    ]
    p = cli.parser("track.py", __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    for name in args.report_to:
        if importlib.util.find_spec(name) is None:
            p.error(f"--report-to {name}: the package {name} is not installed; pip install -r requirements/track.txt")
    lines = small_lines(args.lines)
    train = sum(line["kind"] == "train" for line in lines)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["WANDB_MODE"] = "offline"  # never the network
        os.environ["TRACKIO_DIR"] = os.path.join(folder, "trackio")  # before trackio's import
        print(
            f"{len(lines)} lines ({train} train, {len(track.scalars(lines[1]))} numbers each), a {args.step_s} s step"
        )
        print(
            f"{'tracker':12} {'open s':>7} {'log ms/line':>12} {'max ms':>8} {'close s':>8} {'(log+close) ms/line':>20}"
            f" {'% of a step':>12}"
        )
        total = 0.0
        for name in args.report_to:
            opened, mean, most, closed = bench(name, lines, folder)
            # a step logs its train line and, at times, an eval line; the close's wait is spread over the lines
            per_step = (mean * len(lines) + closed) / train
            total += per_step
            print(
                f"{name:12} {opened:7.2f} {mean * 1e3:12.3f} {most * 1e3:8.2f} {closed:8.2f} "
                f"{(mean + closed / len(lines)) * 1e3:20.3f} {100 * per_step / args.step_s:11.3f}%"
            )
        print(f"{'all':12} {'':7} {'':12} {'':8} {'':8} {'':20} {100 * total / args.step_s:11.3f}%  (target: <= 2%)")


if __name__ == "__main__":
    main()
