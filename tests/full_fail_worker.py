"""Run under torchrun: train_full.entry() with an error injected on rank 1 in its first grading step.

tests/test_full_hf_rollout.py checks that the whole job then ends within a minute with the
error printed, instead of rank 0 waiting in a collective for the process group's 60 minutes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_full  # noqa: E402

real_grade = train_full.grade


def grade_or_fail(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    return real_grade(*args, **kwargs)


if __name__ == "__main__":
    train_full.grade = grade_or_fail
    train_full.entry(sys.argv[1:])
