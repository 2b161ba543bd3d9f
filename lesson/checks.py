"""The checkers of the lesson's exercises (lesson.ipynb, section 7): each compares a student's function with d3s.py
on many inputs, and raises AssertionError saying what differs, or prints what passed."""

import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import d3s  # noqa: E402


def _rewards(seed, P=6, G=8, binary=True):
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(P, G, generator=gen)
    return (r < 0.4).float() if binary else r


def check_group_advantages(fn):
    """Exercise 1 against d3s.group_advantages, on 0/1 and continuous rewards, rows without spread included."""
    for seed in range(20):
        rewards = _rewards(seed, binary=seed % 2 == 0)
        rewards[0] = rewards[0, 0]  # a row with no spread
        got, want = fn(rewards), d3s.group_advantages(rewards)
        assert got.shape == want.shape, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert torch.allclose(got, want, atol=1e-5), f"rewards {rewards.tolist()}:\n got {got}\nwant {want}"
        assert torch.all(got[0] == 0), "a row whose rewards are all equal must get A = 0"
    print("exercise 1: passed (20 batches, rows without spread included)")


def check_max_variance_subset(fn):
    """Exercise 2: the chosen m indices reach the largest unbiased variance (any optimal subset passes)."""
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        n = 3 + seed % 6
        values = torch.rand(n, generator=gen).tolist() if seed % 3 else (torch.rand(n, generator=gen) < 0.5).float().tolist()
        for m in range(1, n + 1):
            idx = [int(i) for i in fn(values, m)]
            assert len(set(idx)) == m and all(0 <= i < n for i in idx), f"values {values}, m = {m}: {idx} is not m indices"
            var = lambda ix: torch.tensor([values[i] for i in ix], dtype=torch.float64).var().item() if m > 1 else 0.0  # noqa: E731
            best = max(var(c) for c in itertools.combinations(range(n), m))
            assert var(idx) >= best - 1e-9, f"values {values}, m = {m}: Var {var(idx):.4f} < the best {best:.4f}"
            mine = d3s.max_variance_subset(torch.tensor(values), m).tolist()
            assert abs(var(mine) - best) < 1e-9  # d3s itself is optimal
    print("exercise 2: passed (30 rows, every m)")


def check_entropy_scores(fn):
    """Exercise 3: the scores rank the tokens as entropy alone does (variants.TOKEN_RULES['entropy'])."""
    gen = torch.Generator().manual_seed(0)
    adv, entropy = torch.randn(5, generator=gen), torch.rand(5, 7, generator=gen) * 2
    mask = torch.ones(5, 7)
    for k in (0.1, 0.3, 0.6):
        got = d3s.select_tokens(fn(adv, entropy), mask, k)
        want = d3s.select_tokens(entropy, mask, k)
        assert torch.equal(got, want), f"K = {k}: the kept tokens differ from the top K by entropy"
    assert not torch.equal(d3s.select_tokens(fn(adv, entropy), mask, 0.3), d3s.select_tokens(d3s.token_scores(adv, entropy), mask, 0.3)), \
        "these are the tokens |A| * H keeps: the exercise asks for entropy alone"
    print("exercise 3: passed (the top K by entropy at K = 0.1, 0.3, 0.6)")


def check_linear_schedule(fn):
    """Exercise 4 against d3s.dynamic_schedule at every step of a few runs (and past their end)."""
    for total, ends in ((100, (8, 32, 0.05, 0.2)), (7, (4, 16, 0.05, 0.2)), (80, (2, 4, 0.3, 0.5))):
        for step in range(total + 3):
            n, k = fn(step, total, *ends)
            want_n, want_k = d3s.dynamic_schedule(step, total, *ends)
            assert n == want_n and math.isclose(k, want_k, abs_tol=1e-9), \
                f"step {step} of {total}, ends {ends}: ({n}, {k}), expected ({want_n}, {want_k})"
    print("exercise 4: passed (three runs, every step)")
