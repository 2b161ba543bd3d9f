"""bench/grader.py: how fast the math-verify grader pool (support/grading.py) scores a step's answers, per pool size.

    python bench/grader.py                            # 512 real answers, 1 and 2 grader processes
    python bench/grader.py --n 256 --workers 1,2,4 --slow

The per-answer times it printed are in grading.default_grader_workers' docstring (why 8 processes per rank at most).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import cli  # noqa: E402  (support/cli.py: one-line errors)
from support.grading import Grader  # noqa: E402
from support.mathtask import load_problems  # noqa: E402


def bench_grader(n=512, workers=(1, 2), data_dir=None, timeout_s=5.0, slow=False):
    """Print the wall time of Grader(timeout_s, w).score_batch on `n` real answers for each w in `workers`.

    The answers are gold answers of math500, minerva_math and olympiadbench (the repo's data/),
    evenly spaced rows, boxed: even positions get their own gold (right), odd positions the next
    row's gold (a real answer, wrong here). slow=True puts first one answer math-verify never
    finishes (a power tower), which costs one child timeout_s. Every w gets a fresh grader (empty
    cache), whose children are started, and timed, before the timed call. Returns {w: seconds}.
    """
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is in bench/
    data_dir = data_dir or os.path.join(repository, "data")
    golds = [
        r["answer"]
        for name in ("math500.jsonl", "minerva_math.jsonl", "olympiadbench.jsonl")
        for r in load_problems(os.path.join(data_dir, name))[0]
    ]
    golds = [golds[i * len(golds) // n] for i in range(n)]
    completions = [f"The answer is \\boxed{{{golds[i if i % 2 == 0 else (i + 1) % n]}}}." for i in range(n)]
    if slow:
        completions, golds = ["\\boxed{9^{9^{9^{9^{9^{9}}}}}}"] + completions[1:], ["7"] + golds[1:]
    print(
        f"{n} answers{' (the first one slow)' if slow else ''}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the start, timeout {timeout_s} s"
    )
    times, first = {}, None
    for w in workers:
        with Grader(timeout_s, workers=w) as grader:
            t0 = time.perf_counter()
            grader.start()
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            rewards = grader.score_batch(completions, golds)
            times[w] = time.perf_counter() - t0
        first = first or (rewards, times[w])
        print(
            f"workers={w}: start {start_s:.2f} s, score_batch {times[w]:.2f} s ({n / times[w]:.0f} answers/s, "
            f"x{first[1] / times[w]:.2f} vs workers={workers[0]}), reward sum {sum(rewards):.0f}, "
            f"timeouts {grader.timeouts}, rewards identical to workers={workers[0]}: {rewards == first[0]}"
        )
    return times


def main(argv=None):
    n = cli.number
    flags = [
        cli.flag("--n", 512, n(int, 1, 10**6), "answers to grade"),
        cli.flag("--workers", "1,2", None, "comma-separated grader process counts"),
        cli.flag("--timeout", 5.0, n(float, 0, 3600, low_open=True), "seconds per answer"),
        cli.flag("--slow", False, bool, "the first answer hits the time limit (a power tower)"),
    ]
    p = cli.parser("grader.py", __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    workers = cli.int_list(p, "--workers", args.workers, low=1, what="comma-separated process counts")
    bench_grader(args.n, workers, timeout_s=args.timeout, slow=args.slow)


if __name__ == "__main__":  # the grader's children are spawned: they import this file again
    main()
