"""grading.Grader with a pool of grader processes, as a specification.

The pool gives the rewards of one grader (hand-written answers offline, a few hundred real gold
answers from the repo's data/); a slow answer hits the time limit in its own child while the
others are graded; a killed child is replaced; close() leaves no child alive. Every grader here
is real: math-verify in spawned children. About 30 s on a loaded 2-core CPU.
"""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from support.grading import Grader, default_grader_workers
from support.mathtask import load_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")  # the repository's own benchmark files (data/README.md)

SLOW = "\\boxed{9^{9^{9^{9^{9^{9}}}}}}"  # sympy evaluates the power tower: math-verify never returns

# (completion, gold, reward) checked by hand: equivalent forms, near misses, no or bad \boxed{}
HAND_WRITTEN = [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2}", "\\frac{1}{2}", 0.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{12}", 0.0),
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),
    ("\\boxed{[1, 2]}", "(1,2]", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{10^3}", "1000", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{7}", "-7", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{3,2,1\\}", 0.0),
    ("\\boxed{45^\\circ}", "45", 1.0),
    ("\\boxed{\\text{(B)}}", "B", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{5}", "6", 0.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{2^{11}}", "1024", 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
    ("first \\boxed{4} then \\boxed{3}", "4", 0.0),
    ("no box: 4", "4", 0.0),
    ("\\boxed{}", "4", 0.0),
    ("\\boxed{" + "1+" * 300 + "1}", "301", 0.0),  # longer than MAX_BOXED_CHARS: not an answer
]


@pytest.fixture(scope="module")
def one_grader():
    with Grader(timeout_s=10.0) as grader:
        yield grader


@pytest.fixture(scope="module")
def pool():
    with Grader(timeout_s=10.0, workers=3) as grader:
        yield grader


def alive_pids(grader):
    return sorted(c.proc.pid for c in grader._children if c.proc.is_alive())


# ---------------------------------------------------------------------------------------------
# Same rewards as one grader, in input order
# ---------------------------------------------------------------------------------------------
def test_pool_gives_the_hand_checked_rewards_of_one_grader_in_input_order(one_grader, pool):
    completions, golds, expected = map(list, zip(*HAND_WRITTEN))
    completions, golds, expected = completions * 2, golds * 2, expected * 2  # repeats: graded once, same reward
    assert pool.score_batch(completions, golds) == expected
    assert one_grader.score_batch(completions, golds) == expected
    assert [pool.score(c, g) for c, g, _ in HAND_WRITTEN[:4]] == [1.0, 1.0, 1.0, 0.0]  # score() too
    assert len(alive_pids(pool)) == 3  # 32 answers waited: all 3 children were started


def test_pool_gives_the_rewards_of_one_grader_on_real_gold_answers(one_grader, pool):
    golds = []
    for name in ("math500.jsonl", "minerva_math.jsonl", "olympiadbench.jsonl"):
        rows, _ = load_problems(os.path.join(DATA, name))
        golds += [rows[i * len(rows) // 35]["answer"] for i in range(35)]  # 35 evenly spaced rows per file
    n = len(golds)
    # each gold against itself (right) and against the next row's gold (a real answer, wrong here)
    completions = [f"So \\boxed{{{g}}}." for g in golds] + [f"So \\boxed{{{golds[(i + 1) % n]}}}." for i in range(n)]
    pool_rewards = pool.score_batch(completions, golds + golds)
    assert pool_rewards == one_grader.score_batch(completions, golds + golds)
    assert sum(pool_rewards[:n]) >= 0.9 * n and sum(pool_rewards[n:]) <= 0.1 * n  # both rewards really occur
    assert pool.timeouts == one_grader.timeouts == 0


# ---------------------------------------------------------------------------------------------
# The time limit, per answer and per child; dead children are replaced
# ---------------------------------------------------------------------------------------------
def test_slow_answer_times_out_in_its_child_while_the_others_are_graded():
    timeout = 2.0
    others = HAND_WRITTEN[:12]
    with Grader(timeout_s=timeout, workers=2) as grader:
        grader.start()  # both children ready outside the timed part
        t0 = time.time()
        rewards = grader.score_batch([SLOW] + [c for c, _, _ in others], ["7"] + [g for _, g, _ in others])
        elapsed = time.time() - t0
        assert rewards == [0.0] + [r for _, _, r in others]
        assert grader.timeouts == 1
        assert elapsed < timeout + 3.0, f"{elapsed:.1f} s"
        assert grader.score_batch(["\\boxed{8}", "\\boxed{9}"], ["8", "9"]) == [1.0, 1.0]  # a new child replaced it
        assert len(alive_pids(grader)) == 2 and grader.timeouts == 1


def test_a_child_killed_between_batches_is_replaced_without_a_timeout():
    with Grader(timeout_s=10.0, workers=2) as grader:
        grader.start()
        before = alive_pids(grader)
        assert len(before) == 2
        victim = grader._children[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        completions, golds, expected = map(list, zip(*HAND_WRITTEN[:8]))
        assert grader.score_batch(completions, golds) == expected
        after = alive_pids(grader)
        assert len(after) == 2 and victim.pid not in after
        assert grader.timeouts == 0  # it died between answers: no answer lost


def test_a_child_killed_on_an_answer_scores_it_0_at_once_and_is_replaced():
    with Grader(timeout_s=60.0, workers=2) as grader:
        grader.start()

        def kill_the_busy_child():
            time.sleep(1.0)
            for child in list(grader._children):
                if child.state == "busy":
                    os.kill(child.proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_the_busy_child)
        killer.start()
        t0 = time.time()
        rewards = grader.score_batch([SLOW, "\\boxed{3}"], ["7", "3"])
        elapsed = time.time() - t0
        killer.join()
        assert rewards == [0.0, 1.0] and grader.timeouts == 1
        assert elapsed < 30.0, f"{elapsed:.1f} s: the death was not noticed before the 60 s limit"
        assert grader.score_batch(["\\boxed{4}", "\\boxed{5}"], ["4", "5"]) == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# close(), bad arguments, the default size
# ---------------------------------------------------------------------------------------------
def test_close_leaves_no_child_alive():
    grader = Grader(timeout_s=10.0, workers=3)
    with grader:
        grader.start()
        procs = [c.proc for c in grader._children]
        assert len(procs) == 3 and all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)
    assert not {p.pid for p in procs} & {p.pid for p in mp.active_children()}
    for p in procs:
        with pytest.raises(ProcessLookupError):  # killed and reaped: no such process
            os.kill(p.pid, 0)
    assert grader.score("\\boxed{2}", "2") == 1.0  # a closed grader starts a child again when used
    grader.close()


@pytest.mark.parametrize(
    "kwargs, name", [({"workers": 0}, "workers"), ({"workers": 2.0}, "workers"), ({"timeout_s": 0}, "timeout_s")]
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Grader(**kwargs)


def test_default_grader_workers_splits_the_cores_among_ranks_and_caps():
    assert [default_grader_workers(8, cores=c) for c in (4, 16, 64, 224)] == [1, 2, 8, 8]
    assert default_grader_workers(1, cores=2) == 2 and default_grader_workers(1, cores=2, cap=1) == 1
    assert 1 <= default_grader_workers(1) <= 8
    with pytest.raises(ValueError, match="ranks_per_node"):
        default_grader_workers(0)
