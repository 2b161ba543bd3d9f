"""A refactor keeps the numbers. Two forms:

Default (any machine, CI): fixed inputs through the method's functions and the rungs' own step functions, against
tests/golden/fixed_inputs.json, recorded (2026-11-26, AMD EPYC) from the code that passed the bit-for-bit form below:
  - d3s.py: group_advantages, select_samples under every rule (d3s's four and variants'), kept_variance,
    usefulness_rate, token_entropy, token_scores (every token rule), select_tokens (batch and sequence scope, with
    and without the per-response floor), dynamic_schedule, method_budget (every row, every schedule of
    methods.progress), kl_k3, policy_loss (grpo and gspo, both aggregations, with a KL term) and its gradient;
  - toy/bandit.py: bandit.run, one step of every row (eval line 0, train line 1, eval line 1), with the two
    sources of trouble replaced by fixed inputs: the rollouts (fixed tokens instead of Policy.sample) and the
    initial policy (seeded weights, last layer included: the zero last layer gives equal entropies, ties);
  - train_small.py: select_samples -> take_rows -> kl_ref_all -> forward_kept -> token_scores -> select_tokens
    -> update_policy -> step_metrics, as train()'s loop calls them, on a seeded tiny Qwen2 and a fixed token
    batch, then the updated policy's log-probs and entropies of every rollout (grpo; d3s and d3s-i with 2
    mini-batches and the reference's KL; d3s-i with GSPO);
  - train_full.py: steps 3-6 (select_samples, forward_kept, select_tokens, update_policy,
    step_metrics: tests/full_fsdp_worker.train_step) on FSDP2 in a gloo group of one process, fixed rollouts,
    then the updated policy's pass-1 log-probs; and the settings of its AdamW.
Why it gives the same numbers on every CPU (the trajectories do not: a sampled token or a top-K tie already
differs between an AMD EPYC and an Intel Xeon at step 1, and RL amplifies it):
  - nothing is sampled: every input is made from seeded integers (torch's CPU generator gives the same ones
    everywhere) and the rollouts are given, so no token hangs on the last bit of a probability;
  - nothing is amplified: one step from fixed weights, and the update is an SGD step (SGD_LR). Adam's first step
    is lr * g / (|g| + eps), about lr * sign(g): a gradient element that rounding puts on the other side of 0
    would move its weight by 2 lr. train_full's AdamW settings are compared as values instead;
  - no discrete choice sits near its boundary: every call to d3s.select_tokens and d3s.policy_loss (the rungs'
    included) is checked here (clear_of_ties) to keep a gap of GAP between the K-th kept and the first dropped
    score and between each log-ratio and the clip bounds; ties are excluded by construction (distinct scores,
    a toy setting whose top K falls between distinct scores), not by luck of rounding. Rewards are 0/1 or
    seeded, and max_variance_subset breaks exact ties by rule (stable sort, a 1e-9 tolerance);
  - floats are compared with a tolerance for float reassociation (another SIMD width, another kernel, sums in
    another order): |now - golden| <= RTOL * |golden| + ATOL * s, s the largest |value| of the tensor the value
    belongs to (1 for a single number), RTOL = ATOL = 1e-5. Reordering a sum of n fp32 terms moves it by about
    sqrt(n) * 6e-8 of the terms' scale (at most n * 6e-8); here n <= 64 and a step is a handful of matmuls, so
    a CPU's rounding stays near 1e-6, well inside. test_rounding_noise_stays_inside_the_tolerance checks that
    margin: every float input times 1 + u, |u| <= 1e-6 (about 8 ulps), changes no choice and no number past
    the tolerance, while a loss 1.001 times larger fails it (1e-3 >> 1e-5). Integers, booleans and index sets
    (kept rollouts, kept tokens) are compared exactly;
  - one thread (torch.set_num_threads(1) while the fixed inputs run).
test_a_changed_loss_or_selection_is_reported runs the same comparison on a perturbed method (the loss scaled by
1.001; d3s's samples rule turned into d3s-i's) and requires it to fail. D3S_RECORD_FIXED=1 writes
fixed_inputs.json anew (only when the numbers are meant to change, with the reason in the commit).

Bit for bit, with D3S_EXACT_GOLDEN=1, on the machine that recorded tests/golden/refactor.json (2026-11-25, before
the reader's-path restructuring, issue 29): the three rungs through their command lines, every value of every
line and a checksum of the weights train_small exports equal:
  - toy/bandit.py: every train and eval line of grpo and d3s, 8 steps, seed 0; and of the other rows,
    token rules and schedules (TOY_VARIANTS);
  - train_small.py: metrics.jsonl of grpo, d3s and d3s-i, 3 steps with --mini-batches 2, from one cached
    warm start on a two-answer task (every group has mixed rewards, so every step really trains);
  - train_full.py: one step of d3s on 2 gloo ranks (torchrun, --rollout hf, --kl-ref, --mini-batches 2),
    from that warm start.
Per-seed numbers move between CPUs (sampling, ties, RL's amplification), so this form is for the recording
machine only; elsewhere it is skipped. D3S_RECORD_GOLDEN=1 writes refactor.json anew (only when the numbers are
meant to change, with the reason in the commit).
"""

import contextlib
import copy
import glob
import json
import math
import os
import pathlib
import platform
import socket
import subprocess
import sys

import pytest
import torch

import d3s
from support import methods

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.figures  # golden numbers: .ci/run runs them again on another float path
GOLDEN = ROOT / "tests" / "golden" / "refactor.json"
FIXED = ROOT / "tests" / "golden" / "fixed_inputs.json"
RECORD, EXACT = os.environ.get("D3S_RECORD_GOLDEN") == "1", os.environ.get("D3S_EXACT_GOLDEN") == "1"
RECORD_FIXED = os.environ.get("D3S_RECORD_FIXED") == "1"
RTOL, ATOL = 1e-5, 1e-5  # float tolerance: relative, and absolute per unit of the tensor's largest |value|
GAP = 1e-4  # the least gap a discrete choice keeps from its boundary: scores (relative to the largest), log-ratios
JITTER = 1e-6  # the relative noise test_rounding_noise_stays_inside_the_tolerance puts on every float input


# === The default form: fixed inputs ===================================================================================
class Inputs:
    """Seeded inputs, made from integers (exactly the same numbers on any CPU). jitter > 0 multiplies each float by
    1 + u, u uniform in [-jitter, jitter]: a stand-in for another CPU's rounding."""

    def __init__(self, seed, jitter=0.0):
        self.gen, self.noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
        self.jitter = jitter

    def uniform(self, *shape, low=-1.0, high=1.0):
        u = torch.randint(0, 2**20, shape, generator=self.gen).double() / 2**20
        return self.jittered((low + (high - low) * u).float())

    def jittered(self, t):
        if not self.jitter:
            return t
        u = self.jitter * (2 * torch.rand(t.shape, generator=self.noise, dtype=torch.float64) - 1)
        return (t * (1 + u)).to(t.dtype)

    def ints(self, high, *shape, low=0):
        return torch.randint(low, high, shape, generator=self.gen)


def set_weights(model, x):
    """Every parameter from x (names in order): matrices uniform in +-1/sqrt(fan-in) (embeddings +-1), norm weights
    1 +- 0.2, biases +-0.1. Weights that do not depend on torch's normal_ (vectorized differently per CPU)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                embedding = isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.Embedding)
                a = 1.0 if embedding else p.shape[-1] ** -0.5
                p.copy_(x.uniform(*p.shape, low=-a, high=a))
            elif "norm" in name:
                p.copy_(1 + x.uniform(*p.shape, low=-0.2, high=0.2))
            else:
                p.copy_(x.uniform(*p.shape, low=-0.1, high=0.1))
    return model


def top_k_gap(scores, mask, k_frac, scope="batch", min_per_seq=0):
    """The gap between the last kept and the first dropped valid score, relative to the largest |score|: where it is
    small, a last-bit difference could swap the two (a tie). inf where nothing is dropped."""
    valid = mask.bool()
    scale = float(scores[valid].abs().max()) if valid.any() else 1.0
    rows = [scores[valid]] if scope == "batch" else [s[m] for s, m in zip(scores, valid)]
    gaps = []
    for row in rows:
        ordered = row.float().sort(descending=True).values
        k = math.ceil(k_frac * ordered.numel() - 1e-9)
        if 0 < k < ordered.numel():
            gaps.append(float(ordered[k - 1] - ordered[k]) / max(scale, 1e-30))
    return min(gaps, default=math.inf)


def clip_gap(logp, old_logp, mask, kind="grpo", clip_low=None, clip_high=None, **_):
    """The least distance between a selected token's log-ratio (GSPO: its response's) and log(1 - eps_low) or
    log(1 + eps_high): where it is small, rounding could move a token across a clip."""
    eps_low, eps_high = (
        d3s.CLIP_DEFAULTS[kind][0] if clip_low is None else clip_low,
        d3s.CLIP_DEFAULTS[kind][1] if clip_high is None else clip_high,
    )
    mask = mask.bool()
    log_ratio = logp.detach().double() - old_logp.double()
    if kind == "gspo":
        seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = seq.unsqueeze(-1).expand_as(log_ratio)
    r = log_ratio[mask]
    if not r.numel():
        return math.inf
    bounds = torch.tensor([math.log1p(-eps_low), math.log1p(eps_high)], dtype=torch.float64)
    return float((r.unsqueeze(-1) - bounds).abs().min())


@contextlib.contextmanager
def clear_of_ties():
    """Every d3s.select_tokens and d3s.policy_loss call inside (the rungs' included) is checked first: the K-th
    kept token and each ratio keep a gap of GAP from the dropped tokens and the clip bounds (ValueError if not:
    change the inputs, do not loosen this)."""
    select_tokens, policy_loss = d3s.select_tokens, d3s.policy_loss

    def checked_select(scores, mask, k_frac, scope="batch", min_per_seq=0):
        gap = top_k_gap(scores, mask, k_frac, scope)
        if gap < GAP:
            raise ValueError(f"select_tokens: the K-th and (K+1)-th scores are {gap:.2g} apart (relative): a near-tie")
        return select_tokens(scores, mask, k_frac, scope=scope, min_per_seq=min_per_seq)

    def checked_loss(logp, old_logp, adv, mask, kind="grpo", **kw):
        gap = clip_gap(logp, old_logp, mask, kind, **kw)
        if gap < GAP:
            raise ValueError(f"policy_loss: a log-ratio is {gap:.2g} from a clip bound")
        return policy_loss(logp, old_logp, adv, mask, kind=kind, **kw)

    d3s.select_tokens, d3s.policy_loss = checked_select, checked_loss
    try:
        yield
    finally:
        d3s.select_tokens, d3s.policy_loss = select_tokens, policy_loss


def plain(value):
    """Tensors as (nested) lists, a dict's tensors too; None, numbers and strings as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if not wall_clock(k)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


# --- d3s.py ---------------------------------------------------------------------------------------------------------
REWARDS_01 = torch.tensor([[1.0, 0, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0]])
SAMPLE_RULES = {
    "cross": "cross",
    "intra": "intra",
    "pods": "pods",
    "all": "all",
    "random": methods.uniform_samples,
    "dapo-filter": methods.dapo_filter,
}


def d3s_outputs(x):
    """The method's functions on constructed inputs."""
    out = {}
    real = x.uniform(4, 6, low=0.0, high=1.0)  # distinct rewards: every subset has its own variance
    for name, rewards in (("01", REWARDS_01), ("real", real)):
        out[f"group_advantages.{name}"] = d3s.group_advantages(rewards)
        out[f"group_advantages.{name}.dr"] = d3s.group_advantages(rewards, scale=False)
        for rule, fn in SAMPLE_RULES.items():
            for n_keep in (2, 3, 5):
                keep, adv = d3s.select_samples(rewards, n_keep, fn, generator=torch.Generator().manual_seed(n_keep))
                out[f"select_samples.{name}.{rule}.{n_keep}"] = {
                    "keep": keep,
                    "adv": adv,
                    "kept_variance": d3s.kept_variance(adv, keep),
                    "usefulness_rate": d3s.usefulness_rate(adv, keep),
                }
    logits = x.uniform(3, 5, 7, low=-4.0, high=4.0)
    logits[0, 0, :3] = -math.inf  # tokens the policy never writes
    out["token_entropy"] = d3s.token_entropy(logits)
    out["token_entropy.chunked"] = d3s.token_entropy(logits, chunk_size=2)
    B, T = 6, 9
    lengths = torch.tensor([9, 3, 6, 1, 8, 5])
    mask = torch.arange(T) < lengths.unsqueeze(1)  # [B, T]
    adv = d3s.group_advantages(REWARDS_01[:, :3].reshape(2, 6)).reshape(-1)[:B]  # [B], with ties across responses
    entropy = x.uniform(B, T, low=0.0, high=2.0)
    for rule, fn in methods.TOKEN_RULES.items():
        scores = d3s.token_scores(adv, entropy, rule=fn, generator=torch.Generator().manual_seed(0))
        out[f"token_scores.{rule}"] = scores
        if rule in ("adv-entropy", "entropy", "random"):  # "adv" ranks |A| broken by 1e-6 noise: not a float rule
            for k in (0.05, 0.2, 0.5):
                out[f"select_tokens.{rule}.{k}"] = d3s.select_tokens(scores, mask, k)
    distinct = x.jittered(torch.randperm(B * T, generator=x.gen).view(B, T).float() / (B * T) + 0.01)  # no ties
    for k in (0.05, 0.2, 0.35, 1.0):
        for scope in ("batch", "sequence"):
            for floor in (0, 1):
                out[f"select_tokens.{k}.{scope}.{floor}"] = d3s.select_tokens(
                    distinct, mask, k, scope=scope, min_per_seq=floor
                )
    out["dynamic_schedule"] = [d3s.dynamic_schedule(s, 10) for s in range(12)] + [
        d3s.dynamic_schedule(s, 7, n_init=3, n_final=9, k_init=0.1, k_final=0.3) for s in range(8)
    ]
    history = [0.1 * (i % 4) for i in range(10)]  # train rewards of the steps before (--schedule adaptive)
    out["method_budget"] = {
        f"{method}.{schedule}": [
            d3s.method_budget(
                row,
                step=s,
                total_steps=10,
                group_size=32,
                progress=methods.progress(schedule, s, 10, history=history[:s]),
            )
            for s in range(10)
        ]
        for method, row in methods.LADDER.items()
        for schedule in methods.SCHEDULES
    }
    out["method_budget.static"] = [
        d3s.method_budget(row, step=3, total_steps=10, group_size=16, n_init=4, n_final=16, static_n=6, static_k=0.3)
        for row in methods.LADDER.values()
    ]
    B, T = 5, 6
    logp = x.uniform(B, T, low=-3.0, high=-0.1)
    mask = torch.arange(T) < torch.tensor([6, 4, 1, 5, 3]).unsqueeze(1)
    ref = logp - x.uniform(B, T, low=-0.5, high=0.5)
    out["kl_k3"] = d3s.kl_k3(logp, ref)
    steps = torch.tensor([-0.6, -0.35, -0.1, 0.0, 0.1, 0.15, 0.4, 0.7])  # log-ratios clear of log 0.8, log 1.28
    token_log_ratio = x.jittered(steps[x.ints(len(steps), B, T)])
    seq_log_ratio = x.jittered(torch.tensor([-1e-3, -1e-4, 0.0, 2e-4, 1e-3]))  # clear of +-3e-4, 4e-4 (GSPO)
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9])
    for kind, log_ratio in (("grpo", token_log_ratio), ("gspo", seq_log_ratio.unsqueeze(1).expand(B, T))):
        for agg in ("token-mean", "seq-mean-token-mean"):
            for beta in (0.0, 0.1):
                new = logp.clone().requires_grad_()
                loss, stats = d3s.policy_loss(
                    new, logp - log_ratio, adv, mask, kind=kind, agg=agg, ref_logp=ref, beta=beta
                )
                loss.backward()
                out[f"policy_loss.{kind}.{agg}.{beta}"] = {"loss": loss, "stats": stats, "grad": new.grad}
    new = logp.clone().requires_grad_()
    loss, stats = d3s.policy_loss(new, logp - token_log_ratio, adv, mask, clip_low=0.1, clip_high=0.5, normalizer=40.0)
    loss.backward()
    out["policy_loss.grpo.clip-0.1-0.5.normalizer-40"] = {"loss": loss, "stats": stats, "grad": new.grad}
    return out


# --- toy/bandit.py --------------------------------------------------------------------------------------------------
# The toy's policy sees (prompt, position, previous token): rollouts of a group that share them have equal entropy,
# and with equal rewards equal scores. A vocabulary of 16 and these K keep every top K's boundary between distinct
# scores (clear_of_ties checks it).
TOY_FLAGS = [
    "--seeds",
    "1",
    "--steps",
    "1",
    "--prompts",
    "4",
    "--batch-prompts",
    "3",
    "--group-size",
    "8",
    "--length",
    "5",
    "--vocab",
    "16",
    "--max-decisions",
    "2",
    "--hidden",
    "8",
    "--n-init",
    "3",
    "--n-final",
    "8",
    "--k-init",
    "0.2",
    "--workers",
    "1",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
]


def toy_outputs(x, folder):
    """bandit.run, 1 step of every row: eval line 0, train line 1 and eval line 1, from a fixed policy and fixed
    rollouts (half of them copy the right answer at every decision, so groups have mixed rewards)."""
    if str(ROOT / "toy") not in sys.path:
        sys.path.insert(0, str(ROOT / "toy"))
    import bandit

    out, real_policy = {}, bandit.Policy

    class FixedPolicy(real_policy):
        def __init__(self, prior, hidden):
            super().__init__(prior, hidden)
            set_weights(self, Inputs(1, x.jitter))  # the same initial policy for every row

        @torch.no_grad()
        def sample(self, prompt_ids, length, gen):
            answers, decisions = task["answers"][prompt_ids], task["decisions"][prompt_ids]
            fixed = Inputs(2)
            tokens = fixed.ints(self.bos, len(prompt_ids), length)
            right = fixed.ints(2, len(prompt_ids), 1).bool() & decisions  # half the rollouts: every decision right
            tokens = torch.where(right, answers, tokens)
            return tokens, self(prompt_ids, tokens)

    bandit.Policy = FixedPolicy
    try:
        for method in ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random", "dapo-filter-k"):
            args = bandit.parse_args([*TOY_FLAGS, "--methods", method, "--out", str(folder)])
            task = bandit.make_task(args, 0)
            out[method] = bandit.run(method, 0, args)
        args = bandit.parse_args(
            [*TOY_FLAGS, "--methods", "d3s", "--token-rule", "entropy", "--normalizer", "all", "--out", str(folder)]
        )
        out["d3s.entropy.all"] = bandit.run("d3s", 0, args)
    finally:
        bandit.Policy = real_policy
    return out


# --- train_small.py -------------------------------------------------------------------------------------------------
# The update steps with SGD: Adam's first step is lr * g / (|g| + eps), about lr * sign(g), so a gradient element
# that rounding puts on the other side of 0 moves its weight by 2 lr (the toy too: --optimizer sgd). With SGD the
# updated policy is as close to the recorded one as the gradients are.
SGD_LR = 0.5
SMALL_CONFIGS = {
    "grpo": ("grpo", "grpo", 1),
    "d3s-m2": ("d3s", "grpo", 2),
    "d3s-i-m2": ("d3s-i", "grpo", 2),
    "d3s-i-gspo-m2": ("d3s-i", "gspo", 2),
}


def small_batch(x, tokenizer, P=3, G=4):
    """A rollout batch as sampler.sample returns it, from fixed token ids: left-padded prompts, responses that
    end at their first EOS (some at the length limit), and 0/1 rewards with every group mixed."""
    pad, eos, V = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    Lp, T = 7, 8
    prompt_ids, prompt_mask = torch.full((P, Lp), pad), torch.zeros(P, Lp, dtype=torch.long)
    for p, n in enumerate((7, 4, 5)):
        prompt_ids[p, Lp - n :], prompt_mask[p, Lp - n :] = x.ints(V, n, low=3), 1
    response_ids = x.ints(V, P * G, T, low=3)
    lengths = x.ints(T + 1, P * G, low=2)  # T + 1: no EOS, cut at the limit
    response_mask = torch.zeros(P * G, T, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        if n <= T:
            response_ids[b, n - 1] = eos
            response_ids[b, n:] = pad
        response_mask[b, : min(n, T)] = 1
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 0, 1, 0], [1, 1, 0, 1]])
    return {
        "prompt_ids": prompt_ids.repeat_interleave(G, 0),
        "prompt_mask": prompt_mask.repeat_interleave(G, 0),
        "response_ids": response_ids,
        "response_mask": response_mask,
    }, rewards


def small_outputs(x, folder):
    """train_small's steps 3-6 as train()'s loop calls them (step 2 of 4), then the updated policy's outputs."""
    from support import sampler, tiny
    import train_small

    tokenizer = tiny.build_char_tokenizer()
    base = set_weights(tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), x)
    batch, rewards = small_batch(Inputs(3), tokenizer)
    out, step = {}, 2
    for name, (method, loss, mini_batches) in SMALL_CONFIGS.items():
        args = train_small.parse_args(
            [
                "--method",
                method,
                "--loss",
                loss,
                "--mini-batches",
                str(mini_batches),
                "--steps",
                "4",
                "--group-size",
                "4",
                "--n-init",
                "2",
                "--n-final",
                "4",
                "--k-init",
                "0.3",
                "--k-final",
                "0.5",
                "--out",
                str(folder),
                "--cache-dir",
                str(folder),
            ]
        )
        model, ref_model = copy.deepcopy(base), copy.deepcopy(base).eval().requires_grad_(False)
        valid = batch["response_mask"].bool()
        with torch.no_grad():
            before_logp = sampler.logprobs_entropy(model, batch, args.temperature)[0].masked_fill(~valid, 0)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)  # not train()'s AdamW: see SGD_LR
        with_ref = mini_batches > 1  # the steps that measure the KL to the reference
        sel = train_small.select_samples(rewards, batch, method, step, args, [])
        keep, adv = sel.keep, sel.adv
        kl_all = train_small.kl_ref_all(model, ref_model, batch, args.temperature) if with_ref else None
        pass1 = train_small.forward_kept(model, ref_model if with_ref else None, sel, args.temperature)
        old_logp, entropy, ref_logp = pass1.old_logp, pass1.entropy, pass1.ref_logp
        sel.token_keep, sel.scores = train_small.select_tokens(sel, entropy, step, args)
        token_keep = sel.token_keep
        update = train_small.update_policy(model, optimizer, sel, pass1, args)
        metrics = {**train_small.step_metrics(step, batch, rewards, sel, pass1, update), "grader_timeouts": 0}
        with torch.no_grad():
            after_logp, after_entropy = sampler.logprobs_entropy(model, batch, args.temperature)
        out[name] = {
            "before_logp": before_logp,
            "keep": keep,
            "adv": adv,
            "token_keep": token_keep,
            "old_logp": old_logp,
            "entropy": entropy,
            "ref_logp": ref_logp,
            "kl_ref_all": kl_all,
            "update": update,
            "metrics": metrics,
            "after_logp": after_logp.masked_fill(~valid, 0),
            "after_entropy": after_entropy.masked_fill(~valid, 0),
        }
    return out


# --- train_full.py --------------------------------------------------------------------------------------------------
FULL_CONFIGS = ("grpo", "d3s-m2", "gspo-d3s-i-m2")  # tests/full_fsdp_worker.CONFIGS: method, loss, M, lr


def full_outputs(x, folder):
    """train_full's steps 3-6 (tests/full_fsdp_worker.train_step: its calls in main()'s order) on FSDP2 in a gloo
    group of one process, on fixed rollouts and rewards; then the updated policy's log-probs (pass 1)."""
    import torch.distributed as dist

    from support import fsdp, loss_head
    import full_fsdp_worker as worker
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    model = set_weights(tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), x)
    model_dir = tiny.save_tiny(model, tokenizer, str(folder / "tiny"))
    rollouts, pad_id = worker.make_rollouts(len(tokenizer), seed=0), tokenizer.pad_token_id
    seqs = [s for group in rollouts for s in group]
    T, every = max(len(s["response_ids"]) for s in seqs), list(range(len(seqs)))
    assert not dist.is_initialized(), "a process group is already set up in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    try:
        world = fsdp.World(0, 1, 0, torch.device("cpu"))
        for name in FULL_CONFIGS:
            method, loss, mini_batches, lr = worker.CONFIGS[name]
            args = worker.trainer_args(model_dir, method, loss, mini_batches, lr)
            args.device = "cpu"
            model = fsdp.load_policy(args, world)
            adamw = fsdp.make_optimizer(model, args).defaults  # its settings are compared; SGD steps (SGD_LR)
            optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
            ref_model = fsdp.load_policy(args, world, reference=True) if mini_batches > 1 else None
            before = loss_head.forward_no_grad(model, seqs, every, T, args, world, pad_id=pad_id)[0]
            metrics, details = worker.train_step(
                model, optimizer, rollouts, worker.REWARDS, worker.STEP, args, world, pad_id, ref_model=ref_model
            )
            logp, entropy, _ = loss_head.forward_no_grad(
                model, seqs, every, T, args, world, pad_id=pad_id, with_entropy=True
            )
            out[name] = {
                "before_logp": before,
                "metrics": metrics,
                **details,
                "after_logp": logp,
                "after_entropy": entropy,
                "adamw": {k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay")},
            }
    finally:
        dist.destroy_process_group()
    return out


PARTS = {"d3s": lambda x, folder: d3s_outputs(x), "toy": toy_outputs, "small": small_outputs, "full": full_outputs}


def fixed_outputs(folder, parts=tuple(PARTS), jitter=0.0, guard=True):
    """What the default form compares: {part: {name: plain values}}, one thread, every discrete choice checked
    clear of ties (guard=False: a perturbed method, whose choices need only differ)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with clear_of_ties() if guard else contextlib.nullcontext():
            return {part: plain(PARTS[part](Inputs(0, jitter), pathlib.Path(folder))) for part in parts}
    finally:
        torch.set_num_threads(threads)


def numbers(value):
    """The numbers of a (nested) list of numbers, flat; None if it holds anything else (a dict, a string)."""
    if isinstance(value, list):
        flat = []
        for v in value:
            inner = numbers(v)
            if inner is None:
                return None
            flat += inner
        return flat
    return [value] if value is None or isinstance(value, (int, float)) else None


def mismatches(now, golden, where="", scale=None):
    """Where `now` differs from `golden`, one line each: the same keys, lengths, integers, booleans, strings and
    None; floats within RTOL * |golden| + ATOL * s (s: the largest |value| of the tensor, 1 for a single number)."""
    if isinstance(golden, dict):
        if not isinstance(now, dict):
            return [f"{where}: {type(now).__name__} instead of a dict"]
        lines = [f"{where}: keys {sorted(set(now) ^ set(golden))}"] if set(now) != set(golden) else []
        return lines + [line for k in golden if k in now for line in mismatches(now[k], golden[k], f"{where}.{k}")]
    if isinstance(golden, list):
        if not isinstance(now, list) or len(now) != len(golden):
            return [f"{where}: {len(now) if isinstance(now, list) else now!r} items instead of {len(golden)}"]
        flat = numbers(golden) if scale is None else None
        if flat is not None:  # a tensor: its own scale
            scale = max([abs(v) for v in flat if isinstance(v, float) and math.isfinite(v)], default=0.0)
        return [line for i, (a, b) in enumerate(zip(now, golden)) for line in mismatches(a, b, f"{where}[{i}]", scale)]
    if isinstance(golden, float) and isinstance(now, (int, float)) and not isinstance(now, bool):
        if math.isnan(golden) and math.isnan(now):
            return []
        s = 1.0 if scale is None else scale
        ok = now == golden or abs(now - golden) <= RTOL * abs(golden) + ATOL * s
        return [] if ok else [f"{where}: {now!r} vs {golden!r}"]
    same = now == golden and type(now) is type(golden)
    return [] if same else [f"{where}: {now!r} vs {golden!r}"]


@pytest.fixture(scope="module")
def fixed_golden():
    if not FIXED.exists():
        pytest.fail(f"{FIXED} is missing: record it with D3S_RECORD_FIXED=1")
    return json.loads(FIXED.read_text())


def test_fixed_inputs_give_the_recorded_numbers(tmp_path):
    now = fixed_outputs(tmp_path)
    if RECORD_FIXED:
        machine = {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "recorded": "2026-11-26",
        }
        FIXED.write_text(json.dumps({"machine": machine, **now}, indent=0) + "\n")
    golden = json.loads(FIXED.read_text())
    found = mismatches({k: now[k] for k in PARTS}, {k: golden[k] for k in PARTS})
    assert not found, f"{len(found)} numbers differ from {FIXED.name}:\n" + "\n".join(found[:40])


def test_the_fixed_inputs_are_meaningful(fixed_golden):
    """What the file holds is worth comparing: the rungs' steps train (finite losses, updates, a changed policy),
    the token-selecting rows keep a part of the tokens, off-policy mini-batches clip, and the rules differ."""
    toy = fixed_golden["toy"]
    for method, lines in toy.items():
        train = lines[1]
        assert lines[0]["kind"] == "eval" and train["kind"] == "train" and train["updates"] == 1, method
        assert train["groups_mixed"] > 0 and lines[2]["eval_reward"] != lines[0]["eval_reward"], method
    assert toy["d3s"][1]["kept_tokens"] < toy["d2s"][1]["kept_tokens"] < toy["grpo"][1]["kept_tokens"]
    for name, run in fixed_golden["small"].items():
        m = run["metrics"]
        assert m["updates"] == SMALL_CONFIGS[name][2] and all(math.isfinite(v) for v in run["update"]["losses"]), name
        assert mismatches(run["after_logp"], run["before_logp"]), name  # the step moved the policy
    small_d3s = fixed_golden["small"]["d3s-m2"]
    assert small_d3s["metrics"]["k_real"] < 1 and small_d3s["kl_ref_all"] > 0
    assert fixed_golden["small"]["d3s-m2"]["keep"] != fixed_golden["small"]["d3s-i-m2"]["keep"]  # cross vs intra
    for name, run in fixed_golden["full"].items():
        assert run["metrics"]["updates"] >= 1 and run["metrics"]["loss"] is not None, name
        assert mismatches(run["after_logp"], run["before_logp"]), name
    assert fixed_golden["full"]["gspo-d3s-i-m2"]["metrics"]["clip_frac_by_minibatch"][-1] > 0
    d = fixed_golden["d3s"]
    assert d["select_samples.01.cross.3"]["keep"] != d["select_samples.01.intra.3"]["keep"]
    assert any(v["stats"]["clip_frac"] > 0 for k, v in d.items() if k.startswith("policy_loss.grpo"))


def test_rounding_noise_stays_inside_the_tolerance(tmp_path, fixed_golden):
    """Every float input times 1 + u, |u| <= 1e-6 (8 ulps in fp32; another CPU's reassociation moves a result by
    less): no discrete choice changes (clear_of_ties), and every number stays inside the tolerance."""
    found = mismatches(fixed_outputs(tmp_path, jitter=JITTER), {k: fixed_golden[k] for k in PARTS})
    assert not found, f"{len(found)} numbers moved past the tolerance under {JITTER:g} noise:\n" + "\n".join(found[:40])


def test_a_changed_loss_or_selection_is_reported(tmp_path, fixed_golden, monkeypatch):
    """The same comparison, on a perturbed method: the rungs' loss scaled by 1.001, then d3s's samples rule turned
    into d3s-i's (intra-group). Each shows up in every part that runs it."""
    policy_loss = d3s.policy_loss

    def scaled(*args, **kw):
        loss, stats = policy_loss(*args, **kw)
        return loss * 1.001, stats

    monkeypatch.setattr(d3s, "policy_loss", scaled)
    found = mismatches(fixed_outputs(tmp_path, guard=False), {k: fixed_golden[k] for k in PARTS})
    for part in PARTS:
        assert any(line.startswith(f".{part}.") for line in found), f"a 1.001 loss is not seen in {part}"
    assert any(".loss" in line for line in found)
    monkeypatch.undo()
    monkeypatch.setitem(methods.LADDER, "d3s", methods.LADDER["d3s-i"])
    parts = ("toy", "small")  # the rows run by name (d3s.py's functions take the rule itself)
    found = mismatches(fixed_outputs(tmp_path, parts=parts, guard=False), {k: fixed_golden[k] for k in parts})
    for where in (".toy.d3s[1].", ".small.d3s-m2.keep"):
        assert any(line.startswith(where) for line in found), f"d3s selecting within groups is not seen at {where}"
    assert not any(line.startswith((".toy.grpo", ".small.grpo")) for line in found)  # the other rows are untouched


# === The bit-for-bit form: the trajectories, on the recording machine =================================================
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = [
    "--hidden-size",
    "32",
    "--num-layers",
    "1",
    "--sft-steps",
    "40",
    "--sft-lr",
    "3e-2",
    "--sft-batch",
    "32",
    "--eval-size",
    "6",
    "--eval-samples",
    "2",
    "--pass-k",
    "2",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--n-init",
    "2",
    "--n-final",
    "4",
    "--max-new-tokens",
    "12",
    "--eval-every",
    "3",
    "--save-every",
    "3",
    "--threads",
    "1",
    "--lr",
    "3e-3",
    "--steps",
    "3",
    "--mini-batches",
    "2",
    "--explain-every",
    "0",
]
SMALL_METHODS = ("grpo", "d3s", "d3s-i")
TOY_METHODS = ("grpo", "d3s")
TOY_VARIANTS = {  # the other rows and rules, on the toy (a second each): what moves to support/methods.py must keep them
    "rows": ["--methods", "d1s", "d1s-cross", "d2s", "d3s-i", "pods", "random", "dapo-filter", "dapo-filter-k"],
    "entropy-cosine": ["--methods", "d3s", "--token-rule", "entropy", "--schedule", "cosine"],
    "adv-adaptive": ["--methods", "d3s", "--token-rule", "adv", "--schedule", "adaptive", "--steps", "30"],
    "random-step-sequence": [
        "--methods",
        "d3s",
        "--token-rule",
        "random",
        "--schedule",
        "step",
        "--token-scope",
        "sequence",
    ],
}


def wall_clock(key):
    """Keys whose value is a time, a rate or a memory reading: they differ from run to run."""
    return key.endswith(("_s", "_per_s", "_gb")) or key in ("mfu",)


def clean(line):
    """A metrics line without its clock readings and without paths of the machine that ran it."""
    out = {k: v for k, v in line.items() if not wall_clock(k)}
    if "warm_start" in out:
        out["warm_start"] = {k: v for k, v in out["warm_start"].items() if k not in ("path", "sft_s")}
    return out


def read_jsonl(path):
    with open(path) as f:
        return [clean(json.loads(line)) for line in f if line.strip()]


def weights_checksum(folder):
    """Per tensor of an exported model: its sum and the sum of its squares, in float64 (order of the file)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    return {name: [float(t.double().sum()), float(t.double().square().sum())] for name, t in sorted(tensors.items())}


def two_answer_data(folder):
    """Problems whose answer is 1 or 2 at random: the warm-started tiny model guesses, so groups have mixed rewards."""
    gen = torch.Generator().manual_seed(0)
    paths = []
    for name, n in (("train.jsonl", 64), ("eval.jsonl", 6)):
        with open(folder / name, "w") as f:
            for i in range(n):
                answer = str(1 + int(torch.randint(2, (1,), generator=gen)))
                f.write(json.dumps({"problem": f"Pick {name[0]}{i}.", "answer": answer}) + "\n")
        paths.append(str(folder / name))
    return paths


def run(cmd, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    """Run the three rungs once; returns {"toy": lines, "small": {method: lines}, "small_weights": {...},
    "full": lines}. Only in the bit-for-bit form (D3S_EXACT_GOLDEN=1 or D3S_RECORD_GOLDEN=1): elsewhere the
    trajectories differ."""
    if not (EXACT or RECORD):
        pytest.skip("the trajectories are compared bit for bit on the recording machine only: D3S_EXACT_GOLDEN=1")
    base = tmp_path_factory.mktemp("refactor")
    train, held_out = two_answer_data(base)
    result = {"small": {}, "small_weights": {}}
    run(
        [
            sys.executable,
            "toy/bandit.py",
            "--methods",
            *TOY_METHODS,
            "--seeds",
            "1",
            "--steps",
            "8",
            "--workers",
            "1",
            "--out",
            str(base / "toy"),
        ]
    )
    result["toy"] = read_jsonl(base / "toy" / "metrics.jsonl")
    result["toy_variants"] = {}
    for name, flags in TOY_VARIANTS.items():
        run(
            [
                sys.executable,
                "toy/bandit.py",
                "--seeds",
                "1",
                "--steps",
                "8",
                "--workers",
                "1",
                *flags,
                "--out",
                str(base / name),
            ]
        )
        result["toy_variants"][name] = read_jsonl(base / name / "metrics.jsonl")
    cache = base / "cache"
    for method in SMALL_METHODS:
        out = base / "small" / method
        run(
            [
                sys.executable,
                "train_small.py",
                "--method",
                method,
                "--train-file",
                train,
                "--eval-file",
                held_out,
                "--cache-dir",
                str(cache),
                "--out",
                str(out),
                *SMALL,
            ]
        )
        result["small"][method] = read_jsonl(out / "metrics.jsonl")
        result["small_weights"][method] = weights_checksum(out / "final")
    (warm,) = glob.glob(str(cache / "warmstart-*"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = base / "full"
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={port}",
            "train_full.py",
            "--rollout",
            "hf",
            "--device",
            "cpu",
            "--model",
            warm,
            "--train-data",
            train,
            "--eval-data",
            "none",
            "--template",
            "plain",
            "--out",
            str(out),
            "--steps",
            "1",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--n-init",
            "2",
            "--n-final",
            "4",
            "--mini-batches",
            "2",
            "--micro-batch-size",
            "3",
            "--max-response-len",
            "12",
            "--max-prompt-len",
            "64",
            "--lr",
            "1e-2",
            "--kl-ref",
            "--grader-workers",
            "1",
        ]
    )
    result["full"] = read_jsonl(out / "metrics.jsonl")
    return result


def test_the_recorded_runs_are_meaningful():
    """What the file holds: every small run trains on every step (mixed groups), d3s selects tokens, the full step
    trains on 2 ranks, and the toy's two rows differ."""
    golden = json.loads(GOLDEN.read_text())
    for method, lines in golden["small"].items():
        train = [m for m in lines if m["kind"] == "train"]
        assert len(train) == 3 and all(m["groups_mixed"] > 0 and m["updates"] >= 1 for m in train), method
        assert all(len(m["clip_frac_by_minibatch"]) >= 1 for m in train)
    assert all(m["k_frac"] < 1 for m in golden["small"]["d3s"] if m["kind"] == "train")
    (full,) = [m for m in golden["full"] if m["kind"] == "train"]
    assert full["updates"] >= 1 and full["kl_ref"] is not None and full["k_frac"] < 1
    toy = {m: [x for x in golden["toy"] if x["kind"] == "train" and x["method"] == m] for m in TOY_METHODS}
    assert [len(v) for v in toy.values()] == [8, 8] and toy["grpo"][0]["kept_tokens"] > toy["d3s"][0]["kept_tokens"]


def test_the_rungs_give_the_recorded_numbers(now):
    """The bit-for-bit form: every line of every run and the exported weights, equal to refactor.json."""
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        machine = {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "recorded": "2026-11-25",
        }
        GOLDEN.write_text(json.dumps({"machine": machine, **now}, indent=0) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for part in ("toy", "toy_variants", "small", "small_weights", "full"):
        assert now[part] == golden[part], part
