"""support/run.py: a run's life around its steps, in both trainers: its folder, metrics.jsonl, the cadences of
checkpoints and evaluations, the stop after a step (what a resume restores: support/checkpoint.py).

    Run               what both loops call around the six steps: the metrics lines (rank 0), the history the rules
                      read (grad norms, train rewards), the checkpoint when due, and whether a notice stops the run
    default_out       --out when none is given: a new folder per run
    progress_bar      tqdm at a terminal; in a log file (a SLURM .out, nohup, | tee) a plain line now and then
    out_lock          one writer per run folder: a second run into it stops with one line
    append_metrics, read_metrics, truncate_metrics   metrics.jsonl (docs/metrics.md): a line per step and evaluation
    measures_kl, mean    whether a step forwards the reference model; the mean of the values that are there
    write_summary, score_names   train_small.py's summary.json and the lines it prints
    write_args        OUT/args.json: the flags as parsed and checked
"""

import contextlib
import fcntl  # the run folder's lock (out_lock)
import json
import math
import os
import sys
import time

from tqdm import tqdm

from support import methods, stops, track
from support.cli import UsageError


class Run:
    """What both trainers do around the six steps of a step. Every rank makes every call (agree() and the
    checkpoints hold collectives); rank 0 writes metrics.jsonl. Made after the resume (start: its steps, 0 if none).

    A resumed run keeps the lines of metrics.jsonl that its checkpoint covers (a killed run may have logged past it);
    a fresh one starts it (checkpoint.start has refused a folder that holds a run). history: {"grad_norms": [...],
    "rewards": [...]}, one value per step so far, as the checkpoint stored them: --switch-on-spike reads the norms,
    --schedule adaptive the rewards. Every line goes to the trackers of --report-to too (support/track.py)."""

    def __init__(self, args, prog, notices, start, history=None, world=None):
        self.args, self.prog, self.notices, self.world = args, prog, notices, world
        self.is_main, self.stop_at = world is None or world.is_main, args.stop_after or args.steps
        self.saved = None  # the last checkpoint written
        self.metrics = os.path.join(args.out, "metrics.jsonl")
        self.history = {"grad_norms": [], "rewards": [], **(history or {})}
        if self.is_main:
            os.makedirs(args.out, exist_ok=True)
            truncate_metrics(self.metrics, start if start else -1)
        self.trackers = track.Trackers(args, args.out, start, is_main=self.is_main)  # --report-to (rank 0)

    def log(self, line):
        """metrics.jsonl's next line (rank 0; under torchrun a full disk is noted: every rank stops at agree())."""
        if line["kind"] == "train":
            self.history["grad_norms"].append(line["grad_norm"])
            self.history["rewards"].append(line["reward_mean"])
        if self.is_main:
            with self.notices.writing(self.metrics) if self.world else contextlib.nullcontext():
                append_metrics(self.metrics, line)
            self.trackers.log(line)  # each tracker of --report-to; one that fails costs a line, never the run

    def checkpoint(self, step, notice, save):
        """After `step`: save(step) (the trainer's checkpoint; returns where: self.saved) when due, and on a notice
        (from notices.agree()). Returns the notice when the run must stop here (before its last step), else None."""
        a = self.args
        if step % a.save_every == 0 or step in (a.steps, self.stop_at) or notice:
            self.saved = save(step)
        return notice if notice and step < self.stop_at else None

    def close(self):
        """The trackers' end (a killed run skips it: what reached the disk stays)."""
        self.trackers.close()


def default_out(args, rung, world=None):
    """--out when none is given: runs/RUNG/METHOD__SEED__YYYYmmdd-HHMMSS, a new folder per run (cleanRL's
    runs/{name}__{seed}__{time}), so that a fresh run never meets an earlier one; under torchrun rank 0's clock
    (the latest of the ranks', one all-reduce), so that every rank names the same folder."""
    seed = getattr(args, "rl_seed", args.seed)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(stops.most(int(time.time()), world)))
    return os.path.join("runs", rung, f"{args.method}__{seed}__{stamp}")


def progress_bar(iterable=None, *, total=None, initial=0, desc="", disable=False, every_s=30.0, leave=True):
    """A progress bar for a loop: tqdm where stderr is a terminal; elsewhere (a log file: SLURM's .out, nohup, a pipe)
    Lines, which prints one plain line every `every_s` seconds and at the end, never a carriage return."""
    if disable or sys.stderr.isatty():
        return tqdm(iterable, total=total, initial=initial, desc=desc, disable=disable, leave=leave, dynamic_ncols=True)
    return Lines(iterable, total=total, initial=initial, desc=desc, every_s=every_s, leave=leave)


class Lines:
    """tqdm's interface (iteration, update, set_postfix, write, close) as plain lines on stderr:
    `desc: n/total  key=value ...  (s each)`, one every `every_s` seconds (the first at once) and one at the end; a
    transient bar (leave=False: an evaluation's) only once it has run for `every_s` seconds."""

    def __init__(self, iterable=None, *, total=None, initial=0, desc="", every_s=30.0, leave=True):
        self.iterable, self.total, self.n, self.desc, self.every_s = iterable, total, initial, desc, every_s
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = initial + len(iterable)
        self.first, self.postfix, self.t0, self.leave = initial, "", time.time(), leave
        self.shown = None if leave else self.t0

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n=1):
        self.n += n
        now = time.time()
        if self.shown is None or now - self.shown >= self.every_s or (self.n == self.total and self.leave):
            per_step = (now - self.t0) / max(self.n - self.first, 1)
            total = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.n}{total}  {self.postfix}  ({per_step:.2f} s each)", file=sys.stderr, flush=True)
            self.shown = now

    def set_postfix(self, **values):
        self.postfix = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def measures_kl(step, args):
    """Whether step `step` (from 1) forwards the reference model: every step when the KL is in the loss
    (--kl-coef > 0); else, the KL being only a metric, step 1, every --kl-every steps and the last (0: never)."""
    return args.kl_coef > 0 or (args.kl_every > 0 and (step == 1 or step % args.kl_every == 0 or step == args.steps))


def mean(values):
    """The mean of the values that are not None; None if there are none (a step with no update logs None)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path, up_to_step=None):
    """The lines of metrics.jsonl (those of steps <= up_to_step); a last line cut short by a full disk is dropped."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        raw = [line for line in f if line.strip()]
    lines = [json.loads(line) for line in raw[:-1]]
    with contextlib.suppress(json.JSONDecodeError):  # half written when the disk filled up: the run stopped there
        lines += [json.loads(line) for line in raw[-1:]]
    return [m for m in lines if up_to_step is None or m.get("step", math.inf) <= up_to_step]


def truncate_metrics(path, step):
    """Keep what the checkpoint after `step` steps covers (a killed run may have logged past it): the train lines
    of steps 1..step and the evaluations after at most `step` steps."""
    if not os.path.exists(path):
        return
    kept = read_metrics(path, up_to_step=step)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in kept)
    os.replace(path + ".tmp", path)


@contextlib.contextmanager
def out_lock(out, prog, world=None):
    """Hold an exclusive lock on OUT/.lock while the block runs (under torchrun: rank 0 holds it); the OS drops it
    when the process ends, killed or not. A second run into the same folder, fresh or --resume, stops with one line
    (exit 2, every rank) instead of interleaving its lines and checkpoints with the first's."""
    busy = None
    with contextlib.ExitStack() as stack:
        if world is None or world.is_main:
            os.makedirs(out, exist_ok=True)
            f = stack.enter_context(open(os.path.join(out, ".lock"), "a"))
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy = True
        if stops.any_rank(busy, world):  # rank 0's answer, on every rank
            raise UsageError(
                f"--out {out}: another {prog} is writing there now ({os.path.join(out, '.lock')}); "
                "wait for it to end, or use another --out"
            )
        yield


def write_summary(args, lines, warm_info, totals, timeouts, rl_s, wall_s):
    """train_small.py's OUT/summary.json and the lines it prints: the warm start's and the final held-out numbers, what
    the run trained on (rollouts, tokens), the mechanism metrics over the run, and where the time went."""
    evals = [m for m in lines if m["kind"] == "eval"]
    train = [m for m in lines if m["kind"] == "train"]
    first, last = evals[0], evals[-1]
    own_rule = methods.rule_name(args.method)  # --switch-on-spike: switched_at_step, the first step under another rule
    summary = {
        "method": args.method,
        "loss": args.loss,
        "steps": args.steps,
        "out": args.out,
        "evals": [
            {
                "step": m["step"],
                "pass1_mean": m["eval_pass1_mean"],
                "greedy_pass1": m["eval_greedy_pass1"],
                "rl_s": m["gen_s"] + m["train_s"],
                "update_s": m["train_s"],
                "tokens": m["tokens"],
            }
            for m in evals
        ],
        "warm_start": {
            "greedy_pass1": first["eval_greedy_pass1"],
            "pass1_mean": first["eval_pass1_mean"],
            "passk": first["eval_passk"],
            "k": first["k"],
            "n": first["n"],
            "train_reward_step1": train[0]["reward_mean"] if train else None,
            **{k.replace("eval_pass1_mean_", ""): v for k, v in first.items() if k.startswith("eval_pass1_mean_level")},
            **{key: warm_info.get(key) for key in ("cached", "sft_steps", "path")},
        },
        "final": {
            "greedy_pass1": last["eval_greedy_pass1"],
            "pass1_mean": last["eval_pass1_mean"],
            "passk": last["eval_passk"],
            "k": last["k"],
            "n": last["n"],
            **{k.replace("eval_pass1_mean_", ""): v for k, v in last.items() if k.startswith("eval_pass1_mean_level")},
        },
        "best_greedy_pass1": max(m["eval_greedy_pass1"] for m in evals),
        "samples_trained": totals["samples"],
        "tokens_trained": totals["tokens"],
        "tokens_forwarded": totals["fwd_tokens"],
        "mean_grad_norm": mean([m["grad_norm"] for m in train if m["grad_norm"] is not None]),
        "mean_kept_adv_var": sum(m["kept_adv_var"] for m in train) / max(len(train), 1),
        "mean_sur": sum(m["sur"] for m in train) / max(len(train), 1),
        "mean_k_frac": sum(m["k_frac"] for m in train) / max(len(train), 1),
        "mean_k_real": sum(m["k_real"] for m in train) / max(len(train), 1),
        "final_kl_ref": next((m["kl_ref"] for m in reversed(train) if m.get("kl_ref") is not None), None),
        "mean_entropy": sum(m["entropy_mean"] for m in train) / max(len(train), 1),
        "mean_entropy_kept": mean([m["entropy_kept"] for m in train if m["kept_tokens"]]),  # steps that kept tokens
        "time_per_step": {
            key: sum(m.get(f"{key}_s", 0.0) for m in train) / max(len(train), 1)
            for key in ("gen", "reward", "pass1", "train")
        },
        "rl_seed": args.rl_seed,
        "switched_at_step": next((m["step"] for m in train if m.get("sample_rule", own_rule) != own_rule), None),
        "skipped_updates": totals["skipped"],
        "grader_timeouts": timeouts,
        "dropped_long_prompts": getattr(args, "dropped_long_prompts", 0),  # --drop-long-prompts (warmstart.fit_files)
        "gen_s": round(totals["gen_s"], 1),
        "train_s": round(totals["train_s"], 1),
        "rl_s": round(rl_s, 1),
        "wall_s": round(wall_s, 1),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    w, fin = summary["warm_start"], summary["final"]
    one, k = score_names(last)
    print(
        f"\n== {args.method} ({args.loss}), {args.steps} steps, {args.out}\n"
        f"warm start  held-out greedy {one} {w['greedy_pass1']:.3f}  {one} mean@{w['n']} {w['pass1_mean']:.3f}  "
        f"{k}{w['k']} {w['passk']:.3f}  (train reward at step 1: {w['train_reward_step1']})\n"
        f"final       held-out greedy {one} {fin['greedy_pass1']:.3f}  {one} mean@{fin['n']} {fin['pass1_mean']:.3f}  "
        f"{k}{fin['k']} {fin['passk']:.3f}\n"
        f"trained on {summary['samples_trained']} rollouts, {summary['tokens_trained']} tokens in the loss "
        f"({summary['tokens_forwarded']} forwarded); {summary['skipped_updates']} skipped updates, "
        f"{timeouts} grader timeouts\n"
        f"time: {summary['gen_s']} s generating + grading, {summary['train_s']} s training, {summary['rl_s']} s RL "
        f"incl. eval, {summary['wall_s']} s in all"
    )
    return summary


def score_names(line):
    """How an eval line's numbers are printed: Pass@1 and Pass@k, or under --eval-reward train (its eval_scorer) the
    run's own reward: mean rewards and the expected best of k."""
    return ("reward", "best-of-") if line.get("eval_scorer") else ("Pass@1", "Pass@")


def write_args(args, run_flags, world=None):
    """OUT/args.json (eval_args.json with --eval-only), both trainers: the flags as parsed and checked, the world size,
    and under "run" the flags that define the run's trajectory (the rung's RUN_FLAGS: --resume auto reads them)."""
    name = "eval_args.json" if getattr(args, "eval_only", False) else "args.json"
    with stops.attempt(args.out, args.out, world):
        os.makedirs(args.out, exist_ok=True)
        if world is None or world.is_main:
            with open(os.path.join(args.out, name), "w") as f:
                json.dump({**vars(args), "world": world.size if world else 1, "run": run_flags}, f, indent=1)
