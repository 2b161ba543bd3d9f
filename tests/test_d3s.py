"""Specification tests for d3s.py: one behaviour per test, named after it.

Sections follow d3s.py and docs/algorithm.md: 1 group advantages, 2 max-variance subset, 3 sample
selection (Lemma 1, cross-group D3S, PODS / D3S-I / GRPO / random), 4 token entropy, 5 token
selection, 6 dynamic schedule, 7 policy loss, 8 argument errors, 9 doctests.

"Variance" means the unbiased (Bessel-corrected) variance throughout, as in d3s.py.
"""

import doctest
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import d3s
from support import methods
from d3s import (
    dynamic_schedule,
    group_advantages,
    kept_variance,
    max_variance_subset,
    policy_loss,
    select_samples,
    select_tokens,
    token_entropy,
)


def unbiased_var(values):
    """Two-pass unbiased variance in exact-ish float64 arithmetic (the reference, not d3s.py's)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return 0.0
    mean = math.fsum(values) / len(values)
    return math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)


def population_var(values):
    values = [float(v) for v in values]
    mean = math.fsum(values) / len(values)
    return math.fsum((v - mean) ** 2 for v in values) / len(values)


def best_subset_variance(values, m):
    """Brute force: the largest unbiased variance over all m-subsets."""
    return max(unbiased_var(subset) for subset in itertools.combinations(values, m))


def subset_variance(values, indices):
    return unbiased_var([values[i] for i in indices])


def assert_optimal(values, m, indices):
    values = [float(v) for v in values]
    best = best_subset_variance(values, m)
    got = subset_variance(values, indices)
    assert got >= best - 1e-9 * (1.0 + best), (values, m, indices, got, best)


def binary_rewards(P, G, seed, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(P, G, generator=g) < p).float()


def continuous_rewards(P, G, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(P, G, generator=g)


def budget(method, step, total_steps, group_size, **kw):
    """d3s.method_budget of a method by name (methods.LADDER: the papers' rows and the others)."""
    return d3s.method_budget(methods.LADDER[method], step=step, total_steps=total_steps, group_size=group_size, **kw)


def has_spread(rewards):
    return rewards.amax(-1) > rewards.amin(-1)


# =============================================================================================
# 1. group_advantages
# =============================================================================================
def test_group_advantages_match_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    # unbiased std: sqrt(1/3), 1/2, sqrt(5/3); eps = 1e-6 in the denominator
    s1, s2, s3 = math.sqrt(1 / 3) + 1e-6, 0.5 + 1e-6, math.sqrt(5 / 3) + 1e-6
    expected = torch.tensor(
        [
            [-0.5 / s1, -0.5 / s1, 0.5 / s1, 0.5 / s1],  # +-0.8660
            [-0.25 / s2, -0.25 / s2, -0.25 / s2, 0.75 / s2],  # -0.5, 1.5
            [-1.5 / s3, -0.5 / s3, 0.5 / s3, 1.5 / s3],  # +-1.1619, +-0.3873
        ]
    )
    torch.testing.assert_close(group_advantages(rewards), expected, atol=1e-6, rtol=1e-6)


def test_group_advantages_use_unbiased_std_like_torch_std():
    rewards = continuous_rewards(16, 8, seed=0)
    expected = (rewards - rewards.mean(-1, keepdim=True)) / rewards.std(-1, keepdim=True)  # unbiased
    adv = group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(adv, expected)
    for row in adv:
        assert unbiased_var(row) == pytest.approx(1.0, abs=1e-5)  # so Var(A) = 1, not (G-1)/G


def test_group_advantages_have_zero_mean_per_group():
    adv = group_advantages(binary_rewards(32, 8, seed=1))
    torch.testing.assert_close(adv.sum(-1), torch.zeros(32), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize(
    "rewards",
    [
        torch.full((2, 3), 0.1),  # constant non-integer: mean(0.1,...) != 0.1 in float32
        torch.full((1, 7), 0.1),
        torch.ones(3, 4),
        torch.zeros(2, 8),
        torch.tensor([[0.3], [1.0], [0.0]]),  # G = 1: torch.std would be NaN
    ],
    ids=["0.1-G3", "0.1-G7", "ones", "zeros", "G1"],
)
def test_zero_spread_groups_get_exactly_zero_never_nan(rewards, scale):
    adv = group_advantages(rewards, scale=scale)
    assert torch.isfinite(adv).all()
    assert (adv == 0).all()


def test_zero_spread_group_does_not_affect_other_groups():
    rewards = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 1.0]])
    adv = group_advantages(rewards)
    assert (adv[0] == 0).all()
    torch.testing.assert_close(adv[1], group_advantages(rewards[1:])[0])


def test_scale_false_is_dr_grpo_reward_minus_group_mean():
    rewards = continuous_rewards(8, 6, seed=2)
    torch.testing.assert_close(group_advantages(rewards, scale=False), rewards - rewards.mean(-1, keepdim=True))
    torch.testing.assert_close(
        group_advantages(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), scale=False), torch.tensor([[-0.25, -0.25, -0.25, 0.75]])
    )


# =============================================================================================
# 2. max_variance_subset
# =============================================================================================
def _small_vectors(n, seed):
    """Rows of length n: continuous, 0/1 (many ties), small integers (some ties), all equal."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat(
        [
            torch.randn(4, n, generator=g, dtype=torch.float64),
            (torch.rand(4, n, generator=g) < 0.5).double(),
            torch.randint(0, 3, (3, n), generator=g).double(),
            torch.full((1, n), 0.5, dtype=torch.float64),
        ]
    )


@pytest.mark.parametrize("n", range(1, 9))
def test_max_variance_subset_is_optimal_exhaustively_for_every_m(n):
    rows = _small_vectors(n, seed=n)
    for m in range(1, n + 1):
        chosen = max_variance_subset(rows, m)
        for values, indices in zip(rows.tolist(), chosen.tolist()):
            assert_optimal(values, m, indices)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_max_variance_subset_is_optimal_on_random_floats(data):
    values = data.draw(st.lists(st.floats(-10, 10, allow_nan=False, allow_infinity=False), min_size=1, max_size=8))
    m = data.draw(st.integers(1, len(values)))
    indices = max_variance_subset(torch.tensor(values, dtype=torch.float64), m).tolist()
    assert_optimal(values, m, indices)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_max_variance_subset_is_optimal_on_tied_values(data):
    values = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=1, max_size=8))
    m = data.draw(st.integers(1, len(values)))
    indices = max_variance_subset(torch.tensor(values), m).tolist()
    assert_optimal(values, m, indices)


def test_max_variance_subset_is_optimal_for_float32_inputs():
    rows = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))  # float32
    for m in range(1, 9):
        for values, indices in zip(rows.tolist(), max_variance_subset(rows, m).tolist()):
            assert_optimal(values, m, indices)


def test_max_variance_subset_vectorizes_over_2d_leading_dims():
    values = torch.randn(6, 9, generator=torch.Generator().manual_seed(4))
    batched = max_variance_subset(values, 4)
    assert torch.equal(batched, torch.stack([max_variance_subset(row, 4) for row in values]))


def test_max_variance_subset_vectorizes_over_3d_leading_dims():
    values = (torch.rand(3, 4, 8, generator=torch.Generator().manual_seed(5)) < 0.5).float()
    batched = max_variance_subset(values, 5)
    assert batched.shape == (3, 4, 5)
    for a in range(3):
        for b in range(4):
            assert torch.equal(batched[a, b], max_variance_subset(values[a, b], 5))


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 3, 7)])
@pytest.mark.parametrize("m", [1, 3, 7])
def test_max_variance_subset_returns_unique_sorted_long_indices_of_shape_m(shape, m):
    values = (torch.rand(shape, generator=torch.Generator().manual_seed(6)) * 4).round()  # with ties
    indices = max_variance_subset(values, m)
    assert indices.dtype == torch.long
    assert indices.shape == shape[:-1] + (m,)
    flat = indices.reshape(-1, m)
    assert ((flat >= 0) & (flat < shape[-1])).all()
    assert (flat[:, 1:] > flat[:, :-1]).all()  # strictly increasing: sorted and unique


def test_max_variance_subset_keeps_the_extremes_for_m_2():
    assert max_variance_subset(torch.tensor([0.5, 0.1, 0.9, 0.7]), 2).tolist() == [1, 2]


def test_max_variance_subset_ties_prefer_more_large_values():
    # {.1,.3,.9} and {.1,.7,.9} have the same variance: the one with more large values wins
    v = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3])
    assert max_variance_subset(v, 3).tolist() == [0, 1, 3]


def test_max_variance_subset_ties_keep_more_high_rewards_for_binary_rewards():
    # {0,0,1} and {0,1,1} tie: keep two correct rollouts and one wrong one
    idx = max_variance_subset(torch.tensor([1.0, 0.0, 0.0, 1.0]), 3)
    assert sorted(torch.tensor([1.0, 0.0, 0.0, 1.0])[idx].tolist()) == [0.0, 1.0, 1.0]


def test_max_variance_subset_with_m_1_picks_a_largest_value():
    # every 1-subset has variance 0: the tie rule takes the largest value
    v = torch.tensor([0.3, 0.9, 0.1])
    assert max_variance_subset(v, 1).tolist() == [1]


def test_max_variance_subset_with_m_n_keeps_everything():
    v = torch.randn(4, 6)
    assert torch.equal(max_variance_subset(v, 6), torch.arange(6).expand(4, 6))


# =============================================================================================
# 3. select_samples
# =============================================================================================
# --- Lemma 1 of D3S (the paper): some subset of a standardized group has Var(A') >= 1; the project's ---
# --- every-N form: the max-variance N-subset has it for every N in 2..G (unbiased variance only) -------
@pytest.mark.parametrize("reward_kind", ["binary", "continuous"])
@pytest.mark.parametrize("G", [4, 8, 16])
def test_d3s_i_kept_advantages_have_unbiased_variance_at_least_one(G, reward_kind):
    make = binary_rewards if reward_kind == "binary" else continuous_rewards
    rewards = make(48, G, seed=G)
    spread = has_spread(rewards)
    assert spread.sum() >= 10
    for n_keep in range(2, G + 1):
        # eps=0 makes Var(A) = 1 exactly (up to float32 rounding) in every group with spread
        keep, adv = select_samples(rewards, n_keep, "intra", eps=0.0)
        for p in torch.nonzero(spread).flatten().tolist():
            assert kept_variance(adv[p], keep[p]) >= 1.0 - 1e-5, (rewards[p], n_keep)


@pytest.mark.parametrize("G", [4, 8, 16])
def test_d3s_i_kept_variance_is_at_least_the_full_group_variance_with_default_eps(G):
    rewards = continuous_rewards(32, G, seed=100 + G)
    full = group_advantages(rewards)
    for n_keep in range(2, G + 1):
        keep, adv = select_samples(rewards, n_keep, "intra")
        for p in range(32):
            assert kept_variance(adv[p], keep[p]) >= unbiased_var(full[p]) - 1e-6


@pytest.mark.parametrize("unbiased", [True, False])
def test_papers_lemma_1_some_subset_reaches_variance_one_under_either_variance(unbiased):
    """The paper's claim: the {min, max} pair of a standardized group with spread has Var >= 1 (it spans >= 2 sigma),
    whichever variance standardizes and measures it."""
    rewards = continuous_rewards(64, 8, seed=7)
    a = (rewards - rewards.mean(-1, keepdim=True)) / rewards.std(-1, keepdim=True, unbiased=unbiased)
    for row in a[has_spread(rewards)]:
        pair = torch.stack([row.min(), row.max()])
        assert float(pair.var(unbiased=unbiased)) >= 1.0 - 1e-5


def test_population_variance_would_violate_the_every_n_form_of_lemma_1_which_is_why_unbiased_is_used():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    # population version: A standardized with the population std (A = +-1, population Var = 1);
    # the best 3-subset {-1, 1, 1} then has population variance 8/9 = 0.889 < 1.
    a_pop = ((rewards - rewards.mean()) / rewards.std(unbiased=False))[0].tolist()
    best_pop = max(population_var(s) for s in itertools.combinations(a_pop, 3))
    assert best_pop == pytest.approx(8 / 9)
    assert best_pop < 1.0
    # unbiased version (what d3s.py does): Var(A') = 1 >= 1.
    keep, adv = select_samples(rewards, 3, "intra", eps=0.0)
    assert kept_variance(adv[0], keep[0]) == pytest.approx(1.0, abs=1e-6)


# --- cross-group "d3s" -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_d3s_keeps_exactly_n_keep_times_P_rollouts(seed):
    rewards = binary_rewards(6, 8, seed=seed)
    for n_keep in range(1, 9):
        keep, _ = select_samples(rewards, n_keep, "cross")
        assert int(keep.sum()) == n_keep * 6


def test_d3s_may_take_all_of_one_group_and_none_of_another():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    keep, _ = select_samples(rewards, 2, "cross")
    assert keep.sum(-1).tolist() == [4, 0]


def test_d3s_may_keep_uneven_counts_from_groups_that_both_have_spread():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    keep, _ = select_samples(rewards, 2, "cross")
    assert keep.sum(-1).tolist() == [1, 3]


def test_d3s_never_keeps_zero_spread_groups_while_nonzero_advantages_remain():
    checked = 0
    for seed in range(40):
        rewards = binary_rewards(8, 8, seed=seed, p=0.2 + 0.015 * seed)  # some all-0 / all-1 groups
        adv = group_advantages(rewards)
        n_nonzero = int((adv != 0).sum())
        for n_keep in range(1, 9):
            if n_keep * 8 > n_nonzero:
                break
            keep, _ = select_samples(rewards, n_keep, "cross")
            assert not keep[~has_spread(rewards)].any(), (seed, n_keep)
            assert (adv[keep] != 0).all()
            checked += 1
    assert checked >= 40


def test_d3s_choice_is_max_variance_subset_of_the_pooled_advantages():
    rewards = continuous_rewards(5, 8, seed=7)
    rewards[1] = 0.25  # one zero-spread group
    pooled = group_advantages(rewards).reshape(-1)
    for n_keep in (1, 3, 6):
        keep, _ = select_samples(rewards, n_keep, "cross")
        assert torch.equal(torch.nonzero(keep.reshape(-1)).flatten(), max_variance_subset(pooled, n_keep * 5))


def test_d3s_cross_group_choice_has_at_least_the_pooled_variance_of_per_group_choice():
    for seed in range(5):
        rewards = binary_rewards(6, 8, seed=200 + seed)
        for n_keep in (2, 4, 6):
            keep_x, adv_x = select_samples(rewards, n_keep, "cross")
            keep_i, adv_i = select_samples(rewards, n_keep, "intra")
            assert kept_variance(adv_x, keep_x) >= kept_variance(adv_i, keep_i) - 1e-9


def test_d3s_advantages_are_full_group_advantages_on_kept_and_zero_elsewhere():
    rewards = continuous_rewards(4, 8, seed=8)
    keep, adv = select_samples(rewards, 3, "cross")
    full = group_advantages(rewards)
    assert torch.equal(adv[keep], full[keep])
    assert (adv[~keep] == 0).all()


# --- "pods", "d3s-i", "grpo", "random" -------------------------------------------------------
def test_pods_and_d3s_i_pick_the_same_rollouts_for_continuous_rewards():
    rewards = continuous_rewards(64, 8, seed=9)
    for n_keep in range(1, 9):
        keep_pods, _ = select_samples(rewards, n_keep, "pods")
        keep_d3si, _ = select_samples(rewards, n_keep, "intra")
        assert torch.equal(keep_pods, keep_d3si), n_keep


def test_pods_and_d3s_i_keep_the_same_reward_multiset_for_binary_rewards():
    rewards = binary_rewards(64, 8, seed=10)
    for n_keep in range(1, 9):
        keep_pods, _ = select_samples(rewards, n_keep, "pods")
        keep_d3si, _ = select_samples(rewards, n_keep, "intra")
        assert torch.equal((rewards * keep_pods).sum(-1), (rewards * keep_d3si).sum(-1)), n_keep
        assert (keep_pods.sum(-1) == n_keep).all() and (keep_d3si.sum(-1) == n_keep).all()


def test_pods_recomputes_advantages_on_the_kept_subset():
    rewards = continuous_rewards(16, 8, seed=11)
    rewards[3] = 1.0  # zero-spread group
    keep, adv = select_samples(rewards, 4, "pods")
    kept_rewards = rewards[keep].reshape(16, 4)  # boolean indexing keeps row order
    torch.testing.assert_close(adv[keep].reshape(16, 4), group_advantages(kept_rewards))
    assert (adv[~keep] == 0).all()


def test_pods_example_keeps_the_correct_rollout_and_one_wrong_one():
    keep, adv = select_samples(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), 2, "pods")
    assert keep[0].tolist() == [True, False, False, True]
    torch.testing.assert_close(adv[0], torch.tensor([1 / math.sqrt(2), 0.0, 0.0, -1 / math.sqrt(2)]), atol=1e-5, rtol=0)


def test_d3s_i_keeps_full_group_advantages_on_kept_and_zero_elsewhere():
    rewards = continuous_rewards(16, 8, seed=12)
    keep, adv = select_samples(rewards, 4, "intra")
    full = group_advantages(rewards)
    assert (keep.sum(-1) == 4).all()
    assert torch.equal(adv[keep], full[keep])
    assert (adv[~keep] == 0).all()


def test_pods_and_d3s_i_differ_only_in_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    keep_pods, adv_pods = select_samples(rewards, 4, "pods")
    keep_d3si, adv_d3si = select_samples(rewards, 4, "intra")
    assert torch.equal(keep_pods, keep_d3si)
    assert not torch.allclose(adv_pods, adv_d3si)


@pytest.mark.parametrize("n_keep", [1, 5, 8])
def test_grpo_keeps_all_rollouts_with_full_group_advantages_ignoring_n_keep(n_keep):
    rewards = binary_rewards(5, 8, seed=13)
    keep, adv = select_samples(rewards, n_keep, "all")
    assert keep.all()
    assert torch.equal(adv, group_advantages(rewards))


def test_random_keeps_exactly_n_keep_per_group_with_full_group_advantages():
    rewards = continuous_rewards(32, 8, seed=14)
    keep, adv = methods.uniform_samples(rewards, 3, generator=torch.Generator().manual_seed(0))
    assert (keep.sum(-1) == 3).all()
    full = group_advantages(rewards)
    assert torch.equal(adv[keep], full[keep])
    assert (adv[~keep] == 0).all()


def test_random_is_reproducible_with_a_generator():
    rewards = continuous_rewards(32, 8, seed=15)
    first, _ = select_samples(rewards, 3, methods.uniform_samples, generator=torch.Generator().manual_seed(42))
    again, _ = select_samples(rewards, 3, methods.uniform_samples, generator=torch.Generator().manual_seed(42))
    other, _ = select_samples(rewards, 3, methods.uniform_samples, generator=torch.Generator().manual_seed(43))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# =============================================================================================
# 4. token_entropy
# =============================================================================================
def reference_entropy(logits):
    z = logits.double()
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


def test_token_entropy_matches_direct_formula():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(16)) * 3
    torch.testing.assert_close(token_entropy(logits).double(), reference_entropy(logits), atol=1e-5, rtol=1e-5)


def test_token_entropy_accepts_bf16_and_returns_float32():
    logits = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(17)) * 3).bfloat16()
    entropy = token_entropy(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy.double(), reference_entropy(logits), atol=1e-5, rtol=1e-5)


def test_token_entropy_is_finite_and_exact_for_extreme_logits_with_one_dominant_token():
    logits = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(18)) * 1e4  # gaps >> 100
    logits[0, 0] = torch.tensor([1e4] + [-1e4] * 31)
    entropy = token_entropy(logits)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy.double(), reference_entropy(logits), atol=1e-5, rtol=0)


def test_token_entropy_matches_direct_formula_for_large_logits_with_close_top_values():
    logits = torch.tensor([[1e4, 1e4 - 1, -1e4, 0.0], [1e4, 1e4, -1e4, -1e4]])  # H = 0.582, log 2
    torch.testing.assert_close(token_entropy(logits).double(), reference_entropy(logits), atol=1e-3, rtol=0)


def test_token_entropy_treats_minus_inf_logits_as_zero_probability():
    logits = torch.tensor([[0.0, 0.0, -math.inf]])
    torch.testing.assert_close(token_entropy(logits), torch.tensor([math.log(2)]))


def test_token_entropy_is_log_v_for_uniform_logits():
    torch.testing.assert_close(token_entropy(torch.zeros(2, 3, 10)), torch.full((2, 3), math.log(10)))


@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
def test_token_entropy_does_not_depend_on_chunk_size(chunk_size):
    logits = torch.randn(7, 5, 33, generator=torch.Generator().manual_seed(19)) * 2
    torch.testing.assert_close(
        token_entropy(logits, chunk_size=chunk_size), token_entropy(logits, chunk_size=4), atol=1e-6, rtol=0
    )


def test_token_entropy_has_no_grad_even_if_logits_require_grad():
    logits = torch.randn(2, 3, 8, requires_grad=True)
    assert token_entropy(logits).requires_grad is False


@pytest.mark.parametrize("shape", [(2, 5, 11), (4, 11), (11,)])
def test_token_entropy_drops_the_vocabulary_dim(shape):
    assert token_entropy(torch.randn(shape)).shape == shape[:-1]


# =============================================================================================
# 5. select_tokens
# =============================================================================================
SCOPES = ["batch", "sequence"]


def ragged_batch(B=6, T=12, seed=20):
    """Distinct random scores; row b has a random number of valid tokens (>= 1), right-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    scores = torch.randperm(B * T, generator=g).reshape(B, T).float() / (B * T)
    return scores, mask


@pytest.mark.parametrize("k_frac", [0.05, 0.1, 0.2, 0.37, 0.5, 0.99, 1.0])
def test_batch_scope_keeps_ceil_k_frac_of_valid_tokens_without_min_per_seq(k_frac):
    scores, mask = ragged_batch()
    keep = select_tokens(scores, mask, k_frac, min_per_seq=0)
    assert int(keep.sum()) == math.ceil(k_frac * int(mask.sum()))


def test_batch_scope_token_count_is_not_inflated_by_float_rounding():
    scores = torch.rand(3, 10)
    mask = torch.ones(3, 10, dtype=torch.bool)  # 0.1 * 30 = 3.0000000000000004 in float64
    assert int(select_tokens(scores, mask, 0.1, min_per_seq=0).sum()) == 3


def test_batch_scope_keeps_ceil_k_frac_when_every_row_already_has_a_kept_token():
    scores, mask = ragged_batch(B=4, T=10)
    scores[:, 0] += 10.0  # every row's first token is among the global top 4
    keep = select_tokens(scores, mask, 0.3, min_per_seq=1)  # the floor adds nothing here
    assert int(keep.sum()) == math.ceil(0.3 * int(mask.sum()))


def test_the_default_is_the_papers_plain_top_k_without_a_floor_per_response():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.1, 0.3, 0.2, 0.0]])
    keep = select_tokens(scores, torch.ones(2, 4), 0.25)  # 2 of 8 tokens, both from row 0
    assert keep.sum(-1).tolist() == [2, 0]


@pytest.mark.parametrize("k_frac", [0.05, 0.125, 0.2])
def test_realised_fraction_is_within_one_token_of_k(k_frac):
    scores, mask = ragged_batch(B=40, T=9, seed=7)
    valid = int(mask.sum())
    kept = int(select_tokens(scores, mask, k_frac).sum())
    assert abs(kept - k_frac * valid) < 1.0
    # the floor breaks this on short responses: 40 rows of <= 9 tokens keep >= 40 tokens
    assert int(select_tokens(scores, mask, k_frac, min_per_seq=1).sum()) >= 40 > k_frac * valid + 1


@pytest.mark.parametrize("scope", SCOPES)
def test_padding_is_never_kept(scope):
    scores, mask = ragged_batch()
    scores = torch.where(mask, scores, torch.full_like(scores, 1e9))  # padding looks best
    for k_frac in (0.1, 0.5, 1.0):
        assert not (select_tokens(scores, mask, k_frac, scope=scope) & ~mask).any()


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("min_per_seq", [0, 1])
def test_k_frac_one_keeps_exactly_the_mask(scope, min_per_seq):
    scores, mask = ragged_batch()
    mask[2] = False  # a row with no valid tokens
    assert torch.equal(select_tokens(scores, mask, 1.0, scope=scope, min_per_seq=min_per_seq), mask)


def test_select_tokens_accepts_an_integer_mask():
    scores, mask = ragged_batch()
    assert torch.equal(select_tokens(scores, mask.long(), 0.3), select_tokens(scores, mask, 0.3))


def test_batch_scope_keeps_the_globally_highest_scores():
    scores, mask = ragged_batch()
    keep = select_tokens(scores, mask, 0.25, min_per_seq=0)
    assert scores[keep].min() > scores[mask & ~keep].max()


def test_batch_scope_gives_more_tokens_to_rows_with_larger_abs_advantage():
    entropy = torch.rand(1, 20, generator=torch.Generator().manual_seed(21)).expand(3, 20)
    adv = torch.tensor([0.2, -2.0, 1.0])
    scores = adv.abs().unsqueeze(-1) * entropy  # D3S score |A| * H
    keep = select_tokens(scores, torch.ones(3, 20, dtype=torch.bool), 0.3, min_per_seq=0)
    kept_per_row = keep.sum(-1).tolist()
    assert kept_per_row[1] > kept_per_row[2] > kept_per_row[0]


@pytest.mark.parametrize("k_frac", [0.05, 0.2, 0.5, 1.0])
def test_sequence_scope_keeps_ceil_k_frac_of_each_rows_valid_tokens(k_frac):
    scores, mask = ragged_batch()
    keep = select_tokens(scores, mask, k_frac, scope="sequence", min_per_seq=0)
    for b in range(scores.shape[0]):
        n_b = int(mask[b].sum())
        assert int(keep[b].sum()) == math.ceil(k_frac * n_b)
        row_scores = scores[b][mask[b]]
        assert set(scores[b][keep[b]].tolist()) == set(row_scores.topk(math.ceil(k_frac * n_b)).values.tolist())


def test_min_per_seq_keeps_the_best_token_of_every_row_with_valid_tokens():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.1, 0.3, 0.2, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    without = select_tokens(scores, mask, 0.25, min_per_seq=0)  # ceil(0.25 * 7) = 2: both from row 0
    assert without.sum(-1).tolist() == [2, 0, 0]
    keep = select_tokens(scores, mask, 0.25, min_per_seq=1)
    assert keep.sum(-1).tolist() == [2, 1, 0]  # row 1 keeps its best token; row 2 has none to keep
    assert keep[1].tolist() == [False, True, False, False]


# =============================================================================================
# 6. dynamic_schedule
# =============================================================================================
def test_schedule_starts_at_paper_initial_values():
    assert dynamic_schedule(0, 1000) == (8, 0.05)


def test_schedule_ends_at_paper_final_values():
    assert dynamic_schedule(1000, 1000) == (32, 0.2)


def test_schedule_is_linear_in_between():
    assert dynamic_schedule(50, 100) == (20, 0.125)
    assert dynamic_schedule(25, 100) == (14, 0.0875)


def test_schedule_is_monotone_non_decreasing_in_step():
    values = [dynamic_schedule(step, 97) for step in range(0, 120)]
    for (n0, k0), (n1, k1) in zip(values, values[1:]):
        assert n1 >= n0 and k1 >= k0


def test_schedule_clamps_beyond_total_steps():
    assert dynamic_schedule(101, 100) == dynamic_schedule(5000, 100) == (32, 0.2)


def test_schedule_is_constant_when_init_equals_final():
    values = {dynamic_schedule(step, 50, n_init=16, n_final=16, k_init=0.1, k_final=0.1) for step in range(0, 60)}
    assert values == {(16, 0.1)}


def test_schedule_keeps_a_tiny_k_positive():
    """K in (0, 1] stays in (0, 1]: the rounding that cleans float noise must not round a tiny K to 0."""
    for step in (0, 1, 2):
        k = d3s.dynamic_schedule(step, 2, k_init=1e-37, k_final=1e-30)[1]
        assert 0 < k <= 1e-30
    assert budget("d3s", 0, 80, 32, k_init=8e-37)[1] == 8e-37


def test_schedule_returns_int_n_and_float_k():
    n, k = dynamic_schedule(3, 7)
    assert type(n) is int and type(k) is float


# =============================================================================================
# 7. policy_loss
# =============================================================================================
def loss_batch(seed=22, B=5, T=7, off_policy=0.0):
    """logp (leaf, requires grad), old_logp, adv [B], mask [B, T] with >= 1 token per row."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + off_policy * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).double()
    return logp, old, adv, mask


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_on_policy_loss_is_minus_token_mean_advantage(kind):
    logp, old, adv, mask = loss_batch()
    loss, stats = policy_loss(logp, old, adv, mask, kind=kind, agg="token-mean")
    expected = -(adv.unsqueeze(-1) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert stats["clip_frac"] == 0.0 and stats["ratio_min"] == stats["ratio_max"] == 1.0


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_on_policy_gradient_is_minus_advantage_times_mask_over_token_count(kind):
    logp, old, adv, mask = loss_batch()
    loss, _ = policy_loss(logp, old, adv, mask, kind=kind, agg="token-mean")
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv.unsqueeze(-1) * mask / mask.sum())


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_on_policy_seq_mean_token_mean_loss_is_minus_mean_advantage_over_responses(kind):
    logp, old, adv, mask = loss_batch()
    loss, _ = policy_loss(logp, old, adv, mask, kind=kind, agg="seq-mean-token-mean")
    loss.backward()
    B = adv.shape[0]
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-12)
    torch.testing.assert_close(logp.grad, -adv.unsqueeze(-1) * mask / mask.sum(-1, keepdim=True) / B)


def test_seq_mean_token_mean_default_normalizer_counts_only_responses_with_selected_tokens():
    logp, old, adv, mask = loss_batch()
    mask[1] = 0.0
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    keep_rows = [0, 2, 3, 4]
    assert loss.item() == pytest.approx(-adv[keep_rows].mean().item(), abs=1e-12)


def test_gspo_defaults_to_its_own_aggregation_and_grpo_to_token_mean():
    logp, old, adv, mask = loss_batch(off_policy=0.2)
    for kind, agg in (("gspo", "seq-mean-token-mean"), ("grpo", "token-mean")):
        default, _ = policy_loss(logp, old, adv, mask, kind=kind)
        explicit, _ = policy_loss(logp, old, adv, mask, kind=kind, agg=agg)
        assert default.item() == explicit.item()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_gspo_gives_grpos_update_under_either_aggregation(agg):
    """One on-policy update (old = logp, w = 1): GSPO's gradient is GRPO's, so --loss gspo
    needs several mini-batches per batch to be anything else."""
    grads = {}
    for kind in ("grpo", "gspo"):
        logp, old, adv, mask = loss_batch(seed=30)
        loss, _ = policy_loss(logp, old, adv, mask, kind=kind, agg=agg)
        loss.backward()
        grads[kind] = logp.grad
    assert torch.equal(grads["grpo"], grads["gspo"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_off_policy_gspo_and_grpo_give_different_updates(agg):
    """A later mini-batch (old log-probs from before the first optimizer step): w != 1."""
    grads = {}
    for kind in ("grpo", "gspo"):
        logp, old, adv, mask = loss_batch(seed=30, off_policy=0.05)
        loss, stats = policy_loss(logp, old, adv, mask, kind=kind, agg=agg)
        loss.backward()
        grads[kind] = logp.grad
        if kind == "gspo":
            assert stats["clip_frac"] > 0  # GSPO's 3e-4/4e-4 range binds on sequence ratios ~ e^{+-0.02}
    assert not torch.allclose(grads["grpo"], grads["gspo"])


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios_over_selected_tokens():
    g = torch.Generator().manual_seed(8)
    logp = torch.randn(3, 6, generator=g, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) > 0.4
    mask[:, 0] = True
    _, stats = policy_loss(
        logp, old, torch.ones(3, dtype=torch.float64), mask.double(), kind="gspo", clip_low=10.0, clip_high=10.0
    )
    token_ratios = (logp.detach() - old).exp()
    geometric = [float(token_ratios[b][mask[b]].prod() ** (1 / int(mask[b].sum()))) for b in range(3)]
    assert stats["ratio_min"] == pytest.approx(min(geometric), rel=1e-12)
    assert stats["ratio_max"] == pytest.approx(max(geometric), rel=1e-12)


def test_kl_k3_is_non_negative_and_zero_where_the_policies_agree():
    logp = torch.linspace(-5, 0, 11)
    assert torch.equal(d3s.kl_k3(logp, logp), torch.zeros(11))
    assert (d3s.kl_k3(logp, logp.flip(0)) >= 0).all()


def test_grpo_clips_both_sides_and_zeroes_gradient_only_on_binding_tokens():
    # row 0, A = +1: log ratios  0.5 (w>1.2, binds), 0, -0.5 (w<0.8, not binding for A>0), 0.1
    # row 1, A = -1: log ratios -0.5 (w<0.8, binds), 0.5 (w>1.2, not binding for A<0), 0, 0.1
    log_ratio = torch.tensor([[0.5, 0.0, -0.5, 0.1], [-0.5, 0.5, 0.0, 0.1]], dtype=torch.float64)
    logp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    old = -log_ratio
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, kind="grpo", clip_low=0.2, clip_high=0.2)  # symmetric
    loss.backward()
    w = log_ratio.exp()
    # per token -min(w A, clip(w, 0.8, 1.2) A), by hand
    per_token = torch.tensor([[-1.2, -1.0, -w[0, 2], -w[0, 3]], [0.8, w[1, 1], 1.0, w[1, 3]]], dtype=torch.float64)
    assert loss.item() == pytest.approx(per_token.mean().item(), abs=1e-12)
    expected_grad = -adv.unsqueeze(-1) * w / 8
    expected_grad[0, 0] = expected_grad[1, 0] = 0.0  # clipped tokens get no gradient
    torch.testing.assert_close(logp.grad, expected_grad)
    assert stats["clip_frac"] == pytest.approx(2 / 8)


def test_clip_defaults_are_dapo_clip_higher_for_grpo_and_the_gspo_papers_for_gspo():
    assert d3s.CLIP_DEFAULTS == {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.25, 0.22]], dtype=torch.float64)  # w = 1.284 (> 1.28: binds), 1.246 (does not)
    _, stats = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2))
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_token_scores_rank_by_what_each_rule_says():
    adv = torch.tensor([2.0, -1.0, 0.5])
    entropy = torch.tensor([[0.5, 1.0, 0.1], [3.0, 0.0, 0.2], [4.0, 4.0, 4.0]])
    torch.testing.assert_close(d3s.token_scores(adv, entropy), adv.abs().unsqueeze(1) * entropy)  # the paper's |A| * H
    torch.testing.assert_close(d3s.token_scores(adv, entropy, methods.TOKEN_RULES["entropy"]), entropy)
    by_adv = d3s.token_scores(adv, entropy, methods.TOKEN_RULES["adv"], generator=torch.Generator().manual_seed(0))
    assert (by_adv[0].min() > by_adv[1].max()) and (by_adv[1].min() > by_adv[2].max())  # |A| decides between responses
    orders = {
        tuple(
            d3s.token_scores(adv, entropy, methods.TOKEN_RULES["adv"], generator=torch.Generator().manual_seed(s))[0]
            .argsort()
            .tolist()
        )
        for s in range(20)
    }
    assert len(orders) > 1  # ties (equal |A| inside a response) are broken at random, not by position
    r = d3s.token_scores(adv, entropy, methods.TOKEN_RULES["random"], generator=torch.Generator().manual_seed(0))
    assert r.shape == entropy.shape and 0 <= r.min() and r.max() < 1
    # per-token advantages [B, T] work too, and a NaN entropy scores 0 instead of reaching select_tokens
    nan = torch.tensor([[float("nan"), 1.0, 1.0]] * 3)
    assert d3s.token_scores(adv.unsqueeze(1).expand(3, 3), nan)[0, 0] == 0
    with pytest.raises(ValueError, match="rule='bogus'"):
        d3s.token_scores(adv, entropy, "bogus")


def test_grpo_custom_clip_range_is_used():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.25, 0.15]], dtype=torch.float64)  # w = 1.284, 1.162
    loss, stats = policy_loss(
        logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), clip_low=0.2, clip_high=0.28
    )  # DAPO clip-higher
    loss.backward()
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0


def test_gspo_clips_on_the_sequence_ratio_not_on_token_ratios():
    # row 0 (A=+1): token ratios far outside [0.8, 1.2] but geometric mean 1 -> not clipped
    # row 1 (A=+1): every token +0.01 -> s = e^0.01 > 1 + 4e-4 -> clipped, no gradient
    # row 2 (A=-1): every token -0.01 -> s < 1 - 3e-4 -> clipped, no gradient
    # row 3 (A=-1): every token +0.01 -> s > 1 + 4e-4 but A < 0: not binding, gradient -A*s/N
    log_ratio = torch.tensor([[0.3, -0.3, 0.01, -0.01], [0.01] * 4, [-0.01] * 4, [0.01] * 4], dtype=torch.float64)
    logp = torch.zeros(4, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 4, dtype=torch.float64)
    loss, stats = policy_loss(logp, -log_ratio, adv, mask, kind="gspo")
    loss.backward()
    s = math.exp(0.01)
    per_row = [-1.0, -(1 + 4e-4), 1 - 3e-4, s]  # per-token loss -min(sA, clip(s)A), the same for every token of a row
    assert loss.item() == pytest.approx(sum(per_row) / 4, abs=1e-12)
    expected_grad = torch.tensor([[-1 / 16] * 4, [0.0] * 4, [0.0] * 4, [s / 16] * 4], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert stats["clip_frac"] == pytest.approx(8 / 16)


@pytest.mark.parametrize(
    "seq_log_ratio, adv, clipped",
    [
        (3.5e-4, 1.0, False),  # s - 1 = 3.5e-4 < eps_high = 4e-4
        (4.5e-4, 1.0, True),  # s - 1 > 4e-4
        (-2.5e-4, -1.0, False),  # 1 - s = 2.5e-4 < eps_low = 3e-4
        (-3.5e-4, -1.0, True),  # 1 - s > 3e-4
    ],
)
def test_gspo_default_clip_range_is_3e_4_low_and_4e_4_high(seq_log_ratio, adv, clipped):
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 3), -seq_log_ratio, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 3), kind="gspo")
    loss.backward()
    assert stats["clip_frac"] == (1.0 if clipped else 0.0)
    assert (logp.grad == 0).all() == clipped


def test_gspo_sequence_ratio_averages_over_selected_tokens_only():
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)  # huge ratio on an unselected token
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, kind="gspo")
    assert loss.item() == pytest.approx(-1.0)
    assert stats["ratio_max"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0


def test_k3_kl_penalty_value_gradient_and_stat():
    logp, old, adv, mask = loss_batch()
    ref = logp.detach() + 0.3 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(23), dtype=torch.float64
    )
    beta = 0.05
    loss, stats = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=beta)
    loss.backward()
    d = ref - logp.detach()
    k3 = d.exp() - d - 1
    N = mask.sum()
    expected_kl = (k3 * mask).sum() / N
    assert (k3 >= 0).all()
    assert stats["kl"] == pytest.approx(expected_kl.item())
    assert loss.item() == pytest.approx((-(adv.unsqueeze(-1) * mask).sum() / N + beta * expected_kl).item())
    # d/dlogp of k3 = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, (-adv.unsqueeze(-1) + beta * (1 - d.exp())) * mask / N)


def test_kl_is_measured_but_not_in_the_loss_when_beta_is_zero():
    logp, old, adv, mask = loss_batch()
    ref = logp.detach() - 0.5
    with_ref, stats = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.0)
    without, stats_without = policy_loss(logp, old, adv, mask)
    assert with_ref.item() == without.item()
    assert stats["kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5) and stats_without["kl"] == 0.0


def test_a_kl_penalty_without_reference_log_probs_is_an_error():
    logp, old, adv, mask = loss_batch()
    with pytest.raises(ValueError, match=r"^beta=0\.1: .*ref_logp"):
        policy_loss(logp, old, adv, mask, beta=0.1)


def test_bf16_log_probs_count_every_token():
    # bf16 has 8 bits of mantissa: 1001 summed in bf16 is 1000. Counts and sums are kept in fp32.
    logp = torch.full((1, 1001), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), torch.ones(1), torch.ones(1, 1001))
    assert stats["tokens"] == 1001.0 and loss.item() == pytest.approx(-1.0)


def _microbatch_check(kind, agg, normalizer_of):
    logp, old, adv, mask = loss_batch(seed=24, B=7, T=6, off_policy=0.3)  # ratios != 1, some clipped
    full, _ = policy_loss(logp, old, adv, mask, kind=kind, agg=agg)
    full.backward()
    full_grad = logp.grad.clone()
    logp.grad = None
    normalizer = normalizer_of(mask)  # computed once, for the whole optimizer batch
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        micro, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], kind=kind, agg=agg, normalizer=normalizer)
        micro.backward()
        total += micro.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(logp.grad, full_grad)


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_microbatches_with_total_token_count_reproduce_full_batch_token_mean(kind):
    _microbatch_check(kind, "token-mean", lambda mask: mask.sum())


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_microbatches_with_number_of_sequences_reproduce_full_batch_seq_mean_token_mean(kind):
    _microbatch_check(kind, "seq-mean-token-mean", lambda mask: mask.shape[0])


def test_policy_loss_stats_have_the_documented_keys():
    logp, old, adv, mask = loss_batch(off_policy=0.1)
    _, stats = policy_loss(logp, old, adv, mask, ref_logp=logp.detach(), beta=0.1)
    assert set(stats) == {"clip_frac", "ratio_mean", "ratio_min", "ratio_max", "kl", "tokens"}
    assert all(type(v) is float for v in stats.values())
    assert stats["tokens"] == float(mask.sum())
    assert stats["ratio_min"] <= stats["ratio_mean"] <= stats["ratio_max"]


# =============================================================================================
# 8. Argument errors name the argument
# =============================================================================================
R = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
S, M = torch.rand(2, 5), torch.ones(2, 5, dtype=torch.bool)
LP = torch.zeros(2, 5)
A2 = torch.ones(2)

BAD_CALLS = {
    "n_keep > G": (lambda: select_samples(R, 5, "cross"), r"^n_keep=5"),
    "n_keep = 0": (lambda: select_samples(R, 0, "pods"), r"^n_keep=0"),
    "n_keep float": (lambda: select_samples(R, 2.0, "pods"), r"^n_keep=2\.0"),
    "unknown rule": (lambda: select_samples(R, 2, "ppo"), r"^rule='ppo'"),
    "rewards NaN": (lambda: select_samples(torch.tensor([[0.0, math.nan]]), 1, "cross"), r"^rewards="),
    "rewards inf": (lambda: group_advantages(torch.tensor([[0.0, math.inf]])), r"^rewards="),
    "rewards 1-D": (lambda: group_advantages(torch.tensor([0.0, 1.0])), r"^rewards\.shape="),
    "rewards 3-D": (lambda: select_samples(torch.zeros(2, 2, 2), 1, "all"), r"^rewards\.shape="),
    "rewards list": (lambda: group_advantages([[0.0, 1.0]]), r"^rewards="),
    "m = 0": (lambda: max_variance_subset(torch.rand(4), 0), r"^m=0"),
    "m > n": (lambda: max_variance_subset(torch.rand(4), 5), r"^m=5"),
    "k_frac 0": (lambda: select_tokens(S, M, 0), r"^k_frac=0"),
    "k_frac 1.5": (lambda: select_tokens(S, M, 1.5), r"^k_frac=1\.5"),
    "k_frac -0.1": (lambda: select_tokens(S, M, -0.1), r"^k_frac=-0\.1"),
    "select_tokens mask shape": (lambda: select_tokens(S, M[:, :4], 0.5), r"^mask\.shape="),
    "select_tokens scores 1-D": (lambda: select_tokens(S[0], M[0], 0.5), r"^scores\.shape="),
    "unknown scope": (lambda: select_tokens(S, M, 0.5, scope="row"), r"^scope='row'"),
    "old_logp shape": (lambda: policy_loss(LP, LP[:, :4], A2, M), r"^old_logp\.shape="),
    "policy_loss mask shape": (lambda: policy_loss(LP, LP, A2, M[:1]), r"^token_mask\.shape="),
    "ref_logp shape": (lambda: policy_loss(LP, LP, A2, M, ref_logp=LP[:1], beta=0.1), r"^ref_logp\.shape="),
    "adv shape [B, T]": (lambda: policy_loss(LP, LP, LP, M), r"^adv\.shape="),
    "adv shape [B+1]": (lambda: policy_loss(LP, LP, torch.ones(3), M), r"^adv\.shape="),
    "logp 1-D": (lambda: policy_loss(LP[0], LP[0], A2, M[0]), r"^logp\.shape="),
    "unknown kind": (lambda: policy_loss(LP, LP, A2, M, kind="ppo"), r"^kind='ppo'"),
    "unknown agg": (lambda: policy_loss(LP, LP, A2, M, agg="sum"), r"^agg='sum'"),
    "normalizer 0": (lambda: policy_loss(LP, LP, A2, M, normalizer=0), r"^normalizer=0"),
    "normalizer negative": (lambda: policy_loss(LP, LP, A2, M, normalizer=-3.0), r"^normalizer=-3\.0"),
    "total_steps 0": (lambda: dynamic_schedule(0, 0), r"^total_steps=0"),
    "total_steps float": (lambda: dynamic_schedule(0, 10.0), r"^total_steps=10\.0"),
    "step negative": (lambda: dynamic_schedule(-1, 10), r"^step=-1"),
    "n_init 0": (lambda: dynamic_schedule(0, 10, n_init=0), r"^n_init=0"),
    "k_final 1.5": (lambda: dynamic_schedule(0, 10, k_final=1.5), r"^k_final=1\.5"),
}


@pytest.mark.parametrize("call, message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_argument_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# =============================================================================================
# 9. Docstring examples
# =============================================================================================
def test_docstring_examples_pass():
    result = doctest.testmod(d3s)
    assert result.attempted > 0
    assert result.failed == 0


def test_select_tokens_min_per_seq_does_not_exceed_the_budget_on_ties():
    # Tied scores: top-K takes ceil(0.25 * 8) = 2 tokens; only a row left with none gets one more.
    keep = select_tokens(torch.zeros(2, 4), torch.ones(2, 4), 0.25, min_per_seq=1)
    assert (keep.sum(-1) >= 1).all()
    assert int(keep.sum()) <= 2 + int(
        (select_tokens(torch.zeros(2, 4), torch.ones(2, 4), 0.25, min_per_seq=0).sum(-1) == 0).sum()
    )


def test_max_variance_subset_is_exact_for_values_with_a_large_offset():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        v = torch.rand(7, generator=g, dtype=torch.float64) + 1e6
        idx = max_variance_subset(v, 3)
        best = max(v[list(c)].var().item() for c in itertools.combinations(range(7), 3))
        assert v[idx].var().item() >= best * (1 - 1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e-5, 1e-9, 1e6])
def test_max_variance_subset_is_optimal_at_any_scale(scale):
    # the tie tolerance is relative to the data: tiny rewards are not "all ties"
    values = torch.tensor([[0.1, 0.9, 0.5, 0.7]], dtype=torch.float64) * scale
    assert max_variance_subset(values, 2).tolist() == [[0, 1]]
    rows = continuous_rewards(50, 7, seed=31).double() * scale
    for row, idx in zip(rows, max_variance_subset(rows, 3)):
        best = best_subset_variance(row.tolist(), 3)
        assert subset_variance(row.tolist(), idx.tolist()) >= best * (1 - 1e-9)


def test_grpo_ignores_an_n_keep_larger_than_the_group():
    keep, _ = select_samples(binary_rewards(3, 4, seed=2), 32, "all")  # the schedule's N = 32 with G = 4
    assert keep.all()


def test_non_finite_values_or_scores_are_errors():
    with pytest.raises(ValueError, match=r"^values="):
        max_variance_subset(torch.tensor([0.0, float("nan"), 1.0, 2.0]), 2)
    with pytest.raises(ValueError, match=r"^scores="):
        select_tokens(torch.tensor([[1.0, float("inf")]]), torch.ones(1, 2), 0.5)
    # padding may hold anything: only valid tokens are checked
    assert select_tokens(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]]), 0.5).tolist() == [[True, False]]


def test_min_per_seq_is_zero_or_one():
    with pytest.raises(ValueError, match=r"^min_per_seq=2: "):
        select_tokens(torch.ones(2, 4), torch.ones(2, 4), 0.25, min_per_seq=2)


def test_token_entropy_of_a_non_contiguous_slice_and_bf16():
    logits = torch.randn(3, 6, 50, generator=torch.Generator().manual_seed(5)) * 4
    sliced = logits[:, :-1]  # the usual logits[:, :-1], not contiguous
    direct = -(sliced.softmax(-1) * sliced.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(token_entropy(sliced, chunk_size=4), direct, atol=1e-5, rtol=1e-5)
    half = logits.bfloat16()
    direct_half = -(half.float().softmax(-1) * half.float().log_softmax(-1)).sum(-1)
    torch.testing.assert_close(token_entropy(half), direct_half, atol=1e-5, rtol=1e-5)


# =============================================================================================
# 10. The ladder (LADDER, method_budget) and the cross-group guarantees
# =============================================================================================
def test_the_ladder_names_are_the_papers():
    assert set(d3s.LADDER) == {"grpo", "pods", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i"}
    assert set(methods.NAMES) == set(d3s.LADDER) | {
        "random",
        "dapo-filter",
        "dapo-filter-k",
    }  # + DAPO's filter (question 7)
    assert d3s.LADDER["d1s"] == ("intra", "static", "all")
    assert d3s.LADDER["d1s-cross"] == ("cross", "static", "all")
    assert d3s.LADDER["d2s"] == ("cross", "static", "static")
    assert d3s.LADDER["d3s"] == ("cross", "schedule", "schedule")
    assert d3s.LADDER["d3s-i"] == ("intra", "schedule", "schedule")
    assert d3s.LADDER["d3s"].samples == "cross" and d3s.LADDER["d2s"].k == "static"  # named fields


@pytest.mark.parametrize("same", [("d1s", "d3s-i"), ("d1s-cross", "d3s"), ("d2s", "d3s")])
def test_rows_with_the_same_sample_rule_keep_the_same_rollouts(same):
    rewards = binary_rewards(6, 8, seed=5)
    first, second = (select_samples(rewards, 3, d3s.LADDER[m].samples) for m in same)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_method_budget_follows_each_rows_schedule():
    steps, G = 100, 32
    for step in (0, 50, 99):
        sched = dynamic_schedule(step, steps)
        assert budget("d3s", step, steps, G) == sched
        assert budget("d3s-i", step, steps, G) == sched
        assert budget("random", step, steps, G) == (sched[0], 1.0)
        assert budget("d2s", step, steps, G) == (20, 0.125)  # static: the midpoint
        assert budget("d1s", step, steps, G) == (20, 1.0)  # static N, every token
        assert budget("d1s-cross", step, steps, G) == (20, 1.0)
        assert budget("pods", step, steps, G) == (20, 1.0)
        assert budget("grpo", step, steps, G) == (G, 1.0)
    assert budget("d2s", 0, steps, G, static_n=8, static_k=0.05) == (8, 0.05)


def test_method_budget_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"^n_keep=32: .*G=16"):
        budget("d3s", 100, 100, 16)  # the paper's N_final = 32 with G = 16
    with pytest.raises(ValueError, match=r"^row='d3s-static'"):
        d3s.method_budget("d3s-static", step=0, total_steps=10, group_size=32)  # a Row, not a name
    assert budget("grpo", 0, 10, 16) == (16, 1.0)  # grpo has no N to check


def test_cross_group_selection_does_not_guarantee_lemma_1():
    """Lemma 1 is about one group. Pooled: group 2 has no spread, 6 of 8 must be kept, two of
    them zeros: Var(A') = 0.60 < 1."""
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    keep, adv = select_samples(rewards, 3, "cross")
    assert int(keep.sum()) == 6
    assert kept_variance(adv, keep) == pytest.approx(0.60, abs=1e-4)
    keep_i, adv_i = select_samples(rewards, 3, "intra")  # intra: group 1 alone has Var >= 1
    assert unbiased_var(adv_i[0][keep_i[0]].tolist()) >= 1.0


@pytest.mark.parametrize("seed", range(20))
def test_pooled_choice_reaches_at_least_the_pooled_variance_of_the_per_group_choices(seed):
    rewards = binary_rewards(5, 8, seed=seed) if seed % 2 else continuous_rewards(5, 8, seed=seed)
    for n in (2, 4, 6):
        keep_cross, adv = select_samples(rewards, n, "cross")
        keep_intra, _ = select_samples(rewards, n, "intra")
        assert kept_variance(adv, keep_cross) >= kept_variance(adv, keep_intra) - 1e-9


def test_usefulness_rate_is_the_share_of_kept_rollouts_with_nonzero_advantage():
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    keep, adv = select_samples(rewards, 4, "all")
    assert d3s.usefulness_rate(adv, keep) == pytest.approx(8 / 12)
    keep, adv = select_samples(rewards, 2, "cross")  # 6 of 12: the zero-spread group goes first
    assert d3s.usefulness_rate(adv, keep) == 1.0
    assert d3s.usefulness_rate(adv, torch.zeros_like(keep)) == 0.0
