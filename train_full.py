"""train_full.py: GRPO / GSPO with D3S down-sampling at the paper's scale: vLLM rollouts + FSDP2.

    torchrun --nproc_per_node=8 train_full.py                     # Qwen2.5-Math-7B, GRPO + D3S
    torchrun --nproc_per_node=8 train_full.py --loss gspo         # GSPO + D3S
    torchrun --nproc_per_node=8 train_full.py --method grpo       # the GRPO baseline
    python train_full.py --eval-only --model runs/full/hf_final   # Pass@1 / Pass@k table

Every rank holds an FSDP2 shard of the policy (fp32 master weights, bf16 compute) and, on the same GPU, a vLLM
engine (asleep while the trainer runs). A step (docs/algorithm.md section 6) is six calls in main()'s loop, the
same six as train_small.py's:

  1 generate          G rollouts for each prompt of this rank's share of the step's P (vLLM)
  2 grade             0/1 rewards: the last \\boxed{} against the gold answer (grading.Grader)
  3 select_samples    d3s.select_samples on the GLOBAL [P, G] rewards, N from methods.budget; the kept rollouts are
                      then spread over the ranks by token count
  4 forward_kept      no-grad forward of the kept rollouts, only what the step needs: old log-probs,
                      d3s.token_entropy (methods that select tokens), the --kl-ref reference
  5 select_tokens     d3s.select_tokens on the |A| * H scores of all ranks at once
  6 update_policy     M mini-batches, one AdamW step each on d3s.policy_loss; then the weights go to vLLM

Prompt order, sampling seeds (one per prompt) and both selections are functions of the global batch: the kept
rollouts and tokens do not depend on the rank count where generation does not (CPU; GPU: VLLM_BATCH_INVARIANT=1,
usable on compute capability 9.x and newer, refused on 8.x: docs/train_full.md). Steps count from 1
(docs/metrics.md). SIGTERM or SIGUSR1 stops every rank after a step and its checkpoint (exit 75), a full disk before
it (74). Beside this file: support/fsdp.py, loss_head.py, engines.py, gpu.py (the machines); support/run.py (the
run's folder, metrics, checkpoints: support/checkpoint.py), support/checks.py, support/stops.py.

Defaults: [abstract] the paper's own words (its abstract), [summary] a third-party summary of it (the design card),
[notes] notes on the paper (not among the sources), [recipe] the Qwen2.5-Math-7B zero-RL recipe's (SimpleRL-Zoo /
Dr.GRPO / verl), [inferred] from those sources, [choice] this repo's (docs/algorithm.md defines them). The memory
flags' measured costs: docs/memory.md.
"""

import dataclasses
import math
import os
import random
import sys
import time

from support import stops  # before torch: from here on a Ctrl-C is one line and exit 130, not a traceback

if __name__ == "__main__":
    stops.ctrl_c_at_once("train_full.py", "the last checkpoint in --out, if any, is intact; continue with --resume")

import torch
import torch.distributed as dist

import d3s
from support import checkpoint, checks, cli, engines, explain, fsdp, gpu, grading, loss_head, mathtask, methods
from support import reward_function, run, templates, track
from support.cli import UsageError
from support.fsdp import all_reduce
from support.gpu import clock
from support.grading import Grader
from support.mathtask import DataError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # MATH levels 3-5 and the benchmarks
BENCHMARKS = ("aime24", "aime25", "amc23", "gsm8k", "math500", "minerva_math", "olympiadbench")
TRAIN_DATA = os.path.join(DATA, "train_math_lvl3to5_8k.jsonl")  # [recipe] MATH levels 3-5
EVAL_DATA = ",".join(os.path.join(DATA, f"{b}.jsonl") for b in BENCHMARKS)  # [notes] AIME24 ... OlympiadBench
MAX = dist.ReduceOp.MAX
PROG = "train_full.py"
RUN_FLAGS = (
    "model train_data template max_prompt_len method loss loss_agg steps prompts_per_step group_size n_init n_final "
    "k_init k_final static_n static_k token_scope switch_on_spike min_token_per_response normalize_by lr "
    "weight_decay max_grad_norm clip_low clip_high mini_batches kl_coef temperature top_p max_response_len seed "
    "unseeded_sampling system_prompt reward prompt_key answer_key"
).split()  # a resume must repeat them; free to change: the rank count (DCP reshards), memory, evaluation, checkpoints


# ---------------------------------------------------------------------------------------------
# Flags: each declared once, with its range (cli.number) and where its default comes from
# ---------------------------------------------------------------------------------------------
def build_parser():
    f, n, frac = cli.flag, cli.number, "a fraction of tokens in (0, 1]"  # one knob a line: f(flag, default, what, help)
    zero = lambda meaning: n(int, 0, what=f"an int >= 0 (0 = {meaning})")  # a count whose 0 says something else
    flags = [
        # what to train, on what
        f("--model", "Qwen/Qwen2.5-Math-7B", None, "[summary] hub name or local folder of the policy (or to evaluate)"),
        f("--method", "d3s", None, f"[abstract] a row of methods.LADDER: {', '.join(methods.NAMES)}"),
        f("--loss", "grpo", ["grpo", "gspo"], "[abstract] GRPO; [summary] GSPO: token ratios or the sequence ratio"),
        f("--rollout", "vllm", ["vllm", "hf"], "[choice] vLLM (colocated, asleep in training) or HF generate (slow)"),
        f("--train-data", TRAIN_DATA, None, "[recipe] JSONL/JSON/Parquet (problem, answer), or 'name[:config]:split'"),
        *mathtask.FLAGS,  # --prompt-key, --answer-key: --train-data's columns (the --eval-data benchmarks keep theirs)
        *reward_function.FLAGS,  # --reward FILE.py:FUNCTION in place of math-verify (support/reward_function.py)
        f("--eval-data", [EVAL_DATA], None, "[notes] files, globs or hub names; 'none': no evaluation", nargs="+"),
        f("--eval-only", False, bool, "evaluate --model on --eval-data and exit (no training)"),
        f("--out", None, None, "[choice] run folder: checkpoints/, hf_final/ (default: runs/full/METHOD__SEED__TIME)"),
        f(
            "--resume",
            None,
            None,
            "continue from the newest checkpoint in --out (or this; auto: if any)",
            nargs="?",
            const="latest",
        ),
        f("--config", None, None, cli.CONFIG_HELP, metavar="FILE"),
        f(
            "--template",
            "qwen-math",
            ["auto", *templates.TEMPLATES],
            "[recipe] prompt template: chat = the tokenizer's own chat template; auto = chat, but qwen-math for "
            "Qwen2.5-Math or a tokenizer without one; plain: for tiny test models",
        ),
        f("--system-prompt", templates.SYSTEM_PROMPT, None, "[recipe] the system turn of qwen-math and chat prompts"),
        # the batch and D3S
        f("--steps", 250, n(int, 1), "[choice] optimizer steps S (~1 epoch); the D3S schedule runs over them"),
        f("--prompts-per-step", 32, n(int, 1), "[choice] P over all ranks (x G = 1024 rollouts), divisible by them"),
        f("--group-size", 32, n(int, 2, 1024, what="an int in [2, 1024] (rollouts per prompt)"), "[inferred] G"),
        f("--n-init", 8, n(int, 1), "[summary] D3S schedule: rollouts kept per prompt at step 1"),
        f("--n-final", 32, n(int, 1), "[summary] D3S schedule: rollouts kept per prompt at the end"),
        f("--k-init", 0.05, n(float, 0, 1, low_open=True, what=frac), "[summary] tokens kept at step 1"),
        f("--k-final", 0.20, n(float, 0, 1, low_open=True, what=frac), "[summary] tokens kept at the end"),
        f("--static-n", None, n(int, 1), "[choice] N of d1s, d1s-cross, d2s, pods (default: the midpoint)"),
        f("--static-k", None, n(float, 0, 1, low_open=True, what=frac), "[choice] K of d2s (default: the midpoint)"),
        *methods.flags("--token-scope", "--switch-on-spike", "--min-token-per-response"),
        f("--loss-agg", None, ["token-mean", "seq-mean-token-mean"], "[recipe] default: token-mean; gspo: the other"),
        f("--normalize-by", "selected", ["selected", "all"], "[choice] token-mean over the selected or all tokens"),
        # optimization
        f("--lr", 1e-6, n(float, 0, 1, low_open=True, what="in (0, 1] (the recipe's: 1e-6)"), "[recipe] AdamW's"),
        f("--weight-decay", 0.0, n(float, 0, 1, what="in [0, 1] (AdamW's decoupled decay)"), "[recipe] AdamW"),
        f("--max-grad-norm", 1.0, n(float, 0, low_open=True), "[recipe] clipping's norm (grad_norm: before clipping)"),
        f("--clip-low", None, n(float, 0, 1, high_open=True), "[recipe] eps_low (default: 0.2 grpo, 3e-4 gspo)"),
        f("--clip-high", None, n(float, 0), "[choice] eps_high (default: 0.28 grpo, DAPO's; 4e-4 gspo)"),
        f("--mini-batches", 4, n(int, 1, what="an int >= 1 (1 = on-policy)"), "[recipe] M: AdamW steps per batch"),
        f("--no-load-balance", True, bool, "train a kept rollout on its home rank (same update)", dest="load_balance"),
        f("--micro-batch-size", 16, n(int, 1, what="an int >= 1 (rollouts per forward)"), "[choice] memory only"),
        f("--kl-ref", False, bool, "load --model again as a frozen reference; log the KL (k3) to it"),
        f("--kl-coef", 0.0, n(float, 0), "[recipe] beta of the k3 KL penalty (needs --kl-ref)"),
        f("--kl-every", None, zero("never"), "[choice] KL on step 1, every N-th, the last (default: --eval-every, 10)"),
        f("--no-activation-checkpointing", True, bool, "no activation checkpointing", dest="activation_checkpointing"),
        f("--mlp-chunk-tokens", 4096, zero("the whole micro-batch at once"), "[choice] tiled MLP: tokens per chunk"),
        # sampling
        f("--temperature", 1.0, n(float, 0.01, 100), "[recipe] rollouts' (the loss divides the logits by it)"),
        f("--top-p", 1.0, n(float, 0, 1, low_open=True), "[recipe] rollout nucleus sampling"),
        f("--max-prompt-len", 1024, n(int, 1), "[recipe] longer prompts are dropped (and counted)"),
        f("--drop-long-prompts", False, bool, cli.DROP_LONG_PROMPTS_HELP),
        f("--max-response-len", 3000, n(int, 1), "[recipe] max generated tokens per rollout"),
        # evaluation
        f("--eval-every", 0, zero("only after the last step"), "[choice] evaluate before training and every N steps"),
        f("--eval-samples", 32, n(int, 1, 1024, what="an int in [1, 1024] (samples per problem)"), "[notes] k"),
        f("--eval-pass-k", "1,8", None, "[notes] Pass@k values to report (unbiased estimator over the k samples)"),
        f("--eval-temperature", 0.6, n(float, 0.01, 100, also=(0,), what="0 (greedy) or in [0.01, 100]"), "[choice]"),
        f("--eval-top-p", 0.95, n(float, 0, 1, low_open=True), "[choice] evaluation nucleus sampling"),
        f("--eval-max-tokens", 3000, n(int, 1), "[recipe] max generated tokens per evaluation sample"),
        f("--eval-limit", 0, zero("every problem"), "[choice] the first N problems of each benchmark"),
        # checkpoints and reports
        f("--save-every", 50, n(int, 1), "[choice] sharded checkpoint every N steps and after the last"),
        f("--keep-checkpoints", 2, n(int, 1), "[choice] keep the newest N sharded checkpoints"),
        f("--export-every", 0, zero("only hf_final/"), "[choice] an HF export to OUT/hf_step_NNNNNN every N steps"),
        f("--keep-exports", 0, zero("keep all"), "[choice] keep the newest N hf_step_NNNNNN exports"),
        f("--explain-every", 0, zero("off"), "[choice] step 1 and every N-th: OUT/explain/step_NNNNNN.html"),
        f("--stop-after", None, n(int, 1), "stop cleanly after step N and its checkpoint (continue with --resume)"),
        # systems
        f("--seed", 0, n(int, 0, 2**31 - 1, what="an int in [0, 2^31)"), "[choice] data order, sampling and init"),
        f("--unseeded-sampling", False, bool, "no per-prompt sampling seeds (depends on the ranks; resumes inexact)"),
        f("--device", "auto", ["auto", "cuda", "cpu"], "auto: cuda if available, else cpu (gloo)"),
        f("--dtype", "auto", ["auto", "bfloat16", "float32"], "compute dtype; auto: bfloat16 on CUDA, float32 on CPU"),
        f("--cpu-offload", False, bool, "[choice] weights, gradients, AdamW in host memory (docs/train_full.md)"),
        f("--vllm-gpu-memory-utilization", None, n(float, 0, 1, low_open=True), "vLLM's GPU share (default: planned)"),
        f("--vllm-sleep-level", 2, [0, 1, 2], "[choice] 2 frees weights and KV cache, 1 offloads, 0 none", type=int),
        f("--vllm-allow-awake", False, bool, "accept --vllm-sleep-level 0 or 1 and the memory it costs"),
        f("--vllm-kv-cache-gb", 1.0, n(float, 0, 4096, low_open=True, what="in (0, 4096] GB"), "[choice] on CPU"),
        f("--vllm-max-num-seqs", None, n(int, 1), "vLLM max concurrent sequences (default: planned on CUDA; CPU 256)"),
        f("--vllm-enforce-eager", False, bool, "vLLM without CUDA graphs (slower; faster start)"),
        f("--hf-generate-batch", 16, n(int, 1), "[choice] --rollout hf: prompts per generate() call"),
        f("--grader-timeout", 5.0, n(float, 0, 3600, low_open=True), "[choice] seconds per answer (then: reward 0)"),
        f("--grader-workers", None, n(int, 1, 64, what="an int in [1, 64] (processes per rank)"), "math-verify"),
        *track.FLAGS,  # --report-to tensorboard wandb trackio, --run-name, --run-group, --project
        f("--peak-tflops", 0.0, n(float, 0, what="a finite number >= 0 (0: from the GPU's name)"), "for the MFU"),
    ]
    p = cli.parser("train_full.py", __doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[-1], flags)
    p.say = stops.usage_error_line  # one line per job under torchrun: rank 0's
    return p


def parse_args(argv=None):
    """Every flag, before any work: each one's range at parsing, then the checks of several flags together and of
    the paths (checks.check_args). A bad one is one line and exit 2."""
    p = build_parser()
    return checks.check_args(p, p.parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))


def run_flags(args):
    """RUN_FLAGS of this run, local paths made absolute (a resume may start from another folder)."""
    value = lambda k, v: os.path.abspath(v) if k in ("model", "train_data") and os.path.exists(v) else v
    return {k: value(k, getattr(args, k)) for k in RUN_FLAGS}


# ---------------------------------------------------------------------------------------------
# The six steps (docs/algorithm.md section 6); each rank holds its share, every choice is global
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Selection:
    """What a step trains on, the same choice on every rank (global order: rank order = prompt order), filled by
    steps 3 and 5; this rank forwards and trains the rows `mine` of the kept rollouts."""

    method_row: str  # the LADDER row that selects: --method, or its intra-group twin once --switch-on-spike fired
    n_keep: int  # N, rollouts kept per prompt (cross-group: N * P in all)
    k_frac: float  # K, the scheduled fraction of the tokens
    rewards_all: torch.Tensor  # [P, G] of every rank
    keep_all: torch.Tensor  # [P, G] bool: the kept rollouts (d3s.select_samples)
    adv_all: torch.Tensor  # [P, G]: their advantages (0 where dropped)
    kept_all: list  # [(p, g)] of every kept rollout, global order
    first: int  # this rank's first prompt, in global order
    mine: list  # the kept rollouts this rank forwards and trains (indices into kept_all)
    row_of: dict  # kept_all index -> row here
    seqs: list  # this rank's kept rollouts: {"prompt_ids", "response_ids"}
    mask: torch.Tensor  # [B, T] bool: their response tokens
    kept_adv: torch.Tensor  # [B]
    parts: list  # the M mini-batches: this rank's rows of each
    token_keep: torch.Tensor = None  # [B, T] bool: the tokens in the loss (step 5)


@dataclasses.dataclass
class Pass1:
    """Step 4's no-grad forwards of the kept rollouts, before any update."""

    old_logp: torch.Tensor  # [B, T] log pi_old where has_old
    has_old: torch.Tensor  # [B] bool: rows with pass-1 log-probs (mini-batch 1 without token selection: on-policy)
    entropy: torch.Tensor  # [B, T] H_t, or None (methods without token selection: pass 2 measures it)
    ref_logp: torch.Tensor  # [B, T] the reference's log-probs on the steps that measure the KL, else None
    tokens: float  # prompt + response tokens forwarded, all ranks
    head_tokens: float  # response tokens the LM head ran at, all ranks (MFU's: gpu.update_flops)


def generate(engine, problems, step, args, stop_ids):
    """Step 1 for this rank's share of the step's problems [(global index, prompt)]: G rollouts per prompt."""
    outs = engine.generate(
        [p["prompt_ids"] for _, p in problems],
        n=args.group_size,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_response_len,
        seeds=mathtask.sample_seeds(args, step, [g for g, _ in problems], args.group_size),
        stop_ids=stop_ids,
    )
    return [
        [{"prompt_ids": p["prompt_ids"], "response_ids": c["token_ids"]} for c in group]
        for (_, p), group in zip(problems, outs)
    ]


def grade(rollouts, problems, tokenizer, grader, world):
    """Step 2: rewards [P_rank, G], the last \\boxed{} of each response vs the gold answer (0/1), or --reward's
    function. One call for the rank's P_rank x G answers, so the grader pool grades them together."""
    texts = [tokenizer.decode(r["response_ids"], skip_special_tokens=True) for group in rollouts for r in group]
    rows = [p for (_, p), group in zip(problems, rollouts) for _ in group]
    G = len(rollouts[0]) if rollouts else 0
    return torch.tensor(grader.rewards(texts, rows, world), dtype=torch.float32).view(len(rollouts), G)


def select_samples(rewards, rollouts, method_row, step, args, world):
    """Step 3 on the GLOBAL batch: d3s.select_samples on the [P, G] rewards of all ranks with the samples rule of
    `method_row`, then which rank forwards which kept rollout (fsdp.assign_rollouts) and the step's M mini-batches.
    Every rank gets the token ids of every kept rollout (a few MB per step), so that any rank can train any."""
    P_local, G = rewards.shape
    n_keep, k_frac = methods.budget(args, method_row, step)
    rewards_all, counts = fsdp.gather_rows(rewards.float(), world)  # [P, G], CPU
    generator = torch.Generator().manual_seed(args.seed * 7919 + step)  # "random": same draw on every rank
    rule = methods.LADDER[method_row].samples
    keep_all, adv_all = d3s.select_samples(rewards_all, n_keep, rule, generator=generator)
    first = sum(counts[: world.rank])  # this rank's first prompt, in global order
    kept_all = keep_all.nonzero().tolist()  # [(prompt p, rollout g)] of the whole step, global order
    shares = [None] * world.size
    dist.all_gather_object(shares, [rollouts[p - first][g] for p, g in kept_all if first <= p < first + P_local])
    seqs_all = [s for share in shares for s in share]  # global order: rank order = prompt order
    home = [r for r, share in enumerate(shares) for _ in share]
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs_all]
    owner, parts = fsdp.assign_rollouts(lengths, home, world.size, args.mini_batches, args.load_balance)
    mine = [g for g in range(len(kept_all)) if owner[g] == world.rank]  # the kept rollouts this rank forwards
    row_of = {g: r for r, g in enumerate(mine)}
    seqs = [seqs_all[g] for g in mine]
    T = int(all_reduce(max([len(s["response_ids"]) for s in seqs], default=1), world, MAX))
    mask = torch.zeros(len(seqs), T, dtype=torch.bool, device=world.device)  # the response tokens, [B, T]
    for r, s in enumerate(seqs):
        mask[r, : len(s["response_ids"])] = True
    kept_adv = adv_all[keep_all][mine].to(world.device)  # [B], full-group A (pods: recomputed)
    parts = [[row_of[g] for g in part if g in row_of] for part in parts]  # this rank's rows of each mini-batch
    return Selection(
        method_row=method_row,
        n_keep=n_keep,
        k_frac=k_frac,
        rewards_all=rewards_all,
        keep_all=keep_all,
        adv_all=adv_all,
        kept_all=kept_all,
        first=first,
        mine=mine,
        row_of=row_of,
        seqs=seqs,
        mask=mask,
        kept_adv=kept_adv,
        parts=parts,
    )


def forward_kept(model, ref_model, sel, args, world, pad_id):
    """Step 4, only what the step needs (no grad): the methods that select tokens (d2s, d3s, d3s-i) need the
    entropy of every kept token before the global top K, so the policy forwards every kept rollout (the old
    log-probs come with it); the others need the old log-probs of mini-batches 2..M only (mini-batch 1 runs first
    and is on-policy: its old log-probs are pass 2's own, detached; their entropy metric comes from pass 2), none
    at M = 1. ref_model (on the steps that measure or use the KL): every kept rollout."""
    selects = methods.selects_tokens(args.method)
    rows = [r for part in (sel.parts if selects else sel.parts[1:]) for r in part]
    T = sel.mask.shape[1]
    old_logp, entropy, tokens = loss_head.forward_no_grad(
        model, sel.seqs, rows, T, args, world, pad_id=pad_id, with_entropy=selects
    )
    has_old = torch.zeros(len(sel.seqs), dtype=torch.bool)
    has_old[rows] = True
    ref_logp = None
    head = sum(len(sel.seqs[r]["response_ids"]) for r in rows)  # the tokens the LM head runs at (MFU)
    if ref_model is not None:
        every = list(range(len(sel.seqs)))
        ref_logp, _, ref_tokens = loss_head.forward_no_grad(ref_model, sel.seqs, every, T, args, world, pad_id=pad_id)
        tokens += ref_tokens
        head += sum(len(s["response_ids"]) for s in sel.seqs)
    return Pass1(old_logp, has_old, entropy, ref_logp, tokens, all_reduce(head, world))


def select_tokens(sel, entropy, args, world):
    """Step 5: the top K of |A| * H over the kept tokens of ALL ranks, d3s.select_tokens once on the gathered
    [B, T] scores in global order (on CPU: every rank computes the identical choice); this rank's rows of it. Every
    response token for the methods without token selection. A non-finite forward (NaN entropy) scores 0: the loss
    is then non-finite as well and the step is skipped."""
    if not methods.selects_tokens(args.method):
        return sel.mask.clone()
    scores = d3s.token_scores(sel.kept_adv, entropy)  # |A_{i,t}| * H_{i,t}, [B, T]
    keep = d3s.select_tokens(
        fsdp.gather_global(scores, sel.mine, len(sel.kept_all), world),
        fsdp.gather_global(sel.mask, sel.mine, len(sel.kept_all), world),
        sel.k_frac,
        scope=args.token_scope,
        min_per_seq=int(args.min_token_per_response),
    )
    return keep[sel.mine].to(scores.device)


def update_policy(model, optimizer, sel, pass1, args, world, pad_id):
    """Step 6: the M mini-batches (global order), one optimizer step each, then the gradients are freed. The
    normalizer of a mini-batch is its selected tokens (or responses) summed over all ranks, computed before its
    micro-batches, so neither the micro-batch size nor the rank count changes the update. Rows without pass-1
    log-probs (mini-batch 1 of the methods without token selection) are on-policy: their old log-probs are this
    forward's, detached. Without a pass-1 entropy, the entropy metric comes from this forward's logits."""
    device, entropy, token_keep = world.device, pass1.entropy, sel.token_keep
    entropy_here = entropy is None
    if entropy_here:
        entropy = torch.zeros(sel.mask.shape, device=device)
    seqs, kept_adv, ref_logp = sel.seqs, sel.kept_adv, pass1.ref_logp
    losses, grad_norms, clip_fracs, clip_tokens, kl_tokens, trained_tokens, skipped = [], [], [], 0.0, 0.0, 0.0, False
    for part in sel.parts:  # this rank's rows of each mini-batch
        part_keep = token_keep[part]
        if args.loss_agg == "seq-mean-token-mean":
            normalizer = all_reduce(part_keep.any(-1).sum(), world)  # responses with a selected token
        else:
            normalizer = all_reduce((part_keep if args.normalize_by == "selected" else sel.mask[part]).sum(), world)
        n_selected = all_reduce(part_keep.sum(), world)
        if n_selected == 0:  # no selected token in this mini-batch on any rank: no optimizer step
            continue
        optimizer.zero_grad(set_to_none=True)
        loss_sum, part_clip = 0.0, 0.0
        for rows in loss_head.micro_batch_rows(seqs, part, args.micro_batch_size, world, at_least=1):
            if not rows:  # this rank has fewer micro-batches: a zero-loss pass keeps FSDP's collectives matched
                loss = loss_head.idle_loss(model, pad_id, device, args.temperature)
            else:
                inputs, targets, _ = loss_head.pack(seqs, rows, pad_id, device)
                width = targets.shape[1]
                keep = token_keep[rows, :width]
                logp = loss_head.response_logp_at(model, inputs, targets, keep, args.temperature, entropy_here)
                if entropy_here:
                    logp, entropy[rows, :width] = logp
                on_policy = not bool(pass1.has_old[rows].all())  # ratio 1: this forward's own log-probs, detached
                old = logp.detach() if on_policy else pass1.old_logp[rows, :width]
                loss, stats = d3s.policy_loss(
                    logp,
                    old,
                    kept_adv[rows],
                    keep,
                    kind=args.loss,
                    clip_low=args.clip_low,
                    clip_high=args.clip_high,
                    ref_logp=ref_logp[rows, :width] if ref_logp is not None else None,
                    beta=args.kl_coef,
                    normalizer=normalizer,
                    agg=args.loss_agg,
                )
                part_clip += stats["clip_frac"] * stats["tokens"]
                kl_tokens += stats["kl"] * stats["tokens"]
                trained_tokens += float(inputs["attention_mask"].sum())
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # total norm before clipping
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        part_loss = all_reduce(loss_sum, world)
        if math.isfinite(grad_norm) and math.isfinite(part_loss):  # the same on every rank
            optimizer.step()
            grad_norms.append(grad_norm)
        else:
            skipped = True
        losses.append(part_loss)
        clip_fracs.append(all_reduce(part_clip, world) / n_selected)
        clip_tokens += clip_fracs[-1] * n_selected
    optimizer.zero_grad(set_to_none=True)
    return {
        "entropy": entropy,
        "losses": losses,
        "grad_norms": grad_norms,
        "clip_fracs": clip_fracs,
        "clip_tokens": clip_tokens,
        "skipped": skipped,
        "kl_tokens": all_reduce(kl_tokens, world),
        "trained_tokens": all_reduce(trained_tokens, world),
    }


# ---------------------------------------------------------------------------------------------
# What a step reports
# ---------------------------------------------------------------------------------------------
def step_metrics(sel, pass1, update, train_s, measured_kl, world):
    """The step's metrics (global), the ones the paper reads first. entropy_mean is over every kept response
    token, entropy_kept over the selected ones: for the methods that select tokens both come from pass 1 (the
    policy before the step's updates); for the others from pass 2's logits, so on mini-batches 2..M they are the
    entropy of the policy at their forward, after the earlier mini-batches' updates."""
    token_keep, entropy = sel.token_keep, update["entropy"]
    n_tokens, n_selected = all_reduce(sel.mask.sum(), world), all_reduce(token_keep.sum(), world)
    rank_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in sel.seqs)  # what this rank forwarded
    rewards_all, grad_norms, losses = sel.rewards_all, update["grad_norms"], update["losses"]
    return {
        "reward_mean": float(rewards_all.mean()),
        "acc_train": float(rewards_all.mean()),  # 0/1 reward: the same
        "groups_mixed": float((rewards_all.amax(-1) > rewards_all.amin(-1)).float().mean()),  # groups with signal
        "n_keep": sel.n_keep,
        "k_frac": sel.k_frac,
        "sample_rule": methods.rule_name(sel.method_row),  # the rollouts' rule: "cross" turns "intra" at the switch
        "k_real": n_selected / max(n_tokens, 1.0),  # realised fraction of the forwarded tokens
        "kept_samples": len(sel.kept_all),
        "sur": d3s.usefulness_rate(sel.adv_all, sel.keep_all),  # kept rollouts with A != 0
        "kept_tokens": int(n_selected),
        "fwd_tokens": int(n_tokens),  # in the loss; response tokens of the kept
        "kept_adv_var": d3s.kept_variance(sel.adv_all, sel.keep_all),
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,  # finite AdamW steps, before clipping
        "entropy_mean": all_reduce((entropy * sel.mask).sum(), world) / max(n_tokens, 1.0),
        "entropy_kept": all_reduce((entropy * token_keep).sum(), world) / max(n_selected, 1.0),
        "kl_ref": update["kl_tokens"] / max(n_selected, 1.0) if measured_kl else None,
        "clip_frac": update["clip_tokens"] / max(n_selected, 1.0),  # over the selected tokens of every mini-batch
        "clip_frac_by_minibatch": update["clip_fracs"],
        "loss": sum(losses) / len(losses) if losses else None,  # mean over the optimizer steps
        "updates": len(grad_norms),
        "skipped": update["skipped"],  # skipped: an optimizer step had a non-finite loss/gradient
        "train_s": train_s,
        "train_tokens": int(update["trained_tokens"]),  # prompt + response tokens through pass 2
        "pass1_tokens": int(pass1.tokens),  # prompt + response tokens through the no-grad forwards (policy + reference)
        "train_tokens_per_s": update["trained_tokens"] / max(train_s, 1e-9),
        "rank_tokens_max": int(all_reduce(rank_tokens, world, MAX)),  # load balance: the busiest rank's tokens
        "rank_tokens_min": int(all_reduce(rank_tokens, world, dist.ReduceOp.MIN)),  # ... and the idlest rank's
    }


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)  # every flag and path, before any work
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the process group comes after the checks
    engines.check_machine(args, ranks)  # CUDA, vLLM, and a GPU the setting fits
    inputs = mathtask.load_inputs(args)  # tokenizer, stop ids, prompts, benchmarks: a bad one stops every rank at once
    world = fsdp.init_distributed(args.device, args.cpu_offload)
    torch.manual_seed(args.seed + world.rank)
    random.seed(args.seed + world.rank)
    if args.out is None:  # a new folder per run, named by rank 0's clock
        args.out = run.default_out(args, "full", world)
    args.run_name = args.run_name or os.path.basename(os.path.normpath(args.out))  # the trackers' (--report-to)
    with run.out_lock(args.out, PROG, world):  # one writer per run folder, from before anything in it is read
        # fresh (None) or the checkpoint to continue: a fresh run never writes into a folder that holds a run
        ckpt = None if args.eval_only else checkpoint.start(args, run_flags(args), PROG, shards=True)
        run.write_args(args, run_flags(args), world)
        if args.eval_only:
            return evaluate_only(args, world, inputs)
        train(args, world, inputs, ckpt)


def evaluate_only(args, world, inputs):
    """--eval-only: every benchmark, after a check of --model's weights (checks.check_finite_files: a line, exit 2)."""
    tokenizer, stop_ids, _, eval_sets, _ = inputs
    checks.check_finite_files(args.model, world)
    engine = engines.make_engine(args.model, args, world)
    with Grader(args.grader_timeout, workers=args.grader_workers, reward=args.reward) as grader:  # --eval-reward
        grading.evaluate(
            engine, grader, tokenizer=tokenizer, stop_ids=stop_ids, eval_sets=eval_sets, args=args, world=world
        )
    engines.shutdown(engine)


def train(args, world, inputs, ckpt):
    """The policy (FSDP2), its optimizer and the rollout engine, then the loop: RL with args.method from step 0 or
    from the checkpoint `ckpt`, to OUT/hf_final and the final evaluation."""
    tokenizer, stop_ids, prompts, eval_sets, note = inputs
    say = (lambda *m: print(*m, flush=True)) if world.is_main else (lambda *m: None)
    evaluation = dict(tokenizer=tokenizer, stop_ids=stop_ids, eval_sets=eval_sets, args=args, world=world)
    say(
        f"train data: {note}; {world.size} ranks, {args.prompts_per_step // world.size} prompts x {args.group_size} "
        f"rollouts per rank per step, method {args.method}, loss {args.loss}"
    )
    order = mathtask.PromptOrder(len(prompts), args.seed)
    model = fsdp.load_policy(args, world)
    # NaN or inf in the weights (each rank its shards) or in the logits of a first forward: one line naming --model,
    # exit 2, before any step
    checks.check_finite(model, f"--model {args.model}", prompts[0]["prompt_ids"], world)
    ref_model = fsdp.load_policy(args, world, reference=True) if args.kl_ref else None  # the initial policy
    optimizer = fsdp.make_optimizer(model, args)
    # completed steps, and the history its rules read (grad norms: --switch-on-spike's signal), the same on every rank
    step, history = checkpoint.restore_shards(ckpt.path, model, optimizer, order, args, world) if ckpt else (0, None)
    engine = engines.make_engine(args.model, args, world)
    engine.update_weights(fsdp.full_named_tensors(model, getattr(torch, args.dtype)))  # also after a resume
    pad_id, device = tokenizer.pad_token_id, world.device
    flops, out = gpu.mfu_counts(model, device, args.peak_tflops), args.out  # MFU's, the run's folder

    def save(step):  # OUT/checkpoints/step_NNNNNN: the shards, the flags, the data position and history
        state = checkpoint.shards_state(run_flags(args), order, r.history)
        return checkpoint.save_shards(model, optimizer, args.out, step, state, world, keep=args.keep_checkpoints)

    def export(path):  # an HF folder, with vLLM asleep: its fp32 gathers fit beside it (engines.export_asleep)
        return engines.export_asleep(
            engine, model, args, lambda: checkpoint.export_hf(model, tokenizer, path, world, out)
        )

    grader = Grader(
        args.grader_timeout, workers=args.grader_workers, reward=args.reward
    )  # the evaluations: --eval-reward's (math-verify's by default)
    with grader, stops.Notices(PROG, world, args.out) as notices:
        r = run.Run(args, PROG, notices, step, history, world)  # metrics.jsonl: what the checkpoint covers
        evaluate = lambda s, tag=None, name=None: grading.evaluate(
            engine, grader, tag=tag, model_name=name, step=s, trackers=r.trackers, **evaluation
        )
        if grading.evaluation_due(r.metrics, step, args, world):  # step 0, or one a stop cut off after its checkpoint
            evaluate(step)
        bar = run.progress_bar(total=args.steps, initial=step, disable=not world.is_main, desc="steps")  # or log lines
        notice = None
        while step < r.stop_at:  # --steps, or --stop-after
            s = step + 1  # this step, 1..S
            method_row = methods.switch_to_intra(args.method, r.history["grad_norms"], args.switch_on_spike)
            problems = mathtask.rank_share([(g, prompts[g]) for g in order.take(args.prompts_per_step)], world)
            t0 = clock(device)
            rollouts = generate(engine, problems, s, args, stop_ids)  # 1) G rollouts per prompt
            phases = {"gen_s": clock(device) - t0, "gpu_used_gen": gpu.gpu_used_gb(device)}  # + awake vLLM
            engine.sleep()  # free vLLM's GPU memory for training
            t0 = clock(device, reset_peak=True)  # the trainer's own peak from here (gpu.memory_peak_gb)
            rewards = grade(rollouts, problems, tokenizer, grader, world)  # 2) 0/1 rewards [P_rank, G]
            phases["reward_s"] = time.perf_counter() - t0
            sel = select_samples(rewards, rollouts, method_row, s, args, world)  # 3) N per prompt, over all ranks
            t0, measure_kl = clock(device), run.measures_kl(s, args)
            pass1 = forward_kept(model, ref_model if measure_kl else None, sel, args, world, pad_id)  # 4) pass 1
            phases.update(pass1_s=clock(device) - t0, pass1_head_tokens=pass1.head_tokens)  # the latter: MFU's
            sel.token_keep = select_tokens(sel, pass1.entropy, args, world)  # 5) the top K of |A| * H, all ranks
            update = update_policy(model, optimizer, sel, pass1, args, world, pad_id=pad_id)  # 6) M AdamW steps
            train_s = all_reduce(clock(device) - t0, world, MAX)
            stats = step_metrics(sel, pass1, update, train_s, measure_kl, world)
            if args.reward:  # acc_train: correctness, which only math-verify's 0/1 reward measures
                del stats["acc_train"]
            if args.explain_every and (s == 1 or s % args.explain_every == 0):  # rank 0's page of the step
                page = dict(tokenizer=tokenizer, notices=notices, world=world, args=args)
                r.trackers.image(s, explain.full_page(s, rollouts, problems, sel, update["entropy"], stats, **page))
            phases["gpu_used_train"] = gpu.gpu_used_gb(device)  # trainer (+ sleeping vLLM), before the sync
            t0 = clock(device)
            engine.update_weights(fsdp.full_named_tensors(model, getattr(torch, args.dtype)))  # weights to vLLM
            phases["sync_s"] = clock(device) - t0
            step = s
            phases["grader_timeouts"] = grader.timeouts
            r.log(gpu.train_record(step, stats, rollouts, phases, args, world, flops=flops))
            if world.is_main:
                bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", N=stats["n_keep"], K=f"{stats['k_frac']:.2f}")
                bar.update(1)
            notice = notices.agree()  # any rank's full disk (DiskFull everywhere: exit 74) or notice (SIGTERM, ...)
            if args.export_every and step % args.export_every == 0:  # before the checkpoint: a resume redoes both
                export(os.path.join(args.out, f"hf_step_{step:06d}"))
                if args.keep_exports and world.is_main:  # the older ones beyond the newest --keep-exports
                    checkpoint.keep_newest(args.out, checkpoint.EXPORT_DIR, args.keep_exports)
            notice = r.checkpoint(step, notice, save)  # every --save-every steps, the last, and on a notice
            if notice:
                break
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                evaluate(step)
        bar.close()
        if notice:  # SIGTERM, SIGUSR1, a first Ctrl-C or the launcher's end: stopped after this step's checkpoint
            r.close()
            stops.stopped(PROG, notice, step, r.saved, quiet=not world.is_main)  # exit 75: continue with --resume
        if args.stop_after:
            say(f"stopped after step {step} (--stop-after): continue with --resume")
        elif step >= args.steps:
            final = export(os.path.join(args.out, "hf_final"))
            say(f"exported {final}")
            evaluate(step, "final", f"{final} ({args.model} after {step} steps of {args.method}, {args.loss} loss)")
        r.close()  # the trackers
    engines.shutdown(engine)


def entry(argv=None):
    """main() for torchrun. A bad flag, file, model or checkpoint is one line on stderr (once per job) and exit 2
    (a full disk: 74; a Ctrl-C outside the loop: 130, stops.crashed). A rank that fails otherwise prints its
    traceback and exits at once (os._exit), skipping the interpreter's shutdown (vLLM's engine and the process group
    would wait there for ranks that will never answer): torchrun then stops the other ranks within seconds, instead
    of a 60-minute collective timeout."""
    try:
        main(argv)
    except SystemExit as e:  # the parser's errors: already printed (cli.Parser.error)
        if e.code not in (None, 0):
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 2)
    except (UsageError, DataError, checkpoint.CheckpointError, stops.DiskFull) as e:  # exit 2; a full disk: 74
        stops.fail(PROG, e, at_once=True)
    except BaseException as e:  # a Ctrl-C outside the loop: one line, exit 130; else its traceback, exit 1
        stops.crashed(PROG, e, "the last checkpoint in --out, if any, is intact; continue with --resume")


if __name__ == "__main__":
    entry()
