"""support/stops.py: how a run stops, in both trainers: a preemption notice, Ctrl-C, a full disk, a bad input.

Notices         SIGTERM, SIGUSR1 or a first Ctrl-C: the loop finishes its step, writes its checkpoint and exits STOPPED
                (75), --resume continues as if uninterrupted; a second Ctrl-C stops at once (INTERRUPTED, 130). Under
                torchrun every rank agrees on the notice and on a full disk one rank's own write met (agree)
disk_full, DiskFull, attempt   a full disk or quota: one line, exit DISK_FULL (74), the last checkpoint intact
fail, usage_error_line, crashed, interruptible   how a script ends on an error: one line and its exit code
"""

import contextlib
import errno
import os
import shutil
import signal
import sys
import threading
import time
import traceback

from tqdm import tqdm  # tqdm.write: a line starts clear of a progress bar

STOPPED, DISK_FULL, INTERRUPTED = 75, 74, 130  # exit codes: stopped on a notice or a first Ctrl-C with a checkpoint,
# run again with --resume (sysexits' TEMPFAIL); a write failed (IOERR); a Ctrl-C that stopped at once (128 + SIGINT)
NOTICES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # SIGHUP: a closed terminal, some schedulers
LAUNCHER_GONE = 999  # agree()'s code for a rank whose launcher (torchrun) died: the same stop as a notice
NEARLY_FULL = 16 * 2**20  # bytes free below which a write's RuntimeError is taken for a full disk
_EARLY = {"watching": False}  # ctrl_c_at_once's thread acts until the loop's Notices take over


class Notices:
    """While in its `with` block, SIGTERM and SIGUSR1 (a cluster's notice before it preempts a job: SLURM,
    Kubernetes), SIGHUP (a closed terminal) and a first SIGINT (Ctrl-C; torchrun forwards it to every rank) set
    `.signal` (the signal's name), as does the end of the launcher (a rank whose torchrun died, its parent another,
    stops after its step, not an orphan). A second SIGINT stops at once: `prog`'s one line (rank 0's) and exit
    INTERRUPTED (os._exit); every checkpoint is a temporary file renamed, so a write it cuts leaves the last one
    intact. world (train_full.py: fsdp.World): agree() answers for every rank; without one, for this process."""

    def __init__(self, prog, world=None, out="."):
        self.prog, self.world, self.out = prog, world, out
        self.quiet = world is not None and not world.is_main  # a second Ctrl-C: rank 0's line
        self.signal, self.previous, self.faults = None, {}, []
        self.parent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None  # torchrun's agent

    def __enter__(self):
        if _EARLY["watching"]:  # the loop's own handling from here on (ctrl_c_at_once)
            _EARLY["watching"] = False
            signal.set_wakeup_fd(-1)
        for notice in NOTICES:
            self.previous[notice] = signal.signal(notice, self.note)
        return self

    def note(self, number, frame):
        if number == signal.SIGINT and self.signal:  # a second Ctrl-C (or one after a notice): stop now
            line = "stopped at once by a second Ctrl-C (SIGINT); the last checkpoint written is intact; "
            interrupted(self.prog, line + "continue with --resume", quiet=self.quiet, at_once=True)
        self.signal = signal.Signals(number).name

    def __exit__(self, *exc):
        for notice, handler in self.previous.items():
            signal.signal(notice, handler)

    def writing(self, path):
        """A write of this rank alone (rank 0's metrics line, its explain page): a full disk is noted (agree() raises
        DiskFull on every rank), not raised."""
        return noting(self.faults, path)

    def agree(self):
        """At the step's end: DiskFull (on every rank) if a noted write failed (on any); else the name of the notice
        received (by any rank: one all-reduce), or None."""
        if self.parent is not None and os.getppid() != self.parent and not self.signal:
            self.signal = "the end of its launcher (torchrun's process is gone)"
        number = signal.Signals[self.signal].value if self.signal in signal.Signals.__members__ else 0
        number = LAUNCHER_GONE if self.signal and not number else number
        code = int(most(1000 if self.faults else number, self.world))
        if code >= 1000:
            raise DiskFull(self.faults[0] if self.faults else _on_another_rank(self.out), self.out)
        if code == LAUNCHER_GONE:
            return "the end of its launcher (torchrun's process is gone)"
        return signal.Signals(code).name if code else None


def ctrl_c_at_once(prog, fix):
    """Called first, before the imports: until the loop's Notices take over, a Ctrl-C (torchrun forwards one SIGINT to
    each rank) ends this process at once with one line (rank 0's) and exit INTERRUPTED, even while torch imports or
    the main thread waits in C++ (the rendezvous), where no Python handler runs: the signal wakes a thread
    (signal.set_wakeup_fd) that ends it."""

    def stop(*_):
        interrupted(prog, f"stopped by Ctrl-C (SIGINT); {fix}", quiet=os.environ.get("RANK", "0") != "0", at_once=True)

    signal.signal(signal.SIGINT, stop)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)  # C level: written at once, whatever the main thread is doing

    def watch():  # blocked on the pipe for the life of the process (a daemon): it acts only before the loop
        while True:
            if os.read(read, 1) == bytes([signal.SIGINT]) and _EARLY["watching"]:
                time.sleep(1.0)  # the main thread's own handler, where it can run, goes first: the same line and exit
                if _EARLY["watching"]:
                    stop()

    _EARLY["watching"] = True
    threading.Thread(target=watch, daemon=True).start()


def stopped(prog, notice, step, checkpoint, quiet=False):
    """The one line of a run that a notice (or a first Ctrl-C) stopped after `step` and its checkpoint (none if
    `quiet`: the other ranks of a job); exit STOPPED."""
    notice += " (Ctrl-C)" if notice == "SIGINT" else ""
    if not quiet:
        line = f"{prog}: stopped by {notice} after step {step}; checkpoint {checkpoint}; continue with --resume"
        tqdm.write(line, file=sys.stderr)
    sys.exit(STOPPED)


def interrupted(prog, line, quiet=False, at_once=False):
    """`prog: line` (none if `quiet`), then exit INTERRUPTED: at once (os._exit: no cleanup, no atexit) or by
    SystemExit (the `with` blocks close: child processes, locks)."""
    if not quiet:
        tqdm.write(f"{prog}: {line}", file=sys.stderr)
    sys.stdout.flush(), sys.stderr.flush()
    if at_once:
        os._exit(INTERRUPTED)
    sys.exit(INTERRUPTED)


def interruptible(main, prog, fix="run the same command again"):
    """main() for a script's `__main__`: a Ctrl-C outside a Notices block (KeyboardInterrupt) ends in one line and
    exit INTERRUPTED, no traceback; under torchrun only rank 0 prints it. A shell that started the script with SIGINT
    ignored (a background job) has it handled again, as Notices does."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return main()
    except KeyboardInterrupt:
        interrupted(prog, f"stopped by Ctrl-C (SIGINT); {fix}", quiet=os.environ.get("RANK", "0") != "0")


@contextlib.contextmanager
def sigint_ignored():
    """Child processes started in the block ignore SIGINT from their first instruction (inherited): a terminal's Ctrl-C
    reaches the whole process group and is the parent's to act on, so no child prints a KeyboardInterrupt traceback.
    A Ctrl-C in the block itself (milliseconds) is lost. Main thread only (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# === A full disk: one line, exit DISK_FULL, whichever writer met it and on whichever rank =============================
def disk_full(error, path="."):
    """The OSError of a full disk or quota (ENOSPC, EDQUOT) behind `error`, or None; the run stops with one line
    (DISK_FULL). Writers say it in several ways: an OSError (open, write, close), safetensors' "No space left on
    device (os error 28)", DCP's CheckpointException holding each rank's error; torch.save's zip writer only raises a
    RuntimeError ("unexpected pos"): there the file system of `path` answers (less than NEARLY_FULL bytes free)."""
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


class DiskFull(Exception):
    """A write that a full disk (or quota) failed, on this rank or another: the OSError (its errno, file) and the
    run's --out. It ends the run in one line (fail) and exit DISK_FULL."""

    def __init__(self, error, out):
        super().__init__(str(error))
        self.error, self.out = error, out


def _on_another_rank(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (on another rank)", path)


def most(value, world):
    """The largest `value` over all ranks (one all-reduce); without a world (None), `value` itself."""
    if world is None:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def any_rank(flag, world):
    """Whether `flag` holds on any rank; without a world (None), on this process."""
    return bool(most(bool(flag), world))


@contextlib.contextmanager
def attempt(path, out, world):
    """A write (to `path`) that every rank enters and leaves together, in place of a barrier: a full disk on ANY rank
    raises DiskFull on EVERY rank as they leave (one all-reduce). Another error is raised on its own rank."""
    faults = []
    with noting(faults, path):
        yield
    if any_rank(faults, world):
        raise DiskFull(faults[0] if faults else _on_another_rank(path), out)


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


def disk_full_line(prog, error, out):
    """The one line of a full disk (`error` from disk_full); every write is a temporary file renamed into place or an
    appended line that a resume drops, so the last checkpoint is intact."""
    return (
        f"{prog}: error: no space left on the device while writing {error.filename or out} ({error.strerror}); "
        f"the last checkpoint in {out} is intact: free space, then continue with --resume"
    )


# === How a script ends on an error: one line and its exit code =======================================================
def fail(prog, error, out=None, at_once=False):
    """The one line of a bad flag, file, model or checkpoint (a str or ValueError; exit 2) or of a full disk (DiskFull
    or what disk_full recognises; exit DISK_FULL); any other error is raised on. Printed once per job under torchrun
    (usage_error_line); `at_once`: os._exit, as vLLM's engine and the process group would wait at shutdown."""
    if isinstance(error, DiskFull):
        line, code = disk_full_line(prog, error.error, error.out), DISK_FULL
    elif isinstance(error, (str, ValueError)):
        line, code = f"{prog}: error: {error}", 2
    else:
        disk = disk_full(error, out or ".")
        if disk is None:
            raise error
        line, code = disk_full_line(prog, disk, out), DISK_FULL
    usage_error_line(line)
    sys.stdout.flush(), sys.stderr.flush()
    if at_once:
        os._exit(code)
    sys.exit(code)


def usage_error_line(line, wait_s=10.0):
    """Print a bad-input line once per job: rank 0 at once, the others after wait_s (torchrun stops them when rank 0
    exits; a fault only one rank finds, a file missing on its node, still gets its line). Outside torchrun: at once."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(wait_s)
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def crashed(prog, error, fix):
    """The end of any other error under torchrun: a Ctrl-C outside the loop (KeyboardInterrupt) is rank 0's one line
    and exit INTERRUPTED on every rank; anything else prints its traceback and exits 1 at once (torchrun then stops
    the other ranks within seconds, instead of a 60-minute collective timeout)."""
    rank = os.environ.get("RANK", "0")
    if isinstance(error, KeyboardInterrupt):
        interrupted(prog, f"stopped by Ctrl-C (SIGINT); {fix}", quiet=rank != "0", at_once=True)
    line = f"{prog}: rank {rank} failed; ending the job (the other ranks are stopped by torchrun)"
    # rank 0's own bar: tqdm.write clears it; another rank's line may land after rank 0's bar: a newline first
    tqdm.write(line if rank == "0" else "\n" + line, file=sys.stderr)
    traceback.print_exception(error)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1)
