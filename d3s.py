"""d3s.py: GRPO / GSPO with PODS and D3S down-sampling, as pure tensor functions.

One training step of every rung in this repo (toy bandit, train_small.py, train_full.py) is:

    generate G rollouts per prompt -> reward -> group_advantages
    -> select_samples (keep N per prompt)  -> forward the kept rollouts only
    -> token_entropy -> select_tokens (keep the top K of |A| * H)
    -> policy_loss on the selected tokens -> backward / optimizer step

with N and K from dynamic_schedule (D3S: N 8 -> 32, K 5% -> 20%). Which of those pieces a
method uses is the LADDER table (the paper's ablation ladder, GRPO -> D1S -> D1S-Cross ->
D2S -> D3S, plus D3S-I, PODS, DAPO's group filter and a random control), read by method_budget
and select_samples.
The file, top to bottom (the sections of docs/algorithm.md):

    0  LADDER, METHODS, WHOLE_GROUPS         the methods: which rollouts, which budget, tokens or not
    1  group_advantages                      A = (R - mean) / (std + eps) per group
    2  max_variance_subset, select_samples,  the first level: keep N rollouts per prompt; the
       kept_variance, usefulness_rate        Var(A) and Sample Usefulness Rate of the kept set
    3  token_entropy, TOKEN_RULES,           the second level: H per token, the score |A| * H,
       token_scores, select_tokens           keep the top K
    4  SCHEDULES, dynamic_schedule,          N and K at a step: the paper's linear curriculum (and four
       method_budget, INTRA_TWIN,            other shapes, docs/questions.md); a row's budget; the
       spike_ratios, switch_to_intra         switch from cross- to intra-group samples (off by default)
    5  CLIP_DEFAULTS, DEFAULT_AGG, kl_k3,    the GRPO / GSPO clipped surrogate on the selected
       policy_loss                           tokens, with an optional k3 KL

and nothing else: no I/O, no model, no mutable state.

Papers:
  D3S  "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient
       Policy Optimization", Wang et al., ICLR 2026, arXiv 2509.22115.
  PODS "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement Learning",
       Xu et al., arXiv 2504.13818 (max-variance down-sampling, O(n log n)).
  GSPO "Group Sequence Policy Optimization", Zheng et al., arXiv 2507.18071.

Shapes: P prompts, G rollouts per prompt (a "group"), B rollouts in a batch, T response
tokens (right-padded; `mask` marks the real ones), V vocabulary size.

Left out on purpose: value functions, reward models, the model forward pass and data
handling. Those live in the rungs, so this file reads like the paper's method section.
"""

import math

import torch

__all__ = [
    "LADDER",
    "METHODS",
    "WHOLE_GROUPS",
    "group_advantages",
    "max_variance_subset",
    "select_samples",
    "kept_variance",
    "usefulness_rate",
    "token_entropy",
    "TOKEN_RULES",
    "token_scores",
    "select_tokens",
    "SCHEDULES",
    "dynamic_schedule",
    "method_budget",
    "INTRA_TWIN",
    "spike_ratios",
    "switch_to_intra",
    "CLIP_DEFAULTS",
    "DEFAULT_AGG",
    "kl_k3",
    "policy_loss",
]

# ---------------------------------------------------------------------------------------------
# 0. The methods: the paper's ablation ladder (D3S Table 2), each row adding one piece, + PODS
# ---------------------------------------------------------------------------------------------
# name -> (samples, budget, tokens)
#   samples  which rollouts select_samples keeps (per prompt N of G, or N * P of the batch):
#            "all"    every rollout
#            "intra"  per group, the max-variance N by advantage; full-group A kept (Lemma 1 holds)
#            "cross"  over the whole batch, the max-variance N * P of the pooled A   (choice, see
#                     select_samples); full-group A kept
#            "pods"   per group, the max-variance N by reward; A recomputed on the kept N
#            "mixed"  every rollout of each group whose rewards are not all equal (0 < #correct < G
#                     for 0/1 rewards): DAPO's dynamic-sampling filter without its oversampling, so
#                     the rollout budget stays P * G and the kept count varies (no N)
#            "random" per group, a uniform N (a control, not in the paper)
#   budget   where N and K come from: "schedule" = dynamic_schedule (N_init -> N_final, K_init ->
#            K_final; linear unless kind= says otherwise); "static" = fixed N and K (default: the
#            linear schedule's midpoint, so a static row trains on about as many rollouts over a run
#            as the schedule) (choice); "full" = N = G and K = 1
#   tokens   True: keep the top K of the tokens by |A| * H (select_tokens); False: every token
LADDER = {
    "grpo": ("all", "full", False),  # GRPO: every rollout, every token
    "d1s": ("intra", "static", False),  # + sample level: max-variance N per group
    "d1s-cross": ("cross", "static", False),  # ... chosen across groups
    "d2s": ("cross", "static", True),  # + token level: top K by |A| * H
    "d3s": ("cross", "schedule", True),  # + the dynamic schedule of N and K: D3S
    "d3s-i": ("intra", "schedule", True),  # D3S with intra-group samples (the paper's stable variant)
    "pods": ("pods", "static", False),  # PODS: max-variance by reward, A recomputed (arXiv 2504.13818)
    "random": ("random", "schedule", False),  # control: a uniform N of G on D3S's schedule
    "dapo-filter": ("mixed", "full", False),  # DAPO's filter: the groups with spread, every token (as GRPO)
    "dapo-filter-k": ("mixed", "schedule", True),  # ... with D3S's token level: top K by |A| * H on K's schedule
}
METHODS = tuple(LADDER)
WHOLE_GROUPS = ("all", "mixed")  # the sample rules that keep whole groups: they use no N (grpo, dapo-filter)


def _require(ok, name, value, fix):
    """Raise ValueError naming the argument, its value and what to do instead."""
    if not ok:
        raise ValueError(f"{name}={value!r}: {fix}")


def _check_rewards(rewards):
    _require(isinstance(rewards, torch.Tensor), "rewards", type(rewards).__name__,
             "pass a torch.Tensor of shape [P, G]")
    _require(rewards.dim() == 2, "rewards.shape", tuple(rewards.shape),
             "expected [P, G] (prompts x rollouts per prompt)")
    _require(rewards.numel() > 0, "rewards.shape", tuple(rewards.shape), "need at least one prompt and one rollout")
    bad = ~torch.isfinite(rewards.double())
    _require(not bad.any(), "rewards", rewards[bad][:4].tolist(),
             "rewards must be finite (no NaN/inf); check the reward function")


# ---------------------------------------------------------------------------------------------
# 1. Group advantages (GRPO)
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards, scale=True, eps=1e-6):
    """GRPO advantages within each group: A_i = (R_i - mean_g R) / (std_g R + eps).

    rewards: [P, G] (one row per prompt).  Returns [P, G] float.
    - std is the unbiased (Bessel-corrected) std, as torch.std / TRL / verl, so a group with
      spread has unbiased Var(A) = 1 (up to eps). This is what makes Lemma 1 of D3S hold.
    - scale=False gives Dr. GRPO: A_i = R_i - mean_g R.
    - a group whose rewards are all equal gets A = 0 (no gradient), never NaN.

    >>> group_advantages(torch.tensor([[0., 0., 1., 1.], [1., 1., 1., 1.]])).round(decimals=3)
    tensor([[-0.8660, -0.8660,  0.8660,  0.8660],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> group_advantages(torch.tensor([[0., 0., 0., 1.]]), scale=False)
    tensor([[-0.2500, -0.2500, -0.2500,  0.7500]])
    """
    _check_rewards(rewards)
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # R_i - mean_g R
    spread = (rewards.amax(-1, keepdim=True) - rewards.amin(-1, keepdim=True)) > 0
    if scale and rewards.shape[-1] >= 2:
        std = rewards.std(dim=-1, keepdim=True)  # unbiased, as torch.std
        centered = centered / (std + eps)
    elif scale:  # a group of one rollout has no spread: A = 0
        centered = torch.zeros_like(rewards)
    return torch.where(spread, centered, torch.zeros_like(centered))  # equal rewards -> A = 0


# ---------------------------------------------------------------------------------------------
# 2. Sample-level selection (the first level): PODS max-variance, D3S intra- and cross-group
# ---------------------------------------------------------------------------------------------
def max_variance_subset(values, m):
    """Indices of the m-subset of `values` with the largest (unbiased) variance, per row.

    values: [..., n];  returns LongTensor [..., m] of indices into the last dim, ascending.

    PODS (Xu et al., 2025): some variance-maximizing m-subset is always "the k largest plus
    the m-k smallest" for some k in 0..m. So: sort once, score the m+1 candidates in O(1)
    each with prefix sums of v and v^2, take the argmax. O(n log n), vectorized over all
    leading dims (no Python loop over rows or over k).
        sum(k)   = S[m-k] + (S[n] - S[n-k])          S[j] = v_(1) + ... + v_(j)  (sorted)
        sumsq(k) = Q[m-k] + (Q[n] - Q[n-k])          Q[j] = v_(1)^2 + ... + v_(j)^2
        Var(k)   = (sumsq(k) - sum(k)^2 / m) / (m - 1)
    For k = m, m-1, ..., 0 the three indices are slices: S[0..m], S[n], S[n-m..n].
    Among candidates of equal variance the one with more large values wins (more high-reward
    rollouts); between equal values, the stable sort decides which indices are taken.

    >>> max_variance_subset(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), 2)  # the two extremes
    tensor([[0, 1]])
    >>> v = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3])  # {.1,.3,.9} and {.1,.7,.9} tie: more high
    >>> max_variance_subset(v, 3)
    tensor([0, 1, 3])
    """
    _require(isinstance(values, torch.Tensor) and values.dim() >= 1, "values", type(values).__name__,
             "pass a tensor of shape [..., n]")
    n = values.shape[-1]
    _require(isinstance(m, int) and 1 <= m <= n, "m", m, f"must be an int in [1, n={n}]")
    values64 = values.double()
    if not torch.isfinite(values64.sum()):  # one pass; NaN and inf propagate into the sum
        _require(False, "values", values[~torch.isfinite(values)][:4].tolist(), "must be finite (no NaN/inf)")
    order = values.sort(dim=-1, stable=True).indices  # ascending, [..., n]; sorted in the input's dtype
    v_sorted = values64.gather(-1, order)
    v_sorted = v_sorted - v_sorted.mean(-1, keepdim=True)  # centered: prefix sums without cancellation
    v_sorted = torch.nn.functional.pad(v_sorted, (1, 0))  # a leading 0, so S[j] sums the j smallest
    S = v_sorted.cumsum(-1)  # [..., n+1] prefix sums, S[0] = 0
    Q = (v_sorted * v_sorted).cumsum(-1)
    # Candidate i in 0..m keeps the i smallest and the k = m - i largest (slices, no gathers).
    total_sum = S[..., : m + 1] + S[..., n:] - S[..., n - m :]  # [..., m+1]
    total_sq = Q[..., : m + 1] + Q[..., n:] - Q[..., n - m :]
    var = (total_sq - total_sum * total_sum / m) / max(m - 1, 1)  # unbiased variance of each candidate
    # Argmax with a tolerance for rounding in the prefix sums, relative to the data's own scale
    # (sum of squares); among ties, the largest k, i.e. the fewest smallest values.
    best = var.amax(-1, keepdim=True)
    tol = 1e-9 * Q[..., n:] / max(m - 1, 1)
    n_small = (var >= best - tol).byte().argmax(-1, keepdim=True)  # [..., 1]: the first such candidate, m - k
    # Sorted positions of the chosen subset: j < m-k -> j (smallest), else j + (n - m) (largest).
    j = torch.arange(m, device=values.device)
    pos = j + (j >= n_small) * (n - m)  # [..., m]
    chosen = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order.gather(-1, pos), True)  # [..., n]
    return torch.arange(n, device=values.device).expand_as(order)[chosen].view(*order.shape[:-1], m)  # ascending


def select_samples(rewards, n_keep, method, scale=True, eps=1e-6, generator=None):
    """Choose which rollouts to train on, and the advantages the loss should use for them.

    rewards: [P, G].  method: a LADDER name.  Returns (keep [P, G] bool, adv [P, G] float; 0
    where not kept). The method's `samples` column decides:

    | samples  | methods                 | kept                                        | adv for kept       |
    |----------|-------------------------|---------------------------------------------|--------------------|
    | "all"    | grpo                    | all G (n_keep is ignored)                   | full-group A       |
    | "intra"  | d1s, d3s-i              | per group, max-variance n_keep of G by A    | full-group A       |
    | "cross"  | d1s-cross, d2s, d3s     | n_keep*P of P*G maximizing Var of pooled A  | full-group A       |
    | "pods"   | pods                    | per group, max-variance n_keep of G by R    | recomputed on kept |
    | "mixed"  | dapo-filter(-k)         | all G of each group with spread (n_keep     | full-group A       |
    |          |                         | is ignored): DAPO's filter, no oversampling |                    |
    | "random" | random                  | per group, uniform n_keep of G (control)    | full-group A       |

    Within a group A is increasing in R, so "intra" and "pods" keep the same rollouts; they
    differ in the advantages. "mixed" drops exactly the groups whose A is all 0, keeps the others
    whole, and keeps nothing on a step where no group has spread (that step has no token to train on).
    Keeping full-group A gives Var(A') >= 1 on each group's kept
    subset (D3S Lemma 1, unbiased variance), hence a larger bound on the policy-gradient norm.
    Lemma 1 is about one group: it holds for "intra", not for "cross" (see below).

    Reading of cross-group (choice). The paper selects N_s per query, then runs "a further
    cross-group selection over the entire batch", argmax_{S, |S| = N} Var(A_S), without saying
    whether the candidates are all P*G rollouts or the union of the per-query subsets, nor how
    the batch budget N relates to N_s. Here it is one pooled choice over all P*G advantages
    with budget n_keep * P: the union reading with that budget would keep everything it is
    given. (The alternative, intra first then cross over the union with a smaller budget, is
    select_samples(rewards, n_s, "d3s-i") followed by max_variance_subset on adv[keep].)
    What the pooled choice guarantees: a pooled Var(A') at least that of the union of the
    per-group choices (that union is one of its candidates). Not Var(A') >= 1: for rewards
    [[1,0,0,0],[1,1,1,1]] and n_keep = 3 (6 of 8), the best pooled subset must take two of the
    zero advantages of group 2 and has Var(A') = 0.60.
    It may take many rollouts from one group and none from another; groups with equal
    rewards (A = 0) are taken last. For a distributed run, call this on the rewards of the
    whole global batch so the choice does not depend on the number of ranks.

    >>> r = torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]])
    >>> keep, adv = select_samples(r, 2, "d3s")  # 4 of 8: group 2 has no signal
    >>> keep
    tensor([[ True,  True,  True,  True],
            [False, False, False, False]])
    >>> keep, adv = select_samples(r, 2, "pods")
    >>> keep[0].tolist(), [round(a, 3) for a in adv[0].tolist()]  # the 1 and one 0, A recomputed
    ([True, False, False, True], [0.707, 0.0, 0.0, -0.707])
    >>> select_samples(r, 2, "dapo-filter")[0]  # the group with spread, whole
    tensor([[ True,  True,  True,  True],
            [False, False, False, False]])
    """
    _check_rewards(rewards)
    P, G = rewards.shape
    _require(method in LADDER, "method", method, f"choose one of {', '.join(METHODS)}")
    samples = LADDER[method][0]
    adv = group_advantages(rewards, scale=scale, eps=eps)  # [P, G], on all G rollouts
    if samples == "all":  # every rollout: n_keep is not used
        return torch.ones(P, G, dtype=torch.bool, device=rewards.device), adv
    if samples == "mixed":  # DAPO's filter: keep a group iff its rewards are not all equal; n_keep is not used
        spread = rewards.amax(-1, keepdim=True) > rewards.amin(-1, keepdim=True)  # [P, 1]
        keep = spread.expand(P, G).clone()
        return keep, adv * keep
    _require(isinstance(n_keep, int) and 1 <= n_keep <= G, "n_keep", n_keep,
             f"must be an int in [1, G={G}] (rollouts kept per prompt); raise G or lower N")
    keep = torch.zeros(P, G, dtype=torch.bool, device=rewards.device)

    if samples == "random":
        noise = torch.rand(P, G, generator=generator).to(rewards.device)  # CPU generator, any device
        keep.scatter_(1, noise.argsort(-1)[:, :n_keep], True)
        return keep, adv * keep
    if samples == "pods":
        idx = max_variance_subset(rewards, n_keep)  # [P, N], by reward
        keep.scatter_(1, idx, True)
        adv_kept = group_advantages(rewards.gather(1, idx), scale=scale, eps=eps)  # recomputed on the N
        return keep, torch.zeros_like(adv).scatter_(1, idx, adv_kept)
    if samples == "intra":
        keep.scatter_(1, max_variance_subset(adv, n_keep), True)  # by advantage, per group
        return keep, adv * keep
    # "cross": one pooled choice over all P*G advantages, budget n_keep * P.
    idx = max_variance_subset(adv.reshape(-1), n_keep * P)
    keep.view(-1)[idx] = True
    return keep, adv * keep


def kept_variance(adv, keep):
    """Unbiased variance of the advantages of the kept rollouts (what selection maximizes).

    >>> kept_variance(torch.tensor([1., -1., 0.5, 0.]), torch.tensor([True, True, False, False]))
    2.0
    """
    values = adv[keep].double()
    return float(values.var()) if values.numel() >= 2 else 0.0


def usefulness_rate(adv, keep):
    """Sample Usefulness Rate: the share of the trained rollouts whose advantage is non-zero
    (D3S reports ~70% for GRPO, near 100% for D3S). 0.0 when nothing is kept.

    >>> usefulness_rate(torch.tensor([[1., -1., 0., 0.]]), torch.tensor([[True, True, True, False]]))
    0.6666666666666666
    """
    kept = adv[keep]
    return float((kept != 0).double().mean()) if kept.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# 3. Token-level selection (the second level): score |A_{i,t}| * H_{i,t}, keep the top K
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def token_entropy(logits, chunk_size=None):
    """Exact policy entropy per position: H = -sum_v pi(v) log pi(v), pi = softmax(logits).

    logits: [..., V] (any float dtype);  returns float32 [...], no grad.
    Works on `chunk_size` rows at a time in fp32 with two [chunk, V] temporaries, so the full
    [tokens, V] softmax is never materialized (a 1M x 32k fp32 softmax would be 128 GB).
    Default chunk: one temporary of ~8 MiB on CPU (it stays in cache: 4x faster than 128 MiB
    chunks, bench/selection.py) and ~256 MiB on a GPU (few kernel launches).
    With z shifted so its max is 0 and e = exp(z):  H = log(sum_v e_v) - sum_v e_v z_v / sum_v e_v.
    (A non-contiguous `logits`, such as logits[:, :-1], is copied once by the reshape.)

    >>> token_entropy(torch.zeros(2, 4))  # uniform over 4 tokens: log 4
    tensor([1.3863, 1.3863])
    """
    _require(isinstance(logits, torch.Tensor) and logits.dim() >= 1, "logits", type(logits).__name__,
             "pass a tensor of shape [..., V]")
    V = logits.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, (2**21 if logits.device.type == "cpu" else 2**26) // max(V, 1))  # fp32 elements
    _require(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size", chunk_size, "must be an int >= 1")
    flat = logits.reshape(-1, V)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()  # [chunk, V]
        z = z - z.amax(-1, keepdim=True)  # max logit -> 0: exp never overflows (a new tensor)
        z.clamp_(min=torch.finfo(torch.float32).min)  # -inf logits -> a finite floor: e = 0 and e * z = 0
        e = z.exp()  # unnormalized pi
        total = e.sum(-1)
        out[start : start + chunk_size] = total.log() - e.mul_(z).sum(-1) / total  # log Z - E_pi[z]
    return out.reshape(logits.shape[:-1])


TOKEN_RULES = ("adv-entropy", "entropy", "adv", "random")


def token_scores(adv, entropy, rule="adv-entropy", generator=None):
    """The score select_tokens ranks by. D3S: s_{i,t} = |A_{i,t}| * H_{i,t}.

    adv: [B] (one outcome advantage per response) or [B, T];  entropy: [B, T].  Returns [B, T] fp32.
    rule (choice; the paper's is "adv-entropy", the others are one flag away for comparison):
      "adv-entropy"  |A| * H                       the paper's rule
      "entropy"      H                             the high-entropy "minority tokens" rule of
                                                   Wang et al. 2025 (80/20): with select_tokens,
                                                   the top ceil(K * N) tokens by H, token-mean
                                                   over them (TRL's top_entropy_quantile instead
                                                   divides by all tokens)
      "adv"          |A|, ties broken at random    with outcome rewards A is constant inside a
                                                   response, so this picks responses, not tokens
      "random"       uniform noise                 a control
    Non-finite entries (a NaN forward) score 0: that step's loss is NaN too and is skipped.

    >>> token_scores(torch.tensor([2., -1.]), torch.tensor([[0.5, 1.], [3., 0.]]))
    tensor([[1., 2.],
            [3., 0.]])
    """
    _require(rule in TOKEN_RULES, "rule", rule, f"choose one of {', '.join(TOKEN_RULES)}")
    _require(isinstance(entropy, torch.Tensor) and entropy.dim() == 2, "entropy.shape",
             tuple(getattr(entropy, "shape", ())), "expected [B, T]")
    abs_adv = adv.abs().float()
    abs_adv = abs_adv.unsqueeze(-1) if abs_adv.dim() == 1 else abs_adv  # [B, 1] or [B, T]
    if rule == "adv-entropy":
        scores = abs_adv * entropy.float()
    elif rule == "entropy":
        scores = entropy.float().clone()
    else:
        noise = torch.rand(entropy.shape, generator=generator).to(entropy.device)  # CPU generator, any device
        if rule == "random":
            scores = noise
        else:  # |A| first; among equal |A| a random order (1e-6 of the largest |A| never reorders distinct A's here)
            largest = abs_adv.max().clamp(min=1e-30) if abs_adv.numel() else 1.0  # no rollout kept: nothing to rank
            scores = abs_adv.expand(entropy.shape) + noise * 1e-6 * largest
    return scores.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def select_tokens(scores, mask, k_frac, scope="batch", min_per_seq=0):
    """Keep the top `k_frac` of valid tokens by score (D3S: score = |A_{i,t}| * H_{i,t}).

    scores, mask: [B, T] (mask True/1 on real response tokens).  Returns keep [B, T] bool.
    - scope="batch" (default): one global top-K over all valid tokens of the batch. With
      outcome rewards A_{i,t} = A_i is constant within a response, so a per-sequence top-K
      would rank by entropy alone; the global ranking lets |A| matter.
    - scope="sequence": top-K within each response.
    - K counts ceil(k_frac * valid tokens), so the realised fraction is within one token of
      k_frac (batch scope); padding is never kept.
    - min_per_seq=0 (default, the paper's plain top-K%): a kept response may end up with no
      selected token. min_per_seq=1 gives every response with a valid token at least its best
      token (an option: on short responses it raises the kept fraction above k_frac, e.g.
      L = 8 at K = 5% keeps 12.5% or more).

    >>> s = torch.tensor([[0.9, 0.1, 0.5, 0.0], [0.8, 0.7, 0.0, 0.0]])
    >>> m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> select_tokens(s, m, 0.4).int()  # ceil(0.4 * 5) = 2 tokens: the two best overall
    tensor([[1, 0, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    >>> select_tokens(s, m, 0.2).int()  # 1 token: row 2 keeps none
    tensor([[1, 0, 0, 0],
            [0, 0, 0, 0]], dtype=torch.int32)
    >>> select_tokens(s, m, 0.2, min_per_seq=1).int()  # the floor gives row 2 its best token
    tensor([[1, 0, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    """
    _require(isinstance(scores, torch.Tensor) and scores.dim() == 2, "scores.shape",
             tuple(getattr(scores, "shape", ())), "expected a [B, T] tensor")
    _require(isinstance(mask, torch.Tensor), "mask", type(mask).__name__,
             "pass a [B, T] tensor (1 on real response tokens)")
    _require(tuple(mask.shape) == tuple(scores.shape), "mask.shape", tuple(mask.shape),
             f"must equal scores.shape {tuple(scores.shape)}")
    _require(isinstance(k_frac, (int, float)) and 0 < k_frac <= 1, "k_frac", k_frac, "must be in (0, 1]")
    _require(scope in ("batch", "sequence"), "scope", scope, "choose 'batch' or 'sequence'")
    _require(min_per_seq in (0, 1), "min_per_seq", min_per_seq, "choose 1 (every response keeps its best token) or 0")
    valid = mask.bool()
    bad = scores[valid][~torch.isfinite(scores[valid])]
    _require(not bool(bad.numel()), "scores", bad[:4].tolist(),
             "must be finite on valid tokens (check the entropy and advantages)")
    masked = torch.where(valid, scores.float(), torch.full_like(scores, -math.inf, dtype=torch.float))
    if scope == "batch":
        k = math.ceil(k_frac * int(valid.sum()) - 1e-9)  # |kept| = ceil(K * valid tokens)
        keep = torch.zeros_like(valid)
        if k > 0:
            keep.view(-1)[masked.reshape(-1).topk(k).indices] = True
    else:
        n_valid = valid.sum(-1, keepdim=True)  # [B, 1]
        k_row = torch.ceil(k_frac * n_valid - 1e-9)
        rank = masked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0 = best in row
        keep = (rank < k_row) & valid
    if min_per_seq > 0:  # rows with valid tokens but nothing kept get their best token
        best = masked.argmax(-1, keepdim=True)  # [B, 1]
        starved = valid.any(-1, keepdim=True) & ~(keep & valid).any(-1, keepdim=True)
        keep.scatter_(1, best, keep.gather(1, best) | starved)
    return keep & valid


# ---------------------------------------------------------------------------------------------
# 4. Dynamic schedule (curriculum): aggressive down-sampling early, mild late
# ---------------------------------------------------------------------------------------------
SCHEDULES = ("linear", "cosine", "step", "constant", "adaptive")  # "linear" is the paper's


def _plateaus(history, window, tol):
    """How many steps of `history` ended on a plateau: the mean of their last `window` values minus the
    mean of the `window` before is below `tol`. Steps with fewer than 2 * window values before them never do.

    >>> _plateaus([0.5] * 12, 5, 0.02), _plateaus([0.1 * i for i in range(12)], 5, 0.02)
    (3, 0)
    """
    values = [float(v) for v in history]
    _require(all(math.isfinite(v) for v in values), "history", [v for v in values if not math.isfinite(v)][:4],
             "must be finite (the signal of each past step)")
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    mean = lambda a, b: (prefix[b] - prefix[a]) / window  # noqa: E731  the mean of values[a:b]
    return sum(mean(j - window, j) - mean(j - 2 * window, j - window) < tol for j in range(2 * window, len(values) + 1))


def dynamic_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20, kind="linear",
                     history=None, window=10, tol=0.02):
    """N and K at `step` of `total_steps`, along a curve f from the init values (f = 0) to the final ones (f = 1):
        N = round(N_init + (N_final - N_init) * f),   K = K_init + (K_final - K_init) * f,   p = step / total_steps
    kind (the paper's is "linear", the default; the others answer its open question 2, docs/questions.md):
      "linear"    f = p                          the paper's
      "cosine"    f = (1 - cos(pi * p)) / 2      slow at both ends, fastest at the middle
      "step"      f = 0 for p < 1/2, else 1      the init values for the first half, the final ones after
      "constant"  f = 0                          the init values throughout (choice: the aggressive end, so
                                                 it asks "does relaxing matter at all?"; constant at the
                                                 final values is n_init = n_final, k_init = k_final)
      "adaptive"  f = min(1, 2 * plateaus / total_steps), plateaus = _plateaus(history, window, tol)
                  Rule: hold N and K while the signal still rises; each step on which it has plateaued
                  (mean of its last `window` values - mean of the `window` before < tol) relaxes them by
                  two linear steps (so a run that plateaus half the time ends where linear ends).
                  `history`: the signal of each step taken so far (the trainers pass the train reward
                  of steps 1..s-1); `step` is not read. Pure: the same history gives the same N, K.
    Paper defaults: N 8 -> 32 rollouts per prompt, K 5% -> 20% of tokens. N_init = N_final
    (and K_init = K_final) gives static D3S / PODS. Returns (n: int, k: float).
    `step` counts from 0; N_final and K_final are reached at step == total_steps, so a loop over
    range(total_steps) ends one step short of them (p = (total_steps - 1) / total_steps).
    N rounds half up (Python's round() would round half to even).

    >>> dynamic_schedule(0, 100), dynamic_schedule(50, 100), dynamic_schedule(100, 100)
    ((8, 0.05), (20, 0.125), (32, 0.2))
    >>> [dynamic_schedule(25, 100, kind=kind)[0] for kind in ("linear", "cosine", "step", "constant")]  # N at p = 1/4
    [14, 12, 8, 8]
    >>> dynamic_schedule(49, 100, kind="step"), dynamic_schedule(50, 100, kind="step")
    ((8, 0.05), (32, 0.2))
    >>> dynamic_schedule(0, 100, kind="adaptive", history=[0.5] * 30)  # 11 plateau steps: f = 0.22
    (13, 0.083)
    """
    _require(isinstance(total_steps, int) and total_steps >= 1, "total_steps", total_steps, "must be an int >= 1")
    _require(isinstance(step, int) and step >= 0, "step", step, "must be an int >= 0")
    for name, val in (("n_init", n_init), ("n_final", n_final)):
        _require(isinstance(val, int) and val >= 1, name, val, "must be an int >= 1")
    for name, val in (("k_init", k_init), ("k_final", k_final)):
        _require(0 < val <= 1, name, val, "must be in (0, 1]")
    _require(kind in SCHEDULES, "kind", kind, f"choose one of {', '.join(SCHEDULES)}")
    p = min(step / total_steps, 1.0)
    if kind == "linear":
        f = p
    elif kind == "cosine":
        f = (1 - math.cos(math.pi * p)) / 2
    elif kind == "step":
        f = 0.0 if p < 0.5 else 1.0
    elif kind == "constant":
        f = 0.0
    else:  # adaptive
        _require(history is not None, "history", history, "kind='adaptive' needs the signal's past values (a list)")
        _require(isinstance(window, int) and window >= 1, "window", window, "must be an int >= 1")
        f = min(1.0, 2 * _plateaus(history, window, tol) / total_steps)
    n = int(math.floor(n_init + (n_final - n_init) * f + 0.5))  # round half up
    k = k_init + (k_final - k_init) * f
    return n, round(k, 12) if k >= 1e-9 else k  # rounding drops float noise (0.12500000000000003), never K itself


def method_budget(method, step, total_steps, group_size, n_init=8, n_final=32, k_init=0.05, k_final=0.20,
                  static_n=None, static_k=None, kind="linear", history=None):
    """(n_keep, k_frac) of a LADDER method at `step`: rollouts kept per prompt, fraction of tokens.

    budget "full"     -> (G, 1.0): every rollout, every token (GRPO, dapo-filter)
    budget "schedule" -> dynamic_schedule(step, total_steps, ..., kind, history)
    budget "static"   -> (static_n, static_k), by default the linear schedule's midpoint (choice), whatever kind
    k_frac is 1.0 for methods without token selection (tokens = False in LADDER); n_keep is G for
    the rows that keep whole groups (samples "mixed": select_samples ignores n_keep).

    >>> method_budget("d3s", 0, 100, 32), method_budget("d2s", 0, 100, 32), method_budget("d1s", 0, 100, 32)
    ((8, 0.05), (20, 0.125), (20, 1.0))
    >>> method_budget("grpo", 0, 100, 16), method_budget("dapo-filter-k", 0, 100, 16)
    ((16, 1.0), (16, 0.05))
    """
    _require(method in LADDER, "method", method, f"choose one of {', '.join(METHODS)}")
    _require(isinstance(group_size, int) and group_size >= 1, "group_size", group_size, "must be an int >= 1")
    samples, budget, tokens = LADDER[method]
    if budget == "full":
        return group_size, 1.0
    mid_n, mid_k = dynamic_schedule(1, 2, n_init, n_final, k_init, k_final)  # p = 1/2, linear
    if budget == "schedule":
        n, k = dynamic_schedule(step, total_steps, n_init, n_final, k_init, k_final, kind=kind, history=history)
    else:
        n = mid_n if static_n is None else static_n
        k = mid_k if static_k is None else static_k
        _require(0 < k <= 1, "static_k", k, "must be in (0, 1]")
    if samples == "mixed":  # whole groups: no N
        n = group_size
    _require(isinstance(n, int) and 1 <= n <= group_size, "n_keep", n,
             f"N counts rollouts kept per prompt and must be in [1, G={group_size}]; lower N or raise G")
    return n, (k if tokens else 1.0)


# The switch rule (the paper's open question 1, docs/questions.md question 5; off by default): the
# paper found cross-group D3S unstable from an unaligned start and D3S-I stable. A run that starts
# cross-group can move to its intra-group twin, for good, at the first gradient-norm spike.
INTRA_TWIN = {"d3s": "d3s-i", "d1s-cross": "d1s"}  # cross-group row -> the same row with samples "intra"


def spike_ratios(grad_norms, window=10):
    """Per step: its gradient norm / the median of the norms of the `window` steps before it. None where
    there is no ratio: the first `window` steps, and a step with no signal (norm 0 or None: no group with
    spread, nothing trained; or not finite: a skipped update), which is also left out of the medians of later steps.

    >>> spike_ratios([1.0, 2.0, 0.0, 1.0, 9.0], window=2)
    [None, None, None, 0.5, 9.0]
    """
    _require(isinstance(window, int) and window >= 1, "window", window, "must be an int >= 1")
    signal = lambda x: x is not None and x != 0 and math.isfinite(x)  # noqa: E731  (a NaN/inf norm: no signal either)
    ratios = []
    for i, g in enumerate(grad_norms):
        before = sorted(x for x in grad_norms[max(0, i - window):i] if signal(x))  # the steps with signal
        if i < window or not signal(g) or not before:
            ratios.append(None)
            continue
        h = len(before) // 2
        median = before[h] if len(before) % 2 else (before[h - 1] + before[h]) / 2
        ratios.append(g / max(median, 1e-12))
    return ratios


def switch_to_intra(method, grad_norms, ratio, window=10):
    """The row this step runs under the switch rule. Rule: a cross-group row (d3s, d1s-cross) runs as its
    intra-group twin (d3s-i, d1s) from the step after the first spike to the end: a step whose gradient
    norm (before clipping) is over `ratio` x the median of the `window` steps before it (spike_ratios).
    grad_norms: the norms of the steps taken so far, in order. ratio None or 0: off, the paper's method.
    Any other row, or no spike yet: `method` itself. Pure: the same norms give the same row.

    >>> switch_to_intra("d3s", [1.0] * 10 + [1.2], 3.0), switch_to_intra("d3s", [1.0] * 10 + [4.0], 3.0)
    ('d3s', 'd3s-i')
    """
    if not ratio or method not in INTRA_TWIN:
        return method
    _require(math.isfinite(ratio) and ratio > 1, "ratio", ratio, "must be > 1 (a spike is a norm over ratio x its median); "
             "0 or None turns the rule off")
    spiked = any(r is not None and r > ratio for r in spike_ratios(list(grad_norms), window))
    return INTRA_TWIN[method] if spiked else method


# ---------------------------------------------------------------------------------------------
# 5. Policy losses: GRPO (token ratios) and GSPO (sequence ratio), clipped surrogate, k3 KL
# ---------------------------------------------------------------------------------------------
# (eps_low, eps_high). GRPO: 0.2 / 0.28, DAPO's clip-higher, the Qwen2.5-Math zero-RL recipe [recipe]
# (the paper states none); GSPO: 3e-4 / 4e-4, the GSPO paper's. Every rung takes its defaults from here.
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


def policy_loss(logp, old_logp, adv, mask, kind="grpo", clip_low=None, clip_high=None,
                ref_logp=None, beta=0.0, normalizer=None, agg=None):
    """Clipped surrogate over the selected tokens, per token:
        l_{i,t} = -min(w * A_i, clip(w, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_{i,t}
    GRPO: w_{i,t} = exp(logp_{i,t} - old_{i,t})                    (default eps 0.2 / 0.28)
    GSPO: w_i = exp(mean_t (logp_{i,t} - old_{i,t})) over the selected tokens, implemented as
          log w_{i,t} = logp - sg(logp) + sg(mean_t(logp - old)) so the gradient flows per
          token (the paper's GSPO-token form). Under token selection the mean runs over the
          selected tokens (choice)                                 (default eps 3e-4 / 4e-4)
    eps_low, eps_high are the arguments clip_low, clip_high.
    KL (k3, needs ref_logp when beta > 0): see kl_k3. With ref_logp and beta = 0 the KL is
    measured (stats["kl"]) but not added to the loss.

    logp, old_logp, mask (and ref_logp): [B, T]; adv: [B].  Returns (loss, stats).
    agg="token-mean" (default for GRPO): sum(l * mask) / normalizer, normalizer = mask.sum()
          by default: every selected token of the optimizer batch weighs the same.
    agg="seq-mean-token-mean" (default for GSPO, its own 1/G sum_i 1/|o_i| sum_t): mean over
          each response's tokens, then sum / normalizer (default: the number of responses
          with a selected token): every response weighs the same.
    Pass the normalizer of the whole optimizer step when micro-batching (and, distributed, of
    all ranks): the sum of the micro-batch losses then equals the full-batch loss, whatever
    the micro-batch size. With several optimizer steps per rollout batch (mini-batches), each
    step has its own normalizer.

    On-policy with one update per batch, w = 1 exactly: clipping never binds, the loss value
    is -mean(A) over the selected tokens, and the gradient is -A_i * grad(logp_{i,t}) / N.
    GSPO's gradient then equals GRPO's under the same aggregation: ratios, clipping and GSPO
    only do something when rollouts are reused, i.e. with several mini-batches per batch
    (old_logp from before the first), where w drifts from 1 on the later mini-batches.

    >>> logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]])).requires_grad_()
    >>> loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1., -1.]), torch.ones(2, 2))
    >>> loss.item(), stats["clip_frac"]  # -mean(A) = 0, nothing clipped
    (0.0, 0.0)
    """
    _require(kind in CLIP_DEFAULTS, "kind", kind, "choose 'grpo' or 'gspo'")
    agg = agg or DEFAULT_AGG[kind]
    _require(agg in ("token-mean", "seq-mean-token-mean"), "agg", agg, "choose 'token-mean' or 'seq-mean-token-mean'")
    _require(logp.dim() == 2, "logp.shape", tuple(logp.shape), "expected [B, T]")
    same_shape = (("old_logp", old_logp), ("mask", mask)) + ((("ref_logp", ref_logp),) if ref_logp is not None else ())
    for name, t in same_shape:
        _require(tuple(t.shape) == tuple(logp.shape), f"{name}.shape", tuple(t.shape),
                 f"must equal logp.shape {tuple(logp.shape)}")
    _require(tuple(adv.shape) == (logp.shape[0],), "adv.shape", tuple(adv.shape),
             f"expected [B] = ({logp.shape[0]},), one advantage per response")
    _require(isinstance(adv, torch.Tensor) and isinstance(mask, torch.Tensor), "adv/mask",
             (type(adv).__name__, type(mask).__name__),
             "pass torch tensors")
    _require(normalizer is None or float(normalizer) > 0, "normalizer", normalizer,
             "must be > 0 (count of tokens or responses in the optimizer batch)")
    _require(beta == 0 or ref_logp is not None, "beta", beta,
             "a KL penalty needs ref_logp (the reference policy's log-probs); pass it or set beta=0")
    for name, val in (("clip_low", clip_low), ("clip_high", clip_high)):
        _require(val is None or 0 <= val, name, val, "must be >= 0")
    eps_low, eps_high = CLIP_DEFAULTS[kind]
    eps_low = eps_low if clip_low is None else clip_low
    eps_high = eps_high if clip_high is None else clip_high

    dtype = torch.promote_types(logp.dtype, torch.float32)  # at least fp32: bf16 counts and sums would round
    logp, old_logp, mask = logp.to(dtype), old_logp.to(dtype), mask.to(dtype)
    tokens_per_seq = mask.sum(-1)  # [B]
    A = adv.to(dtype).unsqueeze(-1)  # [B, 1]: outcome reward broadcast to tokens
    log_ratio = logp - old_logp  # [B, T]
    if kind == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1) / tokens_per_seq.clamp(min=1)  # mean_t over selected
        log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio)  # w
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    per_token = -surrogate  # [B, T]
    kl = None
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp.to(dtype))  # k3 estimator, >= 0
        if beta > 0:
            per_token = per_token + beta * kl

    if agg == "token-mean":
        denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
        loss = (per_token * mask).sum() / denom
    else:
        seq_mean = (per_token * mask).sum(-1) / tokens_per_seq.clamp(min=1)  # [B]
        denom = (tokens_per_seq > 0).sum().clamp(min=1) if normalizer is None else normalizer
        loss = seq_mean.sum() / denom

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        clipped = ((ratio < 1 - eps_low) & (A < 0)) | ((ratio > 1 + eps_high) & (A > 0))  # binds
        valid = mask > 0
        r = ratio[valid] if valid.any() else torch.ones(1, dtype=ratio.dtype)
        stats = {
            "clip_frac": float((clipped.to(mask.dtype) * mask).sum() / n_tok),
            "ratio_mean": float(r.mean()),
            "ratio_min": float(r.min()),
            "ratio_max": float(r.max()),
            "kl": float((kl * mask).sum() / n_tok) if kl is not None else 0.0,
            "tokens": float(mask.sum()),
        }
    return loss, stats
