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

One training step (docs/algorithm.md section 6), every piece of the method taken from d3s.py:
  sample P prompts x G rollouts -> reward -> d3s.select_samples (N per prompt, from
  d3s.method_budget) -> forward the kept rollouts -> d3s.token_entropy -> scores |A| * H
  -> d3s.select_tokens (top K) -> d3s.policy_loss (on-policy, one update) -> Adam.
Every method generates the same P x G rollouts per step; they differ only in what they train on.
The methods are the rows of d3s.LADDER: the paper's ablation ladder grpo -> d1s -> d1s-cross ->
d2s -> d3s, plus d3s-i, pods, DAPO's group filter (dapo-filter, dapo-filter-k) and a random control.

Reported per method, mean ± std over seeds: steps until the exact expected reward over all
prompts, mean_p E[R | p], first reaches each --target (seeds that never do are counted, not
averaged); that reward after the last step and its mean over the run; the prompts with
E[R | p] >= 0.5; the mean gradient norm (before clipping); the Sample Usefulness Rate; the
rollouts and tokens trained on in the whole run. Then each method paired by seed with grpo
(same task, initial policy and prompt order): the difference in final reward, in mean reward
over the run and in steps to each target (seeds where both reach it), as mean [95% t interval
over seeds], and the verdict: a method differs from grpo only where an interval excludes 0.
Per-seed numbers move with the CPU's floating-point path; the verdicts should not.
metrics.jsonl follows docs/metrics.md, the schema of every rung: train line s (kind "train",
steps count from 1) is the s-th update, with the scheduled and realised K, the entropy of the
trained rollouts' tokens and of the selected ones, and the KL (k3) to the initial policy on the
selected tokens (measured, not in the loss); eval line s (kind "eval") is the exact expected
reward after s updates, from s = 0 (the initial policy) to --steps.
Left out on purpose: a KL penalty, batch reuse (ratios and clipping never bind on-policy), GSPO.
Ablation switches (docs/toy.md, "why is D3S slower in steps"; docs/questions.md): --optimizer,
--normalizer, --max-grad-norm 0, --token-rule, --token-scope, and the schedule's --schedule and
--n-init/--n-final/--k-init/--k-final.
Bad flags stop before any work with one line, `bandit.py: error: --flag VALUE: what; fix`, exit 2.

    python toy/bandit.py                     # 8 methods x 30 seeds: tables, runs/toy/toy.png
    python toy/bandit.py --seeds 3 --methods grpo d3s --filler-logit 0
    python toy/bandit.py --methods grpo d3s --n-init 32 --k-init 0.2     # D3S at its final budget from step 0
    python toy/bandit.py --seeds 1 --methods d3s d3s-i --explain-every 20   # + pages: runs/toy/explain/
"""

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

import d3s  # noqa: E402
import explain  # noqa: E402


PROG = "bandit.py"  # the name in every error line, however the script is started
DEFAULT_METHODS = ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random")  # docs/toy.md's default table


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are ONE line on stderr, `bandit.py: error: --flag VALUE: what is wrong; what to
    do`, exit 2 (argparse's own error prints the usage block first)."""

    def error(self, message):
        message = " ".join(str(message).split())  # one line, whatever argparse put in it
        flag = re.match(r"argument (--[\w-]+)(?:/\S+)?: expected one argument$", message)
        if flag:  # "--lr -inf": argparse takes only "-1" and "-.5" for numbers, anything else for a flag
            message = f"{flag.group(1)}: expected one value; pass it after the flag (one that starts with '-' as {flag.group(1)}=VALUE)"
        message = re.sub(r"^argument (--[\w-]+)(?:/\S+)?: ", r"\1: ", message)  # "argument --x: ..." -> "--x: ..."
        self.exit(2, f"{self.prog}: error: {message}\n")


# Every numeric flag: (type, lowest, highest, open at the lowest?, what it is). Checked after parsing
# (parse_args), so every message has one form; the highest values keep a run's tensors within memory
# (and _check_args bounds the products).
LIMITS = {
    "seeds": (int, 1, 10_000, False, "the seeds per method"),
    "steps": (int, 1, 100_000, False, "the training steps per run"),
    "prompts": (int, 1, 4096, False, "the prompts in the task"),
    "batch_prompts": (int, 1, 4096, False, "the prompts per step (at most --prompts)"),
    "group_size": (int, 2, 4096, False, "the rollouts per prompt (an advantage needs 2)"),
    "length": (int, 1, 256, False, "the tokens per answer"),
    "vocab": (int, 2, 256, False, "the vocabulary size"),
    "max_decisions": (int, 1, 256, False, "the decision positions of the hardest prompt (at most --length)"),
    "hint": (float, -100.0, 100.0, False, "a logit bonus"),
    "filler_logit": (float, -100.0, 100.0, False, "a logit bonus"),
    "hidden": (int, 1, 4096, False, "the MLP width"),
    "lr": (float, 0.0, 100.0, True, "a learning rate"),
    "max_grad_norm": (float, 0.0, 1e6, False, "a clipping norm (0: no clipping)"),
    "n_init": (int, 1, 4096, False, "rollouts kept per prompt (at most --group-size)"),
    "n_final": (int, 1, 4096, False, "rollouts kept per prompt (at most --group-size)"),
    "k_init": (float, 0.0, 1.0, True, "a fraction of the tokens"),
    "k_final": (float, 0.0, 1.0, True, "a fraction of the tokens"),
    "static_n": (int, 1, 4096, False, "rollouts kept per prompt (at most --group-size)"),
    "static_k": (float, 0.0, 1.0, True, "a fraction of the tokens"),
    "target": (float, 0.0, 1.0, True, "an expected reward"),
    "workers": (int, 1, 64, False, "a number of processes"),
    "explain_every": (int, 0, 10**9, False, "a number of steps (0: no pages)"),
}
MAX_ELEMENTS = 2**26  # the largest tensors of a step: sampling logits P*G*L*V, the exact-reward grid prompts*L*(V+1)*max(V, hidden)


def _number(p, name, raw):
    """The value of numeric flag `name`, converted and checked; a one-line error naming flag, value and fix."""
    kind, low, high, open_low, what = LIMITS[name]
    flag, shown = "--" + name.replace("_", "-"), raw if isinstance(raw, str) else repr(raw)
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    try:
        value = kind(raw)
    except (TypeError, ValueError, OverflowError):
        p.error(f"{flag} {shown!r}: not {'an integer' if kind is int else 'a number'}; pass {what}, in {interval}")
    if kind is float and not math.isfinite(value):
        p.error(f"{flag} {shown}: not a finite number; pass {what}, in {interval}")
    if not (low < value if open_low else low <= value) or value > high:
        p.error(f"{flag} {shown}: out of range; pass {what}, in {interval}")
    return value


def _check_out(p, out):
    """--out must name a folder that exists or can be made: not a file, writable."""
    if not out.strip():
        p.error("--out '': empty; pass a folder for the results, e.g. runs/toy")
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"--out {out}: is a file, not a folder; pass a folder (it is made if missing)")
    parent = path
    while not os.path.exists(parent):  # the nearest ancestor that exists: the one makedirs would write into
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"--out {out}: {parent} is a file, so the folder cannot be made; pass another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--out {out}: {parent} is not writable; pass a folder you can write to")


def parse_args(argv=None):
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument  # numbers are parsed as text and checked below (LIMITS): one message form for all
    a("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(d3s.METHODS),
      help="methods to compare (rows of d3s.LADDER; the default: the paper's ablation ladder, pods and a random "
      "control, the table of docs/toy.md; dapo-filter and dapo-filter-k when named)")
    a("--seeds", default=30, help="seeds per method (seed s: same task, init and prompt order for all methods); "
      "the paired 95%% intervals against grpo shrink as 1/sqrt(seeds)")
    a("--steps", default=80, help="training steps per run")
    a("--prompts", default=16, help="prompts in the task")
    a("--batch-prompts", default=8, help="P: prompts per step")
    a("--group-size", default=32, help="G: rollouts per prompt (the paper's N schedule ends at 32)")
    a("--length", default=8, help="L: tokens per answer")
    a("--vocab", default=8, help="V: vocabulary size")
    a("--max-decisions", default=3, help="prompt p has 1 + p %% max-decisions decision positions")
    a("--hint", default=1.0, help="base-policy logit bonus of the right token at decision positions")
    a("--filler-logit", default=3.0, help="base-policy logit bonus of a habitual token at filler positions "
      "(high: filler has low entropy, as most LLM tokens; 0: filler is as uncertain as the decisions)")
    a("--hidden", default=64, help="policy MLP width")
    a("--optimizer", default="adam", choices=["adam", "sgd"], help="adam: torch.optim.Adam (the rungs' AdamW without "
      "weight decay); sgd: plain SGD, which, unlike Adam, keeps the gradient's scale (ablation, docs/toy.md)")
    a("--lr", default=1e-2, help="learning rate")
    a("--max-grad-norm", default=1.0, help="gradient clipping (the norm is logged before clipping); 0: no clipping")
    a("--normalizer", default="selected", choices=["selected", "all"], help="the loss divides by: selected = the "
      "tokens it trains on (the paper's token-mean); all = every token of the P*G rollouts (GRPO's count, so "
      "every method's gradient has GRPO's scale; ablation, docs/toy.md)")
    a("--n-init", default=8, help="D3S schedule: rollouts kept per prompt at step 1")
    a("--n-final", default=32, help="D3S schedule: rollouts kept per prompt at the last step")
    a("--k-init", default=0.05, help="D3S schedule: fraction of tokens kept at step 1")
    a("--k-final", default=0.20, help="D3S schedule: fraction of tokens kept at the last step")
    a("--static-n", default=None, help="N of the static rows d1s, d1s-cross, d2s, pods (default: the "
      "schedule's midpoint, 20) (choice)")
    a("--static-k", default=None, help="K of d2s (default: the schedule's midpoint, 0.125) (choice)")
    a("--schedule", default="linear", choices=list(d3s.SCHEDULES), help="the curve N and K follow from init to final "
      "in the scheduled rows (d3s, d3s-i, random, dapo-filter-k; d3s.dynamic_schedule kind): linear = the paper's; "
      "cosine; step = init for the first half, final after; constant = init throughout; adaptive = relax only when the "
      "train reward plateaus")
    a("--token-rule", default="adv-entropy", choices=list(d3s.TOKEN_RULES), help="token score of the methods that "
      "select tokens (d3s.token_scores): adv-entropy = |A| * H, the paper's; entropy = H; adv = |A|; random = a control")
    a("--token-scope", default="batch", choices=["batch", "sequence"], help="top K of the scores over the whole batch "
      "(batch, this repo's reading: the paper does not say) or within each response (sequence) (d3s.select_tokens)")
    a("--min-token-per-response", action="store_true", help="every kept response keeps at least its best token "
      "(off: the paper's plain top-K%%; with L = 8 the floor would keep >= 12.5%% of the tokens at any K)")
    a("--target", nargs="+", default=[0.5, 0.8], help="'steps to target': first step with expected reward >= each")
    a("--workers", default=2, help="runs in parallel (processes); 1 runs in this process")
    a("--out", default="runs/toy", help="output folder for results.md, metrics.jsonl and toy.png (made if missing)")
    a("--explain-every", default=0, help="0: off. N > 0: step 1 and every N-th step write a page of what "
      "the step trains on (explain.py) to OUT/explain/METHOD_seedS/step_NNNNNN.{html,png}")
    args = p.parse_args(_glue_dash_values(p, sys.argv[1:] if argv is None else argv))
    _check_args(p, args)
    return args


def _glue_dash_values(p, argv):
    """["--lr", "-inf"] -> ["--lr=-inf"]: argparse takes only "-1" and "-.5" for values, so "-inf" or
    "-1e-3" after a one-value flag would be read as an unknown flag instead of a bad (or good) value."""
    options = {o for action in p._actions for o in action.option_strings}
    one_value = {o for action in p._actions if action.nargs is None for o in action.option_strings}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in one_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in options:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _check_args(p, args):
    """Every flag, before any work: one line `bandit.py: error: --flag VALUE: what is wrong; what to do`, exit 2."""
    for name in LIMITS:
        raw = getattr(args, name)
        if name == "target":
            args.target = [_number(p, name, v) for v in raw]
        elif raw is not None:  # --static-n and --static-k default to None: the schedule's midpoint
            setattr(args, name, _number(p, name, raw))
    if len(set(args.methods)) < len(args.methods):
        p.error(f"--methods {' '.join(args.methods)}: a method is named twice; name each once")
    if args.batch_prompts > args.prompts:
        p.error(f"--batch-prompts {args.batch_prompts}: more than the {args.prompts} prompts of the task; "
                f"lower it or raise --prompts")
    if args.max_decisions > args.length:
        p.error(f"--max-decisions {args.max_decisions}: more than the {args.length} positions of an answer; "
                f"lower it or raise --length")
    for name in ("n_init", "n_final", "static_n"):
        value = getattr(args, name)
        if value is not None and value > args.group_size:
            p.error(f"--{name.replace('_', '-')} {value}: more than the {args.group_size} rollouts of a group; "
                    f"lower it or raise --group-size")
    rollout_logits = args.batch_prompts * args.group_size * args.length * args.vocab
    reward_grid = args.prompts * args.length * (args.vocab + 1) * max(args.vocab, args.hidden)
    for size, flags in ((rollout_logits, "--batch-prompts x --group-size x --length x --vocab"),
                        (reward_grid, "--prompts x --length x (--vocab + 1) x max(--vocab, --hidden)")):
        if size > MAX_ELEMENTS:
            p.error(f"{flags.split(' ')[0]} {getattr(args, flags.split(' ')[0][2:].replace('-', '_'))}: "
                    f"{flags} = {size:,} tensor elements, over {MAX_ELEMENTS:,}; make one of them smaller")
    _check_out(p, args.out)
    args.static_n, args.static_k = d3s.method_budget("d2s", 0, 1, args.group_size, args.n_init, args.n_final, args.k_init,
                                                     args.k_final, args.static_n, args.static_k)  # checked above


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
# 3. One run: the six-step loop of docs/algorithm.md section 6
# ---------------------------------------------------------------------------------------------
class Diverged(RuntimeError):
    """The policy went non-finite (a learning rate too large for the setting): main turns it into one line."""


# The keys of the log run() returns and of metrics.jsonl (docs/metrics.md): an eval line after every
# update and before the first, a train line per update. Steps count from 1 (eval step 0: the initial policy).
EVAL_KEYS = ("eval_reward", "eval_solved")
TRAIN_KEYS = ("reward_mean", "acc_train", "groups_mixed", "n_keep", "k_frac", "k_real", "kept_samples", "sur",
              "kept_tokens", "fwd_tokens", "gen_tokens", "kept_tokens_frac", "kept_adv_var", "grad_norm",
              "entropy_mean", "entropy_kept", "kl_ref", "clip_frac", "loss", "updates", "skipped", "response_len",
              # the toy's own
              "grad_norm_grpo_scale", "decision_share", "entropy_decision", "entropy_filler")


def run(method, seed, args):
    """Train one policy with `method`. Returns the run's log, one list per key: eval_step (0..S) and
    EVAL_KEYS, one value per evaluation; step (1..S) and TRAIN_KEYS, one value per update."""
    task = make_task(args, seed)
    torch.manual_seed(seed)  # same initial policy for every method of a seed
    policy = Policy(task["prior"], args.hidden)
    initial = copy.deepcopy(policy).requires_grad_(False)  # the reference of the logged KL
    optimizer = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer]
    opt = optimizer(policy.parameters(), lr=args.lr)
    clip = args.max_grad_norm if args.max_grad_norm > 0 else math.inf  # inf: the norm is measured, nothing is scaled
    all_tokens = args.normalizer == "all"
    rule = args.token_rule if d3s.LADDER[method][2] else "adv-entropy"  # rows without token selection keep every token
    gen = torch.Generator().manual_seed(seed)  # prompt order, rollouts and "random" selection
    score_gen = torch.Generator().manual_seed(seed)  # --token-rule random/adv: its own stream, the rollouts' is untouched
    P, G, L = args.batch_prompts, args.group_size, args.length
    log = {k: [] for k in ("eval_step", *EVAL_KEYS, "step", *TRAIN_KEYS)}
    for step in range(args.steps + 1):  # the evaluation after `step` updates, then update step + 1
        reward_per_prompt = expected_reward(policy, task)  # [prompts]
        if not torch.isfinite(reward_per_prompt).all():  # a NaN anywhere in the policy's table of pi(v | p, t, u)
            raise Diverged(f"{method} seed {seed}: the policy went non-finite after step {step}")
        log["eval_step"].append(step)
        log["eval_reward"].append(float(reward_per_prompt.mean()))
        log["eval_solved"].append(int((reward_per_prompt >= 0.5).sum()))
        if step == args.steps:
            break
        s = step + 1  # this update: steps count from 1, the schedule's position is s - 1 of --steps
        # 1) generate G rollouts for each of P prompts, 2) reward
        prompts = torch.randperm(args.prompts, generator=gen)[:P]  # [P]
        prompt_ids = prompts.repeat_interleave(G)  # [P*G], grouped by prompt
        tokens, sample_logits = policy.sample(prompt_ids, L, gen)  # [P*G, L], [P*G, L, V]
        rewards = reward(task, prompt_ids, tokens).view(P, G)  # [P, G]
        sample_entropy, decisions = d3s.token_entropy(sample_logits), task["decisions"][prompt_ids]  # for the log only
        # 3) advantages + sample selection: N per prompt and K from the method's budget
        n_keep, k_frac = d3s.method_budget(method, s - 1, args.steps, G, args.n_init, args.n_final, args.k_init,
                                           args.k_final, args.static_n, args.static_k, kind=args.schedule,
                                           history=log["reward_mean"])  # history: the train reward of steps 1..s-1
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
        token_scores = d3s.token_scores(kept_adv, entropy, rule=rule, generator=score_gen)  # s_{i,t} = |A_i| * H_{i,t}, [B, L]
        token_keep = d3s.select_tokens(token_scores, mask, k_frac, scope=args.token_scope,
                                       min_per_seq=int(args.min_token_per_response))  # [B, L]
        # 6) loss on the selected tokens (on-policy, one update: w = 1, gradient -A grad logp / #tokens)
        normalizer = P * G * L if all_tokens else None  # None: the selected tokens (token-mean)
        loss, stats = d3s.policy_loss(logp, logp.detach(), kept_adv, token_keep, kind="grpo", ref_logp=ref_logp,
                                      normalizer=normalizer)
        opt.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), clip)  # norm before clipping
        skipped = not torch.isfinite(grad_norm)  # a non-finite gradient: no update this step
        updated = not skipped and bool(token_keep.any())  # dapo-filter on a step with no mixed group: nothing to train on
        if updated:
            opt.step()
        if args.explain_every and (s == 1 or s % args.explain_every == 0):  # reads the step's tensors, draws nothing
            extra = {"loss": loss.item(), "loss normalizer (%s tokens)" % args.normalizer: int(normalizer or token_keep.sum()),
                     "grad norm (before clipping)": float(grad_norm)}
            write_explain(args, method, seed, s, task, prompts, tokens, rewards, keep, adv, kept, entropy, token_scores,
                          token_keep, n_keep, k_frac, extra)
        # the norm the same gradient has when divided by GRPO's count (all P * G * L tokens) instead of the tokens
        # in the loss: what is left of the gradient-norm gain once the normalizer is set aside
        grpo_scale = grad_norm * (P * G * L if all_tokens else token_keep.sum()) / (P * G * L)
        kept_tokens, fwd_tokens = int(token_keep.sum()), int(mask.sum())
        log["step"].append(s)
        for k, v in (("reward_mean", rewards.mean()), ("acc_train", rewards.mean()),  # a 0/1 reward is correctness
                     ("groups_mixed", (rewards.amax(-1) > rewards.amin(-1)).float().mean()), ("k_frac", k_frac),
                     ("k_real", token_keep.sum() / mask.sum()), ("sur", d3s.usefulness_rate(adv, keep)),
                     ("kept_tokens_frac", kept_tokens / (P * G * L)), ("kept_adv_var", d3s.kept_variance(adv, keep)),
                     ("entropy_mean", mean0(entropy)), ("entropy_kept", mean0(entropy[token_keep])), ("kl_ref", stats["kl"]),
                     ("clip_frac", stats["clip_frac"]), ("loss", loss.detach()), ("response_len", L),
                     ("decision_share", mean0(decisions[kept][token_keep].float())),  # of the trained tokens
                     ("entropy_decision", sample_entropy[decisions].mean()), ("entropy_filler", sample_entropy[~decisions].mean())):
            log[k].append(float(v))
        for k, v in (("n_keep", n_keep), ("kept_samples", kept.numel()), ("kept_tokens", kept_tokens),
                     ("fwd_tokens", fwd_tokens), ("gen_tokens", P * G * L), ("updates", int(updated))):
            log[k].append(int(v))
        log["skipped"].append(bool(skipped))
        log["grad_norm"].append(float(grad_norm) if updated else None)  # one optimizer step: its norm, if finite
        log["grad_norm_grpo_scale"].append(float(grpo_scale) if updated else None)
    return log


def mean0(values):
    """The mean of a tensor, 0.0 when it is empty (a dapo-filter step that kept no rollout)."""
    return float(values.mean()) if values.numel() else 0.0


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


def t_cdf(t, df):
    """P(T <= t) for Student's t with an integer df >= 1, exact: the finite series of Abramowitz &
    Stegun 26.7.3 (odd df) and 26.7.4 (even df) in theta = atan(t / sqrt(df)); no scipy needed."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    term, total = 1.0, 1.0
    if df % 2:  # A = 2/pi (theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ... up to c^(df-3)))
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        a = 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    else:  # A = sin (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... up to c^(df-2))
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + math.copysign(a / 2, t)  # A = P(|T| < |t|)


def t_quantile(q, df):
    """The q-quantile of Student's t with integer df >= 1, q in (0, 1): bisection on t_cdf to 1e-10.
    t_quantile(0.975, 9) = 2.2622, (0.975, 29) = 2.0452, (0.975, 10**4) = 1.9602."""
    if q < 0.5:
        return -t_quantile(1 - q, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < q:
        high *= 2
    while high - low > 1e-10 * max(1.0, high):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
    return (low + high) / 2


def paired_interval(diffs, level=0.95):
    """(mean, lower, upper) of paired differences: mean ± t_{(1+level)/2, n-1} * sd / sqrt(n); no bounds for n < 2."""
    n = len(diffs)
    m, sd = mean_std(diffs)
    if n < 2:
        return m, None, None
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def excludes_zero(lower, upper, fmt):
    """Does the interval exclude 0 as printed with `fmt`? [+0.000, +0.053] is read as touching 0, as a reader
    sees it: the verdict never rests on a digit the table does not show."""
    return lower is not None and (float(fmt % lower) > 0 or float(fmt % upper) < 0)


def steps_to(log, target):
    """The updates after which the expected reward first is >= target (0: already at the start), None if
    the run never gets there."""
    return next((s for s, r in zip(log["eval_step"], log["eval_reward"]) if r >= target), None)


def mean_finite(values):
    """The mean of the values that are not None (a skipped update logs grad_norm None); None if there are none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(logs, args, reference="grpo"):
    """Markdown: one row per method, mean ± std over seeds; then, when `reference` ran, each method
    paired by seed with it (same task, initial policy and prompt order) with 95% t intervals."""
    head = ["method"] + ["steps to reward ≥ %g" % t for t in args.target]
    head += ["final reward", "mean reward over the run", "prompts solved /%d" % args.prompts, "mean grad norm",
             "… at GRPO's normalizer", "SUR", "rollouts trained", "tokens trained", "K realised / scheduled"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in logs.items():
        cells = [method]
        for target in args.target:  # seeds that never reach the target are counted, not averaged
            reached = [h for h in (steps_to(log, target) for log in runs) if h is not None]
            cells.append("%.0f ± %.0f (%d/%d)" % (*mean_std(reached), len(reached), len(runs)) if reached else "– (0/%d)" % len(runs))
        for key, reduce, fmt in (("eval_reward", lambda v: v[-1], "%.3f ± %.3f"),
                                 ("eval_reward", lambda v: sum(v) / len(v), "%.3f ± %.3f"),
                                 ("eval_solved", lambda v: v[-1], "%.1f ± %.1f"),
                                 ("grad_norm", mean_finite, "%.3f ± %.3f"),
                                 ("grad_norm_grpo_scale", mean_finite, "%.3f ± %.3f"),
                                 ("sur", lambda v: sum(v) / len(v), "%.2f"),
                                 ("kept_samples", sum, "%.0f"), ("kept_tokens", sum, "%.0f ± %.0f")):
            values = [v for v in (reduce(log[key]) for log in runs) if v is not None]  # None: a run with no update
            cells.append(fmt % mean_std(values)[: fmt.count("%")] if values else "–")
        realised = [sum(log["k_real"]) / len(log["k_real"]) for log in runs]
        scheduled = [sum(log["k_frac"]) / len(log["k_frac"]) for log in runs]
        cells.append("%.3f / %.3f" % (sum(realised) / len(runs), sum(scheduled) / len(runs)))
        rows.append("| " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    if reference in logs and len(logs) > 1:
        table += "\n\n" + paired_table(logs, args, reference)
    return table


def paired_table(logs, args, reference="grpo"):
    """Each method minus `reference`, seed by seed: mean [95% t interval], and the verdict: it differs
    only where the interval, as printed, excludes 0."""
    fmt_interval = lambda m, lo, hi, f: (f % m) + (" [%s, %s]" % (f % lo, f % hi) if lo is not None else " (no interval: 1 seed)")  # noqa: E731
    head = ["method", f"final reward − {reference}'s", "seeds better", f"mean reward over the run − {reference}'s"]
    head += [f"steps to ≥ {t:g} − {reference}'s (seeds where both reach it)" for t in args.target]
    head += [f"differs from {reference} (95%)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = logs[reference]
    for method, runs in logs.items():
        if method == reference:
            continue
        verdict, cells = [], [method]
        for name, key, reduce in (("final reward", "eval_reward", lambda v: v[-1]),
                                  ("mean reward over the run", "eval_reward", lambda v: sum(v) / len(v))):
            diffs = [reduce(log[key]) - reduce(ref[key]) for log, ref in zip(runs, base)]
            m, lo, hi = paired_interval(diffs)
            cells.append(fmt_interval(m, lo, hi, "%+.3f"))
            if name == "final reward":
                cells.append("%d/%d" % (sum(d > 0 for d in diffs), len(diffs)))
            if excludes_zero(lo, hi, "%+.3f"):
                verdict.append(("higher " if lo > 0 else "lower ") + name)
        for target in args.target:
            pairs = [(steps_to(log, target), steps_to(ref, target)) for log, ref in zip(runs, base)]
            diffs = [a - b for a, b in pairs if a is not None and b is not None]
            if not diffs:
                cells.append("– (0/%d)" % len(runs))
                continue
            m, lo, hi = paired_interval(diffs)
            cells.append(fmt_interval(m, lo, hi, "%+.1f") + " (%d/%d)" % (len(diffs), len(runs)))
            if excludes_zero(lo, hi, "%+.1f"):
                verdict.append(("slower" if lo > 0 else "faster") + " to %g" % target)
        cells.append(", ".join(verdict) if verdict else "no")
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
        reward = torch.tensor([log["eval_reward"] for log in runs])  # [seeds, steps + 1]: after 0..S updates
        grad_norm = torch.tensor([[math.nan if g is None else g for g in log["grad_norm"]] for log in runs])
        smooth = min(5, grad_norm.shape[1])  # running mean over 5 steps: the raw curve is noisy
        grad_norm = grad_norm.unfold(1, smooth, 1).mean(-1)  # [seeds, steps - smooth + 1]
        for ax, x, y in ((ax_r, runs[0]["eval_step"], reward), (ax_g, runs[0]["step"][smooth - 1 :], grad_norm)):
            mean, std = y.mean(0), (y.std(0) if len(runs) > 1 else torch.zeros_like(y[0]))
            lower = (mean - std).clamp(min=0.0) if ax is ax_r else (mean - std).clamp(min=mean / 3)  # log axis: no band to 0
            ax.plot(x, mean, style, color=color, label=method, lw=1.2)
            ax.fill_between(x, lower, mean + std, color=color, alpha=0.12, lw=0)
    for target in args.target:
        ax_r.axhline(target, color="grey", lw=0.6, ls=":")
    ax_r.set(xlabel="step", ylabel="expected reward, all prompts", title="reward (mean ± std of %d seeds)" % args.seeds)
    positive = any(v is not None and v > 0 for runs in logs.values() for log in runs for v in log["grad_norm"])
    ax_g.set(xlabel="step", ylabel="gradient norm before clipping", yscale="log" if positive else "linear",
             title="gradient norm (mean ± std, 5-step mean)")
    ax_r.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    from PIL import Image  # comes with matplotlib

    Image.open(path).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)  # ~3x fewer bytes


def metric_lines(log, method, seed):
    """The run's lines of metrics.jsonl (docs/metrics.md), in the trainers' order: eval 0, then per step s
    the train line s and the eval line s."""
    lines = []
    for i, step in enumerate(log["eval_step"]):
        if step > 0:  # train line `step` is entry step - 1 of the train lists (log["step"] = 1..S)
            lines.append({"kind": "train", "step": step, "method": method, "seed": seed,
                          **{k: log[k][step - 1] for k in TRAIN_KEYS}})
        lines.append({"kind": "eval", "step": step, "method": method, "seed": seed,
                      **{k: log[k][i] for k in EVAL_KEYS}})
    return lines


def _run_job(job):
    method, seed, args = job
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    return method, seed, run(method, seed, args)


def notes(args, reference="grpo"):
    """What the tables' numbers are, written under them in results.md."""
    return ("First table: mean ± std over the %d seeds; steps to a target average the seeds that reach it (counted in "
            "brackets). Second table: each method minus %s on the same seed (same task, initial policy and prompt "
            "order), mean [95%% t interval over seeds: mean ± t_{0.975, n-1} · sd / √n]; steps to a target over the "
            "seeds where both reach it (counted in brackets). A method differs from %s only where the interval, as "
            "printed, excludes 0. Per-seed numbers move with the CPU's floating-point path (RL amplifies a last-bit "
            "difference); the interval verdicts should not." % (args.seeds, reference, reference))


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start, logs = time.time(), {m: {} for m in args.methods}
    jobs = [(m, s, args) for m in args.methods for s in range(args.seeds)]
    pool = mp.get_context("spawn").Pool(args.workers) if args.workers > 1 else None  # runs are independent
    results = pool.imap_unordered(_run_job, jobs) if pool else map(_run_job, jobs)
    try:
        for method, seed, log in tqdm(results, total=len(jobs), desc="runs", leave=False):
            logs[method][seed] = log
    except Diverged as e:  # one line, as for a bad flag: the setting (a learning rate) is the cause
        if pool:
            pool.terminate()
        print(f"{PROG}: error: --lr {args.lr:g}: {e}; lower --lr (or keep --max-grad-norm above 0)", file=sys.stderr)
        sys.exit(2)
    if pool:
        pool.close(), pool.join()
    logs = {m: [runs[s] for s in sorted(runs)] for m, runs in logs.items()}  # seed order, whatever the workers did
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        for method, runs in logs.items():
            for seed, log in enumerate(runs):
                f.writelines(json.dumps(line) + "\n" for line in metric_lines(log, method, seed))
    table = summarize(logs, args)
    done = "%d runs in %.1f s (static N=%d, K=%.3f)" % (len(jobs), time.time() - start, args.static_n, args.static_k)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("%s\n\n%s\n\n%s; %s, %s\n" % (table, notes(args), done, " ".join(["toy/bandit.py"] + list(argv if argv is not None else sys.argv[1:])),
                                                time.strftime("%Y-%m-%d %H:%M %Z")))
    plot(logs, args, os.path.join(args.out, "toy.png"))
    print(table)
    print(done + "; wrote %s/{results.md,metrics.jsonl,toy.png}" % args.out)
    return logs


if __name__ == "__main__":
    main()
