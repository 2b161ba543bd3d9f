"""support/common.py: the plumbing the three rungs share, so that each rung file holds its method and its loop.

    measures_kl                whether a step forwards the reference model
    mean                       the mean of the values that are there (None if none)
    append_metrics, read_metrics, truncate_metrics    metrics.jsonl (docs/metrics.md)
    out_lock, export_pretrained   one writer per output folder; a model folder written atomically
    Preemption, stopped, disk_full, fail_disk   SIGTERM/SIGUSR1/a first Ctrl-C stop a run after a checkpoint; a
                               second Ctrl-C at once; a full disk, one line
    interruptible, sigint_ignored   Ctrl-C anywhere in a script: one line, exit 130; child processes leave it to the parent
    fit_prompts, check_finite  prompts longer than the model's context, NaN/inf weights or logits: one line, before any work
    run_all                    independent runs in a pool of processes, with a progress bar
    write_summary              train_small.py's summary.json, from its metrics.jsonl
    save_checkpoint, read_checkpoint, read_resume, load_checkpoint   a one-file checkpoint: model, optimizer, RNG, step
    start_run, log_step, log_eval, end_step   train_small.py's run folder around its loop: resume, metrics, checkpoints

The flag checks and their one-line errors are in support/cli.py; train_full.py's distributed plumbing in support/fsdp.py.
"""

import contextlib
import errno
import json
import math
import os
import pickle
import random
import sys

import torch.distributed as dist

from support.cli import UsageError
from support.fsdp import all_reduce


def measures_kl(step, args):
    """Whether step `step` (from 1) forwards the reference model: every step when the KL is in the loss
    (--kl-coef > 0); else, the KL being only a metric, step 1, every --kl-every steps and the last (0: never)."""
    if args.kl_coef > 0:
        return True
    return args.kl_every > 0 and (step == 1 or step % args.kl_every == 0 or step == args.steps)


STOPPED, DISK_FULL, INTERRUPTED = 75, 74, 130  # exit codes: stopped on a notice or a first Ctrl-C with a checkpoint,
# run again with --resume (sysexits' TEMPFAIL); a write failed (IOERR); a Ctrl-C that stopped at once (128 + SIGINT, as a shell)


class Preemption:
    """While in its `with` block, SIGTERM and SIGUSR1 (a cluster's notice before it preempts a job: SLURM, Kubernetes)
    and a first SIGINT (Ctrl-C) do not kill the process: they set `.signal` (the signal's name), so that the loop
    finishes its step, writes its checkpoint and exits with STOPPED; --resume then continues to the numbers of an
    uninterrupted run. A SIGINT after that (a second Ctrl-C) stops at once: `prog`'s one line (none if `quiet`: the
    other ranks of a job) and exit INTERRUPTED, with os._exit, so that nothing after it runs; every checkpoint is
    written to a temporary file and renamed, so a write it cuts leaves the last checkpoint intact."""

    def __init__(self, prog="", quiet=False):
        self.signal, self.previous, self.prog, self.quiet = None, {}, prog, quiet

    def __enter__(self):
        import signal

        for notice in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            self.previous[notice] = signal.signal(notice, self.note)
        return self

    def note(self, number, frame):
        import signal

        if number == signal.SIGINT and self.signal:  # a second Ctrl-C (or one after a notice): stop now
            interrupted(
                self.prog,
                "stopped at once by a second Ctrl-C (SIGINT); the last checkpoint written is intact; "
                "continue with --resume",
                quiet=self.quiet,
                at_once=True,
            )
        self.signal = signal.Signals(number).name

    def __exit__(self, *exc):
        import signal

        for notice, handler in self.previous.items():
            signal.signal(notice, handler)


def stopped(prog, notice, step, checkpoint):
    """The one line of a run that a notice (or a first Ctrl-C) stopped after `step` and its checkpoint; exit STOPPED."""
    from tqdm import tqdm  # tqdm.write: the line starts clear of a progress bar

    notice += " (Ctrl-C)" if notice == "SIGINT" else ""
    tqdm.write(
        f"{prog}: stopped by {notice} after step {step}; checkpoint {checkpoint}; continue with --resume",
        file=sys.stderr,
    )
    sys.exit(STOPPED)


def interrupted(prog, line, quiet=False, at_once=False):
    """`prog: line` (none if `quiet`), then exit INTERRUPTED: at once (os._exit: no cleanup, no atexit) or by
    SystemExit (the `with` blocks close: child processes, locks)."""
    from tqdm import tqdm  # tqdm.write: the line starts clear of a progress bar

    if not quiet:
        tqdm.write(f"{prog}: {line}", file=sys.stderr)
    sys.stdout.flush(), sys.stderr.flush()
    if at_once:
        os._exit(INTERRUPTED)
    sys.exit(INTERRUPTED)


def interruptible(main, prog, fix="run the same command again"):
    """main() for a script's `__main__`: a Ctrl-C outside a Preemption block (KeyboardInterrupt) ends in one line and
    exit INTERRUPTED, no traceback; under torchrun only rank 0 prints it. A shell that started the script with SIGINT
    ignored (a background job) has it handled again, as Preemption does."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return main()
    except KeyboardInterrupt:
        interrupted(prog, f"stopped by Ctrl-C (SIGINT); {fix}", quiet=os.environ.get("RANK", "0") != "0")


@contextlib.contextmanager
def sigint_ignored():
    """Child processes started in the block ignore SIGINT from their first instruction (the setting is inherited,
    and Python leaves an ignored SIGINT ignored): a Ctrl-C at a terminal reaches the whole process group, and it is
    the parent's to act on, so no worker or grader child prints a KeyboardInterrupt traceback of its own. A Ctrl-C
    in the block itself (the few milliseconds of a process start) is lost. Main thread only (elsewhere: no-op)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


NEARLY_FULL = 16 * 2**20  # bytes free below which a write's RuntimeError is taken for a full disk


def disk_full(error, path="."):
    """The OSError of a full disk or quota (ENOSPC, EDQUOT) behind `error`, or None; the run stops with one line
    (DISK_FULL). Writers say it in several ways: an OSError (open, write, close), safetensors' "No space left on
    device (os error 28)", DCP's CheckpointException holding each rank's error; torch.save's zip writer only raises a
    RuntimeError ("unexpected pos"): there the file system of `path` answers (less than NEARLY_FULL bytes free)."""
    import errno
    import shutil

    codes, todo, seen, runtime = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)), [error], [], False
    while todo:
        e = todo.pop()
        if e is None or any(e is x for x in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in codes:
            return e
        if any(words in str(e) for words in ("No space left on device", "os error 28", "Disk quota exceeded")):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        runtime |= isinstance(e, RuntimeError)
        failures = getattr(e, "failures", None) or {}  # DCP: {rank: (exception, traceback)}
        todo += [e.__cause__, e.__context__] + [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if runtime and shutil.disk_usage(folder).free < NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return None


def disk_full_line(prog, error, out):
    """The one line of a full disk (`error` from disk_full) while the run wrote a file. Every write is a temporary
    file renamed into place (checkpoints, exports) or an appended line that a resume drops, so the last checkpoint is
    intact."""
    return (
        f"{prog}: error: no space left on the device while writing {error.filename or out} ({error.strerror}); "
        f"the last checkpoint in {out} is intact: free space, then continue with --resume"
    )


def fail_disk(prog, error, out):
    """disk_full_line, exit DISK_FULL."""
    from tqdm import tqdm  # tqdm.write: the line starts clear of a progress bar

    tqdm.write(disk_full_line(prog, error, out), file=sys.stderr)
    sys.exit(DISK_FULL)


def fit_prompts(args, train_rows, eval_rows, prog="train_small.py"):
    """train_small.py's --train-file and --eval-file rows whose prompt fits the model's context less --max-new-tokens
    (mathtask.fit_context), checked before any work: a longer one stops the run with one line naming its file:line,
    its length and the limit (exit 2), or with --drop-long-prompts (choice) is left out, counted in one line and in
    args.dropped_long_prompts (summary.json). The generated task's prompts are short by construction: not checked.
    A model whose tokenizer or config does not load is left to warmstart.load_base_model's line."""
    import inspect

    from support.mathtask import DataError, fit_context
    from support.warmstart import format_prompt

    args.dropped_long_prompts = 0
    files = [
        (f, path, rows)
        for f, path, rows in (("--train-file", args.train_file, train_rows), ("--eval-file", args.eval_file, eval_rows))
        if path
    ]
    if not files:
        return train_rows, eval_rows
    if args.model is None:
        from support import tiny

        tokenizer = tiny.build_char_tokenizer()
        window = inspect.signature(tiny.build_tiny_model).parameters["max_position_embeddings"].default
    else:
        from transformers import AutoConfig, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.model))
            window = getattr(
                AutoConfig.from_pretrained(os.path.expanduser(args.model)), "max_position_embeddings", None
            )
        except (OSError, ValueError):
            return train_rows, eval_rows
    if not window:  # a model without a position limit: nothing to check
        return train_rows, eval_rows
    if args.max_new_tokens >= window:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens}: the model's context is {window} positions "
            "(max_position_embeddings), prompt included; lower it"
        )
    limit = window - args.max_new_tokens
    why = f"the model's context of {window} positions less --max-new-tokens {args.max_new_tokens}"
    fitted = {}
    for flag, path, rows in files:
        prompt = lambda r: format_prompt(r["problem"], args.template)
        fitted[flag], dropped = fit_context(
            rows, prompt, tokenizer, limit, why, drop=getattr(args, "drop_long_prompts", False)
        )
        if not fitted[flag]:
            raise DataError(f"{flag} {path}: no prompt fits in {limit} tokens ({why}); shorten them or raise the limit")
        if dropped:
            print(
                f"{prog}: --drop-long-prompts: left out {dropped} of the {len(rows)} rows of {path} (prompts longer "
                f"than {limit} tokens)",
                file=sys.stderr,
                flush=True,
            )
        args.dropped_long_prompts += dropped
    return fitted.get("--train-file", train_rows), fitted.get("--eval-file", eval_rows)


def check_finite(model, name, tokenizer=None, prompt=None):
    """NaN or inf in `model`'s weights (one tensor at a time: torch.isfinite(p).all(), no copy of the model: a pass
    over its bytes) or in the logits of a first forward of `prompt`: UsageError naming the model (`name`), before any
    work."""
    import itertools

    import torch

    fix = "its weights are damaged or were saved from a diverged run; pass another model"
    with torch.no_grad():
        for where, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise UsageError(f"{name}: its weights hold NaN or inf ({where}); {fix}")
        if prompt is not None:
            training, ids = model.training, tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            logits = model.eval()(input_ids=ids[:, -64:]).logits  # the prompt's last tokens: enough to see NaN/inf
            model.train(training)
            if not bool(torch.isfinite(logits).all()):
                raise UsageError(
                    f"{name}: its first forward gives NaN or inf logits (weights finite: an overflow in "
                    f"{next(model.parameters()).dtype}?); {fix}, or run it in float32"
                )


def finite_warm_start(warm, args, train_rows):
    """train_small.py: check_finite on the warm start (model, tokenizer, info) and the first training prompt; returns
    `warm`. The line names --model (or the tiny model) and the warm start's cache folder, where there is one."""
    from support.warmstart import format_prompt

    model, tokenizer, info = warm
    name = f"--model {args.model}" if args.model else "the tiny model"
    name += f" (warm start {info['path']}: delete it to build it again)" if info.get("sft_steps") else ""
    check_finite(model, name, tokenizer, format_prompt(train_rows[0]["problem"], args.template))
    return warm


def mean(values):
    """The mean of the values that are not None; None if there are none (a step with no update logs None)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------
# metrics.jsonl: one JSON line per train step and per evaluation (docs/metrics.md)
# ---------------------------------------------------------------------------------------------
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
    try:
        lines += [json.loads(line) for line in raw[-1:]]
    except json.JSONDecodeError:
        pass  # half written when the disk filled up: the run stopped there
    return [m for m in lines if up_to_step is None or m.get("step", math.inf) <= up_to_step]


def train_history(path, args, start_step):
    """The train lines of metrics.jsonl, which --schedule adaptive and the switch rule read; a resume whose
    metrics.jsonl lacks some of them stops with one line."""
    history = [m for m in read_metrics(path) if m["kind"] == "train"]
    if (args.schedule == "adaptive" or args.switch_on_spike) and len(history) != start_step:
        rule = "--schedule adaptive" if args.schedule == "adaptive" else "--switch-on-spike"
        raise UsageError(
            f"--resume {args.resume}: {path} holds {len(history)} of the {start_step} train lines that "
            f"{rule} reads; resume into the run's own --out"
        )
    return history


def add_totals(totals, m):
    """The run's totals (summary.json, the eval lines) after the train line `m`."""
    for key, value in (
        ("samples", m["kept_samples"]),
        ("tokens", m["kept_tokens"]),
        ("fwd_tokens", m["fwd_tokens"]),
        ("gen_s", m["gen_s"] + m["reward_s"]),
        ("train_s", m["train_s"]),
        ("skipped", int(m["skipped"])),
    ):
        totals[key] += value


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
def out_lock(out, prog):
    """Hold an exclusive lock on OUT/.lock while the block runs; the OS drops it when the process ends, killed or
    not. A second run writing to the same folder stops with one line instead of interleaving its lines with the
    first's. No lock where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"--out {out}: another {prog} is writing there now ({os.path.join(out, '.lock')}); "
                "wait for it to end, or use another --out"
            ) from None
        yield


def run_all(fn, jobs, workers, desc="runs"):
    """fn(job) for every job, `workers` processes at a time (spawned; 1: in this process), with a progress bar.
    Yields (job, result) as they finish."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    import multiprocessing as mp

    from tqdm import tqdm

    if workers <= 1:
        for job in tqdm(jobs, desc=desc, leave=False):
            yield job, fn(job)
        return
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        with sigint_ignored():  # the workers start here (spawn: all at the first submit); a Ctrl-C is the parent's
            futures = {pool.submit(fn, job): job for job in jobs}
        try:
            for future in tqdm(as_completed(futures), total=len(jobs), desc=desc, leave=False):
                yield futures[future], future.result()
        except KeyboardInterrupt:  # a Ctrl-C: the running runs stop now, instead of the pool's exit waiting for them
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()  # (the futures are not cancelled first: Python 3.11's pool would then print a traceback)
            raise
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def export_pretrained(model, tokenizer, path):
    """model.save_pretrained and tokenizer.save_pretrained into `path` (AutoModelForCausalLM.from_pretrained loads it),
    written into a temporary folder then renamed: a kill leaves the old folder or the new one, never half of one."""
    import shutil

    shutil.rmtree(path + ".tmp", ignore_errors=True)
    model.save_pretrained(path + ".tmp")
    tokenizer.save_pretrained(path + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)
    return path


# ---------------------------------------------------------------------------------------------
# The summary of a run (train_small.py)
# ---------------------------------------------------------------------------------------------
def write_summary(args, lines, warm_info, totals, timeouts, rl_s, wall_s):
    """train_small.py's OUT/summary.json and the lines it prints: the warm start's and the final held-out numbers, what
    the run trained on (rollouts, tokens), the paper's metrics over the run, and where the time went."""
    from support import methods

    evals = [m for m in lines if m["kind"] == "eval"]
    train = [m for m in lines if m["kind"] == "train"]
    first, last = evals[0], evals[-1]
    own_rule = methods.rule_name(
        args.method
    )  # --switch-on-spike: switched_at_step is the first step run under another rule
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
            "cached": warm_info.get("cached"),
            "sft_steps": warm_info.get("sft_steps"),
            "path": warm_info.get("path"),
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
        "dropped_long_prompts": getattr(args, "dropped_long_prompts", 0),  # --drop-long-prompts (common.fit_prompts)
        "gen_s": round(totals["gen_s"], 1),
        "train_s": round(totals["train_s"], 1),
        "rl_s": round(rl_s, 1),
        "wall_s": round(wall_s, 1),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    w, fin = summary["warm_start"], summary["final"]
    print(
        f"\n== {args.method} ({args.loss}), {args.steps} steps, {args.out}\n"
        f"warm start  held-out greedy Pass@1 {w['greedy_pass1']:.3f}  Pass@1 mean@{w['n']} {w['pass1_mean']:.3f}  "
        f"Pass@{w['k']} {w['passk']:.3f}  (train reward at step 1: {w['train_reward_step1']})\n"
        f"final       held-out greedy Pass@1 {fin['greedy_pass1']:.3f}  Pass@1 mean@{fin['n']} {fin['pass1_mean']:.3f}  "
        f"Pass@{fin['k']} {fin['passk']:.3f}\n"
        f"trained on {summary['samples_trained']} rollouts, {summary['tokens_trained']} tokens in the loss "
        f"({summary['tokens_forwarded']} forwarded); {summary['skipped_updates']} skipped updates, "
        f"{timeouts} grader timeouts\n"
        f"time: {summary['gen_s']} s generating + grading, {summary['train_s']} s training, {summary['rl_s']} s RL "
        f"incl. eval, {summary['wall_s']} s in all"
    )
    return summary


# ---------------------------------------------------------------------------------------------
# A one-file checkpoint (train_small.py): model, optimizer, RNG states, step, the run's flags
# ---------------------------------------------------------------------------------------------
CHECKPOINT_FORMAT = 2  # 2: tensors and plain values only; 1 (before 2026-11): pickled RNG state


def save_checkpoint(path, model, optimizer, step, flags, totals):
    """Model, optimizer, RNG states and step in one file of tensors and plain values (it loads with
    torch.load(weights_only=True): no pickled objects), written to a temp file then renamed: a kill leaves
    either the old or the new checkpoint, never half of one."""
    import numpy as np
    import torch

    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {
        "torch": torch.get_rng_state(),
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "totals": totals,
        "args": flags,
        "rng": rng,
    }
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_checkpoint(path, flags, prog, added=None):
    """The checkpoint --resume continues from, checked before any work: it exists, is complete, holds no pickled
    object (torch.load(weights_only=True)), and was written by a run with these `flags` ({name: value}; a flag
    added later reads as its `added` value in an older checkpoint). Raises UsageError naming the fix."""
    import torch

    fix = "run without --resume to start again, or use a new --out"
    if not os.path.isfile(path):
        where = "no checkpoint at" if not os.path.isdir(path) else "is a folder, not a checkpoint file:"
        raise UsageError(f"--resume: {where} {path}; {fix} (a run writes OUT/checkpoint.pt every --save-every steps)")
    try:
        state = torch.load(path, weights_only=True)
        assert isinstance(state, dict) and {"step", "model", "optimizer", "totals", "args", "rng"} <= set(state)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UsageError(
                f"--resume {path}: refused: it holds a pickled Python object, not tensors (loading it "
                f"could run code); {fix}"
            ) from None
        raise UsageError(f"--resume {path}: truncated or corrupt (not a checkpoint {prog} wrote); {fix}") from None
    except Exception:  # EOFError, RuntimeError (a truncated zip), AssertionError, ...
        raise UsageError(f"--resume {path}: truncated or corrupt (not a checkpoint {prog} wrote); {fix}") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(
            f"--resume {path}: checkpoint format {state.get('format', 1)} of an older {prog}; "
            f"finish that run with the version that wrote it, or {fix}"
        )
    for flag, value in flags.items():
        then = state["args"].get(flag, (added or {}).get(flag))
        if value != then:
            name = "--" + flag.replace("_", "-")
            raise UsageError(
                f"{name} {value}: {path} was made with {name} {then}; resume with the run's flags, or use a new --out"
            )
    return state


def read_resume(args, run_flags, prog, added=None):
    """The checkpoint --resume continues from (OUT/checkpoint.pt, or the one named), read_checkpoint's checks, and it
    must leave steps to run (before --stop-after and --steps)."""
    path = os.path.join(args.out, "checkpoint.pt") if args.resume == "latest" else args.resume
    state = read_checkpoint(path, {k: getattr(args, k) for k in run_flags}, prog, added)
    if args.stop_after is not None and args.stop_after <= state["step"]:
        raise UsageError(
            f"--stop-after {args.stop_after}: {path} is already at step {state['step']}; raise --stop-after or drop it"
        )
    if state["step"] >= args.steps:
        raise UsageError(
            f"--resume {path}: the run already finished its {args.steps} steps; run without --resume to "
            "start again, or use a new --out"
        )
    return state


def load_checkpoint(state, model, optimizer):
    """Restore what read_checkpoint read; returns (step, totals)."""
    import numpy as np
    import torch

    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    version, words, gauss = state["rng"]["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    keys, pos, has_gauss, cached = state["rng"]["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return state["step"], state["totals"]


# ---------------------------------------------------------------------------------------------
# train_small.py's run folder around its loop: start or resume, the lines of metrics.jsonl, checkpoints and stops
# ---------------------------------------------------------------------------------------------
def start_run(args, model, optimizer, run_flags, prog, added=None):
    """Before step 1: a new run removes OUT/metrics.jsonl and OUT/checkpoint.pt of an earlier one; --resume restores
    model, optimizer and RNG states (read_resume's checks) and drops what the killed run logged after its checkpoint.
    Returns (start_step, totals, history: the train lines so far, which --schedule adaptive and the switch rule read)."""
    os.makedirs(args.out, exist_ok=True)
    metrics_path, ckpt_path = os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "checkpoint.pt")
    totals = {"samples": 0, "tokens": 0, "fwd_tokens": 0, "gen_s": 0.0, "train_s": 0.0, "skipped": 0}
    start_step = 0
    if args.resume:
        start_step, totals = load_checkpoint(read_resume(args, run_flags, prog, added), model, optimizer)
        truncate_metrics(metrics_path, start_step)  # drop what the killed run logged after it
        print(f"resumed {ckpt_path} at step {start_step}")
    for stale in [p for p in (metrics_path, ckpt_path) if not args.resume and os.path.exists(p)]:  # a new run
        os.remove(stale)
    return start_step, totals, train_history(metrics_path, args, start_step)


def log_step(args, m, history, totals):
    """A step's train line `m`: onto history, into the run's totals and into OUT/metrics.jsonl."""
    history.append(m)
    add_totals(totals, m)
    append_metrics(os.path.join(args.out, "metrics.jsonl"), m)


def log_eval(args, e, totals, write=None, **more):
    """An evaluation's line of OUT/metrics.jsonl: its numbers `e`, the run's totals so far and `more`; write (the
    progress bar's): prints its one-line summary."""
    append_metrics(os.path.join(args.out, "metrics.jsonl"), {**e, **totals, **more})
    if write:
        write(
            f"step {e['step']}: held-out greedy Pass@1 {e['eval_greedy_pass1']:.3f}, Pass@1 (mean of {e['n']}) "
            f"{e['eval_pass1_mean']:.3f}, Pass@{e['k']} {e['eval_passk']:.3f}"
        )


def end_step(args, step, model, optimizer, run_flags, totals, notice, prog, write=print):
    """After a step: OUT/checkpoint.pt every --save-every steps, at the last step, at --stop-after and after a notice
    (Preemption), which then stops the run (stopped: exit STOPPED). True at --stop-after: a clean stop, announced
    with `write` (the progress bar's); --resume continues."""
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if step % args.save_every == 0 or step in (args.steps, args.stop_after) or notice.signal:
        save_checkpoint(ckpt_path, model, optimizer, step, {k: getattr(args, k) for k in run_flags}, totals)
    if notice.signal and step < args.steps:  # a preemption notice: this step's checkpoint, then exit STOPPED
        stopped(prog, notice.signal, step, ckpt_path)
    if step == args.stop_after:
        write(f"stopped after step {step} (--stop-after); continue with --resume")
    return step == args.stop_after


def fail(prog, error, out=None):
    """The one line of a bad flag, file, model or checkpoint (a str, UsageError, DataError: exit 2) or of a full disk
    (exit DISK_FULL, fail_disk); any other error is raised on."""
    if not isinstance(error, (str, ValueError)):  # UsageError and DataError are ValueErrors
        disk = disk_full(error, out or ".")
        if disk is None:
            raise error
        fail_disk(prog, disk, out)
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


class DiskFull(Exception):
    """A write that a full disk (or quota) failed, on this rank or another: the OSError (its errno, file) and the
    run's --out. train_full.entry prints it as one line (fail_disk) and exits common.DISK_FULL (74)."""

    def __init__(self, error, out):
        super().__init__(str(error))
        self.error, self.out = error, out


def on_another_rank(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (on another rank)", path)


@contextlib.contextmanager
def attempt(path, out, world):
    """A write (to `path`) that every rank enters and leaves together, in place of a barrier: a full disk on ANY
    rank (common.disk_full) raises DiskFull on EVERY rank as they leave (one all-reduce), so no rank waits for one
    that stopped. Another error is raised on its own rank (train_full.entry ends the job)."""
    faults = []
    with noting(faults, path):
        yield
    if all_reduce(bool(faults), world, dist.ReduceOp.MAX):
        raise DiskFull(faults[0] if faults else on_another_rank(path), out)


@contextlib.contextmanager
def noting(faults, path):
    """Run the block; a full disk in it is appended to `faults`, not raised; another error is raised."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        error = disk_full(e, path)
        if error is None:
            raise
        faults.append(error)
