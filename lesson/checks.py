"""The checkers of the lesson's exercises (lesson.ipynb, section 8, "Exercises"): each compares a student's function
with d3s.py on many inputs, and raises AssertionError saying what differs, or prints what passed."""

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
        values = (
            torch.rand(n, generator=gen).tolist() if seed % 3 else (torch.rand(n, generator=gen) < 0.5).float().tolist()
        )
        for m in range(1, n + 1):
            idx = [int(i) for i in fn(values, m)]
            assert len(set(idx)) == m and all(0 <= i < n for i in idx), (
                f"values {values}, m = {m}: {idx} is not m indices"
            )
            var = lambda ix: torch.tensor([values[i] for i in ix], dtype=torch.float64).var().item() if m > 1 else 0.0
            best = max(var(c) for c in itertools.combinations(range(n), m))
            assert var(idx) >= best - 1e-9, f"values {values}, m = {m}: Var {var(idx):.4f} < the best {best:.4f}"
            mine = d3s.max_variance_subset(torch.tensor(values), m).tolist()
            assert abs(var(mine) - best) < 1e-9  # d3s itself is optimal
    print("exercise 2: passed (30 rows, every m)")


def check_entropy_scores(fn):
    """Exercise 3: the scores rank the tokens as entropy alone does (methods.TOKEN_RULES['entropy'])."""
    gen = torch.Generator().manual_seed(0)
    adv, entropy = torch.randn(5, generator=gen), torch.rand(5, 7, generator=gen) * 2
    mask = torch.ones(5, 7)
    for k in (0.1, 0.3, 0.6):
        got = d3s.select_tokens(fn(adv, entropy), mask, k)
        want = d3s.select_tokens(entropy, mask, k)
        assert torch.equal(got, want), f"K = {k}: the kept tokens differ from the top K by entropy"
    assert not torch.equal(
        d3s.select_tokens(fn(adv, entropy), mask, 0.3), d3s.select_tokens(d3s.token_scores(adv, entropy), mask, 0.3)
    ), "these are the tokens |A| * H keeps: the exercise asks for entropy alone"
    print("exercise 3: passed (the top K by entropy at K = 0.1, 0.3, 0.6)")


def check_linear_schedule(fn):
    """Exercise 4 against d3s.dynamic_schedule at every step of a few runs (and past their end). N rounds half up:
    the project's convention (choice; the paper gives no rounding), which Python's round (half to even) misses."""
    for total, ends in ((100, (8, 32, 0.05, 0.2)), (7, (4, 16, 0.05, 0.2)), (80, (2, 4, 0.3, 0.5))):
        for step in range(total + 3):
            n, k = fn(step, total, *ends)
            want_n, want_k = d3s.dynamic_schedule(step, total, *ends)
            assert n == want_n and math.isclose(k, want_k, abs_tol=1e-9), (
                f"step {step} of {total}, ends {ends}: ({n}, {k}), expected ({want_n}, {want_k})"
            )
    print("exercise 4: passed (three runs, every step)")


def _batches():
    """Reward batches [P, G] for exercise 5: 0/1 at several success rates (groups without spread included) and
    continuous, and one hand-made batch where the best pooled choice is uneven across groups."""
    yield torch.tensor(
        [[1.0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 1, 0, 1, 0], [1] * 8, [0] * 8]
    )
    for seed in range(24):
        gen = torch.Generator().manual_seed(100 + seed)
        P, G = 2 + seed % 5, 4 + 2 * (seed % 4)
        if seed % 3 == 2:
            yield torch.rand(P, G, generator=gen)
        else:
            rate = torch.rand(P, 1, generator=gen)  # each prompt its own difficulty: some groups without spread
            yield (torch.rand(P, G, generator=gen) < rate).float()


def check_cross_group_selection(fn):
    """Exercise 5: keep N * P rollouts of the whole batch, pooled across groups, with the largest (unbiased)
    variance of their full-group advantages; return them with those advantages, not re-standardized."""
    for rewards in _batches():
        P, G = rewards.shape
        for n in range(1, G + 1):
            keep, adv = fn(rewards.clone(), n)
            where = f"rewards {rewards.tolist()}, N = {n}"
            assert tuple(keep.shape) == (P, G) and tuple(adv.shape) == (P, G), (
                f"{where}: shapes {tuple(keep.shape)}, {tuple(adv.shape)}"
            )
            keep = keep.bool()
            assert int(keep.sum()) == n * P, f"{where}: kept {int(keep.sum())}, expected N * P = {n * P} over the batch"
            full = d3s.group_advantages(rewards)
            assert torch.allclose(adv.float(), torch.where(keep, full, torch.zeros_like(full)), atol=1e-5), (
                f"{where}: the advantages must be the full-group A of "
                'section 1, "Where GRPO\'s signal goes", on the kept (0 elsewhere), not '
                "recomputed on the kept rollouts (that is PODS)"
            )
            want_keep, want_adv = d3s.select_samples(rewards, n, "cross")
            best = d3s.kept_variance(want_adv, want_keep)
            assert d3s.kept_variance(full, keep) >= best - 1e-6, (
                f"{where}: pooled Var(A') {d3s.kept_variance(full, keep):.4f} < the best {best:.4f}"
            )
    print("exercise 5: passed (25 batches, every N)")


def _token_batches():
    """(adv [B], entropy [B, T], mask [B, T]) for exercise 6: right-padded responses of uneven lengths, the padding
    given a high entropy (a padded position must never be kept), one response with A = 0."""
    for seed in range(12):
        gen = torch.Generator().manual_seed(200 + seed)
        B, T = 3 + seed % 4, 6 + seed % 5
        adv = torch.randn(B, generator=gen) * 1.5
        adv[seed % B] = 0.0
        entropy = torch.rand(B, T, generator=gen) * 2
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T
        mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
        entropy = torch.where(mask, entropy, torch.full_like(entropy, 5.0))  # garbage at the padding
        yield adv, entropy, mask


def check_token_topk(fn):
    """Exercise 6: the top K of |A| * H over every real token of the batch (ceil(K * valid tokens) of them), never a
    padded one. Compared with d3s.select_tokens(d3s.token_scores(adv, entropy), mask, k) by the scores kept (ties,
    as among the tokens of a response with A = 0, may go either way)."""
    for adv, entropy, mask in _token_batches():
        scores = adv.abs().unsqueeze(-1) * entropy
        for k in (0.05, 0.2, 0.5, 1.0):
            got = fn(adv.clone(), entropy.clone(), mask.clone(), k)
            where = f"adv {[round(a, 2) for a in adv.tolist()]}, lengths {mask.sum(-1).tolist()}, K = {k}"
            assert tuple(got.shape) == tuple(mask.shape), (
                f"{where}: shape {tuple(got.shape)}, expected {tuple(mask.shape)}"
            )
            got = got.bool()
            assert not (got & ~mask).any(), f"{where}: a padded position was kept (rank only the real tokens)"
            want = d3s.select_tokens(d3s.token_scores(adv, entropy), mask, k)
            assert int(got.sum()) == int(want.sum()), (
                f"{where}: kept {int(got.sum())} tokens, expected ceil(K * {int(mask.sum())} real tokens) = {int(want.sum())}"
            )
            assert torch.allclose(scores[got].sort().values, scores[want].sort().values), (
                f"{where}: not the top K by |A| * H over the whole batch"
            )
    print("exercise 6: passed (12 batches, K = 5%, 20%, 50%, 100%)")
