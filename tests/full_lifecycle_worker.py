"""train_full.entry() with a test-side hook, for tests/test_full_lifecycle.py:

    python tests/full_lifecycle_worker.py slow SECONDS [train_full.py flags]     # rank 0 pauses after each train line
    python tests/full_lifecycle_worker.py held PATH [train_full.py flags]        # ... while the file PATH exists
    python tests/full_lifecycle_worker.py killed-at-the-end [train_full.py flags]  # SIGKILL right after the last checkpoint

The hooks are this test's, not the product's: `slow` leaves time for a signal while the run is in its loop, `held` holds it there
(after its first step) until the test removes PATH, however slow the machine; `killed-at-the-end` is a real SIGKILL at the one moment between the last step's checkpoint and the run's
end (OUT/hf_final, the final evaluation).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import checkpoint, run  # noqa: E402
import train_full  # noqa: E402
from small_slow_worker import slowed  # noqa: E402  (train_small's slow hook: the same pause)


def held(path, real_append):
    def append_metrics(path_, record):
        real_append(path_, record)
        while record.get("kind") == "train" and os.path.exists(path):
            time.sleep(0.1)

    return append_metrics


def killed_after(steps, real_save):
    def save_shards(*args, **kwargs):
        path = real_save(*args, **kwargs)
        if args[3] == steps:  # the last step's checkpoint is complete: die before the export and the evaluation
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    return save_shards


if __name__ == "__main__":  # the grader's child processes re-import this file
    if sys.argv[1] == "slow":
        run.append_metrics = slowed(float(sys.argv[2]), run.append_metrics)
        train_full.entry(sys.argv[3:])
    elif sys.argv[1] == "held":
        run.append_metrics = held(sys.argv[2], run.append_metrics)
        train_full.entry(sys.argv[3:])
    elif sys.argv[1] == "killed-at-the-end":
        argv = sys.argv[2:]
        checkpoint.save_shards = killed_after(int(argv[argv.index("--steps") + 1]), checkpoint.save_shards)
        train_full.entry(argv)
    else:
        raise SystemExit(f"full_lifecycle_worker.py: unknown hook {sys.argv[1]!r}")
