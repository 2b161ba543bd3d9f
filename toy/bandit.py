"""toy/bandit.py: a sequence bandit in which both levels of D3S matter, in seconds on a CPU.

Each of --prompts prompts asks for an answer of L tokens from a vocabulary of V. Decision positions (1, 2 or 3 per
prompt) decide the 0/1 reward: every one must hold the prompt's right token; the base policy is close to uniform
there (high entropy, a small --hint). Filler positions do not count; the base policy has a habit there
(--filler-logit: low entropy, like most tokens an LLM writes). At step 0 a rollout is right with probability ~28%
(one decision) to ~2% (three), so groups of G = 32 have mixed success. The policy, logits_t = prior[p, t] +
MLP(e_prompt + e_pos + e_prev), starts exactly at the prior (its last layer is zero); its reward is exact.

One training step (docs/algorithm.md, section 6), each piece of the method a call into d3s.py: sample P x G
rollouts -> reward -> d3s.select_samples (N per prompt) -> forward the kept rollouts -> d3s.token_entropy ->
d3s.token_scores, d3s.select_tokens (top K of |A| * H) -> d3s.policy_loss (on-policy, one update) -> Adam.
Every method generates the same rollouts; they differ in what they train on. Left out: a KL penalty, GSPO.

    python toy/bandit.py                          # 8 methods x 30 seeds -> runs/toy/metrics.jsonl
    python toy/bandit.py --seeds 3 --methods grpo d3s --explain-every 20    # + pages: runs/toy/explain/
    python experiments/toy_ladder.py              # the same runs, then docs/toy.md's tables and figure
"""

import copy
import json
import math
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import d3s  # noqa: E402
from support import cli, explain, methods, stops  # noqa: E402
from support.pool import imap  # noqa: E402

PROG = "bandit.py"  # the name in every error line, however the script is started
DEFAULT_METHODS = ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random")  # docs/toy.md's table
MAX_ELEMENTS = 2**26  # the largest tensors of a step: sampling logits P*G*L*V, the exact-reward grid


def build_parser(prog=PROG):
    f, n = cli.flag, cli.number  # one knob a line: f(flag, default, what it may be, help)
    flags = [
        f("--methods", list(DEFAULT_METHODS), methods.NAMES, "rows of methods.LADDER", nargs="+"),
        f("--seeds", 30, n(int, 1, 10_000), "seeds per method (seed s: same task, init and prompt order)"),
        f("--steps", 80, n(int, 1, 100_000), "training steps per run"),
        f("--prompts", 16, n(int, 1, 4096), "prompts in the task"),
        f("--batch-prompts", 8, n(int, 1, 4096), "P: prompts per step"),
        f("--group-size", 32, n(int, 2, 4096), "G: rollouts per prompt (an advantage needs 2)"),
        f("--length", 8, n(int, 1, 256), "L: tokens per answer"),
        f("--vocab", 8, n(int, 2, 256), "V: vocabulary size"),
        f("--max-decisions", 3, n(int, 1, 256), "prompt p has 1 + p %% max-decisions decision positions"),
        f("--hint", 1.0, n(float, -100, 100), "base-policy logit bonus of the right token at decisions"),
        f(
            "--filler-logit",
            3.0,
            n(float, -100, 100),
            "base-policy logit bonus of a habitual token at filler "
            "positions (high: low entropy, as most LLM tokens; 0: as uncertain as the decisions)",
        ),
        f("--hidden", 64, n(int, 1, 4096), "policy MLP width"),
        f(
            "--optimizer",
            "adam",
            ["adam", "sgd"],
            "adam (the rungs' AdamW without weight decay) or sgd, which keeps "
            "the gradient's scale (ablation, docs/toy.md)",
        ),
        f("--lr", 1e-2, n(float, 0, 100, low_open=True), "learning rate"),
        f("--max-grad-norm", 1.0, n(float, 0, 1e6), "gradient clipping (logged before clipping); 0: none"),
        f(
            "--normalizer",
            "selected",
            ["selected", "all"],
            "the loss divides by the tokens it trains on (selected, "
            "this project's token-mean, a choice) or by every token of the P*G rollouts (all: GRPO's scale; docs/toy.md)",
        ),
        f("--n-init", 8, n(int, 1, 4096), "D3S schedule: rollouts kept per prompt at step 1 [summary]"),
        f("--n-final", 32, n(int, 1, 4096), "... at the last step [summary]"),
        f("--k-init", 0.05, n(float, 0, 1, low_open=True), "D3S schedule: fraction of tokens kept at step 1 [summary]"),
        f("--k-final", 0.20, n(float, 0, 1, low_open=True), "... at the last step [summary]"),
        f("--static-n", None, n(int, 1, 4096), "N of the static rows (default: the schedule's midpoint) (choice)"),
        f("--static-k", None, n(float, 0, 1, low_open=True), "K of d2s (default: the midpoint) (choice)"),
        *methods.flags("--schedule", "--token-rule", "--token-scope", "--min-token-per-response"),
        f("--target", [0.5, 0.8], n(float, 0, 1, low_open=True), "rewards for 'steps to target'", nargs="+"),
        f("--workers", 2, n(int, 1, 64), "runs in parallel (processes); 1 runs in this process"),
        f("--out", "runs/toy", None, "output folder for metrics.jsonl (made if missing)"),
        f(
            "--explain-every",
            0,
            n(int, 0, 10**9),
            "step 1 and every N-th step write a page of what the step trains "
            "on (support/explain.py) to OUT/explain/METHOD_seedS/; 0: off",
        ),
    ]
    return cli.parser(prog, __doc__.split("\n\n")[0], flags)


def parse_args(argv=None, parser=None):
    """The flags, checked together: one line `bandit.py: error: --flag VALUE: what; fix`, exit 2."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    if len(set(args.methods)) < len(args.methods):
        p.error(f"--methods {' '.join(args.methods)}: a method is named twice; name each once")
    for flag, value, limit, what in (
        ("--batch-prompts", args.batch_prompts, args.prompts, "prompts of the task"),
        ("--max-decisions", args.max_decisions, args.length, "positions of an answer"),
    ):
        if value > limit:
            p.error(f"{flag} {value}: more than the {limit} {what}; lower it")
    sampling = args.batch_prompts * args.group_size * args.length * args.vocab  # the sampling logits
    grid = args.prompts * args.length * (args.vocab + 1) * max(args.vocab, args.hidden)  # the exact reward's grid
    for flag, value, n, what in (
        ("--batch-prompts", args.batch_prompts, sampling, "--batch-prompts x --group-size x --length x --vocab"),
        ("--prompts", args.prompts, grid, "--prompts x --length x (--vocab + 1) x max(--vocab, --hidden)"),
    ):
        if n > MAX_ELEMENTS:
            p.error(f"{flag} {value}: {what} = {n:,} tensor elements, over {MAX_ELEMENTS:,}; make one of them smaller")
    cli.check_out_dir(p, "--out", args.out)
    args.static_n, args.static_k = methods.check_flags(p, args, args.methods, "--methods")  # N <= G, static N and K
    return args


# === The task, the policy and its exact expected reward ===============================================================
def make_task(args, seed):
    """answers [prompts, L], decisions [prompts, L] bool, prior [prompts, L, V] (base-policy logits)."""
    gen = torch.Generator().manual_seed(seed)
    n, L, V = args.prompts, args.length, args.vocab
    answers = torch.randint(V, (n, L), generator=gen)  # right token at decision positions
    habits = torch.randint(V, (n, L), generator=gen)  # the base policy's favourite token at filler positions
    decisions = torch.zeros(n, L, dtype=torch.bool)
    for p in range(n):
        decisions[p, torch.randperm(L, generator=gen)[: 1 + p % args.max_decisions]] = True  # 1, 2, 3, 1, ... decisions
    favourite = torch.where(decisions, answers, habits)  # [prompts, L]
    bonus = torch.where(decisions, args.hint, args.filler_logit)  # [prompts, L]
    prior = torch.zeros(n, L, V).scatter_(2, favourite.unsqueeze(-1), bonus.unsqueeze(-1))
    return {"answers": answers, "decisions": decisions, "prior": prior}


def reward(task, prompt_ids, tokens):
    """0/1 verifiable reward: every decision token right (filler ignored). [B], [B, L] -> [B]."""
    right = (tokens == task["answers"][prompt_ids]) | ~task["decisions"][prompt_ids]  # [B, L]
    return right.all(-1).float()


class Policy(nn.Module):
    def __init__(self, prior, hidden):
        super().__init__()
        n, L, V = prior.shape
        self.register_buffer("prior", prior)  # the "base model" (not trained)
        self.bos = V  # token id of the start symbol
        self.e_prompt, self.e_pos = nn.Embedding(n, hidden), nn.Embedding(L, hidden)
        self.e_prev = nn.Embedding(V + 1, hidden)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, V))
        nn.init.zeros_(self.mlp[-1].weight), nn.init.zeros_(self.mlp[-1].bias)  # step 0 = the prior

    def step_logits(self, prompt_ids, pos, prev):  # [B], [B], [B] -> [B, V]
        return self.prior[prompt_ids, pos] + self.mlp(self.e_prompt(prompt_ids) + self.e_pos(pos) + self.e_prev(prev))

    def forward(self, prompt_ids, tokens):
        """Teacher-forced logits of every position: prompt_ids [B], tokens [B, L] -> [B, L, V]."""
        B, L = tokens.shape
        prev = torch.cat([torch.full((B, 1), self.bos), tokens[:, :-1]], 1)  # [B, L]
        return self.step_logits(prompt_ids.unsqueeze(1).expand(B, L), torch.arange(L).expand(B, L), prev)

    @torch.no_grad()
    def sample(self, prompt_ids, length, gen):
        """Temperature-1 sampling, one position at a time: [B] -> tokens [B, L], logits [B, L, V]."""
        tokens, logits, prev = [], [], torch.full((prompt_ids.shape[0],), self.bos)
        for t in range(length):
            logits.append(self.step_logits(prompt_ids, torch.full_like(prev, t), prev))
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
    right = torch.where(
        task["decisions"].unsqueeze(-1), nn.functional.one_hot(task["answers"], V), 1
    ).float()  # [n, L, V]
    alpha = nn.functional.one_hot(torch.full((n,), policy.bos), V + 1).float()  # [n, V+1]
    for t in range(L):
        # over V + 1 previous tokens: BOS (the last) never follows, so its column is 0
        alpha = nn.functional.pad(torch.einsum("nu,nuv->nv", alpha, trans[:, t]) * right[:, t], (0, 1))
    return alpha.sum(-1)  # [prompts]


class Diverged(RuntimeError):
    """The policy went non-finite (a learning rate too large for the setting): main turns it into one line."""


# === One run: the six steps of docs/algorithm.md, section 6 ===========================================================
def run(method, seed, args):
    """Train one policy with `method`; returns its metrics.jsonl lines (docs/metrics.md): eval line s after s
    updates (s = 0..S), train line s for update s."""
    task = make_task(args, seed)
    torch.manual_seed(seed)  # same initial policy for every method of a seed
    policy = Policy(task["prior"], args.hidden)
    initial = copy.deepcopy(policy).requires_grad_(False)  # the reference of the logged KL
    opt = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer](policy.parameters(), lr=args.lr)
    clip = args.max_grad_norm if args.max_grad_norm > 0 else math.inf  # inf: the norm is measured, nothing is scaled
    rule = methods.TOKEN_RULES[args.token_rule] if methods.selects_tokens(method) else None
    gen = torch.Generator().manual_seed(seed)  # prompt order, rollouts and "random" selection
    score_gen = torch.Generator().manual_seed(seed)  # --token-rule random/adv: a stream of its own
    P, G, L = args.batch_prompts, args.group_size, args.length
    lines, rewards_so_far = [], []
    for step in range(args.steps + 1):  # the evaluation after `step` updates, then update step + 1
        lines.append(eval_line(policy, task, method, seed, step))  # the exact expected reward after `step` updates
        if step == args.steps:
            return lines
        s = step + 1
        # 1) generate G rollouts for each of P prompts, 2) reward
        prompts = torch.randperm(args.prompts, generator=gen)[:P]  # [P]
        prompt_ids = prompts.repeat_interleave(G)  # [P*G], grouped by prompt
        tokens, sample_logits = policy.sample(prompt_ids, L, gen)  # [P*G, L], [P*G, L, V]
        rewards = reward(task, prompt_ids, tokens).view(P, G)  # [P, G]
        # 3) select samples: N per prompt from the method's budget (d3s.method_budget), max Var(A)
        n_keep, k_frac = methods.budget(args, method, s, history=rewards_so_far)
        keep, adv = d3s.select_samples(rewards, n_keep, methods.LADDER[method].samples, generator=gen)  # [P, G] each
        kept = keep.view(-1).nonzero().squeeze(1)  # [B] indices of the kept rollouts
        kept_adv = adv.view(-1)[kept]  # [B]
        # 4) forward only the kept rollouts; the entropy of the same logits, without grad
        logits = policy(prompt_ids[kept], tokens[kept])  # [B, L, V]
        logp = logits.log_softmax(-1).gather(-1, tokens[kept].unsqueeze(-1)).squeeze(-1)  # [B, L]
        entropy = d3s.token_entropy(logits)  # [B, L]
        ref_logits = initial(prompt_ids[kept], tokens[kept])  # the frozen reference of the logged KL (no grad)
        ref_logp = ref_logits.log_softmax(-1).gather(-1, tokens[kept].unsqueeze(-1)).squeeze(-1)  # [B, L]
        # 5) select tokens: the top K of s_{i,t} = |A_i| * H_{i,t} over the whole batch
        mask = torch.ones_like(logp, dtype=torch.bool)  # every answer has exactly L tokens
        scores = d3s.token_scores(kept_adv, entropy, rule=rule, generator=score_gen)  # [B, L]
        token_keep = d3s.select_tokens(
            scores, mask, k_frac, scope=args.token_scope, min_per_seq=int(args.min_token_per_response)
        )
        # 6) the loss on the selected tokens (on-policy, one update: w = 1, gradient -A grad logp / #tokens), Adam
        normalizer = P * G * L if args.normalizer == "all" else None  # None: the selected tokens (token-mean)
        loss, stats = d3s.policy_loss(
            logp, logp.detach(), kept_adv, token_keep, kind="grpo", ref_logp=ref_logp, normalizer=normalizer
        )
        opt.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), clip)  # the norm before clipping
        skipped = not torch.isfinite(grad_norm)  # a non-finite gradient: no update this step
        updated = not skipped and bool(token_keep.any())  # dapo-filter with no mixed group: nothing to train on
        if updated:
            opt.step()
        record = SimpleNamespace(  # what the step computed, by name: its page and its metrics line read it
            step=s,
            method=method,
            seed=seed,
            task=task,
            prompts=prompts,
            prompt_ids=prompt_ids,
            tokens=tokens,
            sample_logits=sample_logits,
            rewards=rewards,
            n_keep=n_keep,
            k_frac=k_frac,
            keep=keep,
            adv=adv,
            kept=kept,
            entropy=entropy,
            scores=scores,
            token_keep=token_keep,
            normalizer=normalizer,
            loss=loss,
            stats=stats,
            grad_norm=grad_norm,
            skipped=skipped,
            updated=updated,
        )
        if args.explain_every and (s == 1 or s % args.explain_every == 0):
            explain.toy_page(args, record)  # a page of what the step trains on (docs/walkthrough.md)
        rewards_so_far.append(float(rewards.mean()))
        lines.append(train_line(args, record))
    return lines


def eval_line(policy, task, method, seed, step):
    """The eval line: the expected reward over the prompts, and the prompts solved at least half the time."""
    per_prompt = expected_reward(policy, task)  # [prompts]
    if not torch.isfinite(per_prompt).all():
        raise Diverged(f"{method} seed {seed}: the policy went non-finite after step {step}")
    mean, solved = float(per_prompt.mean()), int((per_prompt >= 0.5).sum())
    return {"kind": "eval", "step": step, "method": method, "seed": seed, "eval_reward": mean, "eval_solved": solved}


def train_line(args, v):
    """The step's train line of metrics.jsonl (docs/metrics.md) from run's variables `v`, with the toy's own keys: the
    gradient norm at GRPO's normalizer (all P * G * L tokens), the share of decision positions among the trained
    tokens, the entropy of the decision and the filler positions."""
    P, G, L = args.batch_prompts, args.group_size, args.length
    rewards, keep, adv, kept, token_keep = v.rewards, v.keep, v.adv, v.kept, v.token_keep
    grad_norm, updated = v.grad_norm, v.updated
    grpo_scale = grad_norm * (P * G * L if args.normalizer == "all" else token_keep.sum()) / (P * G * L)
    sample_entropy, decisions = d3s.token_entropy(v.sample_logits), v.task["decisions"][v.prompt_ids]
    mean0 = lambda t: float(t.mean()) if t.numel() else 0.0  # a dapo-filter step may keep nothing
    return {
        "kind": "train",
        "step": v.step,
        "method": v.method,
        "seed": v.seed,
        "reward_mean": float(rewards.mean()),
        "acc_train": float(rewards.mean()),  # a 0/1 reward is correctness
        "groups_mixed": float((rewards.amax(-1) > rewards.amin(-1)).float().mean()),
        "n_keep": int(v.n_keep),
        "k_frac": float(v.k_frac),
        "k_real": float(token_keep.sum() / token_keep.numel()),
        "kept_samples": int(kept.numel()),
        "sur": d3s.usefulness_rate(adv, keep),
        "kept_tokens": int(token_keep.sum()),
        "fwd_tokens": int(token_keep.numel()),
        "gen_tokens": P * G * L,
        "kept_tokens_frac": int(token_keep.sum()) / (P * G * L),
        "kept_adv_var": d3s.kept_variance(adv, keep),
        "grad_norm": float(grad_norm) if updated else None,
        "entropy_mean": mean0(v.entropy),
        "entropy_kept": mean0(v.entropy[token_keep]),
        "kl_ref": float(v.stats["kl"]),
        "clip_frac": float(v.stats["clip_frac"]),
        "loss": float(v.loss.detach()),
        "updates": int(updated),
        "skipped": bool(v.skipped),
        "response_len": float(L),
        "grad_norm_grpo_scale": float(grpo_scale) if updated else None,
        "decision_share": mean0(decisions[kept][token_keep].float()),  # of the trained tokens
        "entropy_decision": float(sample_entropy[decisions].mean()),
        "entropy_filler": float(sample_entropy[~decisions].mean()),
    }


def run_job(job):  # job: (method, seed, args)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    return run(*job)


def main(argv=None, parser=None):
    """Every method x seed, --workers at a time -> OUT/metrics.jsonl; prints the final reward per method."""
    args = parse_args(argv, parser)
    os.makedirs(args.out, exist_ok=True)
    start, runs = time.time(), {m: {} for m in args.methods}
    jobs = [(m, s, args) for m in args.methods for s in range(args.seeds)]
    try:
        for (method, seed, _), lines in imap(run_job, jobs, args.workers):
            runs[method][seed] = lines
    except Diverged as e:  # one line, as for a bad flag: the setting (a learning rate) is the cause
        stops.fail(PROG, f"--lr {args.lr:g}: {e}; lower --lr (or keep --max-grad-norm above 0)")
    runs = {m: [by_seed[s] for s in sorted(by_seed)] for m, by_seed in runs.items()}  # in seed order
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for lines in runs.values() for seed_lines in lines for line in seed_lines)
    for method, lines in runs.items():
        final = [seed_lines[-1]["eval_reward"] for seed_lines in lines]
        print(f"{method:14s} final expected reward {sum(final) / len(final):.3f} over {len(final)} seed(s)")
    print(
        f"{len(jobs)} runs in {time.time() - start:.1f} s (static N={args.static_n}, K={args.static_k:.3f}); "
        f"wrote {os.path.join(args.out, 'metrics.jsonl')}"
    )
    return args, runs


if __name__ == "__main__":
    stops.interruptible(main, PROG)
