"""train_small.py: D3S on a real `transformers` causal LM with verifiable math rewards, on a CPU.

The second rung: the d3s.py functions of the toy drive a Qwen2-architecture model that answers arithmetic word
problems in \\boxed{}, graded by math-verify. With no arguments it builds a tiny model, warm-starts it with a short
supervised phase (both cached: support/warmstart.py), trains it with D3S, evaluates it on held-out problems and prints a
summary, in minutes on a laptop CPU. One RL step (docs/algorithm.md, section 6), the same six calls as train_full.py's:
1 generate, 2 grade, 3 select_samples (d3s.select_samples), 4 forward_kept (d3s.token_entropy of the same logits),
5 select_tokens (d3s.token_scores, d3s.select_tokens), 6 update_policy (d3s.policy_loss per mini-batch, AdamW). With
--mini-batches 1 it is on-policy (ratio 1: no clipping, GSPO = GRPO); with M > 1 the later mini-batches are
off-policy. Left out: value functions, reward models, ranks. Beside this file: support/sampler.py (the KV-cache
sampler), support/run.py (the run's folder, metrics, checkpoints: support/checkpoint.py), support/checks.py.

    python train_small.py                                  # D3S, tiny model, runs/small/d3s__0__TIME/
    python train_small.py --method grpo --loss gspo --mini-batches 4 --out runs/small-grpo
    python train_small.py --resume --out runs/small-grpo   # continue the killed run in --out
    python train_small.py --model Qwen/Qwen2.5-0.5B-Instruct --max-new-tokens 512 \\
        --train-file data/gsm8k.jsonl --eval-file data/gsm8k.jsonl
    python experiments/small_ladder.py --compare grpo,d3s --seeds 3    # methods x seeds, paired: docs/small_compare.md
"""

import copy
import dataclasses
import math
import os
import random
import time

import torch

import d3s
from support import checkpoint, checks, cli, explain, mathtask, methods, reward_function, run, sampler
from support import stops, templates, track, warmstart
from support.grading import Grader, held_out_pass

PROG = "train_small.py"
TINY_MAX_NEW_TOKENS, HF_MAX_NEW_TOKENS = {"steps": 48, "direct": 16}, 512  # a worked answer + EOS: 34 tokens (tiny)
RUN_FLAGS = (
    "method loss steps seed rl_seed model template hidden_size num_layers train_file train_size sft_steps "
    "sft_shortcut sft_lr sft_batch prompts_per_step group_size n_init n_final k_init k_final static_n static_k "
    "schedule token_rule token_scope min_token_per_response switch_on_spike lr warmup_steps max_grad_norm loss_agg "
    "clip_low clip_high mini_batches task kl_coef temperature max_new_tokens system_prompt reward prompt_key answer_key"
).split()  # a resume must repeat them
EPILOG = "Recipe at scale (Qwen2.5-Math-7B; a summary's schedule): G >= 32, N 8 -> 32, K 5% -> 20%, lr 1e-6, "
EPILOG += "clip 0.2/0.28, 3k tokens. The CPU defaults are scaled down; each flag says so."


def build_parser(prog=PROG):
    f, n = cli.flag, cli.number  # one knob a line: f(flag, default, what it may be, help)
    frac, seed = n(float, 0, 1, low_open=True, what="a fraction of tokens in (0, 1]"), n(int, 0, 2**31 - 1)
    group = n(int, 2, 1024, what="an int in [2, 1024] (advantages need 2 rollouts)")
    clip = n(float, 0, 1, high_open=True, what="in [0, 1): the ratio is clipped at 1 - eps_low")
    flags = [
        f("--method", "d3s", None, f"what to train on, a row of methods.LADDER: {', '.join(methods.NAMES)}"),
        f("--loss", "grpo", ["grpo", "gspo"], "policy loss: token ratios (grpo) or the sequence ratio (gspo)"),
        f("--steps", 100, n(int, 1), "RL steps (one optimizer batch of P x G rollouts each)"),
        f("--resume", None, None, "continue OUT/checkpoint.pt (or PATH; auto: if any)", nargs="?", const="latest"),
        f("--config", None, None, cli.CONFIG_HELP, metavar="FILE"),
        f(
            "--out",
            None,
            None,
            "run folder (default: a new runs/small/METHOD__SEED__TIME): metrics.jsonl, checkpoint.pt",
        ),
        f("--seed", 0, seed, "seed of the tiny model, the generated data and the warm start"),
        f("--rl-seed", None, seed, "seed of the RL run: prompt order, sampling, random selection (default: --seed)"),
        f("--threads", 0, n(int, 0, 1024), "torch CPU threads (0: torch's default)"),
        *warmstart.FLAGS,  # the model, the data and the supervised warm start: --model, --task, --sft-steps, ...
        *mathtask.FLAGS,  # the data's columns: --prompt-key, --answer-key
        *reward_function.FLAGS,  # --reward FILE.py:FUNCTION (support/reward_function.py)
        f("--prompts-per-step", 16, n(int, 1, 4096), "P: prompts per step (scaled down for CPU)"),
        f(
            "--group-size",
            16,
            group,
            "G: rollouts per prompt (32 [inferred] from a summary's N_final = 32; scaled down)",
        ),
        f("--n-init", 4, n(int, 1), "N at the first step: rollouts kept per prompt (a summary: 8 of 32)"),
        f("--n-final", 16, n(int, 1), "N at the last step (a summary: 32 of 32)"),
        f("--k-init", 0.05, frac, "K at the first step (a summary: 0.05)"),
        f("--k-final", 0.20, frac, "K at the last step (a summary: 0.20)"),
        f("--static-n", None, n(int, 1), "N of d1s, d1s-cross, d2s, pods (default: the schedule's midpoint) (choice)"),
        f("--static-k", None, frac, "K of d2s (default: the midpoint) (choice)"),
        *methods.flags("--schedule", "--token-rule", "--token-scope", "--switch-on-spike", "--min-token-per-response"),
        f("--lr", 5e-5, n(float, 0, 1, low_open=True), "AdamW learning rate (recipe, 7B: 1e-6)"),
        f("--warmup-steps", 10, n(int, 0, what="an int >= 0 (0: no warmup)"), "the RL lr rises over W steps (choice)"),
        f("--max-grad-norm", 1.0, n(float, 0, low_open=True), "gradient clipping (logged before clipping)"),
        f("--loss-agg", None, ["token-mean", "seq-mean-token-mean"], "default: d3s.DEFAULT_AGG of --loss"),
        f("--clip-low", None, clip, "eps_low (default: 0.2 grpo, 3e-4 gspo (GSPO paper))"),
        f("--clip-high", None, n(float, 0, 100), "eps_high (default: 0.28 grpo, DAPO's clip-higher; 4e-4 gspo)"),
        f("--mini-batches", 4, n(int, 1, 4096), "M: updates per batch ([recipe]: verl's 1024 / 256 = 4); 1: on-policy"),
        f("--kl-coef", 0.0, n(float, 0), "beta of the k3 KL penalty to the warm start (recipe: 0)"),
        f("--kl-every", None, n(int, 0), "the KL metric's cadence with --kl-coef 0 (default: --eval-every; 0: never)"),
        f("--temperature", 1.0, n(float, 0.01, 100), "sampling temperature (rollouts and eval samples)"),
        f("--max-new-tokens", None, n(int, 1, 65536), f"default: {TINY_MAX_NEW_TOKENS}, --model {HF_MAX_NEW_TOKENS}"),
        f("--drop-long-prompts", False, bool, cli.DROP_LONG_PROMPTS_HELP),
        f("--grade-timeout", 5.0, n(float, 0, 3600, low_open=True), "seconds math-verify may spend on an answer"),
        f("--eval-every", 25, n(int, 1), "evaluate on the held-out set every E steps (and at 0 and the end)"),
        f("--eval-samples", 8, n(int, 1, 1024), "n: samples per held-out problem for Pass@1 and Pass@k"),
        f("--mid-eval-samples", None, n(int, 1, 1024), "n before the last evaluation (choice; ladder: 2; <= n)"),
        f("--pass-k", 8, n(int, 1), "k of Pass@k (unbiased estimator from n samples; k <= n)"),
        f("--gen-batch", 512, n(int, 1), "sequences per generate call during evaluation"),
        f("--save-every", 20, n(int, 1), "write OUT/checkpoint.pt every S steps (and at the end)"),
        f("--explain-every", 25, n(int, 0), "step 1 and every N-th step write OUT/explain/step_N.html; 0: off"),
        f("--stop-after", None, n(int, 1), "stop cleanly after step N, checkpointed (continue: --resume)", metavar="N"),
        *track.FLAGS,  # --report-to tensorboard wandb trackio, --run-name, --run-group, --project
    ]
    return cli.parser(prog, __doc__.split("\n\n")[0], flags, epilog=EPILOG)


def parse_args(argv=None, parser=None, method_names=None):
    """The flags, checked together before any work (one line, exit 2), and the defaults that depend on others.
    method_names: the rows the run will train (experiments/small_ladder.py: several); default [--method]."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    checks.check_run(p, args, method_names or [args.method])  # --stop-after, rows, N <= G; static N, K, loss defaults
    if args.hidden_size % 4:
        p.error(f"--hidden-size {args.hidden_size}: must be a multiple of 4 in [8, 4096] (4 heads)")
    if args.pass_k > args.eval_samples:
        p.error(
            f"--pass-k {args.pass_k}: must be an int in [1, --eval-samples {args.eval_samples}] (Pass@k needs k <= n)"
        )
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    if args.resume and args.out is None:
        p.error("--resume: pass --out, the folder of the run to continue")
    if args.out is None:  # a new folder per run: a fresh run never meets an earlier one
        args.out = run.default_out(args, "small")
    for flag, path in (("--out", args.out), ("--cache-dir", args.cache_dir)):
        cli.check_out_dir(p, flag, path)
    reward_function.check_flag(p, args.reward)  # a --reward that does not load: one line
    track.check(p, args)  # a tracker that is not installed: one line before any work; --run-name: the folder's
    for flag, path in (("--train-file", args.train_file), ("--eval-file", args.eval_file)):
        if path is not None and os.path.isdir(path):
            p.error(f"{flag} {path}: is a folder; pass a JSONL, JSON or Parquet file")
    if args.model is not None:
        cli.check_model(p, args.model)
    args.kl_every = args.eval_every if args.kl_every is None else args.kl_every
    args.mid_eval_samples = min(args.mid_eval_samples or args.eval_samples, args.eval_samples)
    if args.max_new_tokens is None:
        args.max_new_tokens = HF_MAX_NEW_TOKENS if args.model else TINY_MAX_NEW_TOKENS[args.task]
    warmstart.fill_defaults(args)  # --sft-steps and --template: by --model and --task
    return args


# === The six steps of a step ==========================================================================================
@dataclasses.dataclass
class Selection:
    """What a step trains on, filled by steps 3 and 5 (row b of `kept` is rollout kept_rows[b] = p * G + g)."""

    method_row: str  # the LADDER row that selects: --method, or its intra-group twin once --switch-on-spike fired
    n_keep: int  # N, rollouts kept per prompt (cross-group: N * P in all)
    k_frac: float  # K, the scheduled fraction of the tokens
    keep: torch.Tensor  # [P, G] bool: the kept rollouts (d3s.select_samples)
    adv: torch.Tensor  # [P, G]: their advantages (0 where dropped)
    kept_rows: torch.Tensor  # [B]: flat indices p * G + g of the kept rollouts
    kept: dict  # the kept rollouts ([B, T] tensors: sampler.take_rows)
    kept_adv: torch.Tensor  # [B]
    parts: list  # the M mini-batches: row indices of `kept`
    token_keep: torch.Tensor = None  # [B, T] bool: the tokens in the loss (step 5)
    scores: torch.Tensor = None  # [B, T]: their scores, |A| * H by default (step 5)


@dataclasses.dataclass
class Pass1:
    """Step 4's forwards of the kept rollouts, before any update."""

    first_logp: torch.Tensor  # [b, T'] log-probs of mini-batch 1, with grad (on-policy: the update reuses them)
    old_logp: torch.Tensor  # [B, T] log pi_old, no grad
    entropy: torch.Tensor  # [B, T] H_t of the same logits
    ref_logp: torch.Tensor  # [B, T] the warm start's log-probs on the steps that measure the KL, else None
    seconds: float  # of the no-grad forwards (pass1_s)


def generate(model, tokenizer, problems, args):
    """1) G rollouts per prompt (row p*G + g), o_t ~ softmax(logits / T): sampler.sample, each prompt's keys and
    values shared by its G rollouts. Returns the rollouts: prompt and response ids and masks [P*G, T], texts."""
    prompts = [templates.format_prompt(r["problem"], args.template, tokenizer, args.system_prompt) for r in problems]
    return sampler.sample(model, tokenizer, prompts, args.group_size, args.max_new_tokens, args.temperature)


def grade(rollouts, problems, grader):
    """2) rewards [P, G]: math-verify's 0/1 on the last \\boxed{} of each text against its problem's gold answer, or
    --reward's function (support/reward_function.py), killed after the time limit (grading.Grader). One call for the P x G
    answers: the pool grades them together."""
    G = len(rollouts["texts"]) // len(problems)
    rows = [r for r in problems for _ in range(G)]
    return torch.tensor(grader.rewards(rollouts["texts"], rows), dtype=torch.float32).view(-1, G)


def select_samples(rewards, rollouts, method_row, step, args, history):
    """3) N per prompt by max Var(A) (d3s.select_samples with the row's samples rule; N and K of the step from
    methods.budget, `history`: the train rewards so far, for --schedule adaptive), then the kept rollouts and the
    --mini-batches M that update on them."""
    n_keep, k_frac = methods.budget(args, method_row, step, history=history)
    gen = torch.Generator().manual_seed(step_seed(args.rl_seed, step, 1))
    keep, adv = d3s.select_samples(rewards, n_keep, methods.LADDER[method_row].samples, generator=gen)
    kept_rows = keep.view(-1).nonzero().squeeze(-1)  # [B] indices of the kept rollouts
    kept, kept_adv = sampler.take_rows(rollouts, kept_rows), adv.view(-1)[kept_rows]  # [B, T], [B]
    parts = [rows for rows in torch.arange(len(kept_rows)).tensor_split(args.mini_batches) if len(rows)]
    return Selection(
        method_row=method_row,
        n_keep=n_keep,
        k_frac=k_frac,
        keep=keep,
        adv=adv,
        kept_rows=kept_rows,
        kept=kept,
        kept_adv=kept_adv,
        parts=parts,
    )


def forward_kept(model, ref_model, sel, temperature):
    """4) The kept rollouts before any update: mini-batch 1 with grad (on-policy: its forward gives its old log-probs
    too), mini-batches 2..M without, and ref_model's log-probs when given (the steps that measure the KL)."""
    B, T = sel.kept["response_ids"].shape
    old_logp, entropy = torch.zeros(B, T), torch.zeros(B, T)
    if not sel.parts:  # nothing kept (dapo-filter on a step without a group with spread): no forward
        return Pass1(None, old_logp, entropy, None, 0.0)
    first = sampler.take_rows(sel.kept, sel.parts[0])
    width = first["response_ids"].shape[1]
    first_logp, first_entropy = sampler.logprobs_entropy(model, first, temperature)  # [b, width], with grad
    old_logp[sel.parts[0], :width], entropy[sel.parts[0], :width] = first_logp.detach(), first_entropy
    t0 = time.time()
    with torch.no_grad():
        for rows in sel.parts[1:]:
            part = sampler.take_rows(sel.kept, rows)
            width = part["response_ids"].shape[1]
            old_logp[rows, :width], entropy[rows, :width] = sampler.logprobs_entropy(model, part, temperature)
        ref_logp = sampler.logprobs_entropy(ref_model, sel.kept, temperature, False)[0] if ref_model else None
    return Pass1(first_logp, old_logp, entropy, ref_logp, time.time() - t0)


def select_tokens(sel, entropy, step, args):
    """5) The top K of |A| * H (or --token-rule's score) over the whole batch (--token-scope sequence: within each
    response): d3s.token_scores, then d3s.select_tokens. Returns (token_keep [B, T] bool, scores [B, T])."""
    gen = torch.Generator().manual_seed(step_seed(args.rl_seed, step, 2))
    scores = d3s.token_scores(sel.kept_adv, entropy, rule=methods.TOKEN_RULES[args.token_rule], generator=gen)
    floor = int(args.min_token_per_response)  # each kept response's best token (off: plain top K)
    mask = sel.kept["response_mask"]
    return d3s.select_tokens(scores, mask, sel.k_frac, scope=args.token_scope, min_per_seq=floor), scores


def update_policy(model, optimizer, sel, pass1, args):
    """6) The M mini-batches in order, one optimizer step each: d3s.policy_loss over the mini-batch's selected tokens
    (its own normalizer), backward, clip, AdamW; a NaN/inf loss or gradient skips the step (logged)."""
    grad_norms, clip_fracs, losses, kls, skipped = [], [], [], [], 0
    for i, rows in enumerate(sel.parts):
        if not bool(sel.token_keep[rows].any()):  # no selected token in this part: nothing to learn from
            continue
        part = sampler.take_rows(sel.kept, rows)
        logp = pass1.first_logp if i == 0 else sampler.logprobs_entropy(model, part, args.temperature, False)[0]
        width = logp.shape[1]
        loss, stats = d3s.policy_loss(
            logp,
            pass1.old_logp[rows, :width],
            sel.kept_adv[rows],
            sel.token_keep[rows, :width],
            kind=args.loss,
            clip_low=args.clip_low,
            clip_high=args.clip_high,
            beta=args.kl_coef,
            agg=args.loss_agg,
            ref_logp=pass1.ref_logp[rows, :width] if pass1.ref_logp is not None else None,
        )
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clip_fracs.append((stats["clip_frac"], stats["tokens"]))
        kls.append((stats["kl"], stats["tokens"]))
        if not math.isfinite(losses[-1]):  # never apply a NaN/inf loss: skip the update, log it
            skipped += 1
            continue
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item())
        if not math.isfinite(grad_norms[-1]):  # a finite loss can still give inf gradients
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kl_ref = sum(k * n for k, n in kls) / max(sum(n for _, n in kls), 1.0) if pass1.ref_logp is not None else None
    return {"grad_norms": grad_norms, "clip_fracs": clip_fracs, "losses": losses, "skipped": skipped, "kl_ref": kl_ref}


# === What a step reports ==============================================================================================
@torch.no_grad()
def kl_ref_all(model, ref_model, rollouts, temperature=1.0):
    """k3 KL of the policy before the step's update to the warm start on every response token (the same tokens for
    every row)."""
    logp = sampler.logprobs_entropy(model, rollouts, temperature, with_entropy=False)[0]  # [P*G, T]
    ref_logp = sampler.logprobs_entropy(ref_model, rollouts, temperature, with_entropy=False)[0]
    return float(d3s.kl_k3(logp, ref_logp)[rollouts["response_mask"].bool()].mean())


def step_metrics(step, rollouts, rewards, sel, pass1, update):
    """The step's line of metrics.jsonl (docs/metrics.md), less its clocks."""
    grad_norms, response_mask = update["grad_norms"], sel.kept["response_mask"]
    entropy, token_keep = pass1.entropy, sel.token_keep
    gen_tokens, fwd_tokens, kept_tokens = (
        int(rollouts["response_mask"].sum()),
        int(response_mask.sum()),
        int(token_keep.sum()),
    )
    return {
        "kind": "train",
        "step": step,
        "reward_mean": float(rewards.mean()),
        "acc_train": float(rewards.mean()),  # the reward is correctness (0/1): the same number
        "groups_mixed": float((rewards.amax(-1) > rewards.amin(-1)).float().mean()),  # groups with signal
        "n_keep": sel.n_keep,
        "k_frac": sel.k_frac,
        "k_real": kept_tokens / max(fwd_tokens, 1),  # of the forwarded tokens
        "kept_samples": int(sel.keep.sum()),
        "sur": d3s.usefulness_rate(sel.adv, sel.keep),  # kept rollouts with A != 0
        "kept_tokens": kept_tokens,
        "fwd_tokens": fwd_tokens,
        "gen_tokens": gen_tokens,  # in the loss, forwarded, generated
        "kept_tokens_frac": kept_tokens / max(gen_tokens, 1),
        "kept_adv_var": d3s.kept_variance(sel.adv, sel.keep),
        "grad_norm": run.mean([g for g in grad_norms if math.isfinite(g)]),  # null: no finite norm this step
        "entropy_mean": float(
            (entropy * response_mask).sum() / response_mask.sum().clamp(min=1)
        ),  # all forwarded tokens
        "entropy_kept": float(entropy[token_keep].mean()) if token_keep.any() else 0.0,  # the selected tokens
        "kl_ref": update["kl_ref"],  # k3 to the warm start on the selected tokens; None where not measured
        "clip_frac": sum(c * n for c, n in update["clip_fracs"]) / max(sum(n for _, n in update["clip_fracs"]), 1),
        "clip_frac_by_minibatch": [c for c, _ in update["clip_fracs"]],
        "loss": run.mean([x for x in update["losses"] if math.isfinite(x)]),  # over optimizer steps; null: none
        "updates": len(grad_norms) - sum(not math.isfinite(g) for g in grad_norms),
        "skipped": update["skipped"] > 0,
        "response_len": gen_tokens / rewards.numel(),
    }


def step_seed(seed, step, salt=0):
    """Every step (and eval) reseeds from (seed, step): the trajectory depends on neither when evaluations happen nor
    whether the run was resumed."""
    return (seed * 1_000_003 + step * 7_919 + salt) % 2**31


def evaluate(model, tokenizer, grader, eval_rows, step, args):
    """Held-out greedy Pass@1, mean Pass@1 over n samples and unbiased Pass@k (grading.held_out_pass; --eval-reward
    train: of the run's own reward); n is --eval-samples at the last step, --mid-eval-samples before it (k <= n)."""
    t0, n = time.time(), args.eval_samples if step == args.steps else args.mid_eval_samples
    torch.manual_seed(step_seed(args.rl_seed, step, 2))
    prompt = lambda problem: templates.format_prompt(problem, args.template, tokenizer, args.system_prompt)
    rows = [{**r, "prompt": prompt(r["problem"])} for r in eval_rows]
    sample = lambda prompts, n, greedy: sampler.sample(
        model, tokenizer, prompts, n, args.max_new_tokens, 1.0 if greedy else args.temperature, greedy=greedy
    )["texts"]
    metrics = held_out_pass(rows, sample, grader, n, min(args.pass_k, n), max(1, args.gen_batch // n), args=args)
    return {"kind": "eval", "step": step, **metrics, "eval_s": round(time.time() - t0, 3)}


def add_totals(totals, m):
    """The run's totals (summary.json, the eval lines) after the train line `m`."""
    totals["samples"] += m["kept_samples"]
    totals["tokens"] += m["kept_tokens"]
    totals["fwd_tokens"] += m["fwd_tokens"]
    totals["gen_s"] += m["gen_s"] + m["reward_s"]
    totals["train_s"] += m["train_s"]
    totals["skipped"] += int(m["skipped"])


# === The run ==========================================================================================================
def train(args, train_rows, eval_rows, warm, resume=None):
    """Warm start -> RL with args.method -> held-out evaluations -> summary (dict). Writes into args.out. resume: the
    checkpoint --resume continues from (checkpoint.start), else None."""
    t_start = time.time()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer, warm_info = checks.finite_warm_start(warm, args, train_rows)  # NaN/inf weights, logits: one line
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the warm start: reference of the logged KL
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start_step, totals, history = 0, {"samples": 0, "tokens": 0, "fwd_tokens": 0, "gen_s": 0.0, "train_s": 0.0}, None
    totals["skipped"], ckpt_path = 0, os.path.join(args.out, "checkpoint.pt")
    if resume:  # model, AdamW, the totals and the history the rules read: as the checkpoint left them
        start_step, totals, history = checkpoint.load_file(resume.saved, model, optimizer)
        print(f"resumed {resume.path} at step {start_step}")

    def save(step):  # OUT/checkpoint.pt: model, AdamW, the run's flags, totals and history
        flags = {k: getattr(args, k) for k in RUN_FLAGS}
        checkpoint.save_file(ckpt_path, model, optimizer, step, flags, totals, history=r.history)
        return ckpt_path

    rl_start = time.time()
    grader = Grader(timeout_s=args.grade_timeout, reward=args.reward)  # --reward's function, else math-verify
    with grader, stops.Notices(PROG, out=args.out) as notices:
        r = run.Run(args, PROG, notices, start_step, history)  # metrics.jsonl: what the checkpoint covers
        if start_step == 0:  # the warm start's evaluation: step 0
            info = {k: v for k, v in warm_info.items() if k != "cached"}
            r.log({**evaluate(model, tokenizer, grader, eval_rows, 0, args), **totals, "warm_start": info})
        desc, steps = f"{args.method} ({args.loss}, seed {args.rl_seed})", range(start_step + 1, args.steps + 1)
        bar = run.progress_bar(steps, desc=desc, initial=start_step, total=args.steps)  # tqdm, or lines in a log file
        step, notice = start_step, None
        for step in bar:
            for group in optimizer.param_groups:  # linear warmup: lr * min(1, step / W)
                group["lr"] = args.lr * min(1.0, step / args.warmup_steps) if args.warmup_steps else args.lr
            torch.manual_seed(step_seed(args.rl_seed, step))
            n_prompts = min(args.prompts_per_step, len(train_rows))
            problems = random.Random(step_seed(args.rl_seed, step)).sample(train_rows, n_prompts)
            t0 = time.time()
            rollouts = generate(model, tokenizer, problems, args)  # 1) G rollouts per prompt
            gen_s = time.time() - t0
            rewards = grade(rollouts, problems, grader)  # 2) 0/1 rewards [P, G]
            reward_s, t1 = time.time() - t0 - gen_s, time.time()
            # 3) select samples: N per prompt by max Var(A) (the row: --method, or its twin once the switch rule fired)
            method_row = methods.switch_to_intra(args.method, r.history["grad_norms"], args.switch_on_spike)
            sel = select_samples(rewards, rollouts, method_row, step, args, r.history["rewards"])
            with_kl = run.measures_kl(step, args)
            kl_all = (
                kl_ref_all(model, ref_model, rollouts, args.temperature) if with_kl else None
            )  # all tokens, a metric
            # 4) forward the kept rollouts only: old log-probs, entropy (and the reference's log-probs on KL steps)
            pass1 = forward_kept(model, ref_model if with_kl else None, sel, args.temperature)
            sel.token_keep, sel.scores = select_tokens(sel, pass1.entropy, step, args)  # 5) top K of |A| * H
            update = update_policy(model, optimizer, sel, pass1, args)  # 6) M mini-batches, d3s.policy_loss, AdamW
            m = {
                **step_metrics(step, rollouts, rewards, sel, pass1, update),
                "grader_timeouts": grader.timeouts,
                "kl_ref_all": kl_all,
                "sample_rule": methods.rule_name(method_row),
                "gen_s": round(gen_s, 3),
                "reward_s": round(reward_s, 3),
                "train_s": round(time.time() - t1, 3),
                "pass1_s": round(pass1.seconds, 3),
            }
            if args.reward:  # acc_train: correctness, which only math-verify's 0/1 reward measures
                del m["acc_train"]
            if args.explain_every and (step == 1 or step % args.explain_every == 0):  # OUT/explain/step_N.html
                png = explain.small_page(
                    step, tokenizer, problems, rollouts, rewards, sel, entropy=pass1.entropy, metrics=m, args=args
                )
                r.trackers.image(step, png)  # its figure beside the curves (--report-to)
            add_totals(totals, m)
            r.log(m)  # metrics.jsonl
            bar.set_postfix(reward=f"{m['reward_mean']:.2f}", N=sel.n_keep, K=f"{sel.k_frac:.2f}", gnorm=m["grad_norm"])
            if step % args.eval_every == 0 or step == args.steps:
                e = evaluate(model, tokenizer, grader, eval_rows, step, args)
                r.log({**e, **totals})
                one, k = run.score_names(e)  # Pass@1 and Pass@k, or --eval-reward train's mean rewards
                bar.write(
                    f"step {step}: held-out greedy {one} {e['eval_greedy_pass1']:.3f}, {one} (mean of {e['n']}) "
                    f"{e['eval_pass1_mean']:.3f}, {k}{e['k']} {e['eval_passk']:.3f}"
                )
            notice = r.checkpoint(step, notices.agree(), save)  # every --save-every steps, and on a notice
            if notice or step == args.stop_after:
                break
        bar.close()
        r.close()  # the trackers
        timeouts = grader.timeouts
    if notice:  # SIGTERM, SIGUSR1 or a first Ctrl-C: stopped after this step and its checkpoint, exit 75
        stops.stopped(PROG, notice, step, r.saved)
    if step == args.stop_after:
        print(f"stopped after step {step} (--stop-after); continue with --resume", flush=True)
        return None
    checkpoint.export_pretrained(model, tokenizer, os.path.join(args.out, "final"))  # from_pretrained loads it
    lines = run.read_metrics(os.path.join(args.out, "metrics.jsonl"))
    rl_s, wall_s = time.time() - rl_start, time.time() - t_start
    return run.write_summary(args, lines, warm_info, totals, timeouts, rl_s=rl_s, wall_s=wall_s)


def main(argv=None):
    args = parse_args(argv)
    try:  # every bad flag, file, model or checkpoint stops here, before training, with one line
        train_rows, eval_rows = warmstart.fit_files(args, *mathtask.load_data(args))  # prompts that fit the context
        flags = {k: getattr(args, k) for k in RUN_FLAGS}
        with run.out_lock(args.out, PROG):  # one writer per run folder, from before anything in it is read
            resume = checkpoint.start(args, flags, PROG)  # fresh (None) or the checkpoint to continue
            run.write_args(args, flags)  # OUT/args.json
            return train(args, train_rows, eval_rows, warmstart.load_warm_start(args, train_rows), resume)
    except Exception as e:  # bad input (exit 2) or a full disk (exit 74): one line; anything else is raised on
        stops.fail(PROG, e, args.out)


if __name__ == "__main__":
    stops.interruptible(main, PROG, "the last checkpoint in --out, if any, is intact; continue with --resume")
