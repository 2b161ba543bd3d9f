# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # D3S in one lesson: which rollouts and which tokens GRPO should train on
#
# GRPO samples G answers for each prompt, scores them 0/1, and trains on every token of every answer. **D3S**
# (Wang et al., ICLR 2026) trains on less: first the rollouts whose advantages vary most (the *sample level*), then
# the tokens of those rollouts with the largest |advantage| × entropy (the *token level*), keeping more of both as
# training goes on. This notebook builds that up from the pieces of [`d3s.py`](../d3s.py), the project's one-file
# implementation: nothing below re-implements the method, every piece is imported.
#
# It runs top to bottom on a laptop CPU in about a minute (under 5), with no download. Sections: 0. a primer (the
# policy gradient, PPO's ratio and clip, GSPO, the KL), 1. where GRPO's signal goes, 2. the first level, 3. the second
# level (a real tiny transformer), 4. the schedule and why it exists, 5. the loss, 6. the experiment (GRPO against D3S
# over seeds), 7. stability (cross-group against intra-group), 8. exercises with checkers, 9. what is settled and what
# is open.
#
# What the lesson says of the paper comes from three kinds of text, each named where it is used
# ([docs/algorithm.md](../docs/algorithm.md), introduction): **the abstract**, the only words of the paper itself at
# hand (it has no number); **a summary**, one of two third-party summaries (a "key findings" page and a design card,
# the source of the schedule's 8 → 32 and 5% → 20%); and **the notes**, notes on the paper that the project's design
# notes quote, not among the sources at hand (the cross-group quote, the ladder's names and averages, the speed-ups).
# Where no source at hand pins a detail down, the project picks a reading, marked **(choice)** below with the
# alternative one argument or flag away (docs/algorithm.md, section 8, lists them all).
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/OWNER/d3s/blob/main/lesson/lesson.ipynb)
# (the badge needs the repository's GitHub address in place of `OWNER/d3s`: set `REPO` in the next cell too).

# %%
import importlib.util
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the notebook's outputs
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook bars, which are off

REPO = "https://github.com/OWNER/d3s"  # where this project lives on GitHub (for Colab only)
here = os.path.abspath("")  # in the repository: the lesson imports the project from one folder up
sys.path[:0] = [os.path.dirname(here) if os.path.basename(here) == "lesson" else here]
if importlib.util.find_spec("d3s") is None:  # on Colab: fetch the project (torch is there already)
    subprocess.run(["git", "clone", "--depth", "1", REPO, "d3s-repo"], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "math-verify", "scipy", "transformers>=5.16.1,<5.20"], check=True
    )
    os.chdir("d3s-repo/lesson")
    sys.path[:0] = [os.path.abspath("..")]
ROOT = sys.path[0]
RUNS = os.path.join(ROOT, "runs", "lesson")  # what the lesson writes: a cached warm start, an explain page
sys.path[:0] = [os.path.join(ROOT, "toy"), os.path.join(ROOT, "experiments"), os.path.join(ROOT, "lesson")]

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from IPython.display import Image, display  # noqa: E402

import bandit  # noqa: E402  (toy/bandit.py: the first rung)
import d3s  # noqa: E402
from support import methods  # noqa: E402

torch.set_num_threads(2)
started = time.time()
print("the project is importable:", ", ".join(m.__name__ + ".py" for m in (d3s, methods, bandit)))

# %% [markdown]
# ## 0. A primer: the policy gradient, PPO's ratio, GSPO and the KL
#
# Four ideas the method sits on, each with a cell on tiny tensors. **The policy gradient.** A policy π samples an
# answer; a reward says how good it was; the *advantage* A says how much better than the group's average. The loss
# −A · log π(token) pushes up the log-probability of the tokens of an answer with A > 0 and down those with A < 0,
# each in proportion to A. Its gradient is −A · ∇log π: **an advantage of 0 gives a gradient of exactly 0**, whatever
# the answer. That one fact is what D3S exploits: a rollout or a token whose weight is 0 costs compute and teaches
# nothing. Below, a policy over 4 tokens (its logits are the parameters), three sampled answers of one token each,
# and `d3s.policy_loss` on-policy against the hand-written −A · log π.


# %%
def r3(t):  # a tensor as a list of rounded numbers (no -0.0), for printing
    return [round(x, 3) + 0.0 for x in t.flatten().tolist()]


theta = torch.tensor([0.5, 0.0, -0.5, 1.0], requires_grad=True)  # the policy's logits over 4 tokens
sampled = torch.tensor([3, 0, 1])  # three one-token answers
A0 = torch.tensor([1.0, -1.0, 0.0])  # their advantages: better, worse, average
logp0 = theta.log_softmax(-1)[sampled].unsqueeze(-1)  # [B=3, T=1] log pi(token)
loss0, _ = d3s.policy_loss(logp0, logp0.detach(), A0, torch.ones(3, 1))  # on-policy: the ratio is 1
(g_lib,) = torch.autograd.grad(loss0, theta)
(g_hand,) = torch.autograd.grad(-(A0 * theta.log_softmax(-1)[sampled]).mean(), theta)
print("policy_loss's gradient == that of -mean(A * log pi):", torch.allclose(g_lib, g_hand))
for i in range(3):  # each answer's own gradient: zero when A = 0
    (g_i,) = torch.autograd.grad(-A0[i] * theta.log_softmax(-1)[sampled[i]], theta)
    print(f"answer {i} (token {int(sampled[i])}, A = {float(A0[i]):+.0f}): gradient {r3(g_i)}")

# %% [markdown]
# **PPO's ratio, clipping and the "old" policy.** The rollouts were generated by the policy as it was before this
# update, π_old; their log-probabilities under it are recorded (`old_logp`). Trainers split a batch into several
# mini-batches and take one optimizer step on each, so from the second mini-batch on, the policy being trained, π,
# has already moved. The importance ratio w = π / π_old corrects for that, and the clipped surrogate
# −min(w A, clip(w, 1 − ε, 1 + ε) A) stops rewarding a move once w leaves [1 − ε, 1 + ε] in the direction A favours:
# there the gradient is 0, so one batch cannot pull the policy far. With **one** mini-batch per batch, π *is* π_old:
# w = 1 exactly, nothing clips, and the loss is plain −A · log π (the cell above). Below, a policy that has moved.

# %%
old = torch.log(torch.tensor([[0.5, 0.4], [0.5, 0.4]]))  # [B=2, T=2] log pi_old of the sampled tokens
new = torch.log(torch.tensor([[0.7, 0.42], [0.3, 0.38]])).requires_grad_()  # the same tokens after an update
A1 = torch.tensor([1.0, -1.0])
loss1, st1 = d3s.policy_loss(new, old, A1, torch.ones(2, 2), kind="grpo", clip_low=0.2, clip_high=0.2)
loss1.backward()
print("ratios w = pi / pi_old:", r3((new - old).exp().detach()))
print(f"clipped share of tokens {st1['clip_frac']:.2f}; gradient (0 where clipped):", r3(new.grad))

# %% [markdown]
# **GSPO's sequence ratio.** GRPO's ratio is per token; GSPO (Zheng et al., 2025) uses one ratio per response, the
# geometric mean of its token ratios, s = exp(mean_t log(π / π_old)), clipped with a much tighter ε (3e-4 / 4e-4
# here): a response is kept or clipped whole, and one token that moved a lot is diluted by the others.

# %%
_, st_g = d3s.policy_loss(new.detach(), old, A1, torch.ones(2, 2), kind="gspo")
seq_ratio = (new.detach() - old).mean(-1).exp()  # one ratio per response
print("token ratios:", r3((new.detach() - old).exp()))
print(f"GSPO's ratio per response: {r3(seq_ratio)} (policy_loss: {st_g['ratio_min']:.3f} to {st_g['ratio_max']:.3f})")
print(f"clipped share of tokens under GSPO's eps 3e-4 / 4e-4: {st_g['clip_frac']:.2f}")

# %% [markdown]
# **The KL term and β.** GRPO's loss can add β · KL(π ‖ π_ref) per token, a pull back toward a frozen reference
# (usually the starting model); `d3s.kl_k3` is the k3 estimator, exp(d) − d − 1 with d = log π_ref − log π: ≥ 0, and
# 0 where the two agree. **This project sets β = 0**, as the common Qwen2.5-Math zero-RL recipe does (docs/algorithm.md,
# section 9): no reference model, and the KL is only measured. With β > 0, `policy_loss` averages β · KL over the
# *selected* tokens only, a reading of the project's **(choice)**: GRPO's covers every token, and no source at hand
# says what D3S does.

# %%
ref = torch.log(torch.tensor([[0.5, 0.4], [0.5, 0.4]]))  # the reference: here the start, pi_old
print("k3 KL per token:", r3(d3s.kl_k3(new.detach(), ref)))
for beta in (0.0, 0.1):
    loss_b, st_b = d3s.policy_loss(new.detach(), old, A1, torch.ones(2, 2), ref_logp=ref, beta=beta)
    print(f"beta = {beta}: loss {loss_b.item():+.4f}, KL measured {st_b['kl']:.4f}")

# %% [markdown]
# ## 1. Where GRPO's signal goes
#
# The toy task of [`toy/bandit.py`](../toy/bandit.py): each prompt asks for 8 tokens. One to three of the positions
# are *decisions* (the 0/1 reward checks them); the others are *filler* the reward ignores, where the base policy has
# a habit (low entropy), as most tokens an LLM writes. We sample one batch as GRPO would: P = 8 prompts × G = 16
# rollouts, then compute GRPO's advantages, $A_i = (R_i - \text{mean}_g R) / (\text{std}_g R + \epsilon)$ per group.

# %%
args = bandit.parse_args(
    ["--group-size", "16", "--n-init", "4", "--n-final", "16", "--workers", "1", "--out", os.path.join(RUNS, "toy")]
)
task = bandit.make_task(args, seed=0)
torch.manual_seed(0)
policy = bandit.Policy(task["prior"], args.hidden)  # step 0: exactly the "base model" prior
gen = torch.Generator().manual_seed(0)
P, G, L = args.batch_prompts, args.group_size, args.length
prompts = torch.randperm(args.prompts, generator=gen)[:P]
prompt_ids = prompts.repeat_interleave(G)  # [P*G], grouped by prompt
tokens, logits = policy.sample(prompt_ids, L, gen)  # [P*G, L] tokens, [P*G, L, V] logits
rewards = bandit.reward(task, prompt_ids, tokens).view(P, G)  # [P, G], 0/1
A = d3s.group_advantages(rewards)  # [P, G]
print("correct answers per prompt:", rewards.sum(-1).int().tolist(), "of", G)
no_spread = rewards.amax(-1) == rewards.amin(-1)
print(f"groups with no spread (A = 0 for all {G}): {int(no_spread.sum())} of {P}")
print(f"rollouts GRPO trains on with A = 0: {float((A == 0).float().mean()):.0%}")

# %% [markdown]
# A group whose answers all fail (or all succeed) has A = 0 everywhere: GRPO spends its forward and backward on it and
# gets no gradient. Inside a response, every token carries the same A (the reward is for the whole answer), so the
# only thing that distinguishes tokens is how uncertain the policy was there: its entropy $H$.

# %%
H = d3s.token_entropy(logits)  # [P*G, L]
decisions = task["decisions"][prompt_ids]  # [P*G, L]: which positions the reward reads
print(
    f"mean entropy at decision positions {float(H[decisions].mean()):.2f}, at filler {float(H[~decisions].mean()):.2f}"
)
print(f"share of tokens that are decisions: {float(decisions.float().mean()):.0%}")
fig, ax = plt.subplots(1, 2, figsize=(11, 3.2))
order = A.argsort(-1)
ax[0].imshow(A.gather(1, order), cmap="coolwarm", vmin=-2.5, vmax=2.5, aspect="auto")
ax[0].set(title="A per rollout (rows: prompts, sorted)", xlabel="rollout", ylabel="prompt")
ax[1].hist([H[decisions].tolist(), H[~decisions].tolist()], bins=30, label=["decision", "filler"], density=True)
ax[1].set(title="token entropy H", xlabel="H (nats)")
ax[1].legend()
display(fig)
plt.close(fig)

# %% [markdown]
# ## 2. The first level: keep the rollouts whose advantages vary most
#
# PODS (Xu et al., 2025) keeps, per group, the N rollouts whose *rewards* have the largest variance, then standardizes
# the advantages again on the kept N. D3S uses the same max-variance rule on the advantages but keeps the advantages
# computed on the whole group of G: a kept set is not pulled back to Var = 1, which is why Lemma 1 (below) has
# a point. The best subset is always "the k largest and the N − k smallest" for some k, so `d3s.max_variance_subset`
# sorts once and scores N + 1 candidates. Here it is on one group with continuous rewards, checked against trying
# every subset.

# %%
import itertools  # noqa: E402

values = torch.tensor([0.10, 0.90, 0.50, 0.70, 0.30, 0.85, 0.20, 0.55])
m = 4
kept = d3s.max_variance_subset(values, m)
best = max(itertools.combinations(range(len(values)), m), key=lambda c: values[list(c)].double().var().item())
print("max_variance_subset:", kept.tolist(), f"Var = {values[kept].double().var():.4f}")
print("brute force:        ", list(best), f"Var = {values[list(best)].double().var():.4f}")
fig = plt.figure(figsize=(6, 1.4))
plt.scatter(
    values, [0] * len(values), c=["C3" if i in kept.tolist() else "lightgrey" for i in range(len(values))], s=80
)
plt.yticks([])
plt.title("kept (red): the extremes")
display(fig)
plt.close(fig)

# %% [markdown]
# **Lemma 1**, as the design-card summary states it (no text of the paper at hand has it; the abstract says only that
# the selection is "theoretically proven"): a group standardized to Var(A) = 1 has a subset with Var(A′) ≥ 1. That holds under either variance: the group's smallest and largest advantages alone span at least 2σ.
# The abstract draws from the theory that selecting for maximum Var(A) "is positively correlated with the upper bound
# of the policy gradient norms": a claim about a *bound*, not that the kept rollouts carry more signal. And the theory
# covers a simplified setting: the design-card summary lists among its limitations that it is "limited to simplified
# single-token, deterministic-reward settings". (On the tiny transformer the gradient norm does grow, mostly because
# the loss divides by fewer tokens: [docs/walkthrough.md](../docs/walkthrough.md), section 5.)
#
# The project proves a **stronger form of its own**: for every size N from 2 to G, the max-variance N-subset has
# Var(A′) ≥ 1 with the unbiased variance (the mean over all N-subsets equals the group's; docs/algorithm.md 2.3). It
# fails with the population variance: rewards [0, 0, 1, 1], N = 3 give 0.889. Selection *within* each group ("intra",
# the rows `d1s` and `d3s-i`) therefore keeps Var(A′) ≥ 1 per group; PODS's re-standardized advantages sit at 1:

# %%
keep_intra, adv_intra = d3s.select_samples(rewards, 4, "intra")  # N = 4 of G = 16 per prompt
keep_pods, adv_pods = d3s.select_samples(rewards, 4, "pods")  # the same rollouts, advantages recomputed on the 4
for p in range(P):
    if not no_spread[p]:
        print(
            f"prompt {p}: Var(A) of the kept 4 = {d3s.kept_variance(adv_intra[p], keep_intra[p]):.2f} (>= 1);"
            f" PODS's recomputed {d3s.kept_variance(adv_pods[p], keep_pods[p]):.2f}"
        )
pop = torch.tensor([-1.0, 1.0, 1.0])  # the best 3 of [0, 0, 1, 1] standardized with the population std: [-1, -1, 1, 1]
print(
    f"population variance, [0, 0, 1, 1], N = 3: {float(pop.var(unbiased=False)):.3f} < 1; the pair {{-1, 1}}: "
    f"{float(torch.tensor([-1.0, 1.0]).var(unbiased=False)):.0f}"
)

# %% [markdown]
# D3S chooses **across groups** ("cross", the rows `d1s-cross`, `d2s`, `d3s`). Notes on the paper quote "a further
# cross-group selection over the entire batch"; no source at hand says over which rollouts or with what budget. This
# project's reading
# **(choice)**: one pooled choice of N × P rollouts over the whole batch; the alternative one flag away is selection
# within groups, `d3s-i` (`--method d3s-i`, `select_samples(..., "intra")`). The pooled choice may take many rollouts
# from one group and none from another, and it drops the groups without spread first. Lemma 1 is about one group,
# though, and does not carry over: here is a batch where the pooled choice must keep zero advantages.

# %%
keep_cross, adv_cross = d3s.select_samples(rewards, 4, "cross")
print("kept per prompt, intra:", keep_intra.sum(-1).tolist())
print("kept per prompt, cross:", keep_cross.sum(-1).tolist())
print(
    f"pooled Var(A') intra {d3s.kept_variance(adv_intra, keep_intra):.2f}, cross {d3s.kept_variance(adv_cross, keep_cross):.2f}"
)
print(
    f"share of kept rollouts with A != 0 (SUR): GRPO {d3s.usefulness_rate(A, torch.ones_like(rewards, dtype=torch.bool)):.2f},"
    f" cross {d3s.usefulness_rate(adv_cross, keep_cross):.2f}"
)
small = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])  # group 2 has no spread; keep 3 per prompt, 6 of 8
k_small, a_small = d3s.select_samples(small, 3, "cross")
print(
    "counter-example: kept", k_small.int().tolist(), f"pooled Var(A') = {d3s.kept_variance(a_small, k_small):.2f} < 1"
)

# %% [markdown]
# ## 3. The second level: |A| × H on a real tiny transformer
#
# Now a real `transformers` Qwen2 (hidden 64, two layers, a byte-level tokenizer, built offline by
# [`support/tiny.py`](../support/tiny.py)), warm-started for a few hundred supervised steps on arithmetic (`\boxed{answer}`), so that
# some of its answers are right. The functions are those of [`train_small.py`](../train_small.py): one step up to the
# token level. (The warm start is cached in `runs/lesson/`: the second run skips it.)

# %%
from support import explain  # noqa: E402
import train_small  # noqa: E402  (the second rung)
from support import sampler  # noqa: E402
from support import warmstart, mathtask  # noqa: E402
from support.grading import Grader  # noqa: E402

small_args = train_small.parse_args(
    [
        "--task",
        "direct",
        "--hidden-size",
        "64",
        "--num-layers",
        "2",
        "--sft-steps",
        "250",
        "--sft-lr",
        "3e-3",
        "--sft-batch",
        "32",
        "--train-size",
        "2000",
        "--threads",
        "2",
        "--cache-dir",
        os.path.join(RUNS, "cache"),
        "--out",
        os.path.join(RUNS, "small"),
        "--group-size",
        "8",
        "--n-init",
        "4",
        "--n-final",
        "8",
    ]
)
train_rows, _ = mathtask.load_data(small_args)
model, tokenizer, info = warmstart.load_warm_start(small_args, train_rows)
problems = [r for r in train_rows if r["level"] == 1][:12]  # one-digit sums: a weak model gets some right
torch.manual_seed(1)
batch = sampler.sample(
    model, tokenizer, [mathtask.format_prompt(r["problem"], "plain") for r in problems], 8, small_args.max_new_tokens
)  # 12 prompts x 8 answers
with Grader(timeout_s=5.0) as grader:
    rewards_s = train_small.grade(batch, problems, grader)  # [12, 8]
print(problems[0]["problem"], "->", [batch["texts"][i] for i in range(4)])
print("right answers per prompt:", rewards_s.sum(-1).int().tolist(), "of 8")

# %% [markdown]
# Keep 4 of 8 answers per prompt across groups, forward only those, and score each of their tokens by |A| × H; keep the
# top K = 20% over the whole batch (printed below in brackets). The scope is a reading **(choice)**: no source at hand
# pins it down, and the design-card summary reads "for each selected sample, rank tokens ... keep top K%", that is
# per response; the alternative is one argument away, `d3s.select_tokens(..., scope="sequence")` (`--token-scope
# sequence`). Exercise 3 shows what the two scopes keep. The page `support/explain.py` draws shows the choice: the P × G grid
# of rollouts coloured by A (the kept ones dotted), then a few answers token by token, shaded by |A| × H, the kept
# tokens outlined.

# %%
keep_s, adv_s = d3s.select_samples(rewards_s, 4, "cross")
rows = keep_s.view(-1).nonzero().squeeze(-1)
kept_batch = sampler.take_rows(batch, rows)
with torch.no_grad():
    logp_s, H_s = sampler.logprobs_entropy(model, kept_batch)  # [B, T] each
scores = d3s.token_scores(adv_s.view(-1)[rows], H_s)  # |A| * H
token_keep = d3s.select_tokens(scores, kept_batch["response_mask"], 0.2)
metrics = {
    "k_real": float(token_keep.sum() / kept_batch["response_mask"].sum()),
    "loss": None,
    "grad_norm": None,
    "kept_tokens": int(token_keep.sum()),
}
sel = train_small.Selection(  # what train_small.py's step 3 and 5 record: the page reads it
    method_row="d3s",
    n_keep=4,
    k_frac=0.2,
    keep=keep_s,
    adv=adv_s,
    kept_rows=rows,
    kept=kept_batch,
    kept_adv=adv_s.view(-1)[rows],
    parts=[rows],
    token_keep=token_keep,
    scores=scores,
)
explain.small_page(1, tokenizer, problems, batch, rewards_s, sel, entropy=H_s, metrics=metrics, args=small_args)
for r in adv_s.view(-1)[rows].abs().argsort(descending=True)[:4].tolist():  # the kept answers with the largest |A|
    n = int(kept_batch["response_mask"][r].sum())
    pieces = [tokenizer.decode([t]) for t in kept_batch["response_ids"][r, :n].tolist()]
    print(
        f"A = {adv_s.view(-1)[rows[r]]:+.2f}:",
        " ".join(f"[{p}]" if k else p for p, k in zip(pieces, token_keep[r, :n].tolist())),
    )

# %%
display(Image(os.path.join(small_args.out, "explain", "step_000001.png")))

# %% [markdown]
# The kept tokens (in brackets) are where the model hesitated in the answers whose advantage is largest: here the
# few right answers, each alone in its group. This briefly warm-started model is still unsure of the format itself,
# so the characters of `\boxed{` are selected along with the digits: the token level trains wherever the policy
# hesitated, format or content, weighted by how much the answer's outcome says. That is D3S's second level; K is the
# share of tokens kept.
#
# ## 4. The schedule: aggressive early, mild late
#
# D3S keeps few rollouts and few tokens at the start and more as training goes on, linearly: N = 8 → 32 and
# K = 5% → 20% by the design-card summary (the abstract gives no number). **Why**, in the paper's abstract: "to prevent overfitting to high-signal data, D3S employs a dynamic
# down-sampling schedule inspired by curriculum learning. This schedule starts with aggressive down-sampling to
# accelerate early learning and gradually relaxes to promote robust generalization." Section 6 sets the toy's
# evidence beside that reason.
#
# Two readings here are the project's **(choice)**: N counts rollouts kept *per prompt*, so "8 of 32" assumes G = 32
# rollouts per prompt, which no source at hand states (it is inferred from N_final = 32; `--group-size` sets another
# G); and N rounds half up, a convention (no source at hand gives a rounding; exercise 4 holds you to it).
# Whether the shape matters is an open question of the design-card summary (its own inference): `methods.progress`
# gives other shapes (`--schedule`).

# %%
steps = range(0, 101)
fig, ax = plt.subplots(1, 2, figsize=(10, 3))
for kind in ("linear", "cosine", "step"):
    nk = [d3s.dynamic_schedule(s, 100, progress=methods.progress(kind, s, 100)) for s in steps]
    ax[0].plot(steps, [n for n, _ in nk], label=kind)
    ax[1].plot(steps, [k for _, k in nk], label=kind)
ax[0].set(title="N: rollouts kept per prompt", xlabel="step")
ax[1].set(title="K: share of tokens kept", xlabel="step")
ax[0].legend()
display(fig)
plt.close(fig)
print("linear at steps 0, 50, 100:", [d3s.dynamic_schedule(s, 100) for s in (0, 50, 100)])

# %% [markdown]
# ## 5. The loss: GRPO against GSPO, and why one update never clips
#
# Section 0 met the ratio, the clip and GSPO on their own; here they meet token selection. Per selected token,
# $\ell = -\min(w A, \text{clip}(w, 1-\epsilon_{low}, 1+\epsilon_{high}) A)$, with
# $w = \pi/\pi_{old}$ per token (GRPO) or, for GSPO, the geometric mean of a response's token ratios, taken over its
# *selected* tokens **(choice)**: over all its tokens is the alternative, with no flag. The loss divides by the number
# of selected tokens **(choice)**: the alternative divides by all tokens of the kept rollouts (`normalizer=`,
# `train_full.py --normalize-by all`), a gradient smaller by 1/K, 5x to 20x on the summary's schedule. The project's
# gradient-norm findings rest on this choice (docs/walkthrough.md, sections 4 and 5). With one update per batch the old
# policy *is* the current one: w = 1 exactly, nothing clips, the loss is −mean(A) over the selected tokens, and the
# gradient with respect to each selected log-prob is −A / (number of selected tokens). GSPO's gradient is then GRPO's
# under the same aggregation (the cell passes `agg="token-mean"`; GSPO's own default averages each response first).

# %%
torch.manual_seed(0)
logp = torch.log(torch.rand(3, 5) * 0.8 + 0.1).requires_grad_()  # [B=3, T=5] log-probs of the sampled tokens
adv = torch.tensor([1.5, -0.5, 0.8])  # one advantage per response
selected = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 0, 0], [1, 0, 0, 1, 1]], dtype=torch.float)
loss, stats = d3s.policy_loss(logp, logp.detach(), adv, selected, kind="grpo")
loss.backward()
expected = -adv.unsqueeze(-1) * selected / selected.sum()
print(
    f"loss {loss.item():+.4f} = -mean(A over selected) {-(adv.unsqueeze(-1) * selected).sum().item() / selected.sum().item():+.4f};"
    f" clip_frac {stats['clip_frac']}"
)
print("gradient == -A * selected / #selected:", torch.allclose(logp.grad, expected))
grpo_grad = logp.grad.clone()
logp.grad = None
d3s.policy_loss(logp, logp.detach(), adv, selected, kind="gspo", agg="token-mean")[0].backward()
print("GSPO's gradient on-policy == GRPO's:", torch.allclose(logp.grad, grpo_grad))

# %% [markdown]
# With several mini-batches per batch (the trainers' default is 4), the later ones see a policy the earlier ones
# already moved: w drifts from 1, the clip binds on some tokens, and GSPO (one ratio per response, tight ε) differs
# from GRPO.

# %%
moved = (logp.detach() + 0.3 * torch.randn(3, 5)).requires_grad_()  # the policy after an update
for kind in ("grpo", "gspo"):
    _, st = d3s.policy_loss(moved, logp.detach(), adv, selected, kind=kind)
    print(
        f"{kind}: ratio in [{st['ratio_min']:.2f}, {st['ratio_max']:.2f}], clipped share of tokens {st['clip_frac']:.2f}"
    )

# %% [markdown]
# ## 6. The experiment: GRPO against D3S on the toy, over seeds
#
# Both methods see the same rollouts per step; they differ in what they train on. One seed says little (RL is noisy),
# so we run several and compare each D3S run with the GRPO run of the same seed (same task, start and prompt order):
# the mean difference with a 95% t interval. **Change one knob** (`K_INIT` or `N_FINAL`) and run the cell again.

# %%
from stats import paired_interval  # noqa: E402  (experiments/stats.py, on scipy)
from toy_ladder import columns  # noqa: E402

SEEDS, K_INIT, N_FINAL = 10, 0.05, 32  # change one and run again
torch.set_num_threads(1)  # the toy's tensors are tiny: a second thread only adds overhead (as bandit.run_job)
flags = ["--workers", "1", "--k-init", str(K_INIT), "--n-final", str(N_FINAL), "--out", os.path.join(RUNS, "toy")]
toy_args = bandit.parse_args(flags)
t0 = time.time()
runs = {m: [columns(bandit.run(m, seed, toy_args)) for seed in range(SEEDS)] for m in ("grpo", "d3s")}
final = {m: [log["eval_reward"][-1] for log in logs] for m, logs in runs.items()}
d, lo, hi = paired_interval([a - b for a, b in zip(final["d3s"], final["grpo"])])
print(
    f"{2 * SEEDS} runs in {time.time() - t0:.0f} s. Final expected reward: GRPO {sum(final['grpo']) / SEEDS:.3f}, "
    f"D3S {sum(final['d3s']) / SEEDS:.3f}; D3S - GRPO {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (95%)"
)
tokens = {m: sum(sum(log["kept_tokens"]) for log in logs) / SEEDS for m, logs in runs.items()}
print(
    f"tokens in the loss per run: GRPO {tokens['grpo']:.0f}, D3S {tokens['d3s']:.0f} ({tokens['d3s'] / tokens['grpo']:.0%})"
)
fig = plt.figure(figsize=(6, 3.2))
for m, color in (("grpo", "C0"), ("d3s", "C3")):
    curve = torch.tensor([log["eval_reward"] for log in runs[m]])
    plt.plot(curve.mean(0), color=color, label=m)
    plt.fill_between(
        range(curve.shape[1]), curve.mean(0) - curve.std(0), curve.mean(0) + curve.std(0), color=color, alpha=0.15
    )
plt.xlabel("step")
plt.ylabel("expected reward (mean ± std over seeds)")
plt.legend()
display(fig)
plt.close(fig)

# %% [markdown]
# An interval that excludes 0 is a difference; one that contains 0 is **no difference detected** at that many seeds,
# with its point estimate, not "no difference". On the toy, D3S ends higher on a fraction of GRPO's tokens but gets
# there later: its small early budget (docs/toy.md has 30 seeds and the ablations). On the tiny transformer of section
# 3 no row of the ladder differs detectably from GRPO in final Pass@1 at 5 seeds (docs/small_compare.md).
#
# **What the token count saves, and what it does not.** "D3S 9%" above counts the tokens *in the loss*. Every method
# still generates all P × G rollouts (the rollouts are what the rewards and the advantages are computed on), and the
# kept rollouts are forwarded whole: the entropy that ranks the tokens needs every token's logits. What the sample
# level saves is the forward and backward of the rollouts it drops; what the token level saves is only the LM head and
# the loss at the dropped tokens (train_full.py's loss head runs the LM head at the selected tokens only), not the
# transformer's forward (docs/algorithm.md, section 6; docs/small_compare.md, section 7: on the tiny rung most of the
# saved time is the sample level's).
#
# **The schedule's reason, beside the toy.** The abstract says the aggressive start is there "to accelerate early
# learning". On the toy it does the opposite: D3S reaches reward 0.5 about 15 steps after GRPO (docs/toy.md, section 1,
# 30 seeds), and the cause is the small early token budget (section 2 there). A larger start is faster over the run;
# in final reward the larger starts end mostly lower than the default (−0.006 to −0.056), with no difference detected
# at 10 seeds (docs/questions.md, question 1), and at 30 seeds, against the same GRPO runs, the default ends +0.081 and
# the final-budget start +0.047 (docs/toy.md, section 2). So on the toy the aggressive start costs speed, and what it
# buys in final reward, if anything, is too small to detect here. The relaxing does matter: held at its initial
# values, D3S ends far lower (question 2). What the toy cannot show is the reason's other half, overfitting: it scores
# the expected reward on the very prompts it trains on, so it has no held-out data to generalize to. (The tiny rung
# has held-out problems; there the static `d2s` and the scheduled `d3s` show no detected difference in their
# train/held-out gap: question 4.) Try `K_INIT = 0.2` above: the final K from step 1.
#
# What notes on the paper quote for its own ladder on Qwen2.5-Math-7B (average Pass@1 / Pass@8; the notes are not
# among the sources at hand, so not checked against any text of the paper: docs/algorithm.md, section 7): GRPO
# 29.8/53.1, D1S 31.3/54.2, D1S-Cross 34.1/54.7, D2S 31.3/54.1, D3S 34.3/56.8. The D3S row's seven Pass@1 cells average
# 34.8, not 34.3, and nothing at hand says which is right (the design card's "+4.5 in Pass@1" may be read off 34.3).
# As quoted, pooled selection alone (D1S-Cross) gets about as far as the whole method in Pass@1, not in Pass@8 (54.7
# against 56.8); adding the token level without the schedule (D2S) drops back.
#
# ## 7. Stability: cross-group (`d3s`) against intra-group (`d3s-i`)
#
# Both summaries credit D3S-I with stability on models that are not aligned: the key-findings summary ("robustness
# and stability, especially for unaligned models"), and the design card, which reports, citing an "Appendix D.1" of the
# paper, cross-group selection unstable on Llama3.1-8B-Instruct ("unstable gradients") while D3S-I, the same method selecting
# within groups, stayed stable. No text of the paper at hand has it. A plausible mechanism, ours and no source's: the
# pooled choice can put the whole budget on a few groups, so a few prompts steer a step; section 2's counterexample
# (pooled Var(A′) = 0.60) is the same freedom seen from the variance side. The first cell shows it on one batch.
#
# Then both methods run on a *less aligned* toy start: the base policy's habit at the decision positions points away
# from the right token (`--hint -1`, where the default is +1). A caveat before the numbers: on the toy this start
# mostly removes spread (most groups fail whole, so A = 0) rather than imitating a misaligned 8B model. We look at the
# gradient norm (before clipping), since the report is of unstable gradients; at a spike measure of this project's
# own, its largest jump over the median of the 10 steps before (`methods.spike_ratios`; over 3 is a spike, the rule of
# `--switch-on-spike 3`); at the KL to the start, which the design card suggests checking; and at the final reward.

# %%
HINT = -1.0  # the base policy's logit bonus for the right token at decisions (default +1)
mech_args = bandit.parse_args(["--workers", "1", "--hint", str(HINT), "--out", os.path.join(RUNS, "toy")])
mech_task = bandit.make_task(mech_args, seed=0)
torch.manual_seed(0)
mech_gen = torch.Generator().manual_seed(0)
Pm, Gm = mech_args.batch_prompts, mech_args.group_size
mech_ids = torch.randperm(mech_args.prompts, generator=mech_gen)[:Pm].repeat_interleave(Gm)
mech_tokens, _ = bandit.Policy(mech_task["prior"], mech_args.hidden).sample(mech_ids, mech_args.length, mech_gen)
mech_rewards = bandit.reward(mech_task, mech_ids, mech_tokens).view(Pm, Gm)
print(f"step 0 from --hint {HINT:+.0f}: right answers per prompt {mech_rewards.sum(-1).int().tolist()} of {Gm}")
for rule in ("cross", "intra"):
    k_m, a_m = d3s.select_samples(mech_rewards, mech_args.n_init, rule)  # N = n_init of G per prompt, N * P in all
    print(f"{rule:>5}: kept per prompt {k_m.sum(-1).tolist()}, SUR {d3s.usefulness_rate(a_m, k_m):.2f}")

# %%
STAB_SEEDS = 6  # seeds per method
stab_args = bandit.parse_args(["--workers", "1", "--hint", str(HINT), "--out", os.path.join(RUNS, "toy")])
t0 = time.time()
stab = {m: [columns(bandit.run(m, seed, stab_args)) for seed in range(STAB_SEEDS)] for m in ("d3s", "d3s-i")}
for m, logs in stab.items():
    peaks = [max(r for r in methods.spike_ratios(log["grad_norm"]) if r is not None) for log in logs]
    print(
        f"{m:>5}: final reward {sum(log['eval_reward'][-1] for log in logs) / STAB_SEEDS:.3f}, "
        f"largest grad norm / running median {sum(peaks) / STAB_SEEDS:.2f} (max {max(peaks):.2f}), "
        f"spikes > 3x per run {sum(sum(r is not None and r > 3 for r in methods.spike_ratios(log['grad_norm'])) for log in logs) / STAB_SEEDS:.1f}, "
        f"KL to the start at the end {sum(log['kl_ref'][-1] for log in logs) / STAB_SEEDS:.2f}, "
        f"SUR {sum(sum(log['sur']) / len(log['sur']) for log in logs) / STAB_SEEDS:.2f}"
    )
d, lo, hi = paired_interval([a["eval_reward"][-1] - b["eval_reward"][-1] for a, b in zip(stab["d3s"], stab["d3s-i"])])
print(
    f"final reward d3s - d3s-i: {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (95%, {STAB_SEEDS} seeds); {2 * STAB_SEEDS} runs in {time.time() - t0:.0f} s"
)
fig = plt.figure(figsize=(6, 3.2))
for m, color in (("d3s", "C3"), ("d3s-i", "C2")):
    for i, log in enumerate(stab[m]):
        plt.plot(
            log["step"],
            [g if g is not None else float("nan") for g in log["grad_norm"]],
            color=color,
            alpha=0.5,
            lw=0.8,
            label=m if i == 0 else None,
        )
plt.xlabel("step")
plt.ylabel("gradient norm before clipping")
plt.yscale("log")
plt.legend()
display(fig)
plt.close(fig)

# %% [markdown]
# What the run above shows (2026-11-27), at its strength. No row has a step whose gradient norm jumps 3× over its
# running median, and both drift about as far from the start (KL). In final reward `d3s` ends below `d3s-i`, the way
# the report would predict, but at 6 seeds the interval contains 0: a difference not detected, not an absence (the
# printed interval gives its size). That is weak evidence either way: 6 seeds, a toy whose "unaligned" start mostly
# removes spread (SUR above), and no mechanism for the 8B model's "unstable gradients" that a 64-unit policy could
# show. The pooled choice does spend its budget differently (first cell: it leaves the groups without spread and
# piles onto the few with it). The tiny transformer from weak starts detects no difference either (docs/questions.md,
# question 5: spikes, KL and Pass@1 over 15 pairs of runs). The instability was reported on an 8B model from an
# unaligned start, with settings no source at hand gives; neither rung reproduces it, and this lesson claims neither
# that it does nor that the instability does not exist. From an unaligned model, that report points to `d3s-i` (or
# `--switch-on-spike 3`, which moves a run to intra-group selection after its first spike; off by default).
#
# ## 8. Exercises
#
# Each exercise has a function to write and a cell that checks it against `d3s.py`; exercises 5 and 6 are the two
# pieces that are D3S's own (the pooled choice across groups, the |A| × H top K over a batch). The functions below call the
# answers (`lesson/answers.py`) so that the notebook runs as it is: **delete the `return answers...` line and write
# your own**, then run the check.

# %%
import answers  # noqa: E402
import checks  # noqa: E402


def my_group_advantages(rewards):
    """Exercise 1. rewards [P, G] -> A [P, G]: (R - mean) / (std + 1e-6) per row, with the unbiased std (torch.std);
    a row whose rewards are all equal must get A = 0, not NaN."""
    return answers.group_advantages(rewards)  # delete this line and write your own


checks.check_group_advantages(my_group_advantages)


# %%
def my_max_variance_subset(values, m):
    """Exercise 2. values: a list of n floats -> a list of m indices whose values have the largest unbiased variance.
    Any correct method passes (trying every subset is fine for small n); the fast one sorts once."""
    return answers.max_variance_subset(values, m)  # delete this line and write your own


checks.check_max_variance_subset(my_max_variance_subset)


# %%
def my_entropy_scores(adv, entropy):
    """Exercise 3. adv [B], entropy [B, T] -> scores [B, T] that rank tokens by entropy alone (the "80/20" rule of
    Wang et al. 2025), ignoring A. Then compare below what it keeps on the toy batch with D3S's |A| * H."""
    return answers.entropy_scores(adv, entropy)  # delete this line and write your own


checks.check_entropy_scores(my_entropy_scores)
kept_rows = keep_cross.view(-1).nonzero().squeeze(-1)
H_kept, A_kept = H[kept_rows], adv_cross.view(-1)[kept_rows]
ones = torch.ones_like(H_kept)
for scope in ("batch", "sequence"):
    for name, s in (
        ("entropy alone", my_entropy_scores(A_kept, H_kept)),
        ("|A| * H", d3s.token_scores(A_kept, H_kept)),
    ):
        chosen = d3s.select_tokens(s, ones, 0.05, scope=scope)
        print(
            f"scope={scope!r:>10}, {name:>13}: {int(chosen.sum())} tokens from {int(chosen.any(-1).sum())} of "
            f"{len(kept_rows)} responses, mean |A| {float(A_kept.abs().unsqueeze(-1).expand_as(chosen)[chosen].mean()):.2f}, "
            f"share of decision positions {float(decisions[kept_rows][chosen].float().mean()):.2f}"
        )
print(
    f"|A| of the kept responses: {float(A_kept.abs().min()):.2f} to {float(A_kept.abs().max()):.2f}; entropy at decisions "
    f"/ at filler: {float(H_kept[decisions[kept_rows]].mean() / H_kept[~decisions[kept_rows]].mean()):.1f}"
)

# %% [markdown]
# Read this before concluding that the paper's rule is worse at finding decisions. With outcome rewards every token of a
# response has the same A, and across the kept responses |A| spans a factor of about 8 (up to about 3.7 here), where a
# decision position's entropy is only about twice a filler's. So over the whole batch (`scope="batch"`, this project's
# choice) |A| × H is mostly a filter over *responses*: its tokens come from the few responses with the largest |A| (the
# rare successes and failures), and it takes some of their filler too. Entropy alone ignores A and takes the
# decisions of any response, including those with a small |A|. Under `scope="sequence"` (the per-response reading) a
# constant |A| cannot reorder a response's tokens, so |A| × H keeps exactly what entropy alone keeps, one token per
# response here: |A| then only matters through the loss's weights. Which reading is the paper's is open; the first
# is the default here, the second one flag away (`--token-scope sequence`).


# %%
def my_linear_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20):
    """Exercise 4. (N, K) at `step` of `total_steps`: linear from the init to the final values, N rounded half up
    (not Python's round, which rounds half to even: the project's convention, a choice; no source at hand gives the
    paper's rounding), and
    the final values after the end."""
    return answers.linear_schedule(step, total_steps, n_init, n_final, k_init, k_final)  # delete this line


checks.check_linear_schedule(my_linear_schedule)


# %%
def my_cross_group_selection(rewards, n):
    """Exercise 5, D3S's own first level. rewards [P, G] -> (keep [P, G] bool, adv [P, G]): the N * P rollouts of the
    whole batch, pooled across groups, whose advantages (exercise 1, on each full group) have the largest unbiased
    variance (exercise 2's rule on the pooled values); adv is those full-group advantages where kept, 0 elsewhere.
    Not per group, and not re-standardized on the kept rollouts (that is PODS)."""
    return answers.cross_group_selection(rewards, n)  # delete this line and write your own


checks.check_cross_group_selection(my_cross_group_selection)
k5, a5 = my_cross_group_selection(rewards, 4)
print("on section 1's batch, kept per prompt:", k5.sum(-1).tolist(), f"pooled Var(A') {d3s.kept_variance(a5, k5):.2f}")


# %%
def my_token_topk(adv, entropy, mask, k):
    """Exercise 6, D3S's own second level. adv [B] (one A per response), entropy [B, T], mask [B, T] (True on real
    tokens; the rest is padding) -> keep [B, T] bool: score each token by |A| * H, and keep the ceil(k * number of
    real tokens) best over the whole batch (this project's scope), never a padded position."""
    return answers.token_topk(adv, entropy, mask, k)  # delete this line and write your own


checks.check_token_topk(my_token_topk)
print(f"the whole lesson ran in {time.time() - started:.0f} s")

# %% [markdown]
# ## 9. What is settled and what is open
#
# One line each, with its source or the run that shows it.
#
# **What the paper itself says** (its abstract, the only words of the paper at hand; no number):
# - Max-Var(A) selection "is positively correlated with the upper bound of the policy gradient norms" (the abstract).
# - The schedule: aggressive "to accelerate early learning", relaxed "to promote robust generalization" (the abstract).
#
# **What the summaries and the notes credit to it** (not the paper's text; PODS's line is PODS's abstract):
# - Max-variance down-sampling "admits an O(n log n) solution" (PODS's abstract); section 2 checks it by brute force.
# - Lemma 1: some subset of a standardized group has Var(A′) ≥ 1 (the design card); true under either variance.
# - N 8 → 32 and K 5% → 20% (the design card); N per prompt of G = 32 is this project's reading.
# - +4.5 Pass@1 and +3.7 Pass@8 over GRPO on Qwen2.5-Math-7B, on under 20% of the tokens (the design card); as a
#   claim, not settled: it rests on a Table 1 average that is 34.3 as stated or 34.8 from its cells (open, below).
# - D3S-I stable and cross-group D3S unstable on Llama3.1-8B-Instruct (the design card; the key-findings summary too).
# - The ladder's names and averages, the Sample Usefulness Rate, the 2.04x speed-up (the notes, not at hand).
#
# **What this project's runs show** (a toy and a 0.63M-parameter model; at their strength):
# - Lemma 1's every-N form needs the unbiased variance and fails for the pooled choice (section 2; tests/test_d3s.py).
# - On the toy D3S ends higher than GRPO, on 9% of its loss tokens, and is slower (docs/toy.md, section 1, 30 seeds).
# - On the toy the slowness is the aggressive start; larger starts end mostly lower in final reward, a difference not
#   detected at 10 seeds (docs/toy.md, section 2; docs/questions.md, question 1).
# - On both rungs relaxing the budget matters. Between the same two ends, no shape was detected to change the toy's
#   final reward, but the step shape is slower over the run and the adaptive rule ends 0.307 lower (question 2).
# - |A| × H needs the batch-wide top K on the toy; on the tiny rung entropy alone does as well (question 3).
# - On the tiny transformer no row of the ladder differs detectably from GRPO in final Pass@1 at 5 seeds
#   (docs/small_compare.md, section 7).
# - D3S's larger gradient norm is mostly its loss normalizer, a choice (docs/walkthrough.md, section 5; docs/toy.md).
# - With 0/1 rewards, max-Var(A) added nothing detected over dropping the groups without spread, with D3S's token
#   level (both rungs); without it, on the tiny rung the filter ended +0.026 [+0.001, +0.051] above the pooled
#   choice, a marginal difference (docs/questions.md, question 7). Graded rewards could part the two rules.
# - Section 7's stability runs: no spike and no detected difference at 6 seeds, on a toy start that mostly removes
#   spread; too weak to say the instability is absent.
#
# **What nobody has shown** (that this project knows of):
# - The 7B speed-up (2.04x over GRPO, as the notes quote it): no reproduction at hand, and no run here at 7B.
# - The stability finding: neither the toy (section 7) nor the tiny rung from three starts reproduces it (question 5).
# - The theory beyond its "simplified single-token, deterministic-reward settings" (the design card).
# - That the schedule prevents overfitting: the toy has no held-out data; the tiny rung shows none to tell (question 4).
# - The GRPO + D3S average Pass@1 of the notes' Table 1: 34.3 as stated or 34.8 from its cells (docs/algorithm.md, 7).
#
# **Open readings, which decide whether this D3S matches the paper** (each a **(choice)** or **[inferred]**, with its
# alternative: docs/algorithm.md, section 8): which rollouts the cross-group step chooses among, and with what budget
# (here all P × G, budget N × P); the token top K's scope (here the whole batch); N counted per prompt, with G = 32;
# the loss's normalizer (here the selected tokens); the span of GSPO's ratio (here the selected tokens); and the KL's
# scope when β > 0 (here the selected tokens; every run here has β = 0).
