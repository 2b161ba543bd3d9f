"""d3s.py: GRPO / GSPO with D3S and PODS down-sampling, as pure tensor functions. One step, in this file's order:

    rewards [P, G] -> group_advantages                  A = (R - mean) / (std + eps) per group
    -> select_samples (max_variance_subset)             keep N rollouts per prompt: max Var(A), across groups
    -> forward the kept rollouts -> token_entropy       H per token, from the same logits
    -> token_scores -> select_tokens                    keep the top K of |A| * H
    -> policy_loss (kl_k3)                              GRPO or GSPO clipped surrogate on the selected tokens

N and K follow dynamic_schedule (N 8 -> 32, K 5% -> 20% [summary]; N per prompt [inferred]; labels: docs/algorithm.md).
The ablation rows [notes] and PODS are configurations of these functions (LADDER, method_budget); other rows and rules:
support/methods.py. No I/O, no model, no mutable state. Papers: D3S (Wang et al., ICLR 2026, arXiv 2509.22115), PODS (Xu
et al., arXiv 2504.13818), GSPO (Zheng et al., arXiv 2507.18071). Shapes: P prompts, G rollouts per prompt (a group), B
rollouts in a batch, T response tokens (right-padded; `mask` marks the real ones), V vocabulary.
"""

import math
from typing import NamedTuple

import torch


def require(ok, name, value, fix):
    """Raise ValueError naming the argument, its value and what to do instead."""
    if not ok:
        raise ValueError(f"{name}={value!r}: {fix}")


# === 1. Group advantages (GRPO) =======================================================================================
def group_advantages(rewards, scale=True, eps=1e-6):
    """GRPO advantages within each group: A_i = (R_i - mean_g R) / (std_g R + eps).

    rewards: [P, G] (one row per prompt). Returns [P, G] float. The std is unbiased (as torch.std, TRL, verl), so a
    group with spread has unbiased Var(A) = 1 (up to eps), as our every-N form of Lemma 1 needs (docs/algorithm.md
    2.3). scale=False gives Dr. GRPO, A_i = R_i - mean_g R. Equal rewards in a group give A = 0 there, never NaN.

    >>> group_advantages(torch.tensor([[0., 0., 1., 1.], [1., 1., 1., 1.]])).round(decimals=3)
    tensor([[-0.8660, -0.8660,  0.8660,  0.8660],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> group_advantages(torch.tensor([[0., 0., 0., 1.]]), scale=False)
    tensor([[-0.2500, -0.2500, -0.2500,  0.7500]])
    """
    require(isinstance(rewards, torch.Tensor), "rewards", type(rewards).__name__, "pass a tensor of shape [P, G]")
    shape_ok, bad = rewards.dim() == 2 and rewards.numel() > 0, ~torch.isfinite(rewards.double())
    require(shape_ok, "rewards.shape", tuple(rewards.shape), "expected [P, G], P, G >= 1")
    require(
        not bad.any(), "rewards", rewards[bad][:4].tolist(), "must be finite (no NaN/inf); check the reward function"
    )
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # R_i - mean_g R
    spread = (rewards.amax(-1, keepdim=True) - rewards.amin(-1, keepdim=True)) > 0
    if scale and rewards.shape[-1] >= 2:
        centered = centered / (rewards.std(dim=-1, keepdim=True) + eps)  # unbiased std, as torch.std
    elif scale:  # a group of one rollout has no spread: A = 0
        centered = torch.zeros_like(rewards)
    return torch.where(spread, centered, torch.zeros_like(centered))  # equal rewards -> A = 0


# === 2. Sample-level selection (the first level): max-variance subsets, across or within groups =======================
def max_variance_subset(values, m):
    """Indices of the m-subset of `values` with the largest (unbiased) variance, per row.

    values: [..., n];  returns LongTensor [..., m] of indices into the last dim, ascending. PODS: some maximizing
    m-subset is always "the k largest plus the m-k smallest" for a k in 0..m. So: sort once, score the m+1
    candidates in O(1) each with prefix sums, take the argmax. O(n log n), vectorized over the leading dims.
        sum(k)   = S[m-k] + (S[n] - S[n-k])          S[j] = v_(1) + ... + v_(j)  (sorted)
        sumsq(k) = Q[m-k] + (Q[n] - Q[n-k])          Q[j] = v_(1)^2 + ... + v_(j)^2
        Var(k)   = (sumsq(k) - sum(k)^2 / m) / (m - 1)
    Among candidates of equal variance the one with more large values wins (more high-reward rollouts).

    >>> max_variance_subset(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), 2)  # the two extremes
    tensor([[0, 1]])
    >>> max_variance_subset(torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3]), 3)  # {.1,.3,.9} and {.1,.7,.9} tie: more high
    tensor([0, 1, 3])
    """
    require(isinstance(values, torch.Tensor) and values.dim() >= 1, "values", type(values).__name__, "pass [..., n]")
    n = values.shape[-1]
    require(isinstance(m, int) and 1 <= m <= n, "m", m, f"must be an int in [1, n={n}]")
    values64 = values.double()
    require(
        bool(torch.isfinite(values64.sum())), "values", values[~torch.isfinite(values)][:4].tolist(), "must be finite"
    )
    order = values.sort(dim=-1, stable=True).indices  # ascending, [..., n]
    v_sorted = values64.gather(-1, order)
    v_sorted = v_sorted - v_sorted.mean(-1, keepdim=True)  # centered: prefix sums without cancellation
    v_sorted = torch.nn.functional.pad(v_sorted, (1, 0))  # a leading 0, so S[j] sums the j smallest
    S, Q = v_sorted.cumsum(-1), (v_sorted * v_sorted).cumsum(-1)  # [..., n+1]
    # Candidate i in 0..m keeps the i smallest and the k = m - i largest (slices, no gathers).
    total_sum = S[..., : m + 1] + S[..., n:] - S[..., n - m :]  # [..., m+1]
    total_sq = Q[..., : m + 1] + Q[..., n:] - Q[..., n - m :]
    var = (total_sq - total_sum * total_sum / m) / max(m - 1, 1)  # unbiased variance of each candidate
    # Argmax with a tolerance for rounding, relative to the data's scale; among ties, the largest k.
    tol = 1e-9 * Q[..., n:] / max(m - 1, 1)
    n_small = (var >= var.amax(-1, keepdim=True) - tol).byte().argmax(-1, keepdim=True)  # [..., 1]: m - k
    j = torch.arange(m, device=values.device)
    pos = j + (j >= n_small) * (n - m)  # sorted positions: j < m-k -> j (smallest), else j + (n - m) (largest)
    chosen = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order.gather(-1, pos), True)  # [..., n]
    return torch.arange(n, device=values.device).expand_as(order)[chosen].view(*order.shape[:-1], m)  # ascending


def select_samples(rewards, n_keep, rule="cross", scale=True, eps=1e-6, generator=None):
    """Which rollouts to train on, and the advantages the loss uses for them.

    rewards: [P, G].  Returns (keep [P, G] bool, adv [P, G] float, 0 where not kept).

    | rule    | rows                 | kept                                              | adv for the kept   |
    |---------|----------------------|---------------------------------------------------|--------------------|
    | "cross" | d1s-cross, d2s, d3s  | n_keep * P of all P * G, max Var of the pooled A  | full-group A       |
    | "intra" | d1s, d3s-i           | per group, the max-variance n_keep of G by A      | full-group A       |
    | "pods"  | pods                 | per group, the max-variance n_keep of G by R      | recomputed on kept |
    | "all"   | grpo                 | all G (n_keep is ignored)                         | full-group A       |
    A function (rewards, n_keep, scale=, eps=, generator=) -> (keep, adv) is a rule beyond the papers
    (support/methods.py).

    D3S keeps full-group A (PODS maximises Var(R), re-standardizes on the kept). Lemma 1 [summary]: a group has a subset
    with Var(A') >= 1 (a larger gradient-norm bound); ours (unbiased Var): every max-Var N has it. Within a group A
    increases with R, so "intra" and "pods" keep the same rollouts. Cross-group (choice): notes on the paper quote
    "a further cross-group selection over the entire batch"; no source at hand says over which candidates. Here: one
    pooled choice over all P*G advantages with budget n_keep * P (docs/algorithm.md 2.4). Its pooled Var(A') is
    at least that of the per-group choices, not >= 1: for [[1,0,0,0],[1,1,1,1]] and n_keep = 3 it must take two
    zeros of group 2 (Var(A') = 0.60). In a distributed run, call it on the global batch.

    >>> r = torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]])
    >>> select_samples(r, 2, "cross")[0]  # 4 of 8: group 2 has no signal
    tensor([[ True,  True,  True,  True],
            [False, False, False, False]])
    >>> keep, adv = select_samples(r, 2, "pods")
    >>> keep[0].tolist(), [round(a, 3) for a in adv[0].tolist()]  # the 1 and one 0, A recomputed
    ([True, False, False, True], [0.707, 0.0, 0.0, -0.707])
    """
    if callable(rule):
        return rule(rewards, n_keep, scale=scale, eps=eps, generator=generator)
    adv = group_advantages(rewards, scale=scale, eps=eps)  # [P, G], on all G rollouts
    P, G = rewards.shape
    rules = ", ".join(SAMPLE_RULES)
    require(rule in SAMPLE_RULES, "rule", rule, f"choose one of {rules}, or a function (support/methods.py)")
    if rule == "all":
        return torch.ones(P, G, dtype=torch.bool, device=rewards.device), adv
    fix = f"must be an int in [1, G={G}] (rollouts kept per prompt); raise G or lower N"
    require(isinstance(n_keep, int) and 1 <= n_keep <= G, "n_keep", n_keep, fix)
    keep = torch.zeros(P, G, dtype=torch.bool, device=rewards.device)
    if rule == "cross":  # one pooled choice over all P*G advantages, budget n_keep * P
        keep.view(-1)[max_variance_subset(adv.reshape(-1), n_keep * P)] = True
        return keep, adv * keep
    if rule == "intra":  # per group, by advantage
        keep.scatter_(1, max_variance_subset(adv, n_keep), True)
        return keep, adv * keep
    idx = max_variance_subset(rewards, n_keep)  # "pods": per group, by reward, [P, N]
    keep.scatter_(1, idx, True)
    adv_kept = group_advantages(rewards.gather(1, idx), scale=scale, eps=eps)  # recomputed on the N
    return keep, torch.zeros_like(adv).scatter_(1, idx, adv_kept)


SAMPLE_RULES = ("cross", "intra", "pods", "all")


def kept_variance(adv, keep):
    """Unbiased variance of the advantages of the kept rollouts (what selection maximizes).

    >>> kept_variance(torch.tensor([1., -1., 0.5, 0.]), torch.tensor([True, True, False, False]))
    2.0
    """
    values = adv[keep].double()
    return float(values.var()) if values.numel() >= 2 else 0.0


def usefulness_rate(adv, keep):
    """Sample Usefulness Rate: the share of the trained rollouts whose advantage is non-zero (notes on the D3S paper
    quote ~70% for GRPO, near 100% for D3S). 0.0 when nothing is kept.

    >>> usefulness_rate(torch.tensor([[1., -1., 0., 0.]]), torch.tensor([[True, True, True, False]]))
    0.6666666666666666
    """
    kept = adv[keep]
    return float((kept != 0).double().mean()) if kept.numel() else 0.0


# === 3. Token-level selection (the second level): score |A_{i,t}| * H_{i,t}, keep the top K ===========================
@torch.no_grad()
def token_entropy(logits, chunk_size=None):
    """Exact policy entropy per position: H = -sum_v pi(v) log pi(v), pi = softmax(logits).

    logits: [..., V] (any float dtype);  returns float32 [...], no grad. Works on `chunk_size` rows at a time in
    fp32, so the [tokens, V] softmax is never made (1M x 32k: 128 GB); default chunk ~8 MiB on CPU (it stays in
    cache), ~256 MiB on a GPU. With z shifted so its max is 0 and e = exp(z):  H = log(sum e) - sum e z / sum e.

    >>> token_entropy(torch.zeros(2, 4))  # uniform over 4 tokens: log 4
    tensor([1.3863, 1.3863])
    """
    ok = isinstance(logits, torch.Tensor) and logits.dim() >= 1
    require(ok, "logits", type(logits).__name__, "pass a tensor of shape [..., V]")
    V = logits.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, (2**21 if logits.device.type == "cpu" else 2**26) // max(V, 1))  # fp32 elements
    require(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size", chunk_size, "must be an int >= 1")
    flat = logits.reshape(-1, V)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()  # [chunk, V]
        z = z - z.amax(-1, keepdim=True)  # max logit -> 0: exp never overflows
        z.clamp_(min=torch.finfo(torch.float32).min)  # -inf logits -> a finite floor: e = 0 and e * z = 0
        e = z.exp()  # unnormalized pi
        total = e.sum(-1)
        out[start : start + chunk_size] = total.log() - e.mul_(z).sum(-1) / total  # log Z - E_pi[z]
    return out.reshape(logits.shape[:-1])


def token_scores(adv, entropy, rule=None, generator=None):
    """The score select_tokens ranks by. D3S: s_{i,t} = |A_{i,t}| * H_{i,t}.

    adv: [B] (one outcome advantage per response) or [B, T]; entropy: [B, T]. Returns [B, T] fp32. rule: None for
    the abstract's |A| * H, or a function (|A|, entropy, generator) -> scores (methods.TOKEN_RULES). Non-finite scores
    (a NaN forward) become 0: that step's loss is NaN too and its update is skipped.

    >>> token_scores(torch.tensor([2., -1.]), torch.tensor([[0.5, 1.], [3., 0.]]))
    tensor([[1., 2.],
            [3., 0.]])
    """
    require(rule is None or callable(rule), "rule", rule, "pass None (|A| * H) or a function (methods.TOKEN_RULES)")
    ok = isinstance(entropy, torch.Tensor) and entropy.dim() == 2
    require(ok, "entropy.shape", tuple(entropy.shape), "expected [B, T]")
    abs_adv = adv.abs().float().unsqueeze(-1) if adv.dim() == 1 else adv.abs().float()  # [B, 1] or [B, T]
    scores = abs_adv * entropy.float() if rule is None else rule(abs_adv, entropy, generator)
    return scores.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def select_tokens(scores, mask, k_frac, scope="batch", min_per_seq=0):
    """Keep the top `k_frac` of the valid tokens by score (D3S: score = |A_{i,t}| * H_{i,t}).

    scores, mask: [B, T] (mask True/1 on real response tokens). Returns keep [B, T] bool. scope="batch" (choice):
    one top-K over the batch; with outcome rewards A is constant within a response, so a per-response top-K
    ("sequence") would rank by entropy alone. K counts ceil(k_frac * valid tokens); padding is never kept.
    min_per_seq=1 gives every response with a valid token its best token (0: a plain top-K%, as a summary reads it).

    >>> s = torch.tensor([[0.9, 0.1, 0.5, 0.0], [0.8, 0.7, 0.0, 0.0]])
    >>> m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> select_tokens(s, m, 0.4).int()  # ceil(0.4 * 5) = 2 tokens: the two best overall
    tensor([[1, 0, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    >>> select_tokens(s, m, 0.2, min_per_seq=1).int()  # 1 token, but the floor gives row 2 its best
    tensor([[1, 0, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    """
    shape = lambda t: tuple(getattr(t, "shape", ()))
    require(isinstance(scores, torch.Tensor) and scores.dim() == 2, "scores.shape", shape(scores), "expected [B, T]")
    ok = isinstance(mask, torch.Tensor) and shape(mask) == shape(scores)
    require(ok, "mask.shape", shape(mask), f"must be {shape(scores)}")
    require(isinstance(k_frac, (int, float)) and 0 < k_frac <= 1, "k_frac", k_frac, "must be in (0, 1]")
    require(scope in ("batch", "sequence"), "scope", scope, "choose 'batch' or 'sequence'")
    require(min_per_seq in (0, 1), "min_per_seq", min_per_seq, "choose 1 (every response keeps its best token) or 0")
    valid = mask.bool()
    bad = scores[valid][~torch.isfinite(scores[valid])]
    require(not bool(bad.numel()), "scores", bad[:4].tolist(), "must be finite on valid tokens (check entropy and A)")
    masked = torch.where(valid, scores.float(), torch.full_like(scores, -math.inf, dtype=torch.float))
    if scope == "batch":
        k = math.ceil(k_frac * int(valid.sum()) - 1e-9)  # |kept| = ceil(K * valid tokens)
        keep = torch.zeros_like(valid)
        if k > 0:
            keep.view(-1)[masked.reshape(-1).topk(k).indices] = True
    else:
        k_row = torch.ceil(k_frac * valid.sum(-1, keepdim=True) - 1e-9)  # [B, 1]
        rank = masked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0 = best in row
        keep = (rank < k_row) & valid
    if min_per_seq > 0:  # rows with valid tokens but nothing kept get their best token
        best = masked.argmax(-1, keepdim=True)  # [B, 1]
        starved = valid.any(-1, keepdim=True) & ~(keep & valid).any(-1, keepdim=True)
        keep.scatter_(1, best, keep.gather(1, best) | starved)
    return keep & valid


# === 4. The dynamic schedule: aggressive down-sampling early, mild late; the methods as configurations ================
def dynamic_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20, progress=None):
    """N and K at `step` (from 0) of `total_steps`, linear from the init to the final values ([summary]: linear):
        N = round(N_init + (N_final - N_init) * f),   K = K_init + (K_final - K_init) * f,   f = step / total_steps
    Defaults [summary]: N 8 -> 32 (per prompt [inferred]), K 5% -> 20%; N rounds half up (choice). progress: f,
    for other shapes of the curve (methods.progress). Returns (n: int, k: float).

    >>> dynamic_schedule(0, 100), dynamic_schedule(50, 100), dynamic_schedule(100, 100)
    ((8, 0.05), (20, 0.125), (32, 0.2))
    """
    require(isinstance(total_steps, int) and total_steps >= 1, "total_steps", total_steps, "must be an int >= 1")
    require(isinstance(step, int) and step >= 0, "step", step, "must be an int >= 0")
    for name, val, ok in (
        ("n_init", n_init, isinstance(n_init, int) and n_init >= 1),
        ("k_init", k_init, 0 < k_init <= 1),
        ("n_final", n_final, isinstance(n_final, int) and n_final >= 1),
        ("k_final", k_final, 0 < k_final <= 1),
    ):
        require(ok, name, val, "must be an int >= 1" if name[0] == "n" else "must be in (0, 1]")
    f = min(step / total_steps, 1.0) if progress is None else progress
    n = int(math.floor(n_init + (n_final - n_init) * f + 0.5))  # round half up
    k = k_init + (k_final - k_init) * f
    return n, round(k, 12) if k >= 1e-9 else k  # rounding drops float noise (0.12500000000000003), never K itself


class Row(NamedTuple):  # one method: which rollouts select_samples keeps, and where its N and K come from
    samples: object  # a select_samples rule: "cross", "intra", "pods", "all" (or a function of support/methods.py)
    n: str  # N, rollouts kept per prompt: "schedule" (dynamic_schedule), "static", or "all" (= G)
    k: str  # K, fraction of tokens kept: "schedule", "static", or "all" (= 1: no token selection)


# The ablation ladder, named as notes on D3S quote it [notes], each row adding one piece to the row above, and PODS.
LADDER = {
    "grpo": Row("all", "all", "all"),  # GRPO: every rollout, every token
    "d1s": Row("intra", "static", "all"),  # + sample level: max-variance N per group
    "d1s-cross": Row("cross", "static", "all"),  # ... chosen across groups
    "d2s": Row("cross", "static", "static"),  # + token level: top K by |A| * H
    "d3s": Row("cross", "schedule", "schedule"),  # + the dynamic schedule of N and K: D3S
    "d3s-i": Row("intra", "schedule", "schedule"),  # D3S within groups: stabler from unaligned models [summary]
    "pods": Row("pods", "static", "all"),  # PODS: max-variance by reward, A recomputed
}


def method_budget(
    row,
    *,
    step,
    total_steps,
    group_size,
    n_init=8,
    n_final=32,
    k_init=0.05,
    k_final=0.20,
    static_n=None,
    static_k=None,
    progress=None,
):
    """(n_keep, k_frac) of a method's Row at `step` (from 0): "schedule": dynamic_schedule; "static": static_n,
    static_k, by default the linear schedule's midpoint (choice: about as many rollouts over a run); "all": G, 1.

    >>> [method_budget(LADDER[m], step=0, total_steps=100, group_size=32) for m in ("d3s", "d2s", "d1s", "grpo")]
    [(8, 0.05), (20, 0.125), (20, 1.0), (32, 1.0)]
    """
    require(isinstance(row, Row), "row", row, "pass a Row, e.g. d3s.LADDER['d3s'] (methods.LADDER: every method)")
    scheduled = dynamic_schedule(step, total_steps, n_init, n_final, k_init, k_final, progress)
    mid_n, mid_k = dynamic_schedule(1, 2, n_init, n_final, k_init, k_final)  # p = 1/2, linear
    static = (mid_n if static_n is None else static_n, mid_k if static_k is None else static_k)
    require(0 < static[1] <= 1, "static_k", static[1], "must be in (0, 1]")
    n = {"schedule": scheduled[0], "static": static[0], "all": group_size}[row.n]
    k = {"schedule": scheduled[1], "static": static[1], "all": 1.0}[row.k]
    fix = f"N counts rollouts kept per prompt and must be in [1, G={group_size}]; lower N or raise G"
    require(isinstance(n, int) and 1 <= n <= group_size, "n_keep", n, fix)
    return n, k


# === 5. Policy losses: GRPO (token ratios) and GSPO (sequence ratio), clipped surrogate, k3 KL ========================
# (eps_low, eps_high). GRPO: 0.2 / 0.28, DAPO's clip-higher (no source at hand gives the D3S paper's); GSPO: 3e-4 /
# 4e-4, the GSPO paper's. Every rung takes its defaults from here.
CLIP_DEFAULTS = {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
DEFAULT_AGG = {"grpo": "token-mean", "gspo": "seq-mean-token-mean"}  # GSPO weighs each response the same


def kl_k3(logp, ref_logp):
    """Per-token KL(pi || pi_ref), the k3 estimator (Schulman): exp(d) - d - 1, d = ref - logp.
    Unbiased for samples of pi, always >= 0, 0 where the two agree. Shapes: any, equal.

    >>> kl_k3(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0])).round(decimals=4)
    tensor([0.0000, 0.7183])
    """
    d = ref_logp - logp
    return torch.expm1(d) - d  # = exp(d) - 1 - d, without the cancellation of exp(d) - 1 at small d


def policy_loss(
    logp,
    old_logp,
    adv,
    token_mask,
    kind="grpo",
    clip_low=None,
    clip_high=None,
    ref_logp=None,
    beta=0.0,
    normalizer=None,
    agg=None,
):
    """Clipped surrogate over the selected tokens, per token:
        l_{i,t} = -min(w * A_i, clip(w, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_{i,t}
    GRPO: w_{i,t} = exp(logp_{i,t} - old_{i,t})                                     (default eps 0.2 / 0.28)
    GSPO: w_i = exp(mean_t (logp_{i,t} - old_{i,t})) over the selected tokens (choice), as log w_{i,t} =
          logp - sg(logp) + sg(mean_t(logp - old)): the gradient flows per token (GSPO-token)  (3e-4 / 4e-4)
    eps_low, eps_high: clip_low, clip_high. KL: kl_k3 to ref_logp; beta * KL averages over the selected tokens only
    (choice; GRPO's, all; beta = 0: measured only). logp, old_logp, token_mask (the selected tokens, d3s.select_tokens)
    and ref_logp: [B, T]; adv: [B]. Returns (loss, stats). agg="token-mean" (GRPO's here, as DAPO and verl; the GRPO
    paper averages per response first): sum(l * token_mask) / normalizer (default token_mask.sum(), a choice): every
    selected token of the optimizer batch weighs the same; "seq-mean-token-mean" (GSPO's): each response's token mean,
    summed, / normalizer (default: the responses with a selected token). Micro-batching: pass the whole optimizer step's
    normalizer (all ranks). On-policy with one update per batch, w = 1: clipping never binds, the loss is -mean(A) over
    the selected tokens and the gradient -A_i grad(logp_{i,t}) / N; GSPO's equals GRPO's under the same agg. Ratios,
    clipping and GSPO act only on reused rollouts (several mini-batches per batch).

    >>> logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]])).requires_grad_()
    >>> loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1., -1.]), torch.ones(2, 2))
    >>> loss.item(), stats["clip_frac"]  # -mean(A) = 0, nothing clipped
    (0.0, 0.0)
    """
    require(kind in CLIP_DEFAULTS, "kind", kind, "choose 'grpo' or 'gspo'")
    agg = agg or DEFAULT_AGG[kind]
    require(agg in ("token-mean", "seq-mean-token-mean"), "agg", agg, "choose 'token-mean' or 'seq-mean-token-mean'")
    require(logp.dim() == 2, "logp.shape", tuple(logp.shape), "expected [B, T]")
    for name, t in (("old_logp", old_logp), ("token_mask", token_mask), ("ref_logp", ref_logp)):
        t_shape = tuple(getattr(t, "shape", ()))
        ok = (t is None and name == "ref_logp") or t_shape == tuple(logp.shape)
        require(ok, f"{name}.shape", t_shape, f"must equal logp.shape {tuple(logp.shape)}")
    require(tuple(adv.shape) == (logp.shape[0],), "adv.shape", tuple(adv.shape), f"expected [B] = ({logp.shape[0]},)")
    require(normalizer is None or float(normalizer) > 0, "normalizer", normalizer, "must be > 0 (tokens or responses)")
    require(beta == 0 or ref_logp is not None, "beta", beta, "a KL penalty needs ref_logp; pass it or set beta=0")
    eps_low = CLIP_DEFAULTS[kind][0] if clip_low is None else clip_low
    eps_high = CLIP_DEFAULTS[kind][1] if clip_high is None else clip_high
    require(eps_low >= 0 and eps_high >= 0, "clip_low/clip_high", (eps_low, eps_high), "must be >= 0")
    dtype = torch.promote_types(logp.dtype, torch.float32)  # at least fp32: bf16 counts and sums would round
    logp, old_logp, token_mask = logp.to(dtype), old_logp.to(dtype), token_mask.to(dtype)
    tokens_per_seq = token_mask.sum(-1)  # [B]
    A = adv.to(dtype).unsqueeze(-1)  # [B, 1]: outcome reward broadcast to tokens
    log_ratio = logp - old_logp  # [B, T]
    if kind == "gspo":
        seq_log_ratio = (log_ratio * token_mask).sum(-1) / tokens_per_seq.clamp(min=1)  # mean_t over selected
        log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio)  # w
    per_token = -torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)  # [B, T]
    kl = kl_k3(logp, ref_logp.to(dtype)) if ref_logp is not None else None  # k3 estimator, >= 0
    if beta > 0:
        per_token = per_token + beta * kl
    if agg == "token-mean":
        loss = (per_token * token_mask).sum() / (token_mask.sum().clamp(min=1) if normalizer is None else normalizer)
    else:
        seq_mean = (per_token * token_mask).sum(-1) / tokens_per_seq.clamp(min=1)  # [B]
        loss = seq_mean.sum() / ((tokens_per_seq > 0).sum().clamp(min=1) if normalizer is None else normalizer)

    with torch.no_grad():
        n_tok = token_mask.sum().clamp(min=1)
        clipped = ((ratio < 1 - eps_low) & (A < 0)) | ((ratio > 1 + eps_high) & (A > 0))  # where the clip binds
        r = ratio[token_mask > 0] if (token_mask > 0).any() else torch.ones(1, dtype=ratio.dtype)
        stats = {
            "clip_frac": float((clipped.to(token_mask.dtype) * token_mask).sum() / n_tok),
            "ratio_mean": float(r.mean()),
            "ratio_min": float(r.min()),
            "ratio_max": float(r.max()),
            "kl": float((kl * token_mask).sum() / n_tok) if kl is not None else 0.0,
            "tokens": float(token_mask.sum()),
        }
    return loss, stats
