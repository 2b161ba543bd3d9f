"""train_full.py on a disk that fills up just before one of its writes (tests/test_full_faults.py).

    python tests/full_disk_worker.py WHAT STEP FILLER [train_full.py flags]      # or under torchrun

WHAT is the write that meets the full disk at step STEP: checkpoint (checkpoint.save_shards), metrics (the train
line of metrics.jsonl), export (checkpoint.export_hf, with --export-every) or explain (explain.write_step, with
--explain-every). Right before it, rank 0 fills the file system of FILLER (a small tmpfs) with that file, so the
write itself fails as it would on a real full disk (ENOSPC from the file system; nothing is faked in train_full).
The test then deletes FILLER and continues the run with --resume.
"""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import run, checkpoint, explain  # noqa: E402
import train_full  # noqa: E402


def fill(path):
    """Write zeros into `path` until the file system refuses (ENOSPC): no byte left."""
    if os.environ.get("RANK", "0") != "0":
        return
    chunk = b"\0" * 65536
    with open(path, "ab", buffering=0) as f:
        for size in (65536, 4096, 1):
            while True:
                try:
                    f.write(chunk[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break


def before(step_of, stall_step, filler, real):
    def wrapped(*args, **kwargs):
        if step_of(*args, **kwargs) == stall_step:
            fill(filler)
        return real(*args, **kwargs)

    return wrapped


if __name__ == "__main__":  # the grader's child processes re-import this file
    what, step, filler = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if what == "checkpoint":
        checkpoint.save_shards = before(lambda *a, **k: a[3], step, filler, checkpoint.save_shards)
    elif what == "metrics":
        run.append_metrics = before(
            lambda path, record: record["step"] if record["kind"] == "train" else None,
            step,
            filler,
            run.append_metrics,
        )
    elif what == "export":
        checkpoint.export_hf = before(
            lambda model, tok, path, *a: int(path.rsplit("_", 1)[-1]) if "hf_step_" in path else None,
            step,
            filler,
            checkpoint.export_hf,
        )
    elif what == "explain":
        explain.write_step = before(lambda *a, **k: k["step"], step, filler, explain.write_step)
    else:
        raise SystemExit(f"full_disk_worker.py: unknown write {what!r}")
    train_full.entry(sys.argv[4:])
