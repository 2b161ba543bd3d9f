"""train_full.py whose checkpoint of step N is left half written, then the process stalls (a SIGKILL lands there).

    python tests/full_stall_worker.py N [train_full.py flags]

The stall is this test's, not the product's: checkpoint.save_shards is wrapped here. The real one writes the
shards and RNG files into OUT/checkpoints/step_NNNNNN.tmp, then trainer_state.json, then renames the folder: a
kill before the rename leaves a .tmp folder that --resume ignores. For step N this wrapper leaves the folder as
such a kill would find it (shards and RNG written, no trainer_state.json, not renamed), says so on stderr and
sleeps; every other step is saved as usual.
"""

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import checkpoint  # noqa: E402
import train_full  # noqa: E402


def stalling(stall_step, real_save):
    def save_checkpoint(model, optimizer, out, step, trainer_state, world, keep):
        final = real_save(model, optimizer, out, step, trainer_state, world, keep)
        if step != stall_step:
            return final
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        os.replace(final, final + ".tmp")  # where the real write was when the kill landed: before the rename ...
        os.remove(os.path.join(final + ".tmp", "trainer_state.json"))  # ... and before trainer_state.json
        print(f"checkpoint of step {step}: shards written, stalled before completion", file=sys.stderr, flush=True)
        time.sleep(600)

    return save_checkpoint


if __name__ == "__main__":  # the grader's child processes re-import this file
    checkpoint.save_shards = stalling(int(sys.argv[1]), checkpoint.save_shards)
    train_full.entry(sys.argv[2:])
