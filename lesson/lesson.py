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
# It runs top to bottom on a laptop CPU in about a minute (under 5), with no download. Sections:
# 1. where GRPO's signal goes, 2. the first level, 3. the second level (a real tiny transformer), 4. the schedule,
# 5. the loss, 6. the experiment (GRPO against D3S over seeds), 7. exercises with checkers.
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
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "math-verify", "scipy", "transformers>=5.16.1,<5.20"],
                   check=True)
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
import variants  # noqa: E402

torch.set_num_threads(2)
started = time.time()
print("the project is importable:", ", ".join(m.__name__ + ".py" for m in (d3s, variants, bandit)))

# %% [markdown]
# ## 1. Where GRPO's signal goes
#
# The toy task of [`toy/bandit.py`](../toy/bandit.py): each prompt asks for 8 tokens. One to three of the positions
# are *decisions* (the 0/1 reward checks them); the others are *filler* the reward ignores, where the base policy has
# a habit (low entropy), as most tokens an LLM writes. We sample one batch as GRPO would: P = 8 prompts × G = 16
# rollouts, then compute GRPO's advantages, $A_i = (R_i - \text{mean}_g R) / (\text{std}_g R + \epsilon)$ per group.

# %%
args = bandit.parse_args(["--group-size", "16", "--n-init", "4", "--n-final", "16", "--workers", "1",
                          "--out", os.path.join(RUNS, "toy")])
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
no_spread = (rewards.amax(-1) == rewards.amin(-1))
print(f"groups with no spread (A = 0 for all {G}): {int(no_spread.sum())} of {P}")
print(f"rollouts GRPO trains on with A = 0: {float((A == 0).float().mean()):.0%}")

# %% [markdown]
# A group whose answers all fail (or all succeed) has A = 0 everywhere: GRPO spends its forward and backward on it and
# gets no gradient. Inside a response, every token carries the same A (the reward is for the whole answer), so the
# only thing that distinguishes tokens is how uncertain the policy was there: its entropy $H$.

# %%
H = d3s.token_entropy(logits)  # [P*G, L]
decisions = task["decisions"][prompt_ids]  # [P*G, L]: which positions the reward reads
print(f"mean entropy at decision positions {float(H[decisions].mean()):.2f}, at filler {float(H[~decisions].mean()):.2f}")
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
# PODS (Xu et al., 2025) keeps, per group, the N rollouts whose advantages have the largest variance. The best such
# subset is always "the k largest and the N − k smallest" for some k, so `d3s.max_variance_subset` sorts once and
# scores N + 1 candidates. Here it is on one group with continuous rewards, checked against trying every subset.

# %%
import itertools  # noqa: E402

values = torch.tensor([0.10, 0.90, 0.50, 0.70, 0.30, 0.85, 0.20, 0.55])
m = 4
kept = d3s.max_variance_subset(values, m)
best = max(itertools.combinations(range(len(values)), m), key=lambda c: values[list(c)].double().var().item())
print("max_variance_subset:", kept.tolist(), f"Var = {values[kept].double().var():.4f}")
print("brute force:        ", list(best), f"Var = {values[list(best)].double().var():.4f}")
fig = plt.figure(figsize=(6, 1.4))
plt.scatter(values, [0] * len(values), c=["C3" if i in kept.tolist() else "lightgrey" for i in range(len(values))], s=80)
plt.yticks([])
plt.title("kept (red): the extremes")
display(fig)
plt.close(fig)

# %% [markdown]
# **Lemma 1** of D3S: with the full group's advantages (mean 0, unbiased variance 1), any N-subset chosen for maximum
# variance has Var(A′) ≥ 1, so the kept rollouts carry at least the gradient signal per rollout of the whole group.
# Selection *within* each group ("intra", the rows `d1s` and `d3s-i`) keeps it per group:

# %%
keep_intra, adv_intra = d3s.select_samples(rewards, 4, "intra")  # N = 4 of G = 16 per prompt
for p in range(P):
    if not no_spread[p]:
        print(f"prompt {p}: Var(A) of the kept 4 = {d3s.kept_variance(adv_intra[p], keep_intra[p]):.2f} (>= 1)")

# %% [markdown]
# D3S chooses **across groups** ("cross", the rows `d1s-cross`, `d2s`, `d3s`): one pooled choice of N × P rollouts
# over the whole batch. It may take many rollouts from one group and none from another, and it drops the groups
# without spread first. Lemma 1 is about one group, though, and does not carry over: here is a batch where the pooled
# choice must keep zero advantages.

# %%
keep_cross, adv_cross = d3s.select_samples(rewards, 4, "cross")
print("kept per prompt, intra:", keep_intra.sum(-1).tolist())
print("kept per prompt, cross:", keep_cross.sum(-1).tolist())
print(f"pooled Var(A') intra {d3s.kept_variance(adv_intra, keep_intra):.2f}, cross {d3s.kept_variance(adv_cross, keep_cross):.2f}")
print(f"share of kept rollouts with A != 0 (SUR): GRPO {d3s.usefulness_rate(A, torch.ones_like(rewards, dtype=torch.bool)):.2f},"
      f" cross {d3s.usefulness_rate(adv_cross, keep_cross):.2f}")
small = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])  # group 2 has no spread; keep 3 per prompt, 6 of 8
k_small, a_small = d3s.select_samples(small, 3, "cross")
print("counter-example: kept", k_small.int().tolist(), f"pooled Var(A') = {d3s.kept_variance(a_small, k_small):.2f} < 1")

# %% [markdown]
# ## 3. The second level: |A| × H on a real tiny transformer
#
# Now a real `transformers` Qwen2 (hidden 64, two layers, a byte-level tokenizer, built offline by
# [`tiny.py`](../tiny.py)), warm-started for a few hundred supervised steps on arithmetic (`\boxed{answer}`), so that
# some of its answers are right. The functions are those of [`train_small.py`](../train_small.py): one step up to the
# token level. (The warm start is cached in `runs/lesson/`: the second run skips it.)

# %%
import explain  # noqa: E402
import train_small  # noqa: E402  (the second rung)
import warmstart  # noqa: E402
from mathtask import Grader  # noqa: E402

small_args = train_small.parse_args(["--task", "direct", "--hidden-size", "64", "--num-layers", "2", "--sft-steps", "250",
                                     "--sft-lr", "3e-3", "--sft-batch", "32", "--train-size", "2000", "--threads", "2",
                                     "--cache-dir", os.path.join(RUNS, "cache"), "--out", os.path.join(RUNS, "small"),
                                     "--group-size", "8", "--n-init", "4", "--n-final", "8"])
train_rows, _ = warmstart.load_data(small_args)
model, tokenizer, info = warmstart.load_warm_start(small_args, train_rows)
problems = [r for r in train_rows if r["level"] == 1][:12]  # one-digit sums: a weak model gets some right
torch.manual_seed(1)
batch = train_small.rollout(model, tokenizer, [warmstart.format_prompt(r["problem"], "plain") for r in problems], 8,
                           small_args.max_new_tokens)  # 12 prompts x 8 answers
with Grader(timeout_s=5.0) as grader:
    rewards_s = train_small.compute_rewards(grader, batch["texts"], [r["answer"] for r in problems for _ in range(8)]).view(12, 8)
print(problems[0]["problem"], "->", [batch["texts"][i] for i in range(4)])
print("right answers per prompt:", rewards_s.sum(-1).int().tolist(), "of 8")

# %% [markdown]
# Keep 4 of 8 answers per prompt across groups, forward only those, and score each of their tokens by |A| × H; keep the
# top K = 20% over the whole batch (printed below in brackets). The page `explain.py` draws shows the choice: the P × G grid of rollouts coloured
# by A (the kept ones dotted), then a few answers token by token, shaded by |A| × H, the kept tokens outlined.

# %%
keep_s, adv_s = d3s.select_samples(rewards_s, 4, "cross")
rows = keep_s.view(-1).nonzero().squeeze(-1)
kept_batch = train_small.take_rows(batch, rows)
with torch.no_grad():
    logp_s, H_s = train_small.forward_logprobs_entropy(model, kept_batch)  # [B, T] each
scores = d3s.token_scores(adv_s.view(-1)[rows], H_s)  # |A| * H
token_keep = d3s.select_tokens(scores, kept_batch["response_mask"], 0.2)
metrics = {"k_real": float(token_keep.sum() / kept_batch["response_mask"].sum()), "loss": None, "grad_norm": None,
           "kept_tokens": int(token_keep.sum())}
explain.small_page(os.path.join(RUNS, "explain"), 1, tokenizer, problems, batch, rewards_s, keep_s, adv_s, rows, 4, 0.2, H_s,
                   scores, token_keep, metrics, small_args)
for r in adv_s.view(-1)[rows].abs().argsort(descending=True)[:4].tolist():  # the kept answers with the largest |A|
    n = int(kept_batch["response_mask"][r].sum())
    pieces = [tokenizer.decode([t]) for t in kept_batch["response_ids"][r, :n].tolist()]
    print(f"A = {adv_s.view(-1)[rows[r]]:+.2f}:", " ".join(f"[{p}]" if k else p for p, k in zip(pieces, token_keep[r, :n].tolist())))

# %%
display(Image(os.path.join(RUNS, "explain", "step_000001.png")))

# %% [markdown]
# The kept tokens (in brackets) are where the model hesitated in the answers whose advantage is largest: here the
# few right answers, each alone in its group. This briefly warm-started model is still unsure of the format itself,
# so the characters of `\boxed{` are selected along with the digits: the token level trains wherever the policy
# hesitated, format or content, weighted by how much the answer's outcome says. That is D3S's second level; K is the
# share of tokens kept.
#
# ## 4. The schedule: aggressive early, mild late
#
# D3S keeps few rollouts and few tokens at the start (N = 8 of 32, K = 5%) and more as training goes on (N = 32,
# K = 20%), linearly. The paper's open question is whether the shape matters: `variants.progress` gives others.

# %%
steps = range(0, 101)
fig, ax = plt.subplots(1, 2, figsize=(10, 3))
for kind in ("linear", "cosine", "step"):
    nk = [d3s.dynamic_schedule(s, 100, progress=variants.progress(kind, s, 100)) for s in steps]
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
# Per selected token, $\ell = -\min(w A, \text{clip}(w, 1-\epsilon_{low}, 1+\epsilon_{high}) A)$, with
# $w = \pi/\pi_{old}$ per token (GRPO) or the geometric mean of the token ratios per response (GSPO). With one update
# per batch the old policy *is* the current one: w = 1 exactly, nothing clips, the loss is −mean(A) over the selected
# tokens, and the gradient with respect to each selected log-prob is −A / (number of selected tokens).

# %%
torch.manual_seed(0)
logp = torch.log(torch.rand(3, 5) * 0.8 + 0.1).requires_grad_()  # [B=3, T=5] log-probs of the sampled tokens
adv = torch.tensor([1.5, -0.5, 0.8])  # one advantage per response
selected = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 0, 0], [1, 0, 0, 1, 1]], dtype=torch.float)
loss, stats = d3s.policy_loss(logp, logp.detach(), adv, selected, kind="grpo")
loss.backward()
expected = -adv.unsqueeze(-1) * selected / selected.sum()
print(f"loss {loss.item():+.4f} = -mean(A over selected) {-(adv.unsqueeze(-1) * selected).sum().item() / selected.sum().item():+.4f};"
      f" clip_frac {stats['clip_frac']}")
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
    print(f"{kind}: ratio in [{st['ratio_min']:.2f}, {st['ratio_max']:.2f}], clipped share of tokens {st['clip_frac']:.2f}")

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
flags = ["--workers", "1", "--k-init", str(K_INIT), "--n-final", str(N_FINAL), "--out", os.path.join(RUNS, "toy")]
toy_args = bandit.parse_args(flags)
t0 = time.time()
runs = {m: [columns(bandit.run(m, seed, toy_args)) for seed in range(SEEDS)] for m in ("grpo", "d3s")}
final = {m: [log["eval_reward"][-1] for log in logs] for m, logs in runs.items()}
d, lo, hi = paired_interval([a - b for a, b in zip(final["d3s"], final["grpo"])])
print(f"{2 * SEEDS} runs in {time.time() - t0:.0f} s. Final expected reward: GRPO {sum(final['grpo']) / SEEDS:.3f}, "
      f"D3S {sum(final['d3s']) / SEEDS:.3f}; D3S - GRPO {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (95%)")
tokens = {m: sum(sum(log["kept_tokens"]) for log in logs) / SEEDS for m, logs in runs.items()}
print(f"tokens in the loss per run: GRPO {tokens['grpo']:.0f}, D3S {tokens['d3s']:.0f} ({tokens['d3s'] / tokens['grpo']:.0%})")
fig = plt.figure(figsize=(6, 3.2))
for m, color in (("grpo", "C0"), ("d3s", "C3")):
    curve = torch.tensor([log["eval_reward"] for log in runs[m]])
    plt.plot(curve.mean(0), color=color, label=m)
    plt.fill_between(range(curve.shape[1]), curve.mean(0) - curve.std(0), curve.mean(0) + curve.std(0), color=color, alpha=0.15)
plt.xlabel("step")
plt.ylabel("expected reward (mean ± std over seeds)")
plt.legend()
display(fig)
plt.close(fig)

# %% [markdown]
# An interval that excludes 0 is a difference; one that contains 0 is none, whatever the means say. On the toy, D3S
# ends higher on a fraction of GRPO's tokens but gets there later: its small early budget (docs/toy.md has 30 seeds and
# the ablations). On the tiny transformer of section 3 no row of the paper's ladder differs from GRPO
# (docs/small_compare.md).
#
# ## 7. Exercises
#
# Each exercise has a function to write and a cell that checks it against `d3s.py`. The functions below call the
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
for name, s in (("entropy alone", my_entropy_scores(A_kept, H_kept)), ("|A| * H", d3s.token_scores(A_kept, H_kept))):
    chosen = d3s.select_tokens(s, ones, 0.05)
    print(f"{name:>13}: share of decision positions among the kept tokens {float(decisions[kept_rows][chosen].float().mean()):.2f}")


# %%
def my_linear_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20):
    """Exercise 4. (N, K) at `step` of `total_steps`: linear from the init to the final values, N rounded half up
    (not Python's round, which rounds half to even), and the final values after the end."""
    return answers.linear_schedule(step, total_steps, n_init, n_final, k_init, k_final)  # delete this line


checks.check_linear_schedule(my_linear_schedule)
print(f"the whole lesson ran in {time.time() - started:.0f} s")
