"""train_small.py whose checkpoint of step N is left half written, then the process stalls (a SIGKILL lands there).

    python tests/small_stall_worker.py N [train_small.py flags]

The stall is this test's, not the product's: checkpoint.save_file is wrapped here (the real one writes to a
temporary file and renames it, so a kill mid-write leaves the previous checkpoint intact).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import checkpoint  # noqa: E402
import train_small  # noqa: E402


def stalling(stall_step, real_save):
    def save_file(path, model, optimizer, step, flags, totals, history):
        if step != stall_step:
            return real_save(path, model, optimizer, step, flags, totals, history)
        real_save(path + ".whole", model, optimizer, step, flags, totals, history)
        with open(path + ".whole", "rb") as f:
            data = f.read()
        os.remove(path + ".whole")
        with open(path + ".tmp", "wb") as f:  # where the real write was when the kill landed
            f.write(data[: len(data) // 2])
        print(f"checkpoint of step {step}: half written, stalled", file=sys.stderr, flush=True)
        time.sleep(600)

    return save_file


if __name__ == "__main__":  # the grader's child processes re-import this file
    checkpoint.save_file = stalling(int(sys.argv[1]), checkpoint.save_file)
    train_small.main(sys.argv[2:])
