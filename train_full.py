"""train_full.py: GRPO / GSPO with D3S down-sampling at the paper's scale: vLLM rollouts + FSDP2.

    torchrun --nproc_per_node=8 train_full.py                     # Qwen2.5-Math-7B, GRPO + D3S
    torchrun --nproc_per_node=8 train_full.py --loss gspo         # GSPO + D3S
    torchrun --nproc_per_node=8 train_full.py --method grpo       # the GRPO baseline
    python train_full.py --eval-only --model runs/full/hf_final   # Pass@1 / Pass@k table

Every rank holds an FSDP2 shard of the policy (fp32 master weights, bf16 compute) and, on the
same GPU, a vLLM engine (sleep mode frees its memory while the trainer runs). One step is
docs/algorithm.md section 6, every algorithmic piece a call into d3s.py:

  1 generate  each rank samples G rollouts for its share of the step's prompts (vLLM)
  2 reward    mathtask.Grader: last \boxed{} vs the gold answer, 0/1
  3 samples   all_gather the rewards -> d3s.select_samples on the GLOBAL [P, G] batch with N
              from d3s.method_budget; the kept rollouts are spread over the ranks by token count
              (load balance: a rank whose prompts were all solved still gets work)
  4 pass 1    no-grad forward of the kept rollouts only, and only what the step needs: with
              token selection (d2s, d3s, d3s-i) every kept rollout, for d3s.token_entropy (and the
              old log-probs); without it the old log-probs of mini-batches 2..M only (none at
              M = 1: mini-batch 1 is on-policy, its old log-probs are pass 2's own, detached).
              The --kl-ref reference on step 1, every --kl-every steps and the last (every step
              with --kl-coef > 0)
  5 tokens    scores |A| * H, gathered from all ranks -> d3s.select_tokens once, globally
  6 pass 2    the kept rollouts in M mini-batches (global order), one optimizer step each:
              micro-batched forward/backward of d3s.policy_loss(normalizer = the mini-batch's
              selected tokens summed over all ranks), FSDP sums the gradients, clip, AdamW
              (skipped if not finite on any rank). Mini-batch 1 is on-policy (ratio 1); the
              later ones are off-policy, which is where clipping and GSPO act.
  7 sync      the FSDP shards are gathered tensor by tensor into vLLM (reload_weights),
              then the prefix cache is reset

The kept rollouts and tokens do not depend on the number of ranks: the prompt order, the
sampling seeds (one per prompt) and both selections are functions of the global batch. Steps
count from 1: train line s of metrics.jsonl is the s-th update, eval line s is after s updates
(0: before training), checkpoints/step_NNNNNN holds NNNNNN completed steps.

The plumbing (process group, FSDP2 sharding, the vLLM and HF engines, checkpoints, clocks) is in
fsdp_vllm.py. Left out on purpose: a reference model by default (beta = 0 in the recipe;
--kl-ref loads one to measure the KL), tensor-parallel vLLM (a 7B model fits one GPU), sequence
packing. Defaults marked [paper] are stated in the D3S paper, [recipe] come from the common
Qwen2.5-Math-7B zero-RL recipe (SimpleRL-Zoo / Dr.GRPO / verl's examples), [inferred] follow
from the paper without being stated, [choice] are this repo's where neither says.
"""

import argparse
import functools
import glob
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist

import d3s
import variants
from fsdp_vllm import (CheckpointError, all_reduce, append_metrics, clock, context_length, eval_record, explain_rows,
                       export_hf, find_checkpoint, flop_params, full_named_tensors, gather_global, gather_rows, gpu_used_gb,
                       init_distributed, load_checkpoint, load_generation_config, load_policy, load_tokenizer, make_engine,
                       make_optimizer, memory_peak_gb, peak_flops, read_checkpoint, save_checkpoint, shutdown,
                       truncate_metrics, write_eval_report, write_explain_page)
from mathtask import (PLAIN_TEMPLATE, QWEN_MATH_TEMPLATE, DataError, Grader, default_grader_workers, load_problems,
                      pass_at_k, stop_token_ids)

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")  # the repository's data/: MATH levels 3-5 and the seven benchmarks (data/README.md)
BENCHMARKS = ("aime24", "aime25", "amc23", "gsm8k", "math500", "minerva_math", "olympiadbench")
TEMPLATES = {"qwen-math": QWEN_MATH_TEMPLATE, "plain": PLAIN_TEMPLATE}


# ---------------------------------------------------------------------------------------------
# 0. Arguments
# ---------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse, with every error as one line on stderr (once per job under torchrun: usage_error_line), exit 2."""

    def error(self, message):
        usage_error_line(f"{self.prog}: error: {message}")
        sys.exit(2)


def usage_error_line(line, wait_s=10.0):
    """Print a bad-input line once per job. Every rank finds the same bad flag, so rank 0 prints at once and
    the others wait: torchrun stops them when rank 0 exits. A rank that alone finds a fault (a file missing
    on its node only) prints it after wait_s, so the line is never lost."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(wait_s)
    print(line, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = Parser(prog="train_full.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=(
        "GRPO/GSPO + D3S with vLLM rollouts and FSDP2 (one node or more, under torchrun). [paper] = stated in the D3S "
        "paper, [recipe] = the common Qwen2.5-Math-7B zero-RL recipe (SimpleRL-Zoo / Dr.GRPO / verl), [inferred] = "
        "follows from the paper, [choice] = this repo's. Measured costs of the memory flags: docs/memory.md."))
    a = p.add_argument
    default_train = os.path.join(DATA, "train_math_lvl3to5_8k.jsonl")
    default_eval = ",".join(os.path.join(DATA, f"{b}.jsonl") for b in BENCHMARKS)
    # what to train, on what
    a("--model", default="Qwen/Qwen2.5-Math-7B", help="[paper] HF hub name or local folder of the policy "
      "(with --eval-only: the model to evaluate, e.g. an hf_final/ export)")
    a("--method", default="d3s", choices=list(variants.METHODS), help="[paper] what to train on, a row of variants.LADDER: grpo "
      "(all), d1s (intra-group samples, static N), d1s-cross (cross-group), d2s (+ top-K tokens, static K), d3s (+ the "
      "schedule), d3s-i (intra-group + tokens + schedule), pods (max-variance by reward, A recomputed), random (control), "
      "dapo-filter (every rollout of the groups with spread, DAPO's filter without oversampling; a step with none "
      "makes no optimizer step), dapo-filter-k (+ D3S's tokens)")
    a("--loss", default="grpo", choices=["grpo", "gspo"], help="[paper] token-ratio GRPO or sequence-ratio GSPO surrogate "
      "(GSPO needs --mini-batches > 1 to differ from GRPO)")
    a("--rollout", default="vllm", choices=["vllm", "hf"], help="[choice] rollout engine: vLLM (colocated, sleep mode on "
      "CUDA) or HF generate (for machines without vLLM; slow)")
    a("--train-data", default=default_train, help="[recipe] MATH levels 3-5 (the repo's data/): local JSONL/JSON/Parquet "
      "with problem/answer, or a hub dataset 'name', 'name:split' or 'name:config:split' (e.g. openai/gsm8k:main:train; "
      "common column names are mapped)")
    a("--eval-data", nargs="+", default=[default_eval], help="[paper] benchmark files (JSONL/JSON/Parquet, globs such as "
      "'data/*.jsonl' work) or hub names, space- or comma-separated; 'none' = no eval. Default: AIME24, AIME25, AMC23, "
      "GSM8K, MATH500, Minerva, OlympiadBench from the repo's data/")
    a("--eval-only", action="store_true", help="evaluate --model on --eval-data and exit (no training)")
    a("--out", default="runs/full", help="[choice] output folder: metrics.jsonl, checkpoints/, hf_final/, eval_*.md/json")
    a("--resume", nargs="?", const="latest", default=None, help="continue a run: the flag alone, from the newest complete "
      "checkpoint in OUT/checkpoints; with a value, from that checkpoint folder. The run's flags must be the ones it "
      "was started with (--steps included)")
    a("--template", default="qwen-math", choices=list(TEMPLATES), help="[recipe] prompt template: Qwen2.5-Math chat "
      "template with 'Please reason step by step...' (plain: for tiny test models)")
    # the batch and D3S
    a("--steps", type=int, default=250, help="[choice] optimizer steps S of the run (~1 epoch of the 8.5k problems at "
      "32 prompts/step); the D3S schedule runs over these, d3s.method_budget(method, s - 1, S) at step s = 1..S")
    a("--prompts-per-step", type=int, default=32, help="[choice] P: prompts per step over all ranks (32 x 32 = 1024 "
      "rollouts, as Dr.GRPO's 128 x 8); must be divisible by the number of ranks")
    a("--group-size", type=int, default=32, help="[inferred] G: rollouts per prompt, from N_final = 32 (the paper states no "
      "G; its N schedule ends at 32, so G >= 32)")
    a("--n-init", type=int, default=8, help="[paper] D3S schedule: rollouts kept per prompt at step 1")
    a("--n-final", type=int, default=32, help="[paper] D3S schedule: rollouts kept per prompt at the end of the run")
    a("--k-init", type=float, default=0.05, help="[paper] D3S schedule: fraction of tokens kept at step 1")
    a("--k-final", type=float, default=0.20, help="[paper] D3S schedule: fraction of tokens kept at the end of the run")
    a("--static-n", type=int, default=None, help="[choice] N of the static rows d1s, d1s-cross, d2s and pods (default: "
      "the schedule's midpoint, 20)")
    a("--static-k", type=float, default=None, help="[choice] K of d2s (default: the schedule's midpoint, 0.125)")
    a("--token-scope", default="batch", choices=["batch", "sequence"], help="[choice] top-K over the whole batch of all "
      "ranks, or within each response")
    a("--switch-on-spike", type=float, default=0.0, help="[choice] the switch rule (the paper's open question 1; "
      "variants.switch_to_intra): a cross-group row (d3s, d1s-cross) selects its samples within groups, as d3s-i and d1s do, "
      "from the step after the first whose grad norm exceeds this x the median of the 10 steps before, to the end; "
      "0: off, the paper's method (3: the spike of docs/questions.md, question 5)")
    a("--min-token-per-response", action="store_true", help="[choice] every kept response keeps at least its best token "
      "(off: the paper's plain top-K%%)")
    a("--loss-agg", default=None, choices=["token-mean", "seq-mean-token-mean"], help="[recipe] loss aggregation "
      "(default: token-mean for grpo, seq-mean-token-mean for gspo, GSPO's own: every response weighs the same)")
    a("--normalize-by", default="selected", choices=["selected", "all"], help="[choice] token-mean divides by the selected "
      "tokens or by all response tokens of the kept rollouts (the 80/20 paper's objective)")
    # optimization
    a("--lr", type=float, default=1e-6, help="[recipe] AdamW learning rate (constant)")
    a("--weight-decay", type=float, default=0.0, help="[recipe] AdamW weight decay")
    a("--max-grad-norm", type=float, default=1.0, help="[recipe] gradient clipping (grad_norm is logged before clipping)")
    a("--clip-low", type=float, default=None, help="[recipe] eps_low of the clipped surrogate (default: 0.2 grpo, 3e-4 gspo "
      "(GSPO paper))")
    a("--clip-high", type=float, default=None, help="[recipe] eps_high (default: 0.28 grpo, DAPO's clip-higher; 4e-4 gspo "
      "(GSPO paper))")
    a("--mini-batches", type=int, default=4, help="[recipe] M: optimizer steps per rollout batch, each on 1/M of the kept "
      "rollouts, old log-probs from before the first (verl's Qwen2.5-Math GRPO examples: train_batch_size 1024 / "
      "ppo_mini_batch_size 256 = 4); 1 = on-policy (ratio 1: no clipping, GSPO = GRPO; no pass 1 for the methods "
      "without token selection)")
    a("--no-load-balance", dest="load_balance", action="store_false", help="train each kept rollout on the rank that "
      "generated it (default: spread each mini-batch's kept rollouts over the ranks by token count; the update is the same)")
    a("--micro-batch-size", type=int, default=16, help="[choice] rollouts per forward/backward on one GPU (memory only: "
      "the loss normalizer is computed once for the whole optimizer step); lower it first if a GPU runs out of memory "
      "(simulated peaks per value: docs/memory.md)")
    a("--kl-ref", action="store_true", help="load the initial --model a second time as a frozen reference (bf16, sharded "
      "like the policy: 2 bytes x parameters / ranks per GPU) and log the KL (k3) to it on the selected tokens, at the "
      "cost of one more no-grad forward of the kept rollouts on the steps that measure it (--kl-every)")
    a("--kl-coef", type=float, default=0.0, help="[recipe] beta of the k3 KL penalty in the loss (needs --kl-ref); with "
      "beta > 0 the KL is in the loss and measured every step")
    a("--kl-every", type=int, default=None, help="[choice] with --kl-ref and --kl-coef 0 the KL is only a metric: the "
      "reference is forwarded on step 1, every N-th step and the last step, kl_ref is null on the others (default: "
      "--eval-every, or 10 when that is 0; 0 = never)")
    a("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false",
      help="turn off activation checkpointing of the decoder layers")
    a("--mlp-chunk-tokens", type=int, default=4096, help="[choice] run each decoder MLP over this many tokens at a time, "
      "recomputed in backward (tiled MLP): its [tokens, intermediate] activations are the largest tensors of a layer; "
      "it costs one more MLP forward in the backward (docs/memory.md); 0 = the whole micro-batch at once")
    # sampling
    a("--temperature", type=float, default=1.0, help="[recipe] rollout sampling temperature")
    a("--top-p", type=float, default=1.0, help="[recipe] rollout nucleus sampling")
    a("--max-prompt-len", type=int, default=1024, help="[recipe] longer prompts are dropped (and counted)")
    a("--max-response-len", type=int, default=3000, help="[recipe] max generated tokens per rollout")
    # evaluation
    a("--eval-every", type=int, default=0, help="[choice] evaluate before training and every N steps (0: only after the "
      "last step)")
    a("--eval-samples", type=int, default=32, help="[paper] k samples per problem: Pass@1 = mean over the k samples")
    a("--eval-pass-k", default="1,8", help="[paper] Pass@k values to report (unbiased estimator over the k samples)")
    a("--eval-temperature", type=float, default=0.6, help="[choice] evaluation sampling temperature (0: greedy)")
    a("--eval-top-p", type=float, default=0.95, help="[choice] evaluation nucleus sampling")
    a("--eval-max-tokens", type=int, default=3000, help="[recipe] max generated tokens per evaluation sample")
    a("--eval-limit", type=int, default=0, help="[choice] evaluate only the first N problems of each benchmark (0: all)")
    # checkpoints
    a("--save-every", type=int, default=50, help="[choice] sharded checkpoint (model, optimizer, data order, RNG) every "
      "N steps, and after the last one")
    a("--keep-checkpoints", type=int, default=2, help="[choice] keep the newest N sharded checkpoints")
    a("--export-every", type=int, default=0, help="[choice] HF export every N steps (0: only hf_final/ after the last step)")
    a("--explain-every", type=int, default=0, help="[choice] step 1 and every N-th step, rank 0 writes "
      "OUT/explain/step_NNNNNN.html (+ .png): which rollouts and tokens the step trained on, from the global selection "
      "(explain.py; a few rollouts' tokens are gathered, never the batch); 0 = off")
    a("--stop-after", type=int, default=None, help="stop cleanly after step N: write its checkpoint, skip the final "
      "export and evaluation, exit 0 (for preemptible jobs; continue with --resume)")
    # systems
    a("--seed", type=int, default=0, help="[choice] seed of the data order, sampling and init")
    a("--unseeded-sampling", action="store_true", help="no per-prompt sampling seeds (vLLM samples seeded requests "
      "one by one: a little slower); each rank's engine is seeded with seed + rank; generation then depends on the "
      "number of ranks and resumes are not bit-exact")
    a("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda if available, else cpu (gloo)")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="compute dtype; auto: bfloat16 on CUDA "
      "(fp32 master weights and gradient reductions), float32 on CPU")
    a("--vllm-gpu-memory-utilization", type=float, default=None, help="fraction of GPU memory vLLM may take while awake "
      "(default on CUDA: what the trainer's resident shards leave, from fsdp_vllm.vllm_memory_plan; printed at start)")
    a("--vllm-sleep-level", type=int, default=2, choices=[0, 1, 2], help="[choice] vLLM sleep during training (CUDA): 2 "
      "frees weights and KV cache (weights are re-sent after every step anyway), 1 offloads weights to CPU RAM, 0 = no "
      "sleep (0 and 1 need --vllm-allow-awake: they cost memory, see the message)")
    a("--vllm-allow-awake", action="store_true", help="accept --vllm-sleep-level 0 or 1 and the memory it costs")
    a("--vllm-kv-cache-gb", type=float, default=1.0, help="[choice] vLLM KV cache size on CPU (ignored on CUDA; the env "
      "VLLM_CPU_KVCACHE_SPACE overrides it)")
    a("--vllm-max-num-seqs", type=int, default=None, help="vLLM max concurrent sequences (default on CUDA: the sequences "
      "whose full-length KV cache fits, from fsdp_vllm.vllm_memory_plan; 256 on CPU)")
    a("--vllm-enforce-eager", action="store_true", help="vLLM without CUDA graphs (slower; faster start)")
    a("--hf-generate-batch", type=int, default=16, help="[choice] --rollout hf: prompts per generate() call")
    a("--grader-timeout", type=float, default=5.0, help="[choice] seconds per answer before math-verify is killed "
      "(reward 0)")
    a("--grader-workers", type=int, default=None, help="math-verify grader processes per rank (default: the CPU cores "
      "/ the ranks on this node, at most 8: mathtask.default_grader_workers)")
    a("--peak-tflops", type=float, default=0.0, help="peak dense bf16 TFLOP/s of one GPU for the logged MFU (0: from the "
      "GPU's name: H100/H200 989, A100 312; unknown GPUs and CPUs log no MFU)")
    args = p.parse_args(argv)
    try:
        return check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except UsageError as e:
        p.error(str(e))


class UsageError(Exception):
    """A bad flag, file, model or checkpoint: one line, `train_full.py: error: --flag VALUE: what is
    wrong; what to do` (entry() prints it on rank 0), exit 2 on every rank."""


MAX_ROLLOUTS = 2**20  # rollouts per step (P x G) and samples per problem beyond which a value is a typo [choice]
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "org/name" or "name": not a local path


def check_args(args, world):
    """Every flag, before any work (no model, data or process group yet): ranges, NaN and inf,
    combinations, paths. Raises UsageError naming the flag, its value and the fix. Fills in the
    defaults that depend on other flags (clip range, loss aggregation, --kl-every, dtype, ...)."""
    rules = [  # (flag, value, ok, what it must be); a None value (not given, default decided below) passes
        ("--steps", args.steps, lambda v: v >= 1, "an int >= 1"),
        ("--prompts-per-step", args.prompts_per_step, lambda v: v >= 1, "an int >= 1"),
        ("--group-size", args.group_size, lambda v: 2 <= v <= 1024, "an int in [2, 1024] (rollouts per prompt)"),
        ("--n-init", args.n_init, lambda v: v >= 1, "an int >= 1"), ("--n-final", args.n_final, lambda v: v >= 1, "an int >= 1"),
        ("--static-n", args.static_n, lambda v: v >= 1, "an int >= 1"),
        ("--k-init", args.k_init, lambda v: 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--k-final", args.k_final, lambda v: 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--static-k", args.static_k, lambda v: 0 < v <= 1, "a fraction of tokens in (0, 1]"),
        ("--lr", args.lr, lambda v: 0 < v <= 1, "in (0, 1] (the recipe's: 1e-6)"),
        ("--weight-decay", args.weight_decay, lambda v: 0 <= v <= 1, "in [0, 1] (AdamW's decoupled decay)"),
        ("--max-grad-norm", args.max_grad_norm, lambda v: 0 < v < math.inf, "a finite number > 0 (the norm the "
         "gradient is clipped to)"),
        ("--clip-low", args.clip_low, lambda v: 0 <= v < 1, "in [0, 1): the ratio is clipped at 1 - eps_low"),
        ("--clip-high", args.clip_high, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        ("--mini-batches", args.mini_batches, lambda v: v >= 1, "an int >= 1 (1 = on-policy)"),
        ("--micro-batch-size", args.micro_batch_size, lambda v: v >= 1, "an int >= 1 (rollouts per forward)"),
        ("--kl-coef", args.kl_coef, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        ("--switch-on-spike", args.switch_on_spike, lambda v: v == 0 or 1 < v < math.inf, "0 (off) or a number > 1 "
         "(a spike is a grad norm over this x its running median; 3 in docs/questions.md)"),
        ("--kl-every", args.kl_every, lambda v: v >= 0, "an int >= 0 (0 = never)"),
        ("--mlp-chunk-tokens", args.mlp_chunk_tokens, lambda v: v >= 0, "an int >= 0 (0 = the whole micro-batch at once)"),
        ("--temperature", args.temperature, lambda v: 0.01 <= v <= 100, "in [0.01, 100] (the loss divides the logits "
         "by it)"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        ("--max-prompt-len", args.max_prompt_len, lambda v: v >= 1, "an int >= 1"),
        ("--max-response-len", args.max_response_len, lambda v: v >= 1, "an int >= 1"),
        ("--eval-every", args.eval_every, lambda v: v >= 0, "an int >= 0 (0 = only after the last step)"),
        ("--eval-samples", args.eval_samples, lambda v: 1 <= v <= 1024, "an int in [1, 1024] (samples per problem)"),
        ("--eval-temperature", args.eval_temperature, lambda v: v == 0 or 0.01 <= v <= 100, "0 (greedy) or in [0.01, 100]"),
        ("--eval-top-p", args.eval_top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        ("--eval-max-tokens", args.eval_max_tokens, lambda v: v >= 1, "an int >= 1"),
        ("--eval-limit", args.eval_limit, lambda v: v >= 0, "an int >= 0 (0 = every problem)"),
        ("--save-every", args.save_every, lambda v: v >= 1, "an int >= 1"),
        ("--keep-checkpoints", args.keep_checkpoints, lambda v: v >= 1, "an int >= 1"),
        ("--export-every", args.export_every, lambda v: v >= 0, "an int >= 0 (0 = only hf_final/)"),
        ("--explain-every", args.explain_every, lambda v: v >= 0, "an int >= 0 (0 = off)"),
        ("--stop-after", args.stop_after, lambda v: 1 <= v <= args.steps, f"an int in [1, --steps {args.steps}]"),
        ("--seed", args.seed, lambda v: 0 <= v < 2**31, "an int in [0, 2^31)"),
        ("--vllm-gpu-memory-utilization", args.vllm_gpu_memory_utilization, lambda v: 0 < v <= 1, "in (0, 1]"),
        ("--vllm-kv-cache-gb", args.vllm_kv_cache_gb, lambda v: 0 < v <= 4096, "in (0, 4096] GB"),
        ("--vllm-max-num-seqs", args.vllm_max_num_seqs, lambda v: v >= 1, "an int >= 1"),
        ("--hf-generate-batch", args.hf_generate_batch, lambda v: v >= 1, "an int >= 1"),
        ("--grader-timeout", args.grader_timeout, lambda v: 0 < v <= 3600, "in (0, 3600] seconds per answer"),
        ("--grader-workers", args.grader_workers, lambda v: 1 <= v <= 64, "an int in [1, 64] (processes per rank)"),
        ("--peak-tflops", args.peak_tflops, lambda v: 0 <= v < math.inf, "a finite number >= 0 (0: from the GPU's name)"),
    ]
    for flag, value, ok, what in rules:
        if value is not None and not ok(value):  # NaN fails every comparison
            raise UsageError(f"{flag} {value}: must be {what}")
    try:
        args.eval_pass_k = sorted({int(k) for k in args.eval_pass_k.split(",") if k.strip()})
    except ValueError:
        raise UsageError(f"--eval-pass-k {args.eval_pass_k!r}: must be comma-separated ints, e.g. 1,8") from None
    if not args.eval_pass_k or not all(1 <= k <= args.eval_samples for k in args.eval_pass_k):
        raise UsageError(f"--eval-pass-k {','.join(map(str, args.eval_pass_k))}: each k must be in [1, --eval-samples "
                         f"{args.eval_samples}] (Pass@k from k <= n samples); lower k or raise --eval-samples")
    # combinations
    if args.prompts_per_step * args.group_size > MAX_ROLLOUTS:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step}: x --group-size {args.group_size} is more than "
                         f"{MAX_ROLLOUTS} rollouts per step; lower one of them")
    if args.prompts_per_step % world:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step}: must be divisible by the {world} ranks; "
                         "change it or the number of ranks")
    if variants.LADDER[args.method].n != "all":  # N counts rollouts kept per prompt: N <= G (whole groups: no N)
        for flag, value in (("--n-init", args.n_init), ("--n-final", args.n_final), ("--static-n", args.static_n)):
            if value is not None and value > args.group_size:
                raise UsageError(f"{flag} {value}: more than --group-size {args.group_size} (N counts rollouts kept "
                                 f"per prompt); lower {flag} or raise --group-size")
    if args.switch_on_spike and args.method not in variants.INTRA_TWIN:
        raise UsageError(f"--switch-on-spike {args.switch_on_spike:g}: moves a cross-group row to its intra-group twin "
                         f"({', '.join(f'{a} -> {b}' for a, b in variants.INTRA_TWIN.items())}); --method {args.method} has "
                         "none: use --method d3s or d1s-cross, or drop the flag")
    if args.mini_batches > args.prompts_per_step * args.group_size:
        raise UsageError(f"--mini-batches {args.mini_batches}: more than the {args.prompts_per_step * args.group_size} "
                         "rollouts of a step; lower it")
    if args.kl_coef > 0 and not args.kl_ref:
        raise UsageError(f"--kl-coef {args.kl_coef}: a KL penalty needs the reference model; add --kl-ref")
    args.kl_every = (args.eval_every or 10) if args.kl_every is None else args.kl_every
    if args.kl_ref and args.kl_coef == 0 and args.kl_every == 0:
        raise UsageError("--kl-every 0: with --kl-ref and --kl-coef 0 the reference would never be used; "
                         "drop --kl-ref, or measure the KL every N > 0 steps")
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    if args.normalize_by == "all" and args.loss_agg != "token-mean":
        raise UsageError(f"--normalize-by all: applies to --loss-agg token-mean ({args.loss_agg} divides by the "
                         "responses); drop it or add --loss-agg token-mean")
    defaults = d3s.CLIP_DEFAULTS[args.loss]  # grpo 0.2 / 0.28 (DAPO's clip-higher), gspo 3e-4 / 4e-4
    args.clip_low = defaults[0] if args.clip_low is None else args.clip_low
    args.clip_high = defaults[1] if args.clip_high is None else args.clip_high
    if args.grader_workers is None:
        args.grader_workers = default_grader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and args.rollout == "vllm" and args.vllm_sleep_level < 2 and not args.vllm_allow_awake:
        raise UsageError(f"--vllm-sleep-level {args.vllm_sleep_level}: costs memory while the trainer runs (0: vLLM's "
                         "whole share of the GPU; 1: its bf16 weights in CPU RAM, 2 bytes x parameters per GPU); level 2, "
                         "the default, frees both; add --vllm-allow-awake to go on")
    # paths: what is read must exist, what is written must be writable
    if not args.model:
        raise UsageError("--model '': empty; pass a model folder or a hub name")
    if os.path.exists(args.model) or not HUB_NAME.fullmatch(args.model):
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            what = "is a file" if os.path.isfile(args.model) else "has no config.json" if os.path.isdir(args.model) \
                else "no such folder"
            raise UsageError(f"--model {args.model}: {what}; pass a model folder (config.json, weights, tokenizer) or a "
                             "hub name")
    for flag, spec in [("--train-data", args.train_data)] * (not args.eval_only) + [("--eval-data", s) for s in args.eval_data]:
        check_data_spec(flag, spec)
    args.eval_data = expand_specs(args.eval_data)
    check_out(args.out)
    return args


def check_machine(args):
    """What this machine must have for the run (main only: tests and bench/memory.py parse flags for
    other machines): CUDA for --device cuda, vLLM for --rollout vllm."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device; use --device cpu, or install torch's CUDA build")
    if args.rollout == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--rollout vllm: vLLM is not installed; pip install -r requirements-full.txt, or use --rollout hf")


def check_data_spec(flag, spec):
    """A data file that exists and is a file, a glob that matches, 'none' (eval), or a hub name."""
    for item in (s.strip() for s in spec.split(",")) if flag == "--eval-data" else [spec]:
        if item == "none" and flag == "--eval-data":
            continue
        if not item:
            raise UsageError(f"{flag} {spec!r}: empty; pass a JSONL/JSON/Parquet file" + (", or none" if flag == "--eval-data" else ""))
        if any(c in item for c in "*?["):
            if not glob.glob(item):
                raise UsageError(f"{flag} {item}: no file matches; check the pattern")
        elif os.path.isdir(item):
            raise UsageError(f"{flag} {item}: is a folder; pass a JSONL/JSON/Parquet file with 'problem' and 'answer'")
        elif not os.path.exists(item) and (item.endswith((".jsonl", ".json", ".parquet")) or not HUB_NAME.fullmatch(item.split(":")[0])):
            raise UsageError(f"{flag} {item}: no such file; pass an existing JSONL/JSON/Parquet file or a hub dataset")


def check_out(out):
    """--out: a folder (made if missing) that this process can write."""
    if not out:
        raise UsageError("--out '': empty; pass a folder for the run's outputs")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: is a file; pass a folder (it is made if missing)")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {parent} is not a writable folder; pass a folder you can write")


RUN_FLAGS = ("model", "train_data", "template", "max_prompt_len", "method", "loss", "loss_agg", "steps", "prompts_per_step",
             "group_size", "n_init", "n_final", "k_init", "k_final", "static_n", "static_k", "token_scope",
             "switch_on_spike", "min_token_per_response", "normalize_by", "lr", "weight_decay", "max_grad_norm", "clip_low", "clip_high",
             "mini_batches", "kl_coef", "temperature", "top_p", "max_response_len", "seed", "unseeded_sampling")
# the flags that define a run's trajectory: a resume must repeat them (--steps too: the schedule runs over it).
# Free to change on a resume: the world size (DCP reshards), memory and systems flags, evaluation, checkpoints.
ADDED_RUN_FLAGS = {"switch_on_spike": 0.0}  # RUN_FLAGS added later: a checkpoint without one ran with this value


def run_flags(args):
    """RUN_FLAGS of this run, local paths made absolute (a resume may start from another folder)."""
    value = lambda k, v: os.path.abspath(v) if k in ("model", "train_data") and os.path.exists(v) else v  # noqa: E731
    return {k: value(k, getattr(args, k)) for k in RUN_FLAGS}


def check_resume(args, world):
    """The checkpoint folder to continue from (--resume), checked before any work: complete, readable,
    of this format, holding no pickled object, written by a run with these RUN_FLAGS. A fresh run's
    --out must hold no checkpoint (nothing is overwritten). Returns the folder or None."""
    if args.eval_only:
        return None
    if not args.resume:
        if find_checkpoint("latest", args.out):
            raise UsageError(f"--out {args.out}: holds the checkpoints of an earlier run; pass --resume to continue it, "
                             "or a new --out (nothing was overwritten)")
        return None
    path = find_checkpoint(args.resume, args.out)
    if path is None:
        raise UsageError(f"--resume: no complete checkpoint in {os.path.join(args.out, 'checkpoints')}; drop --resume to "
                         "start a new run, or pass a checkpoint folder")
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such folder; pass a checkpoint folder (OUT/checkpoints/step_NNNNNN)")
    meta = read_checkpoint(path)  # CheckpointError: the file and the fix
    for flag, value in run_flags(args).items():
        then = meta["run"].get(flag, ADDED_RUN_FLAGS.get(flag))
        if then != value:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: the checkpoint {path} is of a run with "
                             f"--{flag.replace('_', '-')} {then}" + (" (the D3S schedule runs over --steps)" if flag == "steps" else "")
                             + f"; resume with the run's flags (its trainer_state.json lists them), or start a new run "
                             "with a new --out")
    if args.stop_after is not None and args.stop_after <= meta["step"]:
        raise UsageError(f"--stop-after {args.stop_after}: the checkpoint {path} is already at step {meta['step']}; "
                         "raise --stop-after or drop it")
    return path


def trainer_state(args, order, grad_norms=()):
    """The JSON part of a checkpoint: the data position, the run's flags and the grad_norm of every step so
    far (--switch-on-spike's signal)."""
    return {"order": order.state_dict(), "run": run_flags(args), "grad_norms": list(grad_norms)}


def resume_from(path, model, optimizer, order, dist_):
    """Model and optimizer shards, RNG and data position from a checkpoint; returns its completed steps and
    the grad norms of those steps."""
    meta = load_checkpoint(path, model, optimizer, dist_)
    order.load_state_dict(meta["order"])
    return meta["step"], meta.get("grad_norms", [])


def other_world_note(path, world, args):
    """'' when the checkpoint was saved on `world` ranks; else what a resume on another rank count
    keeps and what it cannot (docs/train_full.md, "Resuming on another number of ranks")."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)["world"]
    if saved == world:
        return ""

    def hf_calls(ranks):  # the prompts of each generate() call of --rollout hf: one seed per call
        share, batch = args.prompts_per_step // ranks, args.hf_generate_batch
        return {(r * share + k, r * share + min(k + batch, share)) for r in range(ranks) for k in range(0, share, batch)}

    if args.unseeded_sampling:
        rollouts = "; with --unseeded-sampling the rollouts differ from an uninterrupted run's"
    elif args.rollout == "hf" and hf_calls(saved) != hf_calls(world):
        rollouts = (f"; --rollout hf seeds each generate() call of --hf-generate-batch {args.hf_generate_batch} prompts "
                    "and the calls now group the prompts differently, so the rollouts differ from an uninterrupted run's")
    else:
        rollouts = " (sampling is seeded per prompt, not drawn from it)"
    return (f"; saved on {saved} ranks, resumed on {world}: the model and AdamW state are resharded exactly and the data "
            "order continues, but the per-rank RNG is not restored" + rollouts + "; losses and gradient norms equal an "
            "uninterrupted run's to rounding only, not bit for bit (the sums over ranks run in another order)")


def expand_specs(items):
    """['a.jsonl,b.jsonl', 'dir/*.jsonl', 'none'] -> the list of files / hub names ('none' drops out)."""
    specs = []
    for item in items:
        for spec in (s.strip() for s in item.split(",")):
            if spec and spec != "none":
                specs += sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
    return specs


# ---------------------------------------------------------------------------------------------
# 1. Data: local files or hub datasets -> tokenized prompts; one global order and seeds for all ranks
# ---------------------------------------------------------------------------------------------
def encode_prompts(rows, tokenizer, template, max_prompt_len):
    """Apply the template and tokenize; prompts longer than max_prompt_len are dropped and counted."""
    out, too_long = [], 0
    for row in rows:
        ids = tokenizer(TEMPLATES[template].format(problem=row["problem"]), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_len:
            too_long += 1
            continue
        out.append({"id": row["id"], "problem": row["problem"], "answer": row["answer"], "prompt_ids": ids})
    return out, too_long


class PromptOrder:
    """A fresh seeded permutation of the training prompts each epoch, identical on every rank.

    take(P) returns the next P prompt indices of the global batch; state_dict() is the data
    position saved in checkpoints, so a resumed run sees exactly the prompts it would have seen.
    """

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def _perm(self):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)).tolist()

    def take(self, count):
        out = []
        while len(out) < count:
            perm = self._perm()
            chunk = perm[self.pos : self.pos + count - len(out)]
            out += chunk
            self.pos += len(chunk)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state):
        if state["n"] != self.n:
            raise DataError(f"checkpoint was made with {state['n']} training prompts, this run has {self.n}; "
                            "resume with the same --train-data and --max-prompt-len")
        self.epoch, self.pos = state["epoch"], state["pos"]


def rank_share(items, dist_):
    """This rank's contiguous share of a global list (rank order = global order)."""
    per = len(items) // dist_.world
    return items[dist_.rank * per : (dist_.rank + 1) * per]


def sample_seeds(args, step, indices, n):
    """One sampling seed per (step, global prompt index): generation does not depend on the rank count.

    vLLM seeds sample j of a request with seed + j, so the seeds of one call are n apart: no two
    samples of a step share a noise stream.
    """
    if args.unseeded_sampling:
        return [None] * len(indices)
    return [(args.seed * 1_000_003 + (step * 1_000_003 + index) * n) % (2**31 - 1) for index in indices]


# ---------------------------------------------------------------------------------------------
# 2. The loss head: forward passes on the kept rollouts, never the [n, T, vocab] logits
# ---------------------------------------------------------------------------------------------
def pack(seqs, rows, pad_id, device):
    """[pad.. prompt | response ..pad]: left-padded prompts, right-padded responses, so every
    response starts at the same column and logits_to_keep keeps only the response positions.
    Returns (model inputs, response targets [n, T], response mask [n, T])."""
    width_p = max(len(seqs[r]["prompt_ids"]) for r in rows)
    width_r = max(len(seqs[r]["response_ids"]) for r in rows)
    ids = torch.full((len(rows), width_p + width_r), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        prompt, response = seqs[r]["prompt_ids"], seqs[r]["response_ids"]
        ids[i, width_p - len(prompt) : width_p + len(response)] = torch.tensor(prompt + response)
        attn[i, width_p - len(prompt) : width_p + len(response)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # real tokens at 0, 1, 2, ... as without padding
    inputs = {"input_ids": ids.to(device), "attention_mask": attn.to(device), "position_ids": position_ids.to(device),
              "logits_to_keep": width_r + 1, "use_cache": False}
    return inputs, ids[:, width_p:].to(device), attn[:, width_p:].bool().to(device)


HEAD_CHUNK = 1024  # response positions per LM-head block: [1024, vocab] fp32 logits, 0.6 GB at Qwen's 152k vocabulary


def response_hidden(model, inputs):
    """The final (normed) hidden states of the positions that predict the response tokens, [n, T, H].

    The policy runs as usual (through the FSDP root, which gathers its parameters), but with
    logits_to_keep=1 its LM head sees one position only; a forward hook on the decoder keeps
    its output. So the [n, T, vocab] logits are never made: the loss head below makes them in
    blocks, or only at the selected tokens.
    """
    T = inputs["logits_to_keep"] - 1
    captured = []
    hook = model.model.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(**{**inputs, "logits_to_keep": 1})
    finally:
        hook.remove()
    return captured[0][:, -(T + 1) : -1]  # position width_p - 1 + t predicts response token t


def _head_logp(head, hidden, targets, temperature):
    """log pi(target) for [m, H] hidden states: fp32 logits of one block, divided by the sampling
    temperature (the distribution the rollouts came from); returns ([m] log-probs, [m, V] logits)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1), logits


def response_logp(model, inputs, targets, temperature, with_entropy):
    """Pass 1 (no grad): log pi(o_t | ...) [n, T] of every response token, and the entropy H_t.

    The LM head runs over blocks of HEAD_CHUNK positions of the hidden states, so at most one
    [HEAD_CHUNK, vocab] fp32 block of logits exists at a time (never [n, T, vocab]).
    """
    hidden = response_hidden(model, inputs)  # [n, T, H]
    n, T, H = hidden.shape
    flat, flat_targets = hidden.reshape(n * T, H), targets.reshape(n * T)
    logp = torch.zeros(n * T, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    for start in range(0, n * T, HEAD_CHUNK):
        block = slice(start, start + HEAD_CHUNK)
        logp[block], logits = _head_logp(model.lm_head, flat[block], flat_targets[block], temperature)
        if with_entropy:
            entropy[block] = d3s.token_entropy(logits)
        del logits
    return logp.view(n, T), (entropy.view(n, T) if with_entropy else None)


def response_logp_at(model, inputs, targets, positions, temperature, with_entropy=False):
    """Pass 2 (with grad): log pi of the response tokens at `positions` only, [n, T] (0 elsewhere).

    positions: the tokens in the loss, a bool [n, T] mask or its (rows, cols) index. For a
    token-selecting method (d2s, d3s, d3s-i) that is the top K (5-20%), so the LM head costs 1/K
    less memory and FLOPs: D3S's own saving, which a full-logits loss throws away. Every other
    method passes all valid tokens. Either way the head runs in blocks of HEAD_CHUNK positions
    whose logits are recomputed in backward (torch.utils.checkpoint): one [HEAD_CHUNK, vocab]
    fp32 block at a time. The loss and its gradients equal those of the full-logits head:
    tokens outside `positions` have weight 0 in d3s.policy_loss.

    with_entropy: also return d3s.token_entropy of the same logits at `positions` ([n, T], no
    grad, 0 elsewhere), computed once in the forward (not again when backward recomputes a block):
    the entropy metric of the methods without token selection, which need no pass 1 for it.
    """
    from torch.utils.checkpoint import checkpoint

    hidden = response_hidden(model, inputs)  # [n, T, H]
    index = positions.nonzero(as_tuple=True) if isinstance(positions, torch.Tensor) else positions
    picked, picked_targets = hidden[index], targets[index]  # [m, H], [m]
    logp = torch.zeros(hidden.shape[:2], dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    if picked.shape[0] == 0:  # nothing selected here: keep the graph (FSDP's backward hooks) with a zero
        return (logp + 0.0 * hidden.sum(), entropy) if with_entropy else logp + 0.0 * hidden.sum()
    starts = range(0, picked.shape[0], HEAD_CHUNK)
    block_entropy = [None] * len(starts)

    def block_logp(i, h, y):
        lp, logits = _head_logp(model.lm_head, h, y, temperature)
        if with_entropy and block_entropy[i] is None:  # the forward, not backward's recomputation
            block_entropy[i] = d3s.token_entropy(logits.detach())
        return lp

    blocks = [checkpoint(functools.partial(block_logp, i), picked[s : s + HEAD_CHUNK], picked_targets[s : s + HEAD_CHUNK],
                         use_reentrant=False) for i, s in enumerate(starts)]
    logp = logp.index_put(index, torch.cat(blocks))
    if not with_entropy:
        return logp
    return logp, entropy.index_put(index, torch.cat(block_entropy))


def micro_batches(lengths, size, n_micro):
    """n_micro lists of row indices (longest first, to pad little); trailing lists may be empty."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    return chunks + [[] for _ in range(n_micro - len(chunks))]


DUMMY = {"prompt_ids": [0], "response_ids": [0]}  # a rank with no rows left still runs FSDP's collectives


# ---------------------------------------------------------------------------------------------
# 3. One step on the rollouts (docs/algorithm.md section 6, steps 3-6)
# ---------------------------------------------------------------------------------------------
def budget(step, args, group_size, row=None):
    """(n_keep, k_frac) of step `step` = 1..S for args.method (or `row`, the twin the switch rule moved it to):
    d3s.method_budget at step - 1 of S."""
    return d3s.method_budget(variants.LADDER[row or args.method], step=step - 1, total_steps=args.steps, group_size=group_size,
                             n_init=args.n_init, n_final=args.n_final, k_init=args.k_init, k_final=args.k_final,
                             static_n=args.static_n, static_k=args.static_k)


def select_tokens_global(scores, mask, mine, total, k_frac, scope, dist_, min_per_seq=0):
    """d3s.select_tokens over the [B, T] scores of ALL ranks at once, in global order (on CPU, so
    every rank computes the identical choice, whichever rank holds which rollout); returns this
    rank's rows (global rows `mine`) of the kept-token mask."""
    keep = d3s.select_tokens(gather_global(scores, mine, total, dist_), gather_global(mask, mine, total, dist_),
                             k_frac, scope=scope, min_per_seq=min_per_seq)
    return keep[mine].to(scores.device)


def assign_rollouts(lengths, home, world, m, balance):
    """Which rank trains each kept rollout of the step, and the step's m mini-batches.

    lengths: prompt + response tokens of each kept rollout, in global order (rank order =
    prompt order); home: the rank that generated it. The kept list is split into m contiguous
    mini-batches (torch.tensor_split, as verl splits its batch), the same whatever the number of
    ranks. With balance, each mini-batch's rollouts go longest first to the least-loaded rank
    (LPT), so a rank whose prompts were all solved (cross-group selection kept none of them)
    still gets its share of the work; without it each rollout stays on its home rank. Which
    rank computes a rollout changes neither the kept set nor any normalizer.
    Returns (owner: rank of each kept rollout, parts: m lists of global indices). Pure: the same
    on every rank.
    """
    owner = list(home)
    parts = [part.tolist() for part in torch.arange(len(lengths)).tensor_split(m)]
    if balance:
        for part in parts:
            load = [0] * world
            for g in sorted(part, key=lambda g: (-lengths[g], g)):
                owner[g] = min(range(world), key=lambda r: (load[r], r))
                load[owner[g]] += lengths[g]
    return owner, parts


def select_and_assign(rollouts, rewards, step, args, dist_, row=None):
    """Step 3 on the GLOBAL batch: d3s.select_samples on the [P, G] rewards of all ranks, then which
    rank forwards which kept rollout (assign_rollouts) and the step's M mini-batches. Every rank
    gets the token ids of every kept rollout (a few MB per step), so that any rank can train any.
    row: the LADDER row whose samples rule selects (default args.method; its twin after the switch)."""
    P_local, G = rewards.shape
    row = row or args.method
    n_keep, k_frac = budget(step, args, G, row)
    rewards_all, counts = gather_rows(rewards.float(), dist_)  # [P, G], CPU
    generator = torch.Generator().manual_seed(args.seed * 7919 + step)  # "random": same draw on every rank
    keep_all, adv_all = d3s.select_samples(rewards_all, n_keep, variants.LADDER[row].samples, generator=generator)
    first = sum(counts[: dist_.rank])  # this rank's first prompt, in global order
    kept_all = keep_all.nonzero().tolist()  # [(prompt p, rollout g)] of the whole step, global order
    shares = [None] * dist_.world
    dist.all_gather_object(shares, [rollouts[p - first][g] for p, g in kept_all if first <= p < first + P_local])
    seqs_all = [s for share in shares for s in share]  # global order: rank order = prompt order
    home = [r for r, share in enumerate(shares) for _ in share]
    owner, parts = assign_rollouts([len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs_all], home, dist_.world,
                                   args.mini_batches, args.load_balance)
    mine = [g for g in range(len(kept_all)) if owner[g] == dist_.rank]  # the kept rollouts this rank forwards
    row_of = {g: r for r, g in enumerate(mine)}
    seqs = [seqs_all[g] for g in mine]
    T = int(all_reduce(max([len(s["response_ids"]) for s in seqs], default=1), dist_, dist.ReduceOp.MAX))
    mask = torch.zeros(len(seqs), T, dtype=torch.bool, device=dist_.device)  # the response tokens, [B, T]
    for r, s in enumerate(seqs):
        mask[r, : len(s["response_ids"])] = True
    return types.SimpleNamespace(
        row=row, n_keep=n_keep, k_frac=k_frac, rewards_all=rewards_all, keep_all=keep_all, adv_all=adv_all, kept_all=kept_all,
        first=first, total=len(kept_all), mine=mine, row_of=row_of, seqs=seqs, mask=mask,
        kept_adv=adv_all[keep_all][mine].to(dist_.device),  # [B], full-group A (pods: recomputed)
        parts=[[row_of[g] for g in part if g in row_of] for part in parts])  # this rank's rows of each mini-batch


def forward_no_grad(model, seqs, rows, T, args, dist_, pad_id, with_entropy):
    """log pi [B, T] (and d3s.token_entropy) of `rows` of seqs, no grad, in micro-batches. Every rank
    runs the same number of forwards (FSDP's all-gathers): a rank with fewer rows forwards DUMMY;
    no rank forwards when no rank has a row."""
    device = dist_.device
    logp_out = torch.zeros(len(seqs), T, device=device)
    entropy_out = torch.zeros(len(seqs), T, device=device) if with_entropy else None
    n_micro = int(all_reduce(math.ceil(len(rows) / args.micro_batch_size), dist_, dist.ReduceOp.MAX))
    lengths = [len(seqs[r]["prompt_ids"]) + len(seqs[r]["response_ids"]) for r in rows]
    with torch.no_grad():
        for chunk in micro_batches(lengths, args.micro_batch_size, n_micro):
            chunk = [rows[i] for i in chunk]
            inputs, targets, _ = pack(seqs, chunk, pad_id, device) if chunk else pack([DUMMY], [0], pad_id, device)
            logp, entropy = response_logp(model, inputs, targets, args.temperature, with_entropy=with_entropy)
            if chunk:
                logp_out[chunk, : targets.shape[1]] = logp
                if with_entropy:
                    entropy_out[chunk, : targets.shape[1]] = entropy
    return logp_out, entropy_out, all_reduce(sum(lengths), dist_)


def pass_one(model, ref_model, sel, args, dist_, pad_id, full=False):
    """Step 4, only what the step needs (no grad):
    - the methods that select tokens (d2s, d3s, d3s-i) need the entropy of every kept token
      before the global top K: the policy forwards every kept rollout, giving the old log-probs too;
    - the others need the old log-probs of mini-batches 2..M only (mini-batch 1 runs first and is
      on-policy: its old log-probs are pass 2's own, detached), and no entropy (their entropy
      metric comes from pass 2's logits); with M = 1 the policy is not forwarded at all;
    - ref_model (given on the steps that measure or use the KL): every kept rollout.
    full=True forwards every kept rollout with entropy whatever the method (tests compare the two).
    Returns (old_logp [B, T], has_old [B] bool, entropy [B, T] or None, ref_logp or None, tokens forwarded)."""
    selects = variants.selects_tokens(args.method) or full
    rows = [r for part in (sel.parts if selects else sel.parts[1:]) for r in part]
    T = sel.mask.shape[1]
    old_logp, entropy, tokens = forward_no_grad(model, sel.seqs, rows, T, args, dist_, pad_id, with_entropy=selects)
    has_old = torch.zeros(len(sel.seqs), dtype=torch.bool)
    has_old[rows] = True
    ref_logp = None
    if ref_model is not None:
        every = list(range(len(sel.seqs)))
        ref_logp, _, ref_tokens = forward_no_grad(ref_model, sel.seqs, every, T, args, dist_, pad_id, with_entropy=False)
        tokens += ref_tokens
    return old_logp, has_old, entropy, ref_logp, tokens


def select_tokens_step(sel, entropy, args, dist_):
    """Step 5: the top K of |A| * H over the kept tokens of all ranks (d3s.select_tokens once, globally);
    every response token for the methods without token selection. A non-finite forward (NaN
    entropy) scores 0 (ranked last): the loss is then non-finite as well and the step is skipped."""
    if not variants.selects_tokens(args.method):
        return sel.mask.clone()
    scores = d3s.token_scores(sel.kept_adv, entropy)  # |A_{i,t}| * H_{i,t}, [B, T]
    return select_tokens_global(scores, sel.mask, sel.mine, sel.total, sel.k_frac, args.token_scope, dist_,
                                min_per_seq=int(args.min_token_per_response))


def update_policy(model, optimizer, sel, token_keep, old_logp, has_old, entropy, ref_logp, args, dist_, pad_id):
    """Step 6: the M mini-batches (global order), one optimizer step each. The normalizer of a
    mini-batch is its selected tokens (or responses) summed over all ranks, computed before its
    micro-batches, so neither the micro-batch size nor the rank count changes the update. Rows
    without pass-1 log-probs (mini-batch 1 of the methods without token selection) are on-policy:
    their old log-probs are this forward's, detached. Without a pass-1 entropy, the entropy
    metric is taken from this forward's logits (no grad) and written into `entropy`."""
    device = dist_.device
    entropy_here = entropy is None
    if entropy_here:
        entropy = torch.zeros(sel.mask.shape, device=device)
    seqs, kept_adv = sel.seqs, sel.kept_adv
    losses, grad_norms, clip_fracs, clip_tokens, kl_tokens, trained_tokens, skipped = [], [], [], 0.0, 0.0, 0.0, False
    for part in sel.parts:  # this rank's rows of each mini-batch
        part_keep = token_keep[part]
        if args.loss_agg == "seq-mean-token-mean":
            normalizer = all_reduce(part_keep.any(-1).sum(), dist_)  # responses with a selected token
        else:
            normalizer = all_reduce((part_keep if args.normalize_by == "selected" else sel.mask[part]).sum(), dist_)
        n_selected = all_reduce(part_keep.sum(), dist_)
        if n_selected == 0:  # no selected token in this mini-batch on any rank: no optimizer step
            continue
        n_part_micro = int(all_reduce(math.ceil(len(part) / args.micro_batch_size), dist_, dist.ReduceOp.MAX)) or 1
        part_chunks = [[part[r] for r in c] for c in micro_batches(
            [len(seqs[r]["prompt_ids"]) + len(seqs[r]["response_ids"]) for r in part], args.micro_batch_size, n_part_micro)]
        optimizer.zero_grad(set_to_none=True)
        loss_sum, part_clip = 0.0, 0.0
        for rows in part_chunks:
            if rows:
                inputs, targets, _ = pack(seqs, rows, pad_id, device)
                width = targets.shape[1]
                keep = token_keep[rows, :width]
                logp = response_logp_at(model, inputs, targets, keep, args.temperature, with_entropy=entropy_here)
                if entropy_here:
                    logp, entropy[rows, :width] = logp
                old = old_logp[rows, :width] if bool(has_old[rows].all()) else logp.detach()  # on-policy: ratio 1
                loss, stats = d3s.policy_loss(logp, old, kept_adv[rows], keep, kind=args.loss, clip_low=args.clip_low,
                                              clip_high=args.clip_high,
                                              ref_logp=ref_logp[rows, :width] if ref_logp is not None else None,
                                              beta=args.kl_coef, normalizer=normalizer, agg=args.loss_agg)
                part_clip += stats["clip_frac"] * stats["tokens"]
                kl_tokens += stats["kl"] * stats["tokens"]
                trained_tokens += float(inputs["attention_mask"].sum())
            else:  # this rank has fewer micro-batches: a zero-loss pass keeps FSDP's collectives matched
                inputs, targets, _ = pack([DUMMY], [0], pad_id, device)
                loss = response_logp_at(model, inputs, targets, torch.zeros_like(targets, dtype=torch.bool),
                                        args.temperature).sum() * 0.0
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # total norm before clipping
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        part_loss = all_reduce(loss_sum, dist_)
        if math.isfinite(grad_norm) and math.isfinite(part_loss):  # the same on every rank
            optimizer.step()
            grad_norms.append(grad_norm)
        else:
            skipped = True
        losses.append(part_loss)
        clip_fracs.append(all_reduce(part_clip, dist_) / n_selected)
        clip_tokens += clip_fracs[-1] * n_selected
    return types.SimpleNamespace(entropy=entropy, losses=losses, grad_norms=grad_norms, clip_fracs=clip_fracs,
                                 clip_tokens=clip_tokens, skipped=skipped, kl_tokens=all_reduce(kl_tokens, dist_),
                                 trained_tokens=all_reduce(trained_tokens, dist_))


def train_step(model, optimizer, rollouts, rewards, step, args, dist_, pad_id, keep_grads=False, ref_model=None,
               explain_prompts=None, full_pass1=False, row=None):
    """Step `step` (1..S), steps 3-6 of docs/algorithm.md section 6 on this rank's rollouts, every
    choice made on the global batch: select and assign, pass 1, token selection, the mini-batch
    updates, metrics.

    rollouts: this rank's prompts x G, rollouts[i][j] = {prompt_ids, response_ids} (global
    prompt order = rank order); rewards: [P_rank, G]; ref_model: the frozen reference, given on
    the steps that measure (or use) the KL, else None; explain_prompts: this rank's problem texts
    on a step that writes an explain page, else None; full_pass1: forward every kept rollout in
    pass 1 whatever the method (tests compare); row: the row that selects the samples (default
    args.method; variants.switch_to_intra's twin once --switch-on-spike fired). Returns (metrics, details): metrics, the global
    numbers of metrics.jsonl; details, the global selection (keep [P, G], token_keep [kept, T],
    rewards [P, G]) and, on rank 0 of an explain step, "explain" (else None).
    """
    device = dist_.device
    sel = select_and_assign(rollouts, rewards, step, args, dist_, row)  # 3) samples, and who forwards them
    t0 = clock(device)
    old_logp, has_old, entropy, ref_logp, pass1_tokens = pass_one(model, ref_model, sel, args, dist_, pad_id,
                                                                  full=full_pass1)  # 4)
    token_keep = select_tokens_step(sel, entropy, args, dist_)  # 5)
    upd = update_policy(model, optimizer, sel, token_keep, old_logp, has_old, entropy, ref_logp, args, dist_, pad_id)  # 6)
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)
    train_s = all_reduce(clock(device) - t0, dist_, dist.ReduceOp.MAX)  # the slowest rank's
    shown = None
    if explain_prompts is not None:  # every rank takes part; rank 0 gets the few rollouts a page shows
        G = rewards.shape[1]
        local_row = {sel.kept_all[g][0] * G + sel.kept_all[g][1]: r for g, r in sel.row_of.items()}  # p * G + g -> row
        shown = explain_rows(rollouts, explain_prompts, sel.keep_all, sel.adv_all, sel.rewards_all, sel.first, local_row,
                             sel.seqs, upd.entropy, d3s.token_scores(sel.kept_adv, upd.entropy), token_keep, dist_)
    metrics = step_metrics(sel, token_keep, upd, train_s, pass1_tokens, ref_model is not None, dist_)
    details = {"keep": sel.keep_all, "token_keep": gather_global(token_keep, sel.mine, sel.total, dist_),
               "rewards": sel.rewards_all, "explain": shown, "row": sel.row}
    return metrics, details


def step_metrics(sel, token_keep, upd, train_s, pass1_tokens, measured_kl, dist_):
    """The step's metrics (global), the ones the paper reads first. entropy_mean is over every kept
    response token, entropy_kept over the selected ones. For the methods that select tokens both
    come from pass 1 (the policy before the step's updates); for the others, from pass 2's logits
    (no grad), so on mini-batches 2..M they are the entropy of the policy at their forward, after
    the earlier mini-batches' updates."""
    n_tokens = all_reduce(sel.mask.sum(), dist_)
    n_selected = all_reduce(token_keep.sum(), dist_)
    rank_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in sel.seqs)  # what this rank forwarded
    rewards_all, grad_norms, losses = sel.rewards_all, upd.grad_norms, upd.losses
    return {
        "reward_mean": float(rewards_all.mean()),
        "acc_train": float(rewards_all.mean()),  # the reward is correctness (0/1): the same number
        "groups_mixed": float((rewards_all.amax(-1) > rewards_all.amin(-1)).float().mean()),  # groups with signal
        "n_keep": sel.n_keep, "k_frac": sel.k_frac,
        "sample_rule": variants.rule_name(sel.row),  # which rollouts this step kept: "cross" turns "intra" at the switch
        "k_real": n_selected / max(n_tokens, 1.0),  # realised fraction of the forwarded tokens
        "kept_samples": sel.total,
        "sur": d3s.usefulness_rate(sel.adv_all, sel.keep_all),  # Sample Usefulness Rate: kept rollouts with A != 0
        "kept_tokens": int(n_selected),  # tokens in the loss
        "fwd_tokens": int(n_tokens),  # response tokens of the kept rollouts
        "kept_adv_var": d3s.kept_variance(sel.adv_all, sel.keep_all),
        # mean over the optimizer steps whose gradient was finite, before clipping; None if there is none
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,
        "entropy_mean": all_reduce((upd.entropy * sel.mask).sum(), dist_) / max(n_tokens, 1.0),
        "entropy_kept": all_reduce((upd.entropy * token_keep).sum(), dist_) / max(n_selected, 1.0),
        "kl_ref": upd.kl_tokens / max(n_selected, 1.0) if measured_kl else None,
        "clip_frac": upd.clip_tokens / max(n_selected, 1.0),  # over the selected tokens of every mini-batch
        "clip_frac_by_minibatch": upd.clip_fracs,
        "loss": sum(losses) / len(losses) if losses else None,  # mean over the optimizer steps
        "updates": len(grad_norms), "skipped": upd.skipped,  # skipped: an optimizer step had a non-finite loss/gradient
        "train_s": train_s,
        "train_tokens": int(upd.trained_tokens),  # prompt + response tokens through pass 2
        "pass1_tokens": int(pass1_tokens),  # prompt + response tokens through the no-grad forwards (policy + reference)
        "train_tokens_per_s": upd.trained_tokens / max(train_s, 1e-9),
        "rank_tokens_max": int(all_reduce(rank_tokens, dist_, dist.ReduceOp.MAX)),  # load balance: the busiest rank's
        "rank_tokens_min": int(all_reduce(rank_tokens, dist_, dist.ReduceOp.MIN)),  # ... and the idlest rank's tokens
    }


# ---------------------------------------------------------------------------------------------
# 4. Evaluation: k samples per problem -> Pass@1 (mean over k) and Pass@k (unbiased)
# ---------------------------------------------------------------------------------------------
def load_eval_sets(args, tokenizer, context):
    """Every --eval-data benchmark, read and tokenized once, before any work (a bad file stops the run
    at its start, not after training): [(name, problems, rows without an answer, prompts too long)]."""
    sets = []
    for spec in args.eval_data:
        rows, dropped = load_problems(spec, drop_missing=True, limit=args.eval_limit or None)
        problems, too_long = encode_prompts(rows, tokenizer, args.template, max_prompt_len=context - 1)
        sets.append((os.path.splitext(os.path.basename(spec))[0] if os.path.exists(spec) else spec, problems, dropped,
                     too_long))
    return sets


def evaluate(engine, tokenizer, stops, eval_sets, args, dist_, grader, tag="", model_name=None):
    """Every benchmark: this rank samples --eval-samples answers for its contiguous share of the problems."""
    results = {}
    for name, problems, dropped, too_long in eval_sets:
        per = math.ceil(len(problems) / dist_.world)
        mine = list(range(dist_.rank * per, min((dist_.rank + 1) * per, len(problems))))
        outs = engine.generate([problems[i]["prompt_ids"] for i in mine], args.eval_samples, args.eval_temperature,
                               args.eval_top_p, args.eval_max_tokens, sample_seeds(args, 10**6, mine, args.eval_samples),
                               stops) if mine else []
        texts = [tokenizer.decode(c["token_ids"], skip_special_tokens=True) for group in outs for c in group]
        rewards = grader.score_batch(texts, [problems[i]["answer"] for i, group in zip(mine, outs) for _ in group])
        n = args.eval_samples
        correct = [int(sum(rewards[j * n : (j + 1) * n])) for j in range(len(outs))]  # correct samples per problem
        gathered = [None] * dist_.world
        dist.all_gather_object(gathered, correct)
        correct = [c for part in gathered for c in part]  # rank order = problem order
        row = {"problems": len(correct), "samples": n, "dropped": dropped, "too_long": too_long}
        for k in args.eval_pass_k:
            row[f"pass@{k}"] = 100.0 * sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
        row["correct"] = correct
        results[name] = row
    if results:
        keys = [f"pass@{k}" for k in args.eval_pass_k]
        results["average"] = {k: sum(r[k] for r in results.values()) / len(results) for k in keys}
        if dist_.is_main:
            write_eval_report(results, keys, args, tag, model_name or args.model)
    return results


# ---------------------------------------------------------------------------------------------
# 5. The run
# ---------------------------------------------------------------------------------------------
def measures_kl(step, args):
    """Whether step `step` (1-based) forwards the --kl-ref reference: every step when the KL is in the
    loss (--kl-coef > 0); else, the KL being only a metric, step 1, every --kl-every steps and the last."""
    if args.kl_coef > 0:
        return True
    return args.kl_every > 0 and (step == 1 or step % args.kl_every == 0 or step == args.steps)


def generate(engine, batch, step, args, stops):
    """Step 1 for this rank's share of the batch [(global index, prompt)]: G rollouts per prompt."""
    outs = engine.generate([p["prompt_ids"] for _, p in batch], args.group_size, args.temperature, args.top_p,
                           args.max_response_len, sample_seeds(args, step, [g for g, _ in batch], args.group_size), stops)
    return [[{"prompt_ids": p["prompt_ids"], "response_ids": c["token_ids"]} for c in group]
            for (_, p), group in zip(batch, outs)]


def grade(rollouts, batch, tokenizer, grader):
    """Step 2: 0/1 rewards [P_rank, G], the last \\boxed{} of each response vs the gold answer.
    One score_batch call for the rank's P_rank x G answers, so the grader pool grades them together."""
    texts = [tokenizer.decode(r["response_ids"], skip_special_tokens=True) for group in rollouts for r in group]
    golds = [p["answer"] for (_, p), group in zip(batch, rollouts) for _ in group]
    G = len(rollouts[0]) if rollouts else 0
    return torch.tensor(grader.score_batch(texts, golds), dtype=torch.float32).view(len(rollouts), G)


def load_inputs(args):
    """Tokenizer, stop tokens, training prompts and eval sets: read on every rank before the process
    group exists, so that a bad model folder or data file stops every rank with exit 2 at once."""
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # offline, the hub's retries would print a line each
    try:
        tokenizer = load_tokenizer(args.model)
        generation_config = load_generation_config(args.model)
    except (OSError, ValueError) as e:  # not a model folder, not on the hub (or offline), no tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {args.model}: cannot load its tokenizer ({first}); pass a folder with config.json "
                         "and the tokenizer files, or a hub name") from None
    finally:
        hub_logging.set_verbosity(verbosity)
    stops = stop_token_ids(tokenizer, generation_config)
    eval_sets = load_eval_sets(args, tokenizer, context_length(args.model, args))
    if args.eval_only:
        return tokenizer, stops, None, eval_sets, ""
    rows, dropped = load_problems(args.train_data, drop_missing=True)
    prompts, too_long = encode_prompts(rows, tokenizer, args.template, args.max_prompt_len)
    if not prompts:
        raise UsageError(f"--max-prompt-len {args.max_prompt_len}: no prompt of {args.train_data} is that short "
                         f"({too_long} longer); raise it")
    note = f"{len(prompts)} prompts ({dropped} rows without an answer dropped, {too_long} longer than " \
           f"{args.max_prompt_len} tokens dropped)"
    return tokenizer, stops, prompts, eval_sets, note


def main(argv=None):
    args = parse_args(argv)  # every flag and path, before any work
    check_machine(args)
    ckpt = check_resume(args, int(os.environ.get("WORLD_SIZE", "1")))  # the checkpoint to continue from, or None
    tokenizer, stops, prompts, eval_sets, note = load_inputs(args)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per rank and model load would flood the log
    dist_ = init_distributed(args.device)
    torch.manual_seed(args.seed + dist_.rank)
    random.seed(args.seed + dist_.rank)
    say = (lambda *m: print(*m, flush=True)) if dist_.is_main else (lambda *m: None)
    os.makedirs(args.out, exist_ok=True)
    if dist_.is_main:
        with open(os.path.join(args.out, "args.json" if not args.eval_only else "eval_args.json"), "w") as f:
            json.dump({**vars(args), "world": dist_.world}, f, indent=1)
    if args.eval_only:
        engine = make_engine(args.model, args, dist_)
        with Grader(args.grader_timeout, workers=args.grader_workers) as grader:
            evaluate(engine, tokenizer, stops, eval_sets, args, dist_, grader)
        shutdown(engine)
        return

    say(f"train data: {note}; {dist_.world} ranks, {args.prompts_per_step // dist_.world} prompts x {args.group_size} "
        f"rollouts per rank per step, method {args.method}, loss {args.loss}")
    order = PromptOrder(len(prompts), args.seed)
    model = load_policy(args, dist_)
    ref_model = load_policy(args, dist_, reference=True) if args.kl_ref else None  # the initial policy, frozen
    optimizer = make_optimizer(model, args)
    step, grad_norms = 0, []  # completed steps, and their grad norms (the same on every rank: --switch-on-spike's signal)
    if ckpt:
        step, grad_norms = resume_from(ckpt, model, optimizer, order, dist_)
        say(f"resumed from {ckpt} at step {step}" + other_world_note(ckpt, dist_.world, args))
    n_params = flop_params(model)  # global counts (DTensor.numel is the full size)
    flops_peak = peak_flops(dist_.device, args.peak_tflops)
    engine = make_engine(args.model, args, dist_)
    engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))  # the policy, also after a resume

    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if dist_.is_main:
        truncate_metrics(metrics_path, step)

    def run_eval(tag, name):
        results = evaluate(engine, tokenizer, stops, eval_sets, args, dist_, grader, tag=tag, model_name=name)
        if dist_.is_main and results:
            append_metrics(metrics_path, eval_record(step, results))

    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, disable=not dist_.is_main, desc="steps", dynamic_ncols=True)
    stop_at = args.stop_after or args.steps
    with Grader(args.grader_timeout, workers=args.grader_workers) as grader:
        if args.eval_every and step == 0:
            run_eval("step_000000", f"{args.model} before training")
        while step < stop_at:
            s = step + 1  # this step, 1..S
            if dist_.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dist_.device)
            batch = rank_share([(g, prompts[g]) for g in order.take(args.prompts_per_step)], dist_)
            t0 = clock(dist_.device)
            rollouts = generate(engine, batch, s, args, stops)  # 1) generate
            gen_s = all_reduce(clock(dist_.device) - t0, dist_, dist.ReduceOp.MAX)  # the slowest rank's
            gpu_used_gen = gpu_used_gb(dist_.device)  # trainer + awake vLLM
            engine.sleep()  # free vLLM's GPU memory for training
            t0 = time.perf_counter()
            rewards = grade(rollouts, batch, tokenizer, grader)  # 2) reward
            reward_s = time.perf_counter() - t0
            explain_now = args.explain_every and (s == 1 or s % args.explain_every == 0)
            stats, details = train_step(model, optimizer, rollouts, rewards, s, args, dist_, tokenizer.pad_token_id,
                                        row=variants.switch_to_intra(args.method, grad_norms, args.switch_on_spike),
                                        ref_model=ref_model if measures_kl(s, args) else None,
                                        explain_prompts=[p["problem"] for _, p in batch] if explain_now else None)
            if explain_now and dist_.is_main:  # 3-6 above; the page of this step, from the global selection
                write_explain_page(details, stats, s, args, tokenizer, dist_)
            gpu_used_train = gpu_used_gb(dist_.device)  # trainer (+ sleeping vLLM), before the sync
            t1 = clock(dist_.device)
            engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))  # 7) sync
            sync_s = clock(dist_.device) - t1
            step = s
            grad_norms.append(stats["grad_norm"])
            gen_tokens = all_reduce(sum(len(r["response_ids"]) for group in rollouts for r in group), dist_)
            record = {"kind": "train", "step": step, **stats,
                      "gen_tokens": int(gen_tokens), "kept_tokens_frac": stats["kept_tokens"] / max(gen_tokens, 1.0),
                      "response_len": gen_tokens / (args.prompts_per_step * args.group_size),
                      "grader_timeouts": int(all_reduce(grader.timeouts, dist_)),
                      "gen_s": gen_s, "reward_s": all_reduce(reward_s, dist_, dist.ReduceOp.MAX), "sync_s": sync_s,
                      "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
                      # model FLOPs of the update: the no-grad forwards (2 N per token: pass 1 and the
                      # reference) + pass 2 forward and backward (6 N per token), N without the embedding;
                      # activation recomputation and attention not counted
                      "mfu": ((2 * stats["pass1_tokens"] + 6 * stats["train_tokens"]) * n_params
                              / (stats["train_s"] * dist_.world * flops_peak) if flops_peak else None),
                      "mem_peak_gb": all_reduce(memory_peak_gb(dist_.device), dist_, dist.ReduceOp.MAX),
                      "gpu_used_gen_gb": all_reduce(gpu_used_gen, dist_, dist.ReduceOp.MAX),
                      "gpu_used_train_gb": all_reduce(gpu_used_train, dist_, dist.ReduceOp.MAX)}
            if dist_.is_main:
                append_metrics(metrics_path, record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", N=record["n_keep"], K=f"{record['k_frac']:.2f}")
                bar.update(1)
            if step % args.save_every == 0 or step == stop_at:
                save_checkpoint(model, optimizer, args.out, step, trainer_state(args, order, grad_norms), dist_,
                                args.keep_checkpoints)
            if args.export_every and step % args.export_every == 0:
                export_hf(model, tokenizer, os.path.join(args.out, f"hf_step_{step:06d}"), dist_)
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                run_eval(f"step_{step:06d}", f"{args.model} after {step} steps of {args.method}, {args.loss} loss")
        bar.close()
        if args.stop_after:
            say(f"stopped after step {step} (--stop-after): continue with --resume")
        elif step >= args.steps:
            path = export_hf(model, tokenizer, os.path.join(args.out, "hf_final"), dist_)
            say(f"exported {path}")
            run_eval("final", f"{path} ({args.model} after {step} steps of {args.method}, {args.loss} loss)")
    shutdown(engine)


def entry(argv=None):
    """main() for torchrun. A bad flag, file, model or checkpoint is one line on stderr (usage_error_line)
    and exit 2. A rank that fails otherwise prints its traceback and exits at once (os._exit),
    skipping the interpreter's shutdown (vLLM's engine and the process group would wait there for
    ranks that will never answer): torchrun then stops the other ranks within seconds, instead of
    leaving them in a collective until the 60-minute timeout."""
    try:
        main(argv)
    except SystemExit as e:  # argparse's errors: already printed (Parser.error)
        if e.code not in (None, 0):
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 2)
    except (UsageError, DataError, CheckpointError) as e:
        usage_error_line(f"train_full.py: error: {e}")
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(2)
    except BaseException:
        rank = os.environ.get("RANK", "0")
        print(f"train_full.py: rank {rank} failed; ending the job (the other ranks are stopped by torchrun)",
              file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    entry()
