"""train_small.py: D3S on a real `transformers` causal LM with verifiable math rewards, on a CPU.

The second rung: the `d3s.py` functions of the toy drive a real Qwen2-architecture model that
answers generated arithmetic word problems in \\boxed{}, graded by math-verify. With no
arguments it builds a tiny model (cached), warm-starts it with a short supervised phase
(cached), trains it with D3S, evaluates it and prints a summary, in minutes on a laptop CPU.

    python train_small.py                                  # D3S, tiny model, runs/small/
    python train_small.py --compare grpo,d1s,d1s-cross,d2s,d3s,d3s-i --seeds 3
                                                           # the paper's ladder, same warm start,
                                                           # 3 RL seeds: compare.md, compare.png
    python train_small.py --method grpo --loss gspo --mini-batches 4
    python train_small.py --resume                         # continue the killed run in --out
    python train_small.py --model Qwen/Qwen2.5-0.5B-Instruct --max-new-tokens 512 \\
        --train-file data/gsm8k.jsonl --eval-file data/gsm8k.jsonl

One RL step (docs/algorithm.md section 6), one function or d3s.py call per line:
  1. rollout                    G samples per prompt with HF generate (temperature sampling)
  2. compute_rewards            0/1: last \\boxed{} vs the gold answer, math-verify under a time limit
  3. d3s.select_samples         keep N per prompt (N and K from d3s.method_budget)
  4. forward_logprobs_entropy   kept rollouts only, each prompt forwarded once for its G
                                rollouts: mini-batch 1 with grad (on-policy: its own log-probs
                                are the old ones), mini-batches 2..M without (pass 1: old
                                log-probs); d3s.token_entropy of the same logits
  5. d3s.token_scores,          keep the top K of |A| * H
     d3s.select_tokens
  6. d3s.policy_loss            per mini-batch (M optimizer steps per batch): GRPO or GSPO loss;
                                a NaN/inf loss or gradient skips the update (logged), else
                                backward, clip the gradient norm, AdamW step

Methods: the rows of d3s.LADDER (all generate the same P x G rollouts per step; they differ in
what they train on): the paper's ablation ladder grpo -> d1s (intra-group samples, static N)
-> d1s-cross (cross-group) -> d2s (+ top-K tokens, static K) -> d3s (+ the schedule), and d3s-i
(intra-group, tokens, schedule), pods (max-variance by reward, A recomputed), random, and DAPO's
filter, dapo-filter (every rollout of the groups with spread) and dapo-filter-k (+ D3S's tokens).
The questions the paper left open (--schedule, --token-rule, --token-scope): docs/questions.md.

Left out on purpose: value functions, reward models and distributed training (train_full.py).
With one mini-batch (--mini-batches 1) training is on-policy: the importance ratio is exactly
1, clipping never binds, and --loss gspo gives the same gradient as grpo. With M > 1 the later
mini-batches are off-policy (old log-probs from before the first), so ratios, clipping and
GSPO act. The KL to the warm start is measured on the selected tokens (--kl-coef 0: not in
the loss, as in the paper's recipe, and measured every --kl-every steps only).
"""

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import pickle
import platform
import random
import re
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np
import torch
from tqdm import tqdm

import d3s
import explain
from mathtask import (PLAIN_TEMPLATE, QWEN_MATH_TEMPLATE, DataError, Grader, arithmetic_problems, step_problems,
                      load_problems, pass_at_k, stop_token_ids)

# response length limits: a worked answer "73+96=169. 169-6=163. \boxed{163}" + EOS is 34 tokens for the tiny
# model, a direct one "\boxed{123}" + EOS 12; any HF model with --model
TINY_MAX_NEW_TOKENS, HF_MAX_NEW_TOKENS = {"steps": 48, "direct": 16}, 512
TASKS = {"steps": step_problems, "direct": arithmetic_problems}  # mathtask's generated tasks
TINY_SFT_STEPS = {"steps": 600, "direct": 1000}  # warm-start length per task: a start with headroom (docs/small_compare.md)


class UsageError(ValueError):
    """A flag, file or model that cannot be used; printed as one line before training starts."""


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line on stderr (no usage block), exit 2."""

    def error(self, message):
        message = " ".join(str(message).split())
        flag = re.match(r"argument (--[\w-]+): expected one argument$", message)
        if flag:  # "--lr -inf": argparse reads a value that starts with '-' as a flag
            message = f"argument {flag.group(1)}: expected one value; pass one that starts with '-' as {flag.group(1)}=VALUE"
        if "invalid" in message or "unrecognized" in message or "expected" in message:
            message += f"; see {self.prog} --help"  # what to do: argparse says only what is wrong
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser():
    p = Parser(
        prog="train_small.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Paper recipe (Qwen2.5-Math-7B): G >= 32, N 8 -> 32, K 5% -> 20%, lr 1e-6, clip 0.2/0.28, "
               "temperature 1.0, 3k response tokens. The CPU defaults here are scaled down; each flag says so.")
    a = p.add_argument
    g = p.add_argument_group("run")
    g.add_argument("--method", default="d3s", help=f"what to train on, a row of d3s.LADDER: {', '.join(d3s.METHODS)}")
    g.add_argument("--loss", default="grpo", help="policy loss: grpo (token ratios) or gspo (sequence ratio)")
    g.add_argument("--steps", type=int, default=100, help="RL steps (one optimizer batch of P x G rollouts each)")
    g.add_argument("--compare", default=None, metavar="M1,M2,...",
                   help="run these methods from the same warm start into OUT/<method>/seed<S>, for --seeds RL seeds "
                        "each, then write OUT/compare.md and OUT/compare.png (mean ± std over seeds)")
    g.add_argument("--seeds", type=int, default=1, help="with --compare: RL seeds per method (--rl-seed, --rl-seed + 1, ...); "
                   "the warm start is the same for all")
    g.add_argument("--workers", type=int, default=1, help="with --compare: runs at once, each a train_small.py process "
                   "(give each --threads 1 on a small machine: 2 workers x 1 thread on 2 cores)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue a killed or stopped run: from PATH (a checkpoint.pt), or with no PATH from OUT/checkpoint.pt; "
                        "the run's flags must be the ones it was started with")
    g.add_argument("--out", default="runs/small", help="run directory: metrics.jsonl, checkpoint.pt, summary.json, final/")
    g.add_argument("--seed", type=int, default=0, help="seed of the tiny model, the generated data and the warm start")
    g.add_argument("--rl-seed", type=int, default=None, help="seed of the RL run: prompt order, sampling, random selection "
                   "(default: --seed)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, metavar="PATH_OR_HUB_NAME",
                   help="any HF causal LM (folder or hub name) instead of the tiny model, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    g.add_argument("--template", default="auto", help="prompt template: plain ('{problem}\\nAnswer: '), qwen-math "
                   "(Qwen2.5-Math chat template), or auto (plain for the tiny model, qwen-math with --model)")
    g.add_argument("--hidden-size", type=int, default=128, help="tiny model: hidden size")
    g.add_argument("--num-layers", type=int, default=4, help="tiny model: transformer layers")
    g.add_argument("--task", default="steps", help="the generated task of the tiny model: steps (worked solutions, "
                   "'47+8=55. 55-13=42. \\boxed{42}': every intermediate result is a decision; mathtask.step_problems) or "
                   "direct (the answer only, '\\boxed{42}'; mathtask.arithmetic_problems)")
    g.add_argument("--train-file", default=None, help="JSONL/JSON/Parquet with 'problem' and 'answer' (default: generated arithmetic)")
    g.add_argument("--eval-file", default=None, help="held-out JSONL/JSON/Parquet (default: generated arithmetic, disjoint from train)")
    g.add_argument("--train-size", type=int, default=5000, help="generated training problems (or the first rows of --train-file)")
    g.add_argument("--eval-size", type=int, default=200, help="held-out problems (generated, or the first rows of --eval-file)")
    g.add_argument("--cache-dir", default="runs/cache", help="where the warm-started model is cached")
    g = p.add_argument_group("warm start (supervised, on '\\boxed{answer}' of the training problems; cached)")
    g.add_argument("--sft-steps", type=int, default=None,
                   help=f"supervised steps before RL (default for the tiny model: {TINY_SFT_STEPS['steps']} with --task steps, {TINY_SFT_STEPS['direct']} with direct, 0 with --model)")
    g.add_argument("--sft-shortcut", type=float, default=0.7, help="share of the multi-step demonstrations (--task steps) "
                   "that work every step out but box the first step's result: a habit of the warm start that the reward "
                   "punishes and RL can unlearn (0: every demonstration right; 0.7 leaves held-out Pass@1 near 0.35, "
                   "0.5 near 0.50: docs/small_compare.md) (choice)")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="supervised learning rate (linear decay to 10%%)")
    g.add_argument("--sft-batch", type=int, default=64, help="supervised batch size")
    g = p.add_argument_group("RL")
    g.add_argument("--prompts-per-step", type=int, default=16, help="P: prompts per step (scaled down for CPU)")
    g.add_argument("--group-size", type=int, default=16, help="G: rollouts per prompt (paper: 32, [inferred] from N_final = 32; "
                   "scaled down for CPU)")
    g.add_argument("--n-init", type=int, default=4, help="N at the first step: rollouts kept per prompt (paper: 8 of 32)")
    g.add_argument("--n-final", type=int, default=16, help="N at the last step (paper: 32 of 32)")
    g.add_argument("--k-init", type=float, default=0.05, help="K at the first step: fraction of tokens kept (paper: 0.05)")
    g.add_argument("--k-final", type=float, default=0.20, help="K at the last step (paper: 0.20)")
    g.add_argument("--static-n", type=int, default=None, help="N of the static rows d1s, d1s-cross, d2s, pods (default: "
                   "the schedule's midpoint, so they train on about as many rollouts as the schedule) (choice)")
    g.add_argument("--static-k", type=float, default=None, help="K of d2s (default: the schedule's midpoint) (choice)")
    g.add_argument("--schedule", default="linear", help="the curve N and K follow from init to final in the scheduled rows "
                   "(d3s, d3s-i, random, dapo-filter-k): linear (paper), cosine, step (init for the first half, final "
                   "after), constant (init throughout), adaptive (relax only when the train reward plateaus; "
                   "d3s.dynamic_schedule)")
    g.add_argument("--token-rule", default="adv-entropy", help="token score of the rows that select tokens: adv-entropy "
                   "(|A| * H, paper), entropy (H), adv (|A|, ties at random), random (a control) (d3s.token_scores)")
    g.add_argument("--token-scope", default="batch", help="top-K tokens over the whole batch (batch) or within each response "
                   "(sequence) (choice; paper: not stated)")
    g.add_argument("--switch-on-spike", type=float, default=0.0, help="the switch rule (paper's open question 1; "
                   "d3s.switch_to_intra): a cross-group row (d3s, d1s-cross) selects its samples within groups, as d3s-i "
                   "and d1s do, from the step after the first whose grad norm exceeds this x the median of the 10 steps "
                   "before, to the end; 0: off, the paper's method (choice: 3 is the spike of docs/questions.md, question 5)")
    g.add_argument("--min-token-per-response", action="store_true", help="every kept response keeps at least its best token "
                   "(off: the paper's plain top-K%%, so the realised fraction is K)")
    g.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (recipe, 7B: 1e-6; the tiny model's, "
                   "and the rates that collapsed it: docs/small_compare.md)")
    g.add_argument("--warmup-steps", type=int, default=10, help="W: the RL learning rate rises linearly over the first W steps "
                   "(lr * step / W), so that AdamW's first, sign-like steps are small (paper: not stated) (choice)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (grad_norm is logged before clipping)")
    g.add_argument("--loss-agg", default=None, help="token-mean (every selected token weighs the same) or seq-mean-token-mean "
                   "(every response weighs the same, GSPO's own); default: token-mean for grpo, seq-mean-token-mean for gspo")
    g.add_argument("--clip-low", type=float, default=None, help="eps_low of the clipped ratio (default: 0.2 grpo, 3e-4 gspo "
                   "(GSPO paper))")
    g.add_argument("--clip-high", type=float, default=None, help="eps_high (default: 0.28 grpo, DAPO's clip-higher; 4e-4 gspo "
                   "(GSPO paper))")
    g.add_argument("--mini-batches", type=int, default=4, help="M: optimizer steps per rollout batch, each on 1/M of the kept "
                   "rollouts, old log-probs from before the first ([recipe]: verl's Qwen2.5-Math GRPO runs use "
                   "train_batch_size 1024 / ppo_mini_batch_size 256 = 4); 1 = on-policy (ratio 1, GSPO = GRPO)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="beta of the k3 KL penalty to the warm-start model (recipe: 0; "
                   "the KL is logged either way)")
    g.add_argument("--kl-every", type=int, default=None, help="with --kl-coef 0 the KL to the warm start is only a metric: "
                   "the warm-start model is forwarded on step 1, every E steps and the last step (kl_ref is null on the "
                   "others); default: --eval-every; 0: never. With --kl-coef > 0 it is in the loss and measured every step")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (rollouts and eval samples)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"response length limit (default: {TINY_MAX_NEW_TOKENS} tiny model, {HF_MAX_NEW_TOKENS} with --model; paper: 3k)")
    g.add_argument("--grade-timeout", type=float, default=5.0, help="seconds math-verify may spend on one answer (then reward 0)")
    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval-every", type=int, default=10, help="E: evaluate on the held-out set every E steps (and at step 0 and the end)")
    g.add_argument("--eval-samples", type=int, default=8, help="n: samples per held-out problem for Pass@1 (mean) and Pass@k")
    g.add_argument("--pass-k", type=int, default=8, help="k of Pass@k (unbiased estimator from n samples; k <= n; k = n: "
                   "the share of problems with at least one correct sample)")
    g.add_argument("--gen-batch", type=int, default=512, help="sequences per generate call during evaluation")
    g.add_argument("--save-every", type=int, default=20, help="S: write OUT/checkpoint.pt every S steps (and at the end)")
    g.add_argument("--explain-every", type=int, default=25, help="step 1 and every N-th step write OUT/explain/step_NNNNNN.html "
                   "(+ .png): which rollouts and tokens the step trained on (explain.py); 0 = off")
    g.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop cleanly after step N: write the checkpoint and exit 0, without the final model and summary "
                        "(continue with --resume)")
    del a
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command = " ".join(["python train_small.py"] + args.argv)
    return args


def check_args(args):
    """Stop before any work on a bad flag: UsageError names the flag and what to do."""
    methods = args.compare.split(",") if args.compare else [args.method]
    for m in methods:
        if m not in d3s.LADDER:
            flag = "--compare" if args.compare else "--method"
            hint = " (d3s-static is now d2s, the paper's name)" if m == "d3s-static" else ""
            raise UsageError(f"{flag} {m!r}: unknown method{hint}; choose from {', '.join(d3s.METHODS)}")
    if args.loss not in ("grpo", "gspo"):
        raise UsageError(f"--loss {args.loss!r}: choose grpo or gspo")
    if args.loss_agg not in (None, "token-mean", "seq-mean-token-mean"):
        raise UsageError(f"--loss-agg {args.loss_agg!r}: choose token-mean or seq-mean-token-mean")
    if args.token_scope not in ("batch", "sequence"):
        raise UsageError(f"--token-scope {args.token_scope!r}: choose batch or sequence")
    if args.schedule not in d3s.SCHEDULES:
        raise UsageError(f"--schedule {args.schedule!r}: choose {', '.join(d3s.SCHEDULES)}")
    if args.token_rule not in d3s.TOKEN_RULES:
        raise UsageError(f"--token-rule {args.token_rule!r}: choose {', '.join(d3s.TOKEN_RULES)}")
    if args.task not in TASKS:
        raise UsageError(f"--task {args.task!r}: choose {' or '.join(TASKS)}")
    if args.template not in ("auto", "plain", "qwen-math"):
        raise UsageError(f"--template {args.template!r}: choose auto, plain or qwen-math")
    finite = lambda v: v is not None and math.isfinite(v)  # noqa: E731
    rules = [  # (flag, value, ok, what it must be); None = not given (a default follows below)
        ("--steps", args.steps, lambda v: v >= 1, "an int >= 1"),
        ("--seeds", args.seeds, lambda v: 1 <= v <= 1000, "an int in [1, 1000]"),
        ("--workers", args.workers, lambda v: 1 <= v <= 64, "an int in [1, 64]"),
        ("--seed", args.seed, lambda v: 0 <= v < 2**31, "an int in [0, 2^31)"),
        ("--rl-seed", args.rl_seed, lambda v: 0 <= v < 2**31, "an int in [0, 2^31)"),
        ("--threads", args.threads, lambda v: 0 <= v <= 1024, "an int >= 0 (0: torch's default)"),
        ("--hidden-size", args.hidden_size, lambda v: 8 <= v <= 4096 and v % 4 == 0, "a multiple of 4 in [8, 4096] (4 heads)"),
        ("--num-layers", args.num_layers, lambda v: 1 <= v <= 64, "an int in [1, 64]"),
        ("--train-size", args.train_size, lambda v: 1 <= v <= 10**6, "an int in [1, 10^6]"),
        ("--eval-size", args.eval_size, lambda v: 1 <= v <= 10**5, "an int in [1, 10^5]"),
        ("--sft-steps", args.sft_steps, lambda v: 0 <= v <= 10**6, "an int >= 0"),
        ("--sft-lr", args.sft_lr, lambda v: finite(v) and 0 < v <= 1, "in (0, 1]"),
        ("--sft-shortcut", args.sft_shortcut, lambda v: finite(v) and 0 <= v <= 1, "a share in [0, 1]"),
        ("--sft-batch", args.sft_batch, lambda v: 1 <= v <= 65536, "an int >= 1"),
        ("--prompts-per-step", args.prompts_per_step, lambda v: 1 <= v <= 4096, "an int in [1, 4096]"),
        ("--group-size", args.group_size, lambda v: 2 <= v <= 1024, "an int in [2, 1024] (advantages need 2 rollouts)"),
        ("--n-init", args.n_init, lambda v: v >= 1, "an int >= 1"),
        ("--n-final", args.n_final, lambda v: v >= 1, "an int >= 1"),
        ("--static-n", args.static_n, lambda v: v >= 1, "an int >= 1"),
        ("--k-init", args.k_init, lambda v: finite(v) and 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--k-final", args.k_final, lambda v: finite(v) and 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--static-k", args.static_k, lambda v: finite(v) and 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--lr", args.lr, lambda v: finite(v) and 0 < v <= 1, "in (0, 1]"),
        ("--warmup-steps", args.warmup_steps, lambda v: v >= 0, "an int >= 0 (0: no warmup)"),
        ("--max-grad-norm", args.max_grad_norm, lambda v: finite(v) and v > 0, "a finite number > 0 (the norm the "
         "gradient is clipped to)"),
        ("--clip-low", args.clip_low, lambda v: finite(v) and 0 <= v < 1, "in [0, 1): the ratio is clipped at 1 - eps_low"),
        ("--clip-high", args.clip_high, lambda v: finite(v) and 0 <= v <= 100, "in [0, 100]: the ratio is clipped at 1 + eps_high"),
        ("--mini-batches", args.mini_batches, lambda v: 1 <= v <= 4096, "an int >= 1"),
        ("--kl-coef", args.kl_coef, lambda v: finite(v) and v >= 0, "a finite number >= 0"),
        ("--switch-on-spike", args.switch_on_spike, lambda v: v == 0 or (finite(v) and v > 1), "0 (off) or a number > 1 "
         "(a spike is a grad norm over this x its running median; 3 in docs/questions.md)"),
        ("--kl-every", args.kl_every, lambda v: v >= 0, "an int >= 0 (steps between KL measurements; 0: never)"),
        ("--temperature", args.temperature, lambda v: finite(v) and 0.01 <= v <= 100, "in [0.01, 100] (greedy decoding "
         "is measured by eval_greedy_pass1 anyway)"),
        ("--max-new-tokens", args.max_new_tokens, lambda v: 1 <= v <= 65536, "an int >= 1"),
        ("--grade-timeout", args.grade_timeout, lambda v: finite(v) and 0 < v <= 3600, "in (0, 3600] seconds"),
        ("--eval-every", args.eval_every, lambda v: v >= 1, "an int >= 1"),
        ("--eval-samples", args.eval_samples, lambda v: 1 <= v <= 1024, "an int in [1, 1024]"),
        ("--pass-k", args.pass_k, lambda v: 1 <= v <= args.eval_samples, f"an int in [1, --eval-samples {args.eval_samples}] "
         "(Pass@k needs k <= n samples)"),
        ("--gen-batch", args.gen_batch, lambda v: v >= 1, "an int >= 1"),
        ("--save-every", args.save_every, lambda v: v >= 1, "an int >= 1"),
        ("--explain-every", args.explain_every, lambda v: v >= 0, "an int >= 0 (0: off)"),
        ("--stop-after", args.stop_after, lambda v: 1 <= v <= args.steps, f"an int in [1, --steps {args.steps}]"),
    ]
    for flag, value, ok, what in rules:
        if value is not None and not ok(value):
            raise UsageError(f"{flag} {value}: must be {what}")
    args.kl_every = args.eval_every if args.kl_every is None else args.kl_every
    if args.switch_on_spike and not any(m in d3s.INTRA_TWIN for m in methods):
        raise UsageError(f"--switch-on-spike {args.switch_on_spike:g}: moves a cross-group row to its intra-group twin "
                         f"({', '.join(f'{a} -> {b}' for a, b in d3s.INTRA_TWIN.items())}); {', '.join(methods)} has none: "
                         "use --method d3s or d1s-cross (or add one to --compare), or drop the flag")
    if args.stop_after is not None and args.compare:
        raise UsageError(f"--stop-after {args.stop_after}: stops one run; drop it with --compare")
    for flag, path in (("--out", args.out), ("--cache-dir", args.cache_dir)):
        check_out_path(flag, path)
    for flag, path in (("--train-file", args.train_file), ("--eval-file", args.eval_file)):
        if path is not None and os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a folder; pass a JSONL, JSON or Parquet file")
    if args.model is not None:
        check_model_path(args.model)
    # N counts rollouts kept per prompt, so N <= G (grpo and the dapo-filter rows keep whole groups and use no N).
    if any(d3s.LADDER[m][0] not in d3s.WHOLE_GROUPS for m in methods):
        for flag, value in (("--n-init", args.n_init), ("--n-final", args.n_final), ("--static-n", args.static_n)):
            if value is not None and value > args.group_size:
                raise UsageError(f"{flag} {value} > --group-size {args.group_size}: N counts rollouts kept per prompt "
                                 f"and must be <= G; lower {flag} or raise --group-size")
    args.static_n, args.static_k = d3s.method_budget("d2s", 0, 1, max(args.group_size, args.n_init, args.n_final), args.n_init,
                                                     args.n_final, args.k_init, args.k_final, args.static_n, args.static_k)
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    default_clip = d3s.CLIP_DEFAULTS[args.loss]  # grpo 0.2 / 0.28 (DAPO's clip-higher), gspo 3e-4 / 4e-4
    args.clip_low = default_clip[0] if args.clip_low is None else args.clip_low
    args.clip_high = default_clip[1] if args.clip_high is None else args.clip_high
    if args.sft_steps is None:
        args.sft_steps = 0 if args.model else TINY_SFT_STEPS[args.task]
    if args.max_new_tokens is None:
        args.max_new_tokens = HF_MAX_NEW_TOKENS if args.model else TINY_MAX_NEW_TOKENS[args.task]
    if args.template == "auto":
        args.template = "qwen-math" if args.model else "plain"
    return args


def check_out_path(flag, path):
    """An output folder: not empty, not a file, and it (or the nearest existing parent) writable."""
    if not path:
        raise UsageError(f"{flag} '': empty; pass a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a file; pass a folder (it is created if missing)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {parent} is not a writable folder; pass a folder you can write")


def check_model_path(model):
    """--model: a local folder with config.json, or a hub name (org/name, loaded later)."""
    if not model:
        raise UsageError("--model '': empty; pass a model folder or a hub name like Qwen/Qwen2.5-Math-1.5B")
    if os.path.isfile(model):
        raise UsageError(f"--model {model}: is a file; pass the model's folder (with config.json) or a hub name")
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise UsageError(f"--model {model}: has no config.json; pass a folder saved with save_pretrained, or a hub name")
    elif model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise UsageError(f"--model {model}: no such folder (and not a hub name like Qwen/Qwen2.5-Math-1.5B); check the path")


# ---------------------------------------------------------------------------------------------
# Data: generated arithmetic (default) or JSONL files with `problem` and `answer`
# ---------------------------------------------------------------------------------------------
def load_data(args):
    """(train_rows, eval_rows). Bad files raise DataError naming file:line."""
    if args.train_file:
        train_rows, _ = load_problems(args.train_file, limit=args.train_size)
    else:
        train_rows = TASKS[args.task](args.train_size, "train", seed=args.seed)
    if args.eval_file:
        eval_rows, _ = load_problems(args.eval_file, limit=args.eval_size)
    else:
        eval_rows = TASKS[args.task](args.eval_size, "eval", seed=args.seed)
    return train_rows, eval_rows


def format_prompt(problem, template):
    return (PLAIN_TEMPLATE if template == "plain" else QWEN_MATH_TEMPLATE).format(problem=problem)


# ---------------------------------------------------------------------------------------------
# Model: the tiny Qwen2 (tiny.py) or any HF causal LM, warm-started by a short supervised phase
# ---------------------------------------------------------------------------------------------
def load_base_model(args):
    """(model, tokenizer): --model from a folder or the hub, else a fresh tiny Qwen2 (tiny.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # imported here: the grader's child process re-imports this file

    if args.model is None:
        from tiny import build_char_tokenizer, build_tiny_model

        tokenizer = build_char_tokenizer()
        return build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed), tokenizer
    looks_like_path = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1 or os.sep + os.sep in args.model
    if looks_like_path and not os.path.isdir(os.path.expanduser(args.model)):
        raise UsageError(f"--model {args.model}: no such folder; pass a folder with config.json (save_pretrained) or a hub name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.model))
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(args.model), dtype=torch.float32)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {args.model}: cannot load it ({first_line}); pass a local folder with config.json, "
                         f"or a hub name with internet access") from e
    tokenizer.padding_side = "left"  # generation appends to the right of every prompt
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def warm_start_key(args, train_rows):
    """Everything the warm-started weights depend on; its hash names the cache folder."""
    data = hashlib.sha256(json.dumps([[r["problem"], sft_target(r, args.sft_shortcut)] for r in train_rows]).encode()).hexdigest()
    return {"model": args.model or f"tiny-qwen2-h{args.hidden_size}-l{args.num_layers}", "seed": args.seed,
            "sft_steps": args.sft_steps, "sft_lr": args.sft_lr, "sft_batch": args.sft_batch,
            "template": args.template, "train_data": data[:16], "version": 2}


def load_warm_start(args, train_rows):
    """(model, tokenizer, info): the base model after --sft-steps of supervised training.

    Cached in CACHE_DIR/warmstart-<hash>/ with save_pretrained (AutoModelForCausalLM loads it),
    so repeated runs and every method of --compare start from the very same weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.sft_steps == 0:
        model, tokenizer = load_base_model(args)
        return model, tokenizer, {"sft_steps": 0, "path": args.model or "tiny (fresh)"}
    key = warm_start_key(args, train_rows)
    path = os.path.join(args.cache_dir, "warmstart-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12])
    if os.path.exists(os.path.join(path, "warmstart.json")):
        with open(os.path.join(path, "warmstart.json")) as f:
            info = json.load(f)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.padding_side = "left"
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, {**info, "cached": True}
    model, tokenizer = load_base_model(args)
    t0 = time.time()
    losses = supervised_warm_start(model, tokenizer, train_rows, args)
    info = {**key, "path": path, "sft_loss_first": losses[0], "sft_loss_last": sum(losses[-20:]) / len(losses[-20:]),
            "sft_s": round(time.time() - t0, 1), "n_params": sum(p.numel() for p in model.parameters())}
    tmp = path + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "warmstart.json"), "w") as f:
        json.dump(info, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # atomic: a half-written cache folder is never picked up
    return model, tokenizer, {**info, "cached": False}


def supervised_warm_start(model, tokenizer, train_rows, args):
    """Teacher-forced cross-entropy on sft_target(row) + <eos> after each prompt (prompt tokens masked)."""
    rng = random.Random(args.seed)
    examples = []  # (prompt token ids, target token ids)
    for row in train_rows:
        prompt = tokenizer(format_prompt(row["problem"], args.template), add_special_tokens=False).input_ids
        target = tokenizer(sft_target(row, args.sft_shortcut), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        examples.append((prompt, target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.01)
    warmup_then_decay = lambda s: min(1.0, (s + 1) / 20) * (1 - 0.9 * s / args.sft_steps)  # noqa: E731
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    model.train()
    losses = []
    for _ in (bar := tqdm(range(args.sft_steps), desc="warm start (supervised)", dynamic_ncols=True)):
        batch = sft_batch(rng.sample(examples, min(args.sft_batch, len(examples))), tokenizer.pad_token_id)
        loss = model(**batch).loss  # HF shifts the labels: position t predicts token t + 1
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def sft_target(row, shortcut=0.0):
    """The warm start's target response: the row's worked `solution` (if it has one) and \\boxed{answer}.

    With `shortcut` > 0, that share of the multi-step solutions (chosen by a hash of the problem)
    works every step out but boxes the first step's result: '47+8=55. 55-13=42. \\boxed{55}'.
    The warm-started model then has a habit the reward punishes and RL can unlearn: which result
    to copy into the box, one decision per response (--sft-shortcut). One-step problems (level 1)
    are unaffected: their first result is the answer.
    """
    solution = row.get("solution") or ""
    results = re.findall(r"=(-?\d+)\.", solution)
    boxed = row["answer"]
    if len(results) > 1 and zlib.crc32(row["problem"].encode()) % 1000 < 1000 * shortcut:
        boxed = results[0]
    return (solution + " " if solution else "") + "\\boxed{" + boxed + "}"


def sft_batch(examples, pad_id):
    """Left-padded input_ids / attention_mask / position_ids, and labels = the target tokens only."""
    length = max(len(p) + len(t) for p, t in examples)
    input_ids = torch.full((len(examples), length), pad_id)
    labels = torch.full((len(examples), length), -100)  # -100: no loss (prompt and padding)
    attention_mask = torch.zeros(len(examples), length, dtype=torch.long)
    for i, (prompt, target) in enumerate(examples):
        input_ids[i, length - len(prompt) - len(target):] = torch.tensor(prompt + target)
        labels[i, length - len(target):] = torch.tensor(target)
        attention_mask[i, length - len(prompt) - len(target):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate does for left padding
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}


# ---------------------------------------------------------------------------------------------
# The RL step, one function per stage
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def rollout(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, greedy=False):
    """1) Sample `group_size` responses per prompt. Rows are prompt-major: row p*G + g.

    Returns a dict: prompt_ids [B, Lp] and prompt_mask (left-padded), response_ids [B, T] and
    response_mask (1 up to and including the first EOS; 0 after it), texts (decoded responses).
    Pure temperature sampling, pi(o_t) = softmax(logits / temperature), or greedy.

    HF `generate`'s sampling loop, cut to what this rung needs: each prompt is encoded once and
    its KV cache repeated G times (generate would encode every prompt G times), then one token
    per step for all P x G rows with torch.multinomial, as generate does (same distribution; with
    the same seed the same tokens up to rounding, tested). Rows that hit EOS stay in the batch,
    padded, until every row has ended or max_new_tokens is reached.
    """
    from transformers import DynamicCache

    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompt_mask = enc.attention_mask  # [P, Lp], left-padded
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as generate: left padding does not shift positions
    eos = torch.tensor(stop_token_ids(tokenizer, model.generation_config))  # the one rule of every rung
    model.eval()
    cache = DynamicCache()
    logits = model(input_ids=enc.input_ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [P, V]: the prefill, once per prompt
    cache.batch_repeat_interleave(group_size)  # the prompt's keys and values, shared by its G rollouts
    logits = logits.repeat_interleave(group_size, 0)  # [B, V]
    attention_mask = prompt_mask.repeat_interleave(group_size, 0)  # [B, Lp + t]
    position = positions[:, -1:].repeat_interleave(group_size, 0)  # [B, 1]
    B = logits.shape[0]
    response_ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id)
    ended = torch.zeros(B, dtype=torch.bool)
    for t in range(max_new_tokens):
        if greedy:
            token = logits.float().argmax(-1)  # [B]
        else:
            token = torch.multinomial((logits.float() / temperature).softmax(-1), 1).squeeze(1)  # o_t ~ pi
        response_ids[:, t] = torch.where(ended, tokenizer.pad_token_id, token)
        ended |= torch.isin(token, eos)
        if bool(ended.all()) or t == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones(B, 1, dtype=attention_mask.dtype)], 1)
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    response_ids = response_ids[:, : t + 1]  # [B, T]
    is_eos = torch.isin(response_ids, eos)
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS: padding
    response_mask = (~after_eos).long()
    lengths = response_mask.sum(-1).tolist()
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(response_ids, lengths)]
    return {"prompt_ids": enc.input_ids.repeat_interleave(group_size, 0), "prompt_mask": prompt_mask.repeat_interleave(group_size, 0),
            "response_ids": response_ids, "response_mask": response_mask, "texts": texts}


def compute_rewards(grader, texts, golds):
    """2) 0/1 rewards: math-verify on the last \\boxed{} of each text, killed after the time limit."""
    return torch.tensor(grader.score_batch(texts, golds), dtype=torch.float32)


def forward_logprobs_entropy(model, batch, temperature=1.0, with_entropy=True, share_prompts=True):
    """4) One forward of (kept) rollouts: log pi(o_t | prompt, o_<t) [B, T], with grad unless the
    caller holds torch.no_grad(), and the full-vocabulary entropy H_t [B, T] of the same logits
    (d3s.token_entropy, always without grad).

    Logits are divided by the sampling temperature, so logp is the log-prob of the policy that
    sampled. Position ids follow the left padding, as in generate.

    share_prompts (the default): the G rollouts of a prompt share its forward, as in the sampler.
    Each distinct prompt is forwarded once (its keys and values, with grad, and the logits that
    predict o_1), then every response is forwarded on its prompt's keys and values. The same
    log-probs and gradients as forwarding prompt + response row by row (tested to fp32 rounding),
    for about half the positions on the steps task (~56 prompt characters, ~26 response tokens).
    share_prompts=False: the plain forward of prompt + response per row, logits for the last
    T + 1 positions only (logits_to_keep).
    """
    T = batch["response_ids"].shape[1]
    model.train()
    if not share_prompts:
        input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)  # [B, Lp + T]
        attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=T + 1).logits[:, :-1]  # [B, T, V]: position Lp-1+t predicts o_t
    else:
        from transformers import DynamicCache

        Lp = batch["prompt_ids"].shape[1]
        prompts, row_prompt = torch.unique(torch.cat([batch["prompt_ids"], batch["prompt_mask"]], 1), dim=0,
                                           return_inverse=True)  # [U, 2 Lp] distinct prompts; row b's is row_prompt[b]
        prompt_ids, prompt_mask = prompts[:, :Lp], prompts[:, Lp:]
        first = int(prompt_mask.any(0).int().argmax())  # drop the columns that are padding in every prompt
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
        prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp']
        cache = DynamicCache()
        first_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # [U, 1, V]: predicts o_1
        cache.batch_select_indices(row_prompt)  # each row's prompt keys and values (indexing: gradients add up)
        attention_mask = torch.cat([prompt_mask[row_prompt], batch["response_mask"]], 1)  # [B, Lp' + T]
        position_ids = prompt_pos[row_prompt, -1:] + batch["response_mask"].cumsum(-1)  # as cumsum(mask) - 1 above
        logits = model(input_ids=batch["response_ids"], attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True).logits  # [B, T, V]: position t predicts o_{t+1}
        logits = torch.cat([first_logits[row_prompt], logits[:, :-1]], 1)  # [B, T, V]: o_1 .. o_T
    logits = logits.float() / temperature
    logp = logits.log_softmax(-1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = d3s.token_entropy(logits) if with_entropy else None  # [B, T], no grad
    return logp, entropy


def budget(step, args, history=()):
    """(row, N rollouts kept per prompt, K fraction of tokens kept) of `step` (1-based): the row is args.method,
    or its intra-group twin once --switch-on-spike fired. history: the train lines of steps 1..step-1 (their
    reward is --schedule adaptive's signal, their grad_norm the switch rule's)."""
    row = d3s.switch_to_intra(args.method, [h["grad_norm"] for h in history], args.switch_on_spike)
    n_keep, k_frac = d3s.method_budget(row, step - 1, args.steps, args.group_size, args.n_init, args.n_final,
                                       args.k_init, args.k_final, args.static_n, args.static_k, kind=args.schedule,
                                       history=[h["reward_mean"] for h in history])
    return row, n_keep, k_frac


def measures_kl(step, args):
    """Whether `step` forwards the reference model: every step when the KL is in the loss (--kl-coef > 0);
    else the KL is only a metric, measured on step 1, every --kl-every steps and the last step (never with 0)."""
    if args.kl_coef > 0:
        return True
    return args.kl_every > 0 and (step == 1 or step % args.kl_every == 0 or step == args.steps)


def step_seed(seed, step, salt=0):
    """Every step (and eval) reseeds from (seed, step): the trajectory depends on neither when
    evaluations happen nor whether the run was resumed."""
    return (seed * 1_000_003 + step * 7_919 + salt) % 2**31


def take_rows(batch, rows):
    """The rollouts `rows` of a rollout batch, trimmed to their longest response (none: [0, 0])."""
    T = int(batch["response_mask"][rows].sum(-1).max()) if len(rows) else 0
    return {"prompt_ids": batch["prompt_ids"][rows], "prompt_mask": batch["prompt_mask"][rows],
            "response_ids": batch["response_ids"][rows, :T], "response_mask": batch["response_mask"][rows, :T]}


def train_step(model, ref_model, optimizer, tokenizer, grader, train_rows, step, args, explain_dir=None, history=()):
    """One RL step (docs/algorithm.md section 6); returns its metrics (one JSONL line).

    ref_model: the warm-start model, for the KL (k3) on the selected tokens (in the loss with
    --kl-coef > 0, else a metric on the steps measures_kl names). history: the train lines of
    the steps before this one (--schedule adaptive and --switch-on-spike read them).
    """
    P, G = args.prompts_per_step, args.group_size
    torch.manual_seed(step_seed(args.rl_seed, step))
    problems = random.Random(step_seed(args.rl_seed, step)).sample(train_rows, min(P, len(train_rows)))
    P = len(problems)

    # 1) rollouts and 2) rewards
    t0 = time.time()
    batch = rollout(model, tokenizer, [format_prompt(r["problem"], args.template) for r in problems], G,
                    args.max_new_tokens, args.temperature)
    gen_s = time.time() - t0
    rewards = compute_rewards(grader, batch["texts"], [r["answer"] for r in problems for _ in range(G)]).view(P, G)
    reward_s = time.time() - t0 - gen_s

    # 3) advantages + sample selection (N and K from the method's budget)
    t1 = time.time()
    row, n_keep, k_frac = budget(step, args, history)  # row: args.method, or its twin after --switch-on-spike fired
    keep, adv = d3s.select_samples(rewards, n_keep, row,
                                   generator=torch.Generator().manual_seed(step_seed(args.rl_seed, step, 1)))
    kept_rows = keep.view(-1).nonzero().squeeze(-1)  # [B] indices of the kept rollouts
    kept = take_rows(batch, kept_rows)
    kept_adv = adv.view(-1)[kept_rows]  # [B]

    # the KL to the warm start on every response token of the step, on the steps that measure the KL
    kl_all = kl_ref_all(model, ref_model, batch, args.temperature) if measures_kl(step, args) else None

    # 4)-6) forward the kept rollouts, select tokens, M optimizer steps
    score_gen = torch.Generator().manual_seed(step_seed(args.rl_seed, step, 2))  # --token-rule random/adv: own stream
    update = update_policy(model, ref_model, optimizer, kept, kept_adv, k_frac, measures_kl(step, args), args, score_gen)

    metrics = step_metrics(step, batch, rewards, keep, adv, n_keep, k_frac, kept, update, grader)
    metrics["kl_ref_all"] = kl_all
    metrics["sample_rule"] = d3s.LADDER[row][0]  # which rollouts this step kept: "cross" turns "intra" at the switch
    metrics.update(gen_s=round(gen_s, 3), reward_s=round(reward_s, 3), train_s=round(time.time() - t1, 3),
                   pass1_s=round(update["pass1_s"], 3))  # train_s: selection, kl_ref_all, pass 1, the M updates
    if explain_dir is not None:
        write_explain_page(explain_dir, step, tokenizer, problems, batch, rewards, keep, adv, kept_rows, n_keep,
                           k_frac, update, metrics, args, row)
    return metrics


@torch.no_grad()
def kl_ref_all(model, ref_model, batch, temperature=1.0):
    """KL(pi || pi_ref) (k3) of the policy that sampled the step, before its update, to the warm start,
    on every response token of all P x G rollouts: the same tokens whatever the method keeps, so rows
    compare like with like (kl_ref is measured on each method's selected tokens). Two no-grad forwards
    of the whole batch, on the steps measures_kl names."""
    logp = forward_logprobs_entropy(model, batch, temperature, with_entropy=False)[0]  # [P*G, T]
    ref_logp = forward_logprobs_entropy(ref_model, batch, temperature, with_entropy=False)[0]
    mask = batch["response_mask"].bool()
    return float(d3s.kl_k3(logp, ref_logp)[mask].mean())


def update_policy(model, ref_model, optimizer, kept, kept_adv, k_frac, with_kl, args, score_gen=None):
    """4) forward, 5) token selection and 6) M mini-batches of the kept rollouts, one optimizer step each.

    Only the work the step needs. Mini-batch 1 goes first and is on-policy, so the forward that
    builds its gradient also gives its old log-probs (detached) and entropy. Pass 1, a no-grad
    forward taking the old log-probs before any update, covers mini-batches 2..M only
    (M = 1: no pass 1). The reference model is forwarded only when with_kl. Token selection
    needs every kept token's entropy, so it runs after pass 1, over the whole batch.
    Returns a dict: token_keep, entropy, token_scores [B, T] and the per-mini-batch statistics.
    No kept rollout (dapo-filter on a step without a group with spread): no forward, no update.
    """
    B, T = kept["response_ids"].shape
    response_mask = kept["response_mask"]  # [B, T]
    parts = [rows for rows in torch.arange(B).tensor_split(args.mini_batches) if len(rows)]  # contiguous, in order
    old_logp, entropy = torch.zeros(B, T), torch.zeros(B, T)
    if not parts:
        nothing = torch.zeros(B, T, dtype=torch.bool)
        return {"token_keep": nothing, "entropy": entropy, "token_scores": entropy, "grad_norms": [], "clip_fracs": [],
                "losses": [], "skipped": 0, "pass1_s": 0.0, "kl_ref": None}

    # 4) mini-batch 1 with grad (its graph is used in 6); pass 1, no grad, over the rest; the reference
    first = take_rows(kept, parts[0])
    width = first["response_ids"].shape[1]
    first_logp, first_entropy = forward_logprobs_entropy(model, first, args.temperature)  # [b, width], with grad
    old_logp[parts[0], :width], entropy[parts[0], :width] = first_logp.detach(), first_entropy
    t_pass1 = time.time()
    with torch.no_grad():
        for rows in parts[1:]:
            part = take_rows(kept, rows)
            width = part["response_ids"].shape[1]
            old_logp[rows, :width], entropy[rows, :width] = forward_logprobs_entropy(model, part, args.temperature)
        ref_logp = forward_logprobs_entropy(ref_model, kept, args.temperature, with_entropy=False)[0] if with_kl else None
    pass1_s = time.time() - t_pass1  # pass 1 and the reference forward: the no-grad work before the updates

    # 5) token selection: top K of |A_i| * H_{i,t} over the whole batch
    token_scores = d3s.token_scores(kept_adv, entropy, rule=args.token_rule, generator=score_gen)  # [B, T]; a NaN
    # entropy scores 0 (the update is skipped then); rows without token selection (K = 1) keep every token whatever the rule
    token_keep = d3s.select_tokens(token_scores, response_mask, k_frac, scope=args.token_scope,
                                   min_per_seq=int(args.min_token_per_response))  # [B, T]

    # 6) the mini-batches in order, one optimizer step each. The loss of a mini-batch divides by its own
    #    selected tokens (or responses): the normalizer is per optimizer step. Mini-batch 1 is on-policy
    #    (w = 1); the later ones see the updated policy.
    grad_norms, clip_fracs, losses, kls, skipped = [], [], [], [], 0
    for i, rows in enumerate(parts):
        if not bool(token_keep[rows].any()):  # no selected token in this part: nothing to learn from
            continue
        if i == 0:
            logp = first_logp
        else:
            logp, _ = forward_logprobs_entropy(model, take_rows(kept, rows), args.temperature, with_entropy=False)
        width = logp.shape[1]
        loss, stats = d3s.policy_loss(logp, old_logp[rows, :width], kept_adv[rows], token_keep[rows, :width], kind=args.loss,
                                      clip_low=args.clip_low, clip_high=args.clip_high,
                                      ref_logp=ref_logp[rows, :width] if with_kl else None, beta=args.kl_coef,
                                      agg=args.loss_agg)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clip_fracs.append((stats["clip_frac"], stats["tokens"]))
        kls.append((stats["kl"], stats["tokens"]))
        if not math.isfinite(losses[-1]):  # never apply a NaN/inf loss: skip the update, log it
            skipped += 1
            continue
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        grad_norms.append(grad_norm)
        if not math.isfinite(grad_norm):  # a finite loss can still give inf gradients
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"token_keep": token_keep, "entropy": entropy, "token_scores": token_scores, "grad_norms": grad_norms,
            "clip_fracs": clip_fracs, "losses": losses, "skipped": skipped, "pass1_s": pass1_s,
            "kl_ref": sum(k * n for k, n in kls) / max(sum(n for _, n in kls), 1.0) if with_kl else None}


def mean_or_none(values):
    return sum(values) / len(values) if values else None


def step_metrics(step, batch, rewards, keep, adv, n_keep, k_frac, kept, update, grader):
    """The step's line of metrics.jsonl (docs/metrics.md)."""
    token_keep, entropy, response_mask = update["token_keep"], update["entropy"], kept["response_mask"]
    grad_norms = update["grad_norms"]
    gen_tokens = int(batch["response_mask"].sum())
    fwd_tokens = int(response_mask.sum())
    kept_tokens = int(token_keep.sum())
    return {
        "kind": "train", "step": step,
        "reward_mean": float(rewards.mean()),
        "acc_train": float(rewards.mean()),  # the reward is correctness (0/1): the same number
        "groups_mixed": float((rewards.amax(-1) > rewards.amin(-1)).float().mean()),  # groups with signal
        "n_keep": n_keep, "k_frac": k_frac,
        "k_real": kept_tokens / max(fwd_tokens, 1),  # realised fraction of the forwarded tokens
        "kept_samples": int(keep.sum()),
        "sur": d3s.usefulness_rate(adv, keep),  # Sample Usefulness Rate: kept rollouts with A != 0
        "kept_tokens": kept_tokens,  # tokens in the loss
        "fwd_tokens": fwd_tokens,  # response tokens forwarded (compute scales with these)
        "gen_tokens": gen_tokens,  # response tokens generated
        "kept_tokens_frac": kept_tokens / max(gen_tokens, 1),
        "kept_adv_var": d3s.kept_variance(adv, keep),
        "grad_norm": mean_or_none([g for g in grad_norms if math.isfinite(g)]),  # null: no finite norm this step
        "entropy_mean": float((entropy * response_mask).sum() / response_mask.sum().clamp(min=1)),  # all forwarded tokens
        "entropy_kept": float(entropy[token_keep].mean()) if token_keep.any() else 0.0,  # the selected tokens
        "kl_ref": update["kl_ref"],  # k3 to the warm start on the selected tokens; None on steps that do not measure it
        "clip_frac": sum(c * n for c, n in update["clip_fracs"]) / max(sum(n for _, n in update["clip_fracs"]), 1),
        "clip_frac_by_minibatch": [c for c, _ in update["clip_fracs"]],
        "loss": mean_or_none([x for x in update["losses"] if math.isfinite(x)]),  # over optimizer steps; null: none
        "updates": len(grad_norms) - sum(not math.isfinite(g) for g in grad_norms),
        "skipped": update["skipped"] > 0,
        "response_len": gen_tokens / rewards.numel(),
        "grader_timeouts": grader.timeouts,
    }


def write_explain_page(explain_dir, step, tokenizer, problems, batch, rewards, keep, adv, kept_rows, n_keep, k_frac,
                       update, metrics, args, row=None):
    """The page of this step (explain.py): reads the tensors of the step, draws no random number. row: the LADDER
    row that selected the samples (args.method, or its twin after --switch-on-spike fired)."""
    row = row or args.method
    entropy, token_scores, token_keep = update["entropy"], update["token_scores"], update["token_keep"]
    shown_adv = torch.where(keep, adv, d3s.group_advantages(rewards))  # the loss's A on kept cells (pods: recomputed)
    row_of = {int(i): r for r, i in enumerate(kept_rows.tolist())}  # p * G + g -> row of the kept batch
    shown = []
    for i in explain.pick_rollouts(shown_adv, keep):
        n = int(batch["response_mask"][i].sum())  # response tokens up to and including the first EOS
        item = {"index": i, "tokens": [tokenizer.decode([t]) for t in batch["response_ids"][i, :n].tolist()]}
        if i in row_of:  # forwarded: its entropy, score and selection
            r = row_of[i]
            item.update(entropy=entropy[r, :n].tolist(), score=token_scores[r, :n].tolist(),
                        selected=token_keep[r, :n].tolist())
        shown.append(item)
    switched = {} if row == args.method else {"--switch-on-spike": f"fired: --method {args.method} runs as {row}"}
    explain.write_step(explain_dir, step=step, rung="train_small", method=row, rewards=rewards, adv=shown_adv,
                       keep=keep, n_keep=n_keep, k_frac=k_frac, k_real=metrics["k_real"], shown=shown,
                       prompts=[r["problem"] for r in problems],
                       extra={**switched, "loss (mean over mini-batches)": metrics["loss"],
                              "grad norm (before clipping)": metrics["grad_norm"], "tokens in the loss": metrics["kept_tokens"],
                              "mini-batches": args.mini_batches})


# ---------------------------------------------------------------------------------------------
# Evaluation: held-out greedy Pass@1, mean Pass@1 over n samples, unbiased Pass@k
# ---------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, grader, eval_rows, step, args):
    t0 = time.time()
    torch.manual_seed(step_seed(args.rl_seed, step, 2))
    prompts = [format_prompt(r["problem"], args.template) for r in eval_rows]
    golds = [r["answer"] for r in eval_rows]
    n, chunk = args.eval_samples, max(1, args.gen_batch // args.eval_samples)
    greedy, correct = [], []  # [E], [E] (correct samples out of n)
    for start in tqdm(range(0, len(prompts), chunk), desc=f"eval step {step}", leave=False, dynamic_ncols=True):
        p, g = prompts[start:start + chunk], golds[start:start + chunk]
        texts = rollout(model, tokenizer, p, 1, args.max_new_tokens, greedy=True)["texts"]
        greedy += compute_rewards(grader, texts, g).tolist()
        texts = rollout(model, tokenizer, p, n, args.max_new_tokens, args.temperature)["texts"]
        correct += compute_rewards(grader, texts, [x for x in g for _ in range(n)]).view(len(p), n).sum(-1).tolist()
    metrics = {"kind": "eval", "step": step,
               "eval_greedy_pass1": sum(greedy) / len(greedy),
               "eval_pass1_mean": sum(correct) / (n * len(correct)),
               "eval_passk": sum(pass_at_k(n, int(c), args.pass_k) for c in correct) / len(correct),
               "k": args.pass_k, "n": n}
    levels = sorted({r["level"] for r in eval_rows if "level" in r})
    for level in levels:  # success by difficulty: the spread that gives groups a signal
        idx = [i for i, r in enumerate(eval_rows) if r.get("level") == level]
        metrics[f"eval_pass1_mean_level{level}"] = sum(correct[i] for i in idx) / (n * len(idx))
        metrics[f"eval_passk_level{level}"] = sum(pass_at_k(n, int(correct[i]), args.pass_k) for i in idx) / len(idx)
        metrics[f"eval_greedy_pass1_level{level}"] = sum(greedy[i] for i in idx) / len(idx)
    metrics["eval_s"] = round(time.time() - t0, 3)
    return metrics


# ---------------------------------------------------------------------------------------------
# Checkpoints (atomic) and metrics
# ---------------------------------------------------------------------------------------------
TRAJECTORY_FLAGS = ("method", "loss", "steps", "seed", "rl_seed", "model", "template", "hidden_size", "num_layers",
                    "train_file", "train_size", "sft_steps", "sft_shortcut", "sft_lr", "sft_batch", "prompts_per_step", "group_size",
                    "n_init", "n_final", "k_init", "k_final", "static_n", "static_k", "schedule", "token_rule", "token_scope",
                    "min_token_per_response", "switch_on_spike", "lr", "warmup_steps", "max_grad_norm", "loss_agg", "clip_low", "clip_high",
                    "mini_batches", "task",
                    "kl_coef", "temperature", "max_new_tokens")
ADDED_TRAJECTORY_FLAGS = {"switch_on_spike": 0.0}  # TRAJECTORY_FLAGS added later, and the value older runs had


def save_checkpoint(path, model, optimizer, step, args, totals):
    """Model, optimizer, RNG states and step in one file of tensors and plain values (it loads with
    torch.load(weights_only=True): no pickled objects), written to a temp file then renamed."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"torch": torch.get_rng_state(), "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
           "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    state = {"format": CHECKPOINT_FORMAT, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "totals": totals, "args": {k: getattr(args, k) for k in TRAJECTORY_FLAGS}, "rng": rng}
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        if os.environ.get(STALL_ENV) == str(step):  # tests: a SIGKILL lands while the checkpoint is half written
            f.truncate(f.tell() // 2)
            print(f"checkpoint of step {step}: half written, stalled ({STALL_ENV})", file=sys.stderr, flush=True)
            time.sleep(600)
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a kill leaves either the old or the new checkpoint, never half of one


CHECKPOINT_FORMAT = 2  # 2: tensors and plain values only; 1 (before 2026-11): pickled RNG state
STALL_ENV = "D3S_TEST_STALL_CHECKPOINT"


def read_checkpoint(path, args):
    """The checkpoint --resume continues from, checked before any work: it exists, is complete, holds
    no pickled object (torch.load(weights_only=True)), and was written by a run with these flags."""
    fix = "run without --resume to start again, or use a new --out"
    if not os.path.isfile(path):
        where = "no checkpoint at" if not os.path.isdir(path) else "is a folder, not a checkpoint file:"
        raise UsageError(f"--resume: {where} {path}; {fix} (a run writes OUT/checkpoint.pt every --save-every steps)")
    try:
        state = torch.load(path, weights_only=True)
        assert isinstance(state, dict) and {"step", "model", "optimizer", "totals", "args", "rng"} <= set(state)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UsageError(f"--resume {path}: refused: it holds a pickled Python object, not tensors (loading it "
                             f"could run code); {fix}") from None
        raise UsageError(f"--resume {path}: truncated or corrupt (not a checkpoint train_small.py wrote); {fix}") from None
    except Exception:  # EOFError, RuntimeError (a truncated zip), AssertionError, ...
        raise UsageError(f"--resume {path}: truncated or corrupt (not a checkpoint train_small.py wrote); {fix}") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume {path}: checkpoint format {state.get('format', 1)} of an older train_small.py; "
                         f"finish that run with the version that wrote it, or {fix}")
    for flag in TRAJECTORY_FLAGS:  # a flag added after the checkpoint was written: it ran with the flag's old value
        value = state["args"].get(flag, ADDED_TRAJECTORY_FLAGS.get(flag))
        if getattr(args, flag, None) != value:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag, None)}: {path} was made with "
                             f"--{flag.replace('_', '-')} {value}; resume with the run's flags, or use a new --out")
    if args.stop_after is not None and args.stop_after <= state["step"]:
        raise UsageError(f"--stop-after {args.stop_after}: {path} is already at step {state['step']}; raise --stop-after "
                         "or drop it")
    if state["step"] >= args.steps:
        raise UsageError(f"--resume {path}: the run already finished its {args.steps} steps; {fix}")
    return state


def load_checkpoint(state, model, optimizer):
    """Restore what read_checkpoint read; returns (step, totals)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    version, words, gauss = state["rng"]["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    keys, pos, has_gauss, cached = state["rng"]["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return state["step"], state["totals"]


@contextlib.contextmanager
def out_lock(out):
    """Hold an exclusive lock on OUT/.lock while the block runs; the OS drops it when the process ends, killed or
    not. A second train_small.py writing to the same --out (two --compare commands on one folder, say) stops
    with one line instead of interleaving its runs with the first's. No lock where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--out {out}: another train_small.py is writing there now ({os.path.join(out, '.lock')}); "
                             "wait for it to end, or use another --out") from None
        yield


def read_metrics(path, up_to_step=None):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [m for m in lines if up_to_step is None or m.get("step", math.inf) <= up_to_step]


def log_metrics(path, metrics):
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")


# ---------------------------------------------------------------------------------------------
# One run, and --compare
# ---------------------------------------------------------------------------------------------
def run(args, train_rows=None, eval_rows=None, warm=None):
    """Warm start -> RL with args.method -> summary (dict). Writes into args.out."""
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    if train_rows is None:
        train_rows, eval_rows = load_data(args)
    model, tokenizer, warm_info = warm or load_warm_start(args, train_rows)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the warm start: reference of the logged KL
    os.makedirs(args.out, exist_ok=True)
    metrics_path, ckpt_path = os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "checkpoint.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    totals = {"samples": 0, "tokens": 0, "fwd_tokens": 0, "gen_s": 0.0, "train_s": 0.0, "skipped": 0}
    start_step = 0
    if args.resume:
        state = read_checkpoint(ckpt_path if args.resume == "latest" else args.resume, args)
        start_step, totals = load_checkpoint(state, model, optimizer)
        del state
        kept_lines = read_metrics(metrics_path, up_to_step=start_step)  # drop what the killed run logged after it
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in kept_lines)
        os.replace(metrics_path + ".tmp", metrics_path)
        print(f"resumed {ckpt_path} at step {start_step}")
    else:
        for stale in (metrics_path, ckpt_path):
            if os.path.exists(stale):
                os.remove(stale)
    history = [m for m in read_metrics(metrics_path) if m["kind"] == "train"]  # --schedule adaptive, --switch-on-spike
    if (args.schedule == "adaptive" or args.switch_on_spike) and len(history) != start_step:
        raise UsageError(f"--resume {args.resume}: {metrics_path} holds {len(history)} of the {start_step} train lines that "
                         f"{'--schedule adaptive' if args.schedule == 'adaptive' else '--switch-on-spike'} reads; resume "
                         "into the run's own --out")
    rl_start = time.time()
    with Grader(timeout_s=args.grade_timeout) as grader:
        if start_step == 0:
            log_metrics(metrics_path, {**evaluate(model, tokenizer, grader, eval_rows, 0, args), **totals,
                                       "warm_start": {k: v for k, v in warm_info.items() if k != "cached"}})
        bar = tqdm(range(start_step + 1, args.steps + 1), desc=f"{args.method} ({args.loss}, seed {args.rl_seed})", dynamic_ncols=True,
                   initial=start_step, total=args.steps)
        for step in bar:
            for group in optimizer.param_groups:  # linear warmup: lr * min(1, step / W)
                group["lr"] = args.lr * min(1.0, step / args.warmup_steps) if args.warmup_steps else args.lr
            explain_now = args.explain_every and (step == 1 or step % args.explain_every == 0)
            m = train_step(model, ref_model, optimizer, tokenizer, grader, train_rows, step, args,
                           explain_dir=os.path.join(args.out, "explain") if explain_now else None, history=history)
            history.append(m)
            totals["samples"] += m["kept_samples"]
            totals["tokens"] += m["kept_tokens"]
            totals["fwd_tokens"] += m["fwd_tokens"]
            totals["gen_s"] += m["gen_s"] + m["reward_s"]
            totals["train_s"] += m["train_s"]
            totals["skipped"] += int(m["skipped"])
            log_metrics(metrics_path, m)
            bar.set_postfix(reward=f"{m['reward_mean']:.2f}", N=m["n_keep"], K=f"{m['k_frac']:.2f}",
                            gnorm="-" if m["grad_norm"] is None else f"{m['grad_norm']:.2f}")
            if step % args.eval_every == 0 or step == args.steps:
                e = evaluate(model, tokenizer, grader, eval_rows, step, args)
                log_metrics(metrics_path, {**e, **totals})
                bar.write(f"step {step}: held-out greedy Pass@1 {e['eval_greedy_pass1']:.3f}, "
                          f"Pass@1 (mean of {e['n']}) {e['eval_pass1_mean']:.3f}, Pass@{e['k']} {e['eval_passk']:.3f}")
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint(ckpt_path, model, optimizer, step, args, totals)
            if step == args.stop_after:  # a clean stop: the checkpoint of this step, then --resume continues
                if step % args.save_every:
                    save_checkpoint(ckpt_path, model, optimizer, step, args, totals)
                bar.write(f"stopped after step {step} (--stop-after); continue with --resume")
                return None
        timeouts = grader.timeouts
    final_dir = os.path.join(args.out, "final")
    shutil.rmtree(final_dir + ".tmp", ignore_errors=True)
    model.save_pretrained(final_dir + ".tmp")
    tokenizer.save_pretrained(final_dir + ".tmp")
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(final_dir + ".tmp", final_dir)
    return write_summary(args, read_metrics(metrics_path), warm_info, totals, timeouts,
                         rl_s=time.time() - rl_start, wall_s=time.time() - t_start)


def write_summary(args, lines, warm_info, totals, timeouts, rl_s, wall_s):
    evals = [m for m in lines if m["kind"] == "eval"]
    train = [m for m in lines if m["kind"] == "train"]
    first, last = evals[0], evals[-1]
    own_rule = d3s.LADDER[args.method][0]  # --switch-on-spike: switched_at_step is the first step run under another rule
    summary = {
        "method": args.method, "loss": args.loss, "steps": args.steps, "out": args.out,
        "evals": [{"step": m["step"], "pass1_mean": m["eval_pass1_mean"], "greedy_pass1": m["eval_greedy_pass1"],
                   "rl_s": m["gen_s"] + m["train_s"], "update_s": m["train_s"], "tokens": m["tokens"]} for m in evals],
        "warm_start": {"greedy_pass1": first["eval_greedy_pass1"], "pass1_mean": first["eval_pass1_mean"],
                       "passk": first["eval_passk"], "train_reward_step1": train[0]["reward_mean"] if train else None,
                       **{k.replace("eval_pass1_mean_", ""): v for k, v in first.items() if k.startswith("eval_pass1_mean_level")},
                       "cached": warm_info.get("cached"), "sft_steps": warm_info.get("sft_steps"),
                       "path": warm_info.get("path")},
        "final": {"greedy_pass1": last["eval_greedy_pass1"], "pass1_mean": last["eval_pass1_mean"],
                  "passk": last["eval_passk"], "k": last["k"], "n": last["n"],
                  **{k.replace("eval_pass1_mean_", ""): v for k, v in last.items() if k.startswith("eval_pass1_mean_level")}},
        "best_greedy_pass1": max(m["eval_greedy_pass1"] for m in evals),
        "samples_trained": totals["samples"], "tokens_trained": totals["tokens"], "tokens_forwarded": totals["fwd_tokens"],
        "mean_grad_norm": mean_or_none([m["grad_norm"] for m in train if m["grad_norm"] is not None]),
        "mean_kept_adv_var": sum(m["kept_adv_var"] for m in train) / max(len(train), 1),
        "mean_sur": sum(m["sur"] for m in train) / max(len(train), 1),
        "mean_k_frac": sum(m["k_frac"] for m in train) / max(len(train), 1),
        "mean_k_real": sum(m["k_real"] for m in train) / max(len(train), 1),
        "final_kl_ref": next((m["kl_ref"] for m in reversed(train) if m.get("kl_ref") is not None), None),
        "mean_entropy": sum(m["entropy_mean"] for m in train) / max(len(train), 1),
        "mean_entropy_kept": mean_or_none([m["entropy_kept"] for m in train if m["kept_tokens"]]),  # steps that kept tokens
        "time_per_step": {key: sum(m.get(f"{key}_s", 0.0) for m in train) / max(len(train), 1)
                          for key in ("gen", "reward", "pass1", "train")},
        "rl_seed": args.rl_seed,
        "switched_at_step": next((m["step"] for m in train if m.get("sample_rule", own_rule) != own_rule), None),
        "skipped_updates": totals["skipped"], "grader_timeouts": timeouts,
        "gen_s": round(totals["gen_s"], 1), "train_s": round(totals["train_s"], 1),
        "rl_s": round(rl_s, 1), "wall_s": round(wall_s, 1),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    w, fin = summary["warm_start"], summary["final"]
    print(f"\n== {args.method} ({args.loss}), {args.steps} steps, {args.out}\n"
          f"warm start  held-out greedy Pass@1 {w['greedy_pass1']:.3f}  Pass@1 mean@{fin['n']} {w['pass1_mean']:.3f}  "
          f"Pass@{fin['k']} {w['passk']:.3f}  (train reward at step 1: {w['train_reward_step1']})\n"
          f"final       held-out greedy Pass@1 {fin['greedy_pass1']:.3f}  Pass@1 mean@{fin['n']} {fin['pass1_mean']:.3f}  "
          f"Pass@{fin['k']} {fin['passk']:.3f}\n"
          f"trained on {summary['samples_trained']} rollouts, {summary['tokens_trained']} tokens in the loss "
          f"({summary['tokens_forwarded']} forwarded); {summary['skipped_updates']} skipped updates, "
          f"{timeouts} grader timeouts\n"
          f"time: {summary['gen_s']} s generating + grading, {summary['train_s']} s training, {summary['rl_s']} s RL "
          f"incl. eval, {summary['wall_s']} s in all")
    return summary


def compare(args):
    """Every method of --compare from the same warm start, for --seeds RL seeds each, into
    OUT/<method>/seed<S>/; then OUT/compare.md (mean ± std over seeds) and OUT/compare.png."""
    with out_lock(args.out):
        return _compare(args)


def _compare(args):
    t0 = time.time()
    methods = args.compare.split(",")
    seeds = [args.rl_seed + i for i in range(args.seeds)]
    train_rows, eval_rows = load_data(args)
    _, _, warm_info = load_warm_start(args, train_rows)  # build the cache once, outside the timed runs
    if args.workers > 1:
        summaries = compare_in_processes(args, methods, seeds)
        write_compare(args, methods, seeds, summaries, time.time() - t0)
        return summaries
    summaries = {m: [] for m in methods}
    for seed in seeds:  # seed-major: an interrupted compare has every method of the first seeds
        for method in methods:
            sub = copy.copy(args)
            sub.method, sub.rl_seed, sub.compare = method, seed, None
            sub.switch_on_spike = args.switch_on_spike if method in d3s.INTRA_TWIN else 0.0  # as compare_in_processes
            sub.out = os.path.join(args.out, method, f"seed{seed}")
            done = os.path.join(sub.out, "summary.json")
            lines = read_metrics(os.path.join(sub.out, "metrics.jsonl"))
            if args.resume and os.path.exists(done) and lines and lines[-1]["step"] == args.steps:
                with open(done) as f:
                    summaries[method].append(json.load(f))  # finished before the kill
                continue
            sub.resume = "latest" if args.resume and os.path.exists(os.path.join(sub.out, "checkpoint.pt")) else None
            with out_lock(sub.out):
                summaries[method].append(run(sub, train_rows, eval_rows, warm=load_warm_start(sub, train_rows)))
    write_compare(args, methods, seeds, summaries, time.time() - t0)
    return summaries


def compare_in_processes(args, methods, seeds):
    """--compare with --workers W: each run is `python train_small.py --method M --rl-seed S --out
    OUT/M/seedS` with the compare's other flags, W at a time, seed-major (so the methods share the
    machine's load alike); a finished run (summary.json at the last step) is not run again, a
    killed one resumes from its checkpoint. Its log goes to OUT/M/seedS.log."""
    drop = {"--compare": 1, "--seeds": 1, "--workers": 1, "--out": 1, "--method": 1, "--rl-seed": 1, "--resume": 0}
    base, i = [], 0
    while i < len(args.argv):
        flag = args.argv[i].split("=")[0]
        if flag in drop:
            has_value = drop[flag] and "=" not in args.argv[i]
            i += 1 + (has_value if flag != "--resume" else int(i + 1 < len(args.argv) and not args.argv[i + 1].startswith("--")))
            continue
        base.append(args.argv[i])
        i += 1
    jobs = []
    for seed in seeds:
        for method in methods:
            out = os.path.join(args.out, method, f"seed{seed}")
            lines = read_metrics(os.path.join(out, "metrics.jsonl"))
            if os.path.exists(os.path.join(out, "summary.json")) and lines and lines[-1]["step"] == args.steps:
                continue
            resume = ["--resume"] if os.path.exists(os.path.join(out, "checkpoint.pt")) else []
            switch = ["--switch-on-spike", "0"] if method not in d3s.INTRA_TWIN else []  # a row without a twin: off
            jobs.append((out, [sys.executable, os.path.abspath(__file__), *base, "--method", method, "--rl-seed", str(seed),
                               "--out", out, *resume, *switch]))
    running = []
    with tqdm(total=len(jobs), desc=f"--compare, {args.workers} workers", dynamic_ncols=True) as bar:
        while jobs or running:
            while jobs and len(running) < args.workers:
                out, cmd = jobs.pop(0)
                os.makedirs(out, exist_ok=True)
                log = open(out + ".log", "w")
                running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log))
            time.sleep(1.0)
            for proc, out, log in [r for r in running if r[0].poll() is not None]:
                running.remove((proc, out, log))
                log.close()
                if proc.returncode != 0:
                    raise UsageError(f"--compare: the run in {out} failed (exit {proc.returncode}); see {out}.log, fix it and "
                                     "rerun the same command with --resume")
                bar.update(1)
    summaries = {m: [] for m in methods}
    for seed in seeds:
        for method in methods:
            with open(os.path.join(args.out, method, f"seed{seed}", "summary.json")) as f:
                summaries[method].append(json.load(f))
    return summaries


def mean_std(values, fmt="%.3f"):
    """'m ± s' over seeds (sample std; just 'm' for one seed)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return fmt % m
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{fmt % m} ± {fmt % s}"


def crossing(xs, ys, target):
    """The first x at which the piecewise-linear curve through (xs, ys) reaches `target`, linearly
    interpolated between the two evaluations around it; None if it never does."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target - 1e-12:
            if i == 0 or y == ys[i - 1]:
                return float(x)
            return xs[i - 1] + (x - xs[i - 1]) * (target - ys[i - 1]) / (y - ys[i - 1])
    return None


def ladder_rows(summaries, methods, base="grpo"):
    """The numbers of compare.md, per method (summaries[m]: one summary per seed, in the same seed
    order for every method):
      final:  held-out Pass@1 (mean of n) at the last step, one per seed;
      diff:   (mean, lower, upper) of the same-seed differences to `base`, 95% t interval over seeds
              (toy.bandit.paired_interval); verdict 'better' / 'worse' only if the interval excludes 0;
      to_target: the paper's "training speed-up", both ways: on the seed-mean curve of Pass@1, the
              step, the update seconds and the whole-step seconds (generate + grade + update) at which
              it first reaches `base`'s final mean Pass@1 (interpolated; None: never), and the
              speed-up = base's / this row's (> 1: faster than base).
    """
    from toy.bandit import paired_interval

    base_final = [s["final"]["pass1_mean"] for s in summaries[base]]
    target = sum(base_final) / len(base_final)
    curves = {}
    for m in methods:
        evals = [s["evals"] for s in summaries[m]]
        n_evals = min(len(e) for e in evals)
        mean = lambda key: [sum(e[i][key] for e in evals) / len(evals) for i in range(n_evals)]  # noqa: E731
        curves[m] = {"step": mean("step"), "pass1": mean("pass1_mean"), "update_s": mean("update_s"), "step_s": mean("rl_s")}
    rows = {}
    for m in methods:
        final = [s["final"]["pass1_mean"] for s in summaries[m]]
        c = curves[m]
        to_target = {x: crossing(c[x], c["pass1"], target) for x in ("step", "update_s", "step_s")}
        row = {"final": final, "to_target": to_target, "curve": c}
        if m != base:
            d, lo, hi = paired_interval([a - b for a, b in zip(final, base_final)])
            row["diff"] = (d, lo, hi)
            row["verdict"] = ("no interval (1 seed)" if lo is None else "better" if lo > 0 else "worse" if hi < 0
                              else "no difference")
        rows[m] = row
    for m in methods:
        rows[m]["speedup"] = {x: (None if rows[m]["to_target"][x] in (None, 0.0) or rows[base]["to_target"][x] is None
                                  else rows[base]["to_target"][x] / rows[m]["to_target"][x]) for x in ("step", "update_s", "step_s")}
    return target, rows


def write_compare(args, methods, seeds, summaries, total_s):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s0 = summaries[methods[0]][0]
    k, n = s0["final"]["k"], s0["final"]["n"]
    base = "grpo" if "grpo" in methods else methods[0]
    S = len(seeds)
    target, lrows = ladder_rows(summaries, methods, base)
    avg = lambda values: sum(values) / len(values)  # noqa: E731
    fmt_x = lambda v, f="%.0f": "never" if v is None else f % v  # noqa: E731
    fmt_r = lambda v: "" if v is None else f" ({v:.2f}x)"  # noqa: E731

    outcome = [f"| method | Pass@1 (mean of {n}) | Δ vs {base}, 95% interval | verdict | greedy Pass@1 | Pass@{k} |",
               "|---|---|---|---|---|---|"]
    speed = [f"| method | steps to {target:.3f} | update s to it | whole-step s to it |", "|---|---|---|---|"]
    levels = sorted(key for key in s0["final"] if key.startswith("level"))
    by_level = ["| method | " + " | ".join(f"L{key[5:]} start → end" for key in levels) + " |", "|---" * (len(levels) + 1) + "|"]
    costs = ["| method | rollouts trained | tokens in loss | tokens forwarded | SUR | K realised / scheduled | KL to start "
             "(last) | entropy all / kept | mean grad norm |", "|---" * 9 + "|"]
    times = ["| method | generate s/step | grade s/step | pass 1 s/step | update s/step | whole step s |", "|---" * 6 + "|"]
    for m in methods:
        runs, r = summaries[m], lrows[m]
        col = lambda f, fmt="%.3f": mean_std([f(s) for s in runs], fmt)  # noqa: E731
        if m == base:
            diff, verdict = "(reference)", ""
        else:
            d, lo, hi = r["diff"]
            diff = f"{d:+.3f}" + ("" if lo is None else f" [{lo:+.3f}, {hi:+.3f}]")
            verdict = r["verdict"]
        outcome.append(f"| {m} | {mean_std(r['final'])} | {diff} | {verdict} | {col(lambda s: s['final']['greedy_pass1'])} | "
                       f"{col(lambda s: s['final']['passk'])} |")
        t, sp = r["to_target"], r["speedup"]
        speed.append(f"| {m} | {fmt_x(t['step'], '%.1f')}{fmt_r(sp['step'])} | {fmt_x(t['update_s'])}{fmt_r(sp['update_s'])} | "
                     f"{fmt_x(t['step_s'])}{fmt_r(sp['step_s'])} |")
        by_level.append(f"| {m} | " + " | ".join(f"{avg([s['warm_start'].get(key, 0) for s in runs]):.2f} → "
                                                 f"{avg([s['final'][key] for s in runs]):.2f}" for key in levels) + " |")
        kl = [s["final_kl_ref"] for s in runs if s.get("final_kl_ref") is not None]
        costs.append(f"| {m} | {col(lambda s: s['samples_trained'], '%.0f')} | {col(lambda s: s['tokens_trained'], '%.0f')} | "
                     f"{col(lambda s: s['tokens_forwarded'], '%.0f')} | {col(lambda s: s['mean_sur'], '%.2f')} | "
                     f"{col(lambda s: s['mean_k_real'])} / {col(lambda s: s['mean_k_frac'])} | "
                     f"{mean_std(kl) if kl else 'n/a'} | {col(lambda s: s['mean_entropy'])} / "
                     f"{col(lambda s: s['mean_entropy_kept'] or 0.0)} | {col(lambda s: s['mean_grad_norm'] or 0.0)} |")
        tp = {key: avg([s["time_per_step"][key] for s in runs]) for key in ("gen", "reward", "pass1", "train")}
        times.append(f"| {m} | {tp['gen']:.2f} | {tp['reward']:.2f} | {tp['pass1']:.2f} | {tp['train'] - tp['pass1']:.2f} | "
                     f"{tp['gen'] + tp['reward'] + tp['train']:.2f} |")
    w = s0["warm_start"]
    text = "\n".join([
        f"# train_small.py --compare ({args.loss} loss, {args.steps} steps, {S} RL seed{'s' * (S > 1)}: "
        f"{', '.join(map(str, seeds))})", "",
        f"Command: `{args.command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"total time {total_s / 60:.1f} min.  ",
        f"Warm start (the same for every run): held-out greedy Pass@1 {w['greedy_pass1']:.3f}, Pass@1 mean@{n} "
        f"{w['pass1_mean']:.3f}, Pass@{k} {w['passk']:.3f}.", "",
        "## Held-out Pass@1 at the last step", "", *outcome, "",
        f"Mean ± std over the {S} seeds (same warm start, data and held-out set; the seed sets prompt order, sampling and "
        f"random selection). Δ: the mean of the same-seed differences to {base}, with a 95% Student-t interval over the "
        f"{S} paired differences (mean ± t(0.975, {S - 1}) · sd / √{S}); a row differs from {base} only if its interval "
        f"excludes 0. Held-out set: {args.eval_size} problems, {n} samples each at temperature {args.temperature}.", "",
        f"## Training speed-up: reaching {base}'s final mean Pass@1 ({target:.3f})", "", *speed, "",
        f"On the seed-mean curve of held-out Pass@1 (evaluated every {args.eval_every} steps), the first point at which a "
        f"row reaches {base}'s final mean, interpolated linearly between evaluations; in steps, in update seconds "
        f"(forward, backward, optimizer) and in whole-step seconds (generate + grade + update; evaluation excluded). "
        f"In brackets: the speed-up, {base}'s figure / the row's (> 1: faster). 'never': not reached in {args.steps} steps.", "",
        "## Where RL helped: held-out Pass@1 by level (mean over seeds)", "", *by_level, "",
        "## Costs and the paper's metrics (mean ± std over seeds)", "", *costs, "",
        "Tokens in loss: the response tokens that token selection kept; tokens forwarded: the response tokens of the kept "
        "rollouts (the forward/backward cost). SUR: the share of trained rollouts with a non-zero advantage. KL: k3 to the "
        "warm start on the selected tokens, at the last step that measured it. Entropy: per token, of all forwarded tokens "
        "/ of the selected ones, mean over steps.", "",
        "## Where a step's time goes (mean over steps and seeds)", "", *times, "",
        "Pass 1: the no-grad forward for the old log-probs of mini-batches 2..M (and the reference on KL steps); update: "
        "token selection and the M forward/backward/optimizer steps.", ""])
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(text)

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for i, m in enumerate(methods):
        color, style = f"C{i % 10}", "-" if d3s.LADDER[m][2] else "--"  # dashed: no token selection
        evals = [s["evals"] for s in summaries[m]]
        n_evals = min(len(e) for e in evals)
        acc = torch.tensor([[e["pass1_mean"] for e in ev[:n_evals]] for ev in evals])  # [seeds, evals]
        curve = lrows[m]["curve"]
        for ax, x in ((axes[0], curve["step"]), (axes[1], curve["step_s"])):
            mean, std = acc.mean(0), (acc.std(0) if len(acc) > 1 else torch.zeros(acc.shape[1]))
            ax.plot(x, mean, style, color=color, label=m, lw=1.3)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.12, lw=0)
        if m != base:
            d, lo, hi = lrows[m]["diff"]
            axes[2].errorbar([d], [i], xerr=None if lo is None else [[d - lo], [hi - d]], fmt="o", color=color, capsize=4)
        train = [[t for t in read_metrics(os.path.join(s["out"], "metrics.jsonl")) if t["kind"] == "train"] for s in summaries[m]]
        gnorm = torch.tensor([[t["grad_norm"] if t.get("grad_norm") is not None else math.nan for t in tr] for tr in train])
        axes[3].plot([t["step"] for t in train[0]], gnorm.nanmean(0), style, color=color, label=m, lw=1.0)
    for ax in axes[:2]:
        ax.axhline(target, color="grey", lw=0.8, ls=":")
    axes[0].set(xlabel="RL step", ylabel=f"held-out Pass@1 (mean of {n})", title="mean ± std over seeds")
    axes[1].set(xlabel="whole-step seconds (generate + grade + update)", ylabel=f"held-out Pass@1 (mean of {n})")
    axes[2].axvline(0, color="grey", lw=0.8)
    axes[2].set(yticks=range(len(methods)), yticklabels=methods, xlabel=f"final Pass@1 − {base} (same seed), 95% interval",
                title="paired differences")
    axes[3].set(xlabel="RL step", ylabel="gradient norm before clipping (seed mean)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"train_small.py --compare: tiny Qwen2, --task {args.task}, {args.loss} loss, {S} seed{'s' * (S > 1)}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "compare.png"), dpi=100)
    plt.close(fig)
    print("\n" + text + f"\nwrote {os.path.join(args.out, 'compare.md')} and compare.png")


def main(argv=None):
    args = parse_args(argv)
    try:  # every bad flag, file or model stops here, before training, with one line
        check_args(args)
        if args.compare:
            load_data(args)
            return compare(args)
        train_rows, eval_rows = load_data(args)
        if args.resume:  # checked before the warm start: a bad checkpoint stops here
            read_checkpoint(os.path.join(args.out, "checkpoint.pt") if args.resume == "latest" else args.resume, args)
        with out_lock(args.out):
            warm = load_warm_start(args, train_rows)
            return run(args, train_rows, eval_rows, warm)
    except (UsageError, DataError) as e:
        print(f"train_small.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
