"""toy/bandit.py: a sequence bandit in which both levels of D3S matter, in well under a minute on a CPU.

The task. Each of `--prompts` prompts asks for an answer of L tokens from a vocabulary of V.
Positions are of two kinds, as in an LLM's response:
  - decision positions (1, 2 or 3 per prompt: its difficulty): the reward is 1 if every one
    of them holds the prompt's right token, else 0 (a 0/1 verifiable reward). The base policy
    is close to uniform there (high entropy), with a small --hint toward the right token;
  - filler positions (the other L - d): the reward ignores them. The base policy has a habit
    there (--filler-logit on one token: low entropy, like most tokens an LLM writes).
At step 0 a rollout is right with probability ~28% (d = 1) down to ~2% (d = 3), so groups of
G = 32 have mixed success; and the tokens of one answer differ in entropy and in whether
they matter, so token selection has something to choose.

The policy is a tiny autoregressive model, logits_t = prior[p, t] + MLP(e_prompt + e_pos + e_prev),
its last layer zero-initialised so that step 0 is exactly the "base model" prior.

One training step (ALGORITHM.md section 6), every piece of the method taken from d3s.py:
  sample P prompts x G rollouts -> reward -> d3s.select_samples (N per prompt, from
  d3s.method_budget) -> forward the kept rollouts -> d3s.token_entropy -> scores |A| * H
  -> d3s.select_tokens (top K) -> d3s.policy_loss (on-policy, one update) -> Adam.
Every method generates the same P x G rollouts per step; they differ only in what they train on.
The methods are the rows of d3s.LADDER: the paper's ablation ladder grpo -> d1s -> d1s-cross ->
d2s -> d3s, plus d3s-i, pods and a random control.

Reported per method, mean ± std over seeds: steps until the exact expected reward over all
prompts, mean_p E[R | p], first reaches each --target (seeds that never do are counted, not
averaged); that reward and the prompts with E[R | p] >= 0.5 after the last step; the mean
gradient norm (before clipping); the Sample Usefulness Rate; the rollouts and tokens trained
on in the whole run. Per step, metrics.jsonl also has the scheduled and realised K, the
entropy of the trained rollouts' tokens and of the selected ones, and the KL (k3) to the
initial policy on the selected tokens (measured, not in the loss).
Left out on purpose: a KL penalty, batch reuse (ratios and clipping never bind on-policy), GSPO.

    python toy/bandit.py                     # 8 methods x 10 seeds: table, runs/toy/toy.png
    python toy/bandit.py --seeds 3 --methods grpo d3s --filler-logit 0
    python toy/bandit.py --seeds 1 --methods d3s d3s-i --explain-every 20   # + pages: runs/toy/explain/
"""

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

import d3s  # noqa: E402
import explain  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--methods", nargs="+", default=list(d3s.METHODS), choices=list(d3s.METHODS),
      help="methods to compare (rows of d3s.LADDER: the paper's ablation ladder, pods and a random control)")
    a("--seeds", type=int, default=10, help="seeds per method (seed s: same task, init and prompt order for all methods)")
    a("--steps", type=int, default=80, help="training steps per run")
    a("--prompts", type=int, default=16, help="prompts in the task")
    a("--batch-prompts", type=int, default=8, help="P: prompts per step")
    a("--group-size", type=int, default=32, help="G: rollouts per prompt (the paper's N schedule ends at 32)")
    a("--length", type=int, default=8, help="L: tokens per answer")
    a("--vocab", type=int, default=8, help="V: vocabulary size")
    a("--max-decisions", type=int, default=3, help="prompt p has 1 + p %% max-decisions decision positions")
    a("--hint", type=float, default=1.0, help="base-policy logit bonus of the right token at decision positions")
    a("--filler-logit", type=float, default=3.0, help="base-policy logit bonus of a habitual token at filler positions "
      "(high: filler has low entropy, as most LLM tokens; 0: filler is as uncertain as the decisions)")
    a("--hidden", type=int, default=64, help="policy MLP width")
    a("--lr", type=float, default=1e-2, help="Adam learning rate")
    a("--max-grad-norm", type=float, default=1.0, help="gradient clipping (the norm is logged before clipping)")
    a("--n-init", type=int, default=8, help="D3S schedule: rollouts kept per prompt at step 0")
    a("--n-final", type=int, default=32, help="D3S schedule: rollouts kept per prompt at the last step")
    a("--k-init", type=float, default=0.05, help="D3S schedule: fraction of tokens kept at step 0")
    a("--k-final", type=float, default=0.20, help="D3S schedule: fraction of tokens kept at the last step")
    a("--static-n", type=int, default=None, help="N of the static rows d1s, d1s-cross, d2s, pods (default: the "
      "schedule's midpoint, 20) (choice)")
    a("--static-k", type=float, default=None, help="K of d2s (default: the schedule's midpoint, 0.125) (choice)")
    a("--min-token-per-response", action="store_true", help="every kept response keeps at least its best token "
      "(off: the paper's plain top-K%%; with L = 8 the floor would keep >= 12.5%% of the tokens at any K)")
    a("--target", type=float, nargs="+", default=[0.5, 0.8], help="'steps to target': first step with expected reward >= each")
    a("--workers", type=int, default=2, help="runs in parallel (processes); 1 runs in this process")
    a("--out", default="runs/toy", help="output folder for results.md, metrics.jsonl and toy.png")
    a("--explain-every", type=int, default=0, help="0: off. N > 0: step 0 and every N-th step write a page of what "
      "the step trains on (explain.py) to OUT/explain/METHOD_seedS/step_NNNNNN.{html,png}")
    args = p.parse_args(argv)
    if args.explain_every < 0:
        p.error(f"--explain-every={args.explain_every}: must be >= 0 (0 turns the pages off)")
    args.static_n, args.static_k = d3s.method_budget("d2s", 0, 1, args.group_size, args.n_init, args.n_final, args.k_init,
                                                     args.k_final, args.static_n, args.static_k)  # checks N <= G
    return args


# ---------------------------------------------------------------------------------------------
# 1. The task: per prompt, which positions decide the reward, the right tokens there, a prior
# ---------------------------------------------------------------------------------------------
def make_task(args, seed):
    """answers [prompts, L], decisions [prompts, L] bool, prior [prompts, L, V] (base-policy logits)."""
    gen = torch.Generator().manual_seed(seed)
    n, L, V = args.prompts, args.length, args.vocab
    answers = torch.randint(V, (n, L), generator=gen)  # right token at decision positions
    habits = torch.randint(V, (n, L), generator=gen)  # the base policy's favourite token at filler positions
    decisions = torch.zeros(n, L, dtype=torch.bool)
    for p in range(n):
        difficulty = 1 + p % args.max_decisions  # 1, 2, 3, 1, 2, 3, ... decision positions
        decisions[p, torch.randperm(L, generator=gen)[:difficulty]] = True
    favourite = torch.where(decisions, answers, habits)  # [prompts, L]
    bonus = torch.where(decisions, args.hint, args.filler_logit)  # [prompts, L]
    prior = torch.zeros(n, L, V).scatter_(2, favourite.unsqueeze(-1), bonus.unsqueeze(-1))
    return {"answers": answers, "decisions": decisions, "prior": prior}


def reward(task, prompt_ids, tokens):
    """0/1 verifiable reward: every decision token right (filler ignored). [B], [B, L] -> [B]."""
    right = (tokens == task["answers"][prompt_ids]) | ~task["decisions"][prompt_ids]  # [B, L]
    return right.all(-1).float()


# ---------------------------------------------------------------------------------------------
# 2. The policy: logits_t = prior[p, t] + MLP(e_prompt + e_pos + e_prev), autoregressive
# ---------------------------------------------------------------------------------------------
class Policy(nn.Module):
    def __init__(self, prior, hidden):
        super().__init__()
        n, L, V = prior.shape
        self.register_buffer("prior", prior)  # the "base model" (not trained)
        self.bos = V  # token id of the start symbol
        self.e_prompt, self.e_pos, self.e_prev = nn.Embedding(n, hidden), nn.Embedding(L, hidden), nn.Embedding(V + 1, hidden)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, V))
        nn.init.zeros_(self.mlp[-1].weight), nn.init.zeros_(self.mlp[-1].bias)  # step 0 = the prior

    def step_logits(self, prompt_ids, pos, prev):  # [B], [B], [B] -> [B, V]
        x = self.e_prompt(prompt_ids) + self.e_pos(pos) + self.e_prev(prev)
        return self.prior[prompt_ids, pos] + self.mlp(x)

    def forward(self, prompt_ids, tokens):
        """Teacher-forced logits of every position: prompt_ids [B], tokens [B, L] -> [B, L, V]."""
        B, L = tokens.shape
        prev = torch.cat([torch.full((B, 1), self.bos), tokens[:, :-1]], 1)  # [B, L]
        pos = torch.arange(L).expand(B, L)
        return self.step_logits(prompt_ids.unsqueeze(1).expand(B, L), pos, prev)

    @torch.no_grad()
    def sample(self, prompt_ids, length, gen):
        """Temperature-1 sampling, one position at a time: [B] -> tokens [B, L], logits [B, L, V]."""
        B = prompt_ids.shape[0]
        tokens, logits, prev = [], [], torch.full((B,), self.bos)
        for t in range(length):
            logits.append(self.step_logits(prompt_ids, torch.full((B,), t), prev))
            prev = torch.multinomial(logits[-1].softmax(-1), 1, generator=gen).squeeze(1)
            tokens.append(prev)
        return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def expected_reward(policy, task):
    """Exact E[R | p] for every prompt [prompts], by the forward algorithm over the previous token:
        alpha_0 = onehot(BOS),  alpha_{t+1}(v) = sum_u alpha_t(u) pi(v | p, t, u) [v = a_t if t decides]
        E[R | p] = sum_v alpha_L(v)     (the policy sees only (p, t, previous token): a Markov chain)
    """
    n, L, V = task["prior"].shape
    grid = torch.cartesian_prod(torch.arange(n), torch.arange(L), torch.arange(V + 1))  # every (p, t, u)
    trans = policy.step_logits(*grid.unbind(1)).softmax(-1).view(n, L, V + 1, V)  # pi(v | p, t, u)
    right = torch.where(task["decisions"].unsqueeze(-1), nn.functional.one_hot(task["answers"], V), 1).float()  # [n, L, V]
    alpha = nn.functional.one_hot(torch.full((n,), policy.bos), V + 1).float()  # [n, V+1]
    for t in range(L):
        alpha = torch.einsum("nu,nuv->nv", alpha, trans[:, t]) * right[:, t]  # [n, V]
        alpha = nn.functional.pad(alpha, (0, 1))  # BOS never follows: [n, V+1]
    return alpha.sum(-1)  # [prompts]


# ---------------------------------------------------------------------------------------------
# 3. One run: the six-step loop of ALGORITHM.md section 6
# ---------------------------------------------------------------------------------------------
def run(method, seed, args):
    """Train one policy with `method`; returns per-step lists (reward, grad norm, counts)."""
    task = make_task(args, seed)
    torch.manual_seed(seed)  # same initial policy for every method of a seed
    policy = Policy(task["prior"], args.hidden)
    initial = copy.deepcopy(policy).requires_grad_(False)  # the reference of the logged KL
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(seed)  # prompt order, rollouts and "random" selection
    P, G, L = args.batch_prompts, args.group_size, args.length
    log = {k: [] for k in ("step", "reward", "solved", "train_reward", "grad_norm", "grad_norm_grpo_scale", "n_keep", "k_frac",
                           "k_real", "samples",
                           "tokens", "sur", "decision_share", "kept_var", "entropy_mean", "entropy_kept", "kl_ref",
                           "entropy_decision", "entropy_filler")}
    for step in range(args.steps + 1):
        reward_per_prompt = expected_reward(policy, task)  # [prompts], before the update of `step`
        log["step"].append(step)
        log["reward"].append(float(reward_per_prompt.mean()))
        log["solved"].append(int((reward_per_prompt >= 0.5).sum()))
        if step == args.steps:
            break
        # 1) generate G rollouts for each of P prompts, 2) reward
        prompts = torch.randperm(args.prompts, generator=gen)[:P]  # [P]
        prompt_ids = prompts.repeat_interleave(G)  # [P*G], grouped by prompt
        tokens, sample_logits = policy.sample(prompt_ids, L, gen)  # [P*G, L], [P*G, L, V]
        rewards = reward(task, prompt_ids, tokens).view(P, G)  # [P, G]
        sample_entropy, decisions = d3s.token_entropy(sample_logits), task["decisions"][prompt_ids]  # for the log only
        # 3) advantages + sample selection: N per prompt and K from the method's budget
        n_keep, k_frac = d3s.method_budget(method, step, args.steps, G, args.n_init, args.n_final, args.k_init,
                                           args.k_final, args.static_n, args.static_k)
        keep, adv = d3s.select_samples(rewards, n_keep, method, generator=gen)  # [P, G] each
        kept = keep.view(-1).nonzero().squeeze(1)  # [B] indices of the kept rollouts
        kept_adv = adv.view(-1)[kept]  # [B]
        # 4) forward only the kept rollouts; entropy from the same logits, without grad
        logits = policy(prompt_ids[kept], tokens[kept])  # [B, L, V]
        logp = logits.log_softmax(-1).gather(-1, tokens[kept].unsqueeze(-1)).squeeze(-1)  # [B, L]
        entropy = d3s.token_entropy(logits)  # [B, L]
        with torch.no_grad():
            ref_logp = initial(prompt_ids[kept], tokens[kept]).log_softmax(-1).gather(-1, tokens[kept].unsqueeze(-1)).squeeze(-1)
        # 5) token selection: top K of s_{i,t} = |A_i| * H_{i,t} over the whole batch
        mask = torch.ones_like(logp, dtype=torch.bool)  # every answer has exactly L tokens
        token_scores = d3s.token_scores(kept_adv, entropy)  # s_{i,t} = |A_i| * H_{i,t}, [B, L]
        token_keep = d3s.select_tokens(token_scores, mask, k_frac, min_per_seq=int(args.min_token_per_response))  # [B, L]
        # 6) loss on the selected tokens (on-policy, one update: w = 1, gradient -A grad logp / #tokens)
        loss, stats = d3s.policy_loss(logp, logp.detach(), kept_adv, token_keep, kind="grpo", ref_logp=ref_logp)
        opt.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)  # norm before clipping
        opt.step()
        if args.explain_every and step % args.explain_every == 0:  # reads this step's tensors, draws no random number
            extra = {"loss": loss.item(), "loss normalizer (selected tokens)": int(token_keep.sum()),
                     "grad norm (before clipping)": float(grad_norm)}
            write_explain(args, method, seed, step, task, prompts, tokens, rewards, keep, adv, kept, entropy, token_scores,
                          token_keep, n_keep, k_frac, extra)
        for k, v in (("train_reward", rewards.mean()), ("grad_norm", grad_norm), ("n_keep", n_keep), ("k_frac", k_frac),
                     # the norm the same gradient has when divided by GRPO's count (all P * G * L tokens) instead of
                     # the tokens in the loss: what is left of the gradient-norm gain once the normalizer is set aside
                     ("grad_norm_grpo_scale", grad_norm * token_keep.sum() / (P * G * L)),
                     ("k_real", token_keep.sum() / mask.sum()), ("samples", kept.numel()), ("tokens", token_keep.sum()),
                     ("sur", d3s.usefulness_rate(adv, keep)), ("kept_var", d3s.kept_variance(adv, keep)),
                     ("decision_share", decisions[kept][token_keep].float().mean()),  # of the trained tokens
                     ("entropy_mean", entropy.mean()), ("entropy_kept", entropy[token_keep].mean()), ("kl_ref", stats["kl"]),
                     ("entropy_decision", sample_entropy[decisions].mean()), ("entropy_filler", sample_entropy[~decisions].mean())):
            log[k].append(float(v))
    return log


def write_explain(args, method, seed, step, task, prompts, tokens, rewards, keep, adv, kept, entropy, scores,
                  token_keep, n_keep, k_frac, extra):
    """One page of this step (explain.py): the P x G grid of kept rollouts, then the tokens of a
    few of them. A toy "token" is a position: its id, and a mark on the decision positions (the
    ones the reward reads). A dropped rollout was never forwarded: no entropy, no score."""
    G = args.group_size
    shown_adv = torch.where(keep, adv, d3s.group_advantages(rewards))  # the loss's A on kept, full-group A on dropped
    row_of = {int(i): r for r, i in enumerate(kept.tolist())}  # flat index -> row of the forwarded batch
    shown = []
    for i in explain.pick_rollouts(shown_adv, keep):
        prompt = int(prompts[i // G])
        decisions, answers = task["decisions"][prompt].tolist(), task["answers"][prompt].tolist()
        r = row_of.get(i)
        shown.append({
            "index": i, "tokens": [str(v) for v in tokens[i].tolist()],
            "entropy": None if r is None else entropy[r].tolist(), "score": None if r is None else scores[r].tolist(),
            "selected": None if r is None else token_keep[r].tolist(),
            "marked": decisions, "mark_label": "decision position (the reward reads it)",
            "notes": [(f"decision: the right token is {a}, this one is {'right' if v == a else 'wrong'}" if d
                       else "filler: the reward ignores it") for d, a, v in zip(decisions, answers, tokens[i].tolist())],
        })
    labels = ["prompt %d: %d decision%s" % (p, task["decisions"][p].sum(), "" if task["decisions"][p].sum() == 1 else "s")
              for p in prompts.tolist()]
    explain.write_step(os.path.join(args.out, "explain", f"{method}_seed{seed}"), step=step, rung="toy", method=method,
                       rewards=rewards, adv=shown_adv, keep=keep, n_keep=n_keep, k_frac=k_frac,
                       k_real=float(token_keep.sum() / token_keep.numel()), shown=shown, prompts=labels, extra=extra)


# ---------------------------------------------------------------------------------------------
# 4. Many runs -> markdown table, metrics.jsonl, toy.png
# ---------------------------------------------------------------------------------------------
def mean_std(values):
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / max(len(values) - 1, 1))


def summarize(logs, args):
    """Markdown table, one row per method, mean ± std over seeds."""
    head = ["method"] + ["steps to reward ≥ %g" % t for t in args.target]
    head += ["final reward", "prompts solved /%d" % args.prompts, "mean grad norm", "… at GRPO's normalizer", "SUR",
             "rollouts trained", "tokens trained"]
    head += ["final reward − grpo's, same seed (seeds above)"] if "grpo" in logs else []
    head += ["K realised / scheduled"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in logs.items():
        cells = [method]
        for target in args.target:  # seeds that never reach the target are counted, not averaged
            hits = [next((s for s, r in zip(log["step"], log["reward"]) if r >= target), None) for log in runs]
            reached = [h for h in hits if h is not None]
            cells.append("%.0f ± %.0f (%d/%d)" % (*mean_std(reached), len(reached), len(runs)) if reached else "– (0/%d)" % len(runs))
        for key, reduce, fmt in (("reward", lambda v: v[-1], "%.3f ± %.3f"), ("solved", lambda v: v[-1], "%.1f ± %.1f"),
                                 ("grad_norm", lambda v: sum(v) / len(v), "%.3f ± %.3f"),
                                 ("grad_norm_grpo_scale", lambda v: sum(v) / len(v), "%.3f ± %.3f"),
                                 ("sur", lambda v: sum(v) / len(v), "%.2f"),
                                 ("samples", sum, "%.0f"), ("tokens", sum, "%.0f ± %.0f")):
            cells.append(fmt % mean_std([reduce(log[key]) for log in runs])[: fmt.count("%")])
        if "grpo" in logs:  # paired by seed (same task, init and prompt order): final reward minus GRPO's
            diffs = [log["reward"][-1] - base["reward"][-1] for log, base in zip(runs, logs["grpo"])]
            cells.append("%+.3f ± %.3f (%d/%d)" % (*mean_std(diffs), sum(d > 0 for d in diffs), len(diffs)))
        realised = [sum(log["k_real"]) / len(log["k_real"]) for log in runs]
        scheduled = [sum(log["k_frac"]) / len(log["k_frac"]) for log in runs]
        cells.append("%.3f / %.3f" % (sum(realised) / len(runs), sum(scheduled) / len(runs)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(logs, args, path):
    """Expected reward and gradient norm against step: mean over seeds, band = ± one std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_g) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (method, runs) in enumerate(logs.items()):
        color, style = "C%d" % (i % 10), "-" if d3s.LADDER[method][2] else "--"  # dashed: no token selection
        reward = torch.tensor([log["reward"] for log in runs])  # [seeds, steps + 1]
        grad_norm = torch.tensor([log["grad_norm"] for log in runs])  # [seeds, steps]
        smooth = min(5, grad_norm.shape[1])  # running mean over 5 steps: the raw curve is noisy
        grad_norm = grad_norm.unfold(1, smooth, 1).mean(-1)  # [seeds, steps - smooth + 1]
        steps = runs[0]["step"]
        for ax, x, y in ((ax_r, steps, reward), (ax_g, steps[smooth - 1 : grad_norm.shape[1] + smooth - 1], grad_norm)):
            mean, std = y.mean(0), (y.std(0) if len(runs) > 1 else torch.zeros_like(y[0]))
            lower = (mean - std).clamp(min=0.0) if ax is ax_r else (mean - std).clamp(min=mean / 3)  # log axis: no band to 0
            ax.plot(x, mean, style, color=color, label=method, lw=1.2)
            ax.fill_between(x, lower, mean + std, color=color, alpha=0.12, lw=0)
    for target in args.target:
        ax_r.axhline(target, color="grey", lw=0.6, ls=":")
    ax_r.set(xlabel="step", ylabel="expected reward, all prompts", title="reward (mean ± std of %d seeds)" % args.seeds)
    ax_g.set(xlabel="step", ylabel="gradient norm before clipping", yscale="log",
             title="gradient norm (mean ± std, 5-step mean)")
    ax_r.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    from PIL import Image  # comes with matplotlib

    Image.open(path).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)  # ~3x fewer bytes


def _run_job(job):
    method, seed, args = job
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    return method, seed, run(method, seed, args)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start, logs = time.time(), {m: {} for m in args.methods}
    jobs = [(m, s, args) for m in args.methods for s in range(args.seeds)]
    pool = mp.get_context("spawn").Pool(args.workers) if args.workers > 1 else None  # runs are independent
    results = pool.imap_unordered(_run_job, jobs) if pool else map(_run_job, jobs)
    for method, seed, log in tqdm(results, total=len(jobs), desc="runs", leave=False):
        logs[method][seed] = log
    if pool:
        pool.close(), pool.join()
    logs = {m: [runs[s] for s in sorted(runs)] for m, runs in logs.items()}  # seed order, whatever the workers did
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        for method, runs in logs.items():
            for seed, log in enumerate(runs):
                for i, step in enumerate(log["step"]):  # the last step has only the evaluation
                    f.write(json.dumps({"method": method, "seed": seed, **{k: v[i] for k, v in log.items() if i < len(v)}}) + "\n")
    table = summarize(logs, args)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    plot(logs, args, os.path.join(args.out, "toy.png"))
    print(table)
    print("%d runs in %.1f s (static N=%d, K=%.3f); wrote %s/{results.md,metrics.jsonl,toy.png}"
          % (len(jobs), time.time() - start, args.static_n, args.static_k, args.out))
    return logs


if __name__ == "__main__":
    main()
