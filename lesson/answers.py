"""The answers to the lesson's exercises (lesson.ipynb, section 8, "Exercises"). Try them yourself first."""

import itertools
import math

import torch


def group_advantages(rewards):
    """Exercise 1: A = (R - mean) / (std + 1e-6) per row, the unbiased std; a row with no spread gets A = 0."""
    centered = rewards - rewards.mean(-1, keepdim=True)
    spread = rewards.amax(-1, keepdim=True) > rewards.amin(-1, keepdim=True)
    return torch.where(spread, centered / (rewards.std(-1, keepdim=True) + 1e-6), torch.zeros_like(rewards))


def max_variance_subset(values, m):
    """Exercise 2: the indices (ascending) of the m values with the largest unbiased variance. PODS: the best subset
    is always "the k largest plus the m - k smallest" for some k, so m + 1 candidates suffice."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    candidates = [sorted(order[: m - k] + order[len(order) - k :]) for k in range(m + 1)]
    variance = lambda idx: torch.tensor([values[i] for i in idx], dtype=torch.float64).var().item() if m > 1 else 0.0
    return max(candidates, key=variance)


def brute_force_subset(values, m):
    """The same by trying every m-subset (for checking; exponential in len(values))."""
    return max(
        (list(c) for c in itertools.combinations(range(len(values)), m)),
        key=lambda idx: torch.tensor([values[i] for i in idx], dtype=torch.float64).var().item() if m > 1 else 0.0,
    )


def entropy_scores(adv, entropy):
    """Exercise 3: score tokens by their entropy alone (the "80/20" rule), ignoring the advantage."""
    return entropy.float().clone()


def linear_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20):
    """Exercise 4: N and K on the paper's linear schedule (N rounded half up, the project's convention; capped at the
    final values)."""
    f = min(step / total_steps, 1.0)
    return int(math.floor(n_init + (n_final - n_init) * f + 0.5)), k_init + (k_final - k_init) * f


def cross_group_selection(rewards, n):
    """Exercise 5: one pooled choice of N * P rollouts over the whole batch by the max-variance rule of exercise 2,
    on the full-group advantages of exercise 1, which the kept rollouts keep (D3S; PODS would recompute them)."""
    P, G = rewards.shape
    adv = group_advantages(rewards)
    pooled = adv.flatten().tolist()
    kept = max_variance_subset(pooled, n * P)  # the k largest and the n * P - k smallest advantages of the batch
    keep = torch.zeros(P * G, dtype=torch.bool)
    keep[kept] = True
    keep = keep.view(P, G)
    return keep, torch.where(keep, adv, torch.zeros_like(adv))


def token_topk(adv, entropy, mask, k):
    """Exercise 6: score every token by |A| * H (A of its response), rank the real tokens of the whole batch, keep
    the ceil(K * real tokens) best; padding never."""
    scores = adv.abs().unsqueeze(-1) * entropy
    scores = scores.masked_fill(~mask.bool(), float("-inf"))  # padding ranks last
    count = math.ceil(k * int(mask.sum()) - 1e-9)
    keep = torch.zeros(scores.numel(), dtype=torch.bool)
    keep[scores.flatten().topk(count).indices] = True
    return keep.view(scores.shape)
