"""train_small.py whose every train line is followed by a pause of S seconds: a step lasts long enough that a signal
sent after the first one lands mid-run, however fast the machine (the numbers are those of the plain run).

    python tests/small_slow_worker.py S [train_small.py flags]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import run, stops  # noqa: E402
import train_small  # noqa: E402


def slowed(pause, real_append):
    def append_metrics(path, record):
        real_append(path, record)
        if record.get("kind") == "train":
            time.sleep(pause)

    return append_metrics


if __name__ == "__main__":  # the grader's child processes re-import this file
    run.append_metrics = slowed(float(sys.argv[1]), run.append_metrics)
    stops.interruptible(lambda: train_small.main(sys.argv[2:]), train_small.PROG)
