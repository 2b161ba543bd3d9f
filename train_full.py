"""train_full.py: GRPO / GSPO with D3S down-sampling at the paper's scale: vLLM rollouts + FSDP2.

    torchrun --nproc_per_node=8 train_full.py                     # Qwen2.5-Math-7B, GRPO + D3S
    torchrun --nproc_per_node=8 train_full.py --loss gspo         # GSPO + D3S
    torchrun --nproc_per_node=8 train_full.py --method grpo       # the GRPO baseline
    python train_full.py --eval-only --model runs/full/hf_final   # Pass@1 / Pass@k table

Every rank holds an FSDP2 shard of the policy (fp32 master weights, bf16 compute) and, on the
same GPU, a vLLM engine (sleep mode frees its memory while the trainer runs). One step is
ALGORITHM.md section 6, every algorithmic piece a call into d3s.py:

  1 generate  each rank samples G rollouts for its share of the step's prompts (vLLM)
  2 reward    mathtask.Grader: last \\boxed{} vs the gold answer, 0/1
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
sampling seeds (one per prompt) and both selections are functions of the global batch.

Methods are the rows of d3s.LADDER: the paper's ablation ladder grpo -> d1s -> d1s-cross -> d2s
-> d3s, plus d3s-i, pods and a random control.

Left out on purpose: a reference model by default (beta = 0 in the recipe; --kl-ref loads one
to measure the KL), tensor-parallel vLLM (a 7B model fits one GPU), sequence packing. Defaults
marked [paper] are stated in the D3S paper, [recipe] come from the common Qwen2.5-Math-7B
zero-RL recipe (SimpleRL-Zoo / Dr.GRPO / verl's examples), [inferred] follow from the paper
without being stated, [choice] are this repo's where neither says.
"""

import argparse
import datetime
import functools
import glob
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist

import d3s
import explain
from mathtask import (PLAIN_TEMPLATE, QWEN_MATH_TEMPLATE, DataError, Grader, default_grader_workers, extract_boxed,
                      load_problems, pass_at_k)

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_DATA = os.path.normpath(os.path.join(HERE, "..", "shared", "data"))
BENCHMARKS = ("aime24", "aime25", "amc23", "gsm8k", "math500", "minerva_math", "olympiadbench")
TEMPLATES = {"qwen-math": QWEN_MATH_TEMPLATE, "plain": PLAIN_TEMPLATE}


# ---------------------------------------------------------------------------------------------
# 0. Arguments
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="GRPO/GSPO + D3S with vLLM rollouts and FSDP2 (one node or more, under torchrun). "
        "[paper] = stated in the D3S paper, [recipe] = common Qwen2.5-Math-7B zero-RL recipe "
        "(SimpleRL-Zoo / Dr.GRPO), [choice] = this repo's choice.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    default_train = os.path.join(SHARED_DATA, "train_math_lvl3to5_8k.jsonl")
    default_eval = ",".join(os.path.join(SHARED_DATA, f"{b}.jsonl") for b in BENCHMARKS)
    # what to train, on what
    a("--model", default="Qwen/Qwen2.5-Math-7B", help="[paper] HF hub name or local folder of the policy "
      "(with --eval-only: the model to evaluate, e.g. an hf_final/ export)")
    a("--method", default="d3s", choices=list(d3s.METHODS), help="[paper] what to train on, a row of d3s.LADDER: grpo "
      "(all), d1s (intra-group samples, static N), d1s-cross (cross-group), d2s (+ top-K tokens, static K), d3s (+ the "
      "schedule), d3s-i (intra-group + tokens + schedule), pods (max-variance by reward, A recomputed), random (control)")
    a("--loss", default="grpo", choices=["grpo", "gspo"], help="[paper] token-ratio GRPO or sequence-ratio GSPO surrogate "
      "(GSPO needs --mini-batches > 1 to differ from GRPO)")
    a("--rollout", default="vllm", choices=["vllm", "hf"], help="[choice] rollout engine: vLLM (colocated, sleep mode on "
      "CUDA) or HF generate (for machines without vLLM; slow)")
    a("--train-data", default=default_train, help="[recipe] MATH levels 3-5: local JSONL/JSON/Parquet with problem/answer, "
      "or a hub dataset 'name', 'name:split' or 'name:config:split' (e.g. openai/gsm8k:main:train; common column "
      "names are mapped)")
    a("--eval-data", nargs="+", default=[default_eval], help="[paper] benchmark files (JSONL/JSON/Parquet, globs such as "
      "'../shared/data/*.jsonl' work) or hub names, space- or comma-separated; 'none' = no eval. "
      "Default: AIME24, AIME25, AMC23, GSM8K, MATH500, Minerva, OlympiadBench from ../shared/data")
    a("--eval-only", action="store_true", help="evaluate --model on --eval-data and exit (no training)")
    a("--out", default="runs/full", help="output folder: metrics.jsonl, checkpoints/, hf_final/, eval.md, eval.json")
    a("--resume", nargs="?", const="latest", default=None, help="resume from a checkpoint folder, or (flag alone) from "
      "the latest complete one in OUT/checkpoints")
    a("--template", default="qwen-math", choices=list(TEMPLATES), help="[recipe] prompt template: Qwen2.5-Math chat "
      "template with 'Please reason step by step...' (plain: for tiny test models)")
    # the batch and D3S
    a("--steps", type=int, default=250, help="[choice] optimizer steps in the run (~1 epoch of the 8.5k problems at "
      "32 prompts/step); the D3S schedule runs over these")
    a("--prompts-per-step", type=int, default=32, help="[choice] P: prompts per optimizer step over all ranks (32 x 32 = "
      "1024 rollouts, as Dr.GRPO's 128 x 8); must be divisible by the number of ranks")
    a("--group-size", type=int, default=32, help="[inferred] G: rollouts per prompt, from N_final = 32 (the paper states no "
      "G; its N schedule ends at 32, so G >= 32)")
    a("--n-init", type=int, default=8, help="[paper] D3S schedule: rollouts kept per prompt at step 0")
    a("--n-final", type=int, default=32, help="[paper] D3S schedule: rollouts kept per prompt at the last step")
    a("--k-init", type=float, default=0.05, help="[paper] D3S schedule: fraction of tokens kept at step 0")
    a("--k-final", type=float, default=0.20, help="[paper] D3S schedule: fraction of tokens kept at the last step")
    a("--static-n", type=int, default=None, help="[choice] N of the static rows d1s, d1s-cross, d2s and pods (default: "
      "the schedule's midpoint, 20)")
    a("--static-k", type=float, default=None, help="[choice] K of d2s (default: the schedule's midpoint, 0.125)")
    a("--token-scope", default="batch", choices=["batch", "sequence"], help="[choice] top-K over the whole batch of all "
      "ranks, or within each response")
    a("--min-token-per-response", action="store_true", help="[choice] every kept response keeps at least its best token "
      "(off: the paper's plain top-K%%)")
    a("--loss-agg", default=None, choices=["token-mean", "seq-mean-token-mean"], help="loss aggregation (default: "
      "token-mean for grpo [recipe], seq-mean-token-mean for gspo, GSPO's own: every response weighs the same)")
    a("--normalize-by", default="selected", choices=["selected", "all"], help="[choice] token-mean divides by the selected "
      "tokens (default) or by all response tokens of the kept rollouts (the 80/20 paper's objective)")
    # optimization
    a("--lr", type=float, default=1e-6, help="[recipe] AdamW learning rate (constant)")
    a("--weight-decay", type=float, default=0.0, help="[recipe] AdamW weight decay")
    a("--max-grad-norm", type=float, default=1.0, help="[recipe] gradient clipping (logged before clipping)")
    a("--clip-low", type=float, default=None, help="[recipe] eps_low of the clipped surrogate (default: 0.2 grpo, 3e-4 gspo "
      "(GSPO paper))")
    a("--clip-high", type=float, default=None, help="[recipe] eps_high (default: 0.28 grpo, DAPO's clip-higher; 4e-4 gspo "
      "(GSPO paper))")
    a("--mini-batches", type=int, default=4, help="[recipe] M: optimizer steps per rollout batch, each on 1/M of the kept "
      "rollouts, old log-probs from before the first (verl's Qwen2.5-Math GRPO examples: train_batch_size 1024 / "
      "ppo_mini_batch_size 256 = 4); 1 = on-policy (ratio 1: no clipping, GSPO = GRPO)")
    a("--no-load-balance", dest="load_balance", action="store_false", help="train each kept rollout on the rank that "
      "generated it (default: spread each mini-batch's kept rollouts over the ranks by token count; the update is the same)")
    a("--micro-batch-size", type=int, default=16, help="[choice] rollouts per forward/backward on one GPU (memory only: "
      "the loss normalizer is computed once for the whole optimizer step). 16: bench/memory.py simulates a peak of 36.9 "
      "GiB per GPU for the 7B on 8 ranks at 3000 response tokens (32.5 GiB for the 1.5B on one GPU), leaving room for "
      "what it leaves out; lower it first if a GPU runs out of memory")
    a("--kl-ref", action="store_true", help="load the initial --model a second time as a frozen reference and log the KL "
      "(k3) to it on the selected tokens. Costs one more no-grad forward of the kept rollouts per step and, per GPU, "
      "the reference's bf16 shard (2 bytes x parameters / ranks: 1.9 GB for the 7B on 8 GPUs) plus one gathered layer")
    a("--kl-coef", type=float, default=0.0, help="[recipe] beta of the k3 KL penalty in the loss (needs --kl-ref); "
      "with beta > 0 the KL is in the loss and measured every step")
    a("--kl-every", type=int, default=None, help="[choice] with --kl-ref and --kl-coef 0 the KL is only a metric: the "
      "reference is forwarded on step 1, every N-th step and the last step, kl_ref is null on the others (default: "
      "--eval-every, or 10 when that is 0; 0 = never)")
    a("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false",
      help="turn off activation checkpointing of the decoder layers")
    a("--mlp-chunk-tokens", type=int, default=4096, help="[choice] run each decoder MLP over this many tokens at a time, "
      "recomputed in backward (tiled MLP): its [tokens, intermediate] activations are the largest tensors of a layer "
      "(bench/memory.py: 1.75 GiB less per GPU for the 7B at micro-batch 4 x 3000, for one more MLP forward in the "
      "backward); 0 = whole micro-batch at once")
    # sampling
    a("--temperature", type=float, default=1.0, help="[recipe] rollout sampling temperature")
    a("--top-p", type=float, default=1.0, help="[recipe] rollout nucleus sampling")
    a("--max-prompt-len", type=int, default=1024, help="[recipe] longer prompts are dropped (and counted)")
    a("--max-response-len", type=int, default=3000, help="[recipe] max generated tokens per rollout")
    # evaluation
    a("--eval-every", type=int, default=0, help="[choice] evaluate every this many steps (0: only after the last step)")
    a("--eval-samples", type=int, default=32, help="[paper] k samples per problem: Pass@1 = mean over the k samples")
    a("--eval-pass-k", default="1,8", help="[paper] Pass@k values to report (unbiased estimator over the k samples)")
    a("--eval-temperature", type=float, default=0.6, help="[choice] evaluation sampling temperature")
    a("--eval-top-p", type=float, default=0.95, help="[choice] evaluation nucleus sampling")
    a("--eval-max-tokens", type=int, default=3000, help="[recipe] max generated tokens per evaluation sample")
    a("--eval-limit", type=int, default=0, help="evaluate only the first N problems of each benchmark (0: all)")
    # checkpoints
    a("--save-every", type=int, default=50, help="sharded checkpoint (model, optimizer, data order, RNG) every N steps")
    a("--keep-checkpoints", type=int, default=2, help="keep the newest N sharded checkpoints")
    a("--export-every", type=int, default=0, help="HF export every N steps (0: only hf_final/ after the last step)")
    a("--explain-every", type=int, default=0, help="step 0 and every N-th step, rank 0 writes OUT/explain/step_NNNNNN.html "
      "(+ .png): which rollouts and tokens the step trained on, from the global selection (explain.py; a few "
      "rollouts' tokens are gathered, never the batch); 0 = off")
    a("--stop-after", type=int, default=0, help="stop after this many steps in this invocation (0: run to --steps); "
      "for preemptible jobs: resume with --resume")
    # systems
    a("--seed", type=int, default=0, help="seed of the data order, sampling and init")
    a("--unseeded-sampling", action="store_true", help="no per-prompt sampling seeds (vLLM samples seeded requests "
      "one by one: a little slower); each rank's engine is seeded with seed + rank; generation then depends on the "
      "number of ranks and resumes are not bit-exact")
    a("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda if available, else cpu (gloo)")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="compute dtype; auto: bfloat16 on CUDA "
      "(fp32 master weights and gradient reductions), float32 on CPU")
    a("--vllm-gpu-memory-utilization", type=float, default=None, help="fraction of GPU memory vLLM may take while awake "
      "(default on CUDA: what the trainer's resident shards leave, from vllm_memory_plan; printed at start)")
    a("--vllm-sleep-level", type=int, default=2, choices=[0, 1, 2], help="vLLM sleep during training (CUDA): 2 frees weights "
      "and KV cache (weights are re-sent after every step anyway), 1 offloads weights to CPU RAM, 0 = no sleep "
      "(0 and 1 need --vllm-allow-awake: they cost memory, see the message)")
    a("--vllm-allow-awake", action="store_true", help="accept --vllm-sleep-level 0 or 1 and the memory it costs")
    a("--vllm-kv-cache-gb", type=float, default=1.0, help="vLLM KV cache size on CPU (ignored on CUDA; the env "
      "VLLM_CPU_KVCACHE_SPACE overrides it)")
    a("--vllm-max-num-seqs", type=int, default=None, help="vLLM max concurrent sequences (default on CUDA: the sequences "
      "whose full-length KV cache fits, from vllm_memory_plan; 256 on CPU)")
    a("--vllm-enforce-eager", action="store_true", help="vLLM without CUDA graphs (slower; faster start)")
    a("--hf-generate-batch", type=int, default=16, help="--rollout hf: prompts per generate() call")
    a("--grader-timeout", type=float, default=5.0, help="seconds per answer before math-verify is killed (reward 0)")
    a("--grader-workers", type=int, default=None, help="math-verify grader processes per rank (default: the CPU cores "
      "/ the ranks on this node, at most 8: mathtask.default_grader_workers)")
    a("--peak-tflops", type=float, default=0.0, help="peak dense bf16 TFLOP/s of one GPU for the logged MFU (0: from the "
      "GPU's name: H100/H200 989, A100 312; unknown GPUs and CPUs log no MFU)")
    args = p.parse_args(argv)

    if args.grader_workers is None:
        args.grader_workers = default_grader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.grader_workers < 1:
        p.error(f"--grader-workers {args.grader_workers}: must be >= 1 (grader processes per rank)")
    defaults = d3s.CLIP_DEFAULTS[args.loss]  # grpo 0.2 / 0.28 (DAPO's clip-higher), gspo 3e-4 / 4e-4
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    args.clip_low = defaults[0] if args.clip_low is None else args.clip_low
    args.clip_high = defaults[1] if args.clip_high is None else args.clip_high
    args.eval_pass_k = sorted({int(k) for k in args.eval_pass_k.split(",") if k.strip()})
    args.eval_data = expand_specs(args.eval_data)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and args.rollout == "vllm" and args.vllm_sleep_level < 2 and not args.vllm_allow_awake:
        p.error(f"--vllm-sleep-level {args.vllm_sleep_level} costs memory: level 0 keeps vLLM's whole share of the GPU "
                "(its weights and KV cache, --vllm-gpu-memory-utilization of the GPU) while the trainer runs, where the "
                "trainer needs it; level 1 frees the KV cache but parks vLLM's bf16 weights in CPU RAM, 2 bytes x "
                "parameters per GPU (15 GB per GPU for a 7B model, 122 GB of host RAM on an 8-GPU node). Level 2 (the "
                "default) frees both: the weights are re-sent after every step anyway. Add --vllm-allow-awake to go on.")
    if not args.eval_only and d3s.LADDER[args.method][1] != "full":  # N counts rollouts kept per prompt: N <= G
        for flag, value in (("--n-init", args.n_init), ("--n-final", args.n_final), ("--static-n", args.static_n)):
            if value is not None and value > args.group_size:
                p.error(f"{flag}={value} > --group-size={args.group_size}: N counts rollouts kept per prompt, "
                        f"so raise --group-size or lower {flag}")
    if args.mini_batches < 1:
        p.error(f"--mini-batches={args.mini_batches}: must be >= 1 (1 = on-policy)")
    if args.mlp_chunk_tokens < 0:
        p.error(f"--mlp-chunk-tokens={args.mlp_chunk_tokens}: must be >= 0 (0 = the whole micro-batch at once)")
    if args.kl_coef < 0 or (args.kl_coef > 0 and not args.kl_ref):
        p.error(f"--kl-coef={args.kl_coef}: must be >= 0, and a KL penalty needs the reference: add --kl-ref")
    if args.kl_every is None:
        args.kl_every = args.eval_every or 10
    return args


def expand_specs(items):
    """['a.jsonl,b.jsonl', 'dir/*.jsonl', 'none'] -> the list of files / hub names ('none' drops out)."""
    specs = []
    for item in items:
        for spec in (s.strip() for s in item.split(",")):
            if spec and spec != "none":
                specs += sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
    return specs


# ---------------------------------------------------------------------------------------------
# 1. Distributed setup: one process per GPU (torchrun); device from LOCAL_RANK, data from RANK
# ---------------------------------------------------------------------------------------------
class Dist:
    """rank, world (all nodes), local_rank, device: where this process trains and generates."""

    def __init__(self, rank, world, local_rank, device):
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device
        self.is_main = rank == 0


def init_distributed(device_type):
    """Join the torchrun process group (or make a world of one): nccl on CUDA, gloo on CPU.

    vLLM's external_launcher reads the same RANK / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, so a
    plain `python train_full.py` sets them for a world of one.
    """
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=60),
                                device_id=device if device_type == "cuda" else None)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def gather_rows(local, dist_):
    """Concatenate a [rows, ...] tensor over all ranks in rank order; rows may differ per rank.

    Returns (global tensor on CPU, rows per rank). Pads to the largest rank for all_gather.
    """
    dtype = local.dtype
    send = local.to(dist_.device, torch.uint8 if dtype == torch.bool else dtype)
    rows = torch.tensor([send.shape[0]], device=dist_.device)
    all_rows = [torch.zeros_like(rows) for _ in range(dist_.world)]
    dist.all_gather(all_rows, rows)
    counts = [int(r) for r in all_rows]
    padded = send.new_zeros((max(counts), *send.shape[1:]))
    padded[: send.shape[0]] = send
    parts = [torch.empty_like(padded) for _ in range(dist_.world)]
    dist.all_gather(parts, padded)
    out = torch.cat([part[:n] for part, n in zip(parts, counts)]).cpu()
    return (out.bool() if dtype == torch.bool else out), counts


def all_reduce(value, dist_, op=dist.ReduceOp.SUM):
    """A Python number summed (or max'ed) over all ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=dist_.device)
    dist.all_reduce(t, op=op)
    return t.item()


# ---------------------------------------------------------------------------------------------
# 2. Data: local files or hub datasets -> tokenized prompts; one global order for all ranks
# ---------------------------------------------------------------------------------------------
def load_rows_once(spec, dist_, limit=None):
    """mathtask.load_problems (rows without an answer dropped and counted) on rank 0 first, so that a hub
    download happens once, into the cache; then on the other ranks."""
    if dist_.is_main:
        result = load_problems(spec, drop_missing=True, limit=limit)
    dist.barrier()
    if not dist_.is_main:
        result = load_problems(spec, drop_missing=True, limit=limit)
    return result


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
# 3. Policy: HF model -> FSDP2 (fully_shard per decoder layer and the untied embedding, then the root)
# ---------------------------------------------------------------------------------------------
def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer):
    """EOS plus Qwen's <|im_end|> (the chat template ends the assistant turn with it)."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def load_policy(args, dist_, reference=False):
    """The trainable policy: fp32 master weights sharded with FSDP2, compute in args.dtype.

    reference=True: the same model, frozen, stored in args.dtype (bf16 on GPU: 2 bytes per
    parameter, sharded), for the KL of --kl-ref.
    Memory: rank 0 reads the checkpoint on CPU, every other rank builds the model on the meta
    device; after fully_shard the full weights are broadcast from rank 0 and each rank keeps
    only its shard, so a 7B model never sits 8 times in host memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    storage = getattr(torch, args.dtype) if reference else torch.float32
    config = AutoConfig.from_pretrained(args.model)
    full_state = None
    if dist_.is_main:
        full_state = AutoModelForCausalLM.from_pretrained(args.model, dtype=storage).state_dict()
    checkpoint_dtype = config.dtype  # e.g. bfloat16: what export_hf writes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=storage)
    model.config.dtype, model.config.use_cache = checkpoint_dtype, False
    shard_policy(model, args)
    model.to_empty(device=dist_.device)
    set_model_state_dict(model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _init_rotary_buffers(model, dist_.device)  # non-persistent: not in the checkpoint, garbage after to_empty
    if reference:
        return model.eval().requires_grad_(False)
    model.train()
    return model


def shard_policy(model, args, mesh=None):
    """FSDP2 in place: activation checkpointing, tiled MLPs, fully_shard per decoder layer and the
    untied embedding, then the root.

    fp32 master weights, compute in args.dtype, fp32 gradient reduction; gradients are SUMMED
    over ranks (the loss already divides by the global token count). bench/memory.py calls
    this too, so the memory plan simulates the very wrapping that trains.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mlp_chunk_tokens:
        chunk_mlps(model, args.mlp_chunk_tokens)
    compute = getattr(torch, args.dtype)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)  # fp32 master weights + reductions
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if not model.config.tie_word_embeddings:  # an untied embedding (the 7B) is needed in forward only: 1 GiB freed after it
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
    # root (final norm, lm_head; the tied embedding): stays gathered after forward for the loss head, which calls
    # lm_head block by block; backward starts there
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # an FSDPModule
            module.set_gradient_divide_factor(1.0)  # SUM over ranks: the loss already divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
            # a rank whose micro-batch has no selected token gives an untied lm_head no gradient: reduce-scatter
            # zeros for it, so that every rank runs the same collectives (torch >= 2.13, requirements.txt's pin;
            # older torch lacks the switch, and only an untied model on several ranks needs it)
            if hasattr(module, "set_reduce_scatter_unused_params"):
                module.set_reduce_scatter_unused_params(True)
    return model


def chunk_mlps(model, chunk_tokens):
    """Tiled MLP: each decoder layer's MLP runs over slices of about chunk_tokens tokens along
    the sequence, and with grad each slice is checkpointed (recomputed in backward). The
    [n, L, intermediate] activations of the MLP (gate, up, their product: 5.3x the hidden size
    for Qwen2.5) then exist for one slice at a time, in forward and in backward. Per-token,
    so the output is the same as the whole MLP's.
    """
    from torch.utils.checkpoint import checkpoint

    def tiled(whole, x):  # x [n, L, H]
        width = max(1, chunk_tokens // x.shape[0])  # positions per slice
        if x.shape[1] <= width:
            return whole(x)
        run = (lambda part: checkpoint(whole, part, use_reentrant=False)) if torch.is_grad_enabled() else whole
        return torch.cat([run(part) for part in x.split(width, dim=1)], dim=1)

    for layer in model.model.layers:
        layer.mlp.forward = functools.partial(tiled, layer.mlp.forward)


@torch.no_grad()
def _init_rotary_buffers(model, device):
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf.to(device))


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))


def full_named_tensors(model, dtype):
    """(name, full tensor) one parameter at a time, gathered from the FSDP shards (all ranks call it)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, tensor.detach().to(dtype)


# ---------------------------------------------------------------------------------------------
# 4. Rollout engines: vLLM (colocated, one per rank) or HF generate; same interface
# ---------------------------------------------------------------------------------------------
def context_length(model_path, args):
    """Prompt + response tokens one sequence may hold: the model's context window, capped at
    max(prompt + response budget, 4096) so a long-context model does not reserve a huge sequence."""
    from transformers import AutoConfig

    window = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 10**9
    return min(window, max(args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens), 4096))


def vllm_memory_plan(config, args, ranks, gpu_bytes, kv_ref=False):
    """gpu_memory_utilization and max_num_seqs of the colocated vLLM engine on one GPU.

    While vLLM generates, the trainer keeps its shards on the same GPU: fp32 weights and
    AdamW's two moments, 12 bytes x parameters / ranks (gradients are freed after each step;
    bench/memory.py checks these bytes), plus 2 bytes x parameters / ranks for --kl-ref's bf16
    reference. vLLM may take the rest, less MARGIN_GIB for the CUDA context, NCCL buffers and
    fragmentation. Inside vLLM's share its bf16 weights take 2 bytes x parameters and its
    forward's workspace about VLLM_WORKSPACE_GIB; the KV cache gets the rest, 2 (K and V) x
    layers x KV heads x head dim x 2 bytes per token. max_num_seqs is the number of sequences
    whose KV cache fits at full length (prompt + response), so vLLM need not preempt (clamped
    to 16 .. 1024). Returns a dict with the numbers (printed at start).
    """
    params = sum(p.numel() for p in _meta_model(config).parameters())
    gib = 2**30
    trainer = (12 + (2 if kv_ref else 0)) * params / ranks
    share = max(gpu_bytes - trainer - MARGIN_GIB * gib, 0.0)
    utilization = min(max(share / gpu_bytes, 0.05), 0.95)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    kv_bytes = utilization * gpu_bytes - 2 * params - VLLM_WORKSPACE_GIB * gib
    full_length = args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens)
    max_num_seqs = int(min(1024, max(16, kv_bytes // (kv_per_token * full_length))))
    return {"params": params, "trainer_resident_gib": trainer / gib, "gpu_gib": gpu_bytes / gib,
            "gpu_memory_utilization": round(utilization, 3), "kv_cache_gib": kv_bytes / gib,
            "kv_bytes_per_token": kv_per_token, "max_num_seqs": max_num_seqs}


MARGIN_GIB, VLLM_WORKSPACE_GIB = 4.0, 3.0  # CUDA context + NCCL + fragmentation; vLLM's forward workspace


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


class VLLMEngine:
    """A vLLM engine inside this trainer process, on this rank's GPU (external_launcher, TP=1).

    generate() runs this rank's prompts; sleep() frees its GPU memory for training;
    update_weights() streams the new weights in through vLLM 0.32's reload_weights (in place,
    checkpoint format) and resets the prefix cache, whose KV entries belong to the old weights.
    """

    def __init__(self, model_path, args, dist_):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        from vllm import LLM

        self.cuda = cuda = dist_.device.type == "cuda"
        self.sleep_level = args.vllm_sleep_level if cuda else 0  # vLLM has no sleep mode on CPU
        extra = {} if cuda else {"kv_cache_memory_bytes": int(args.vllm_kv_cache_gb * 2**30)}
        utilization, max_num_seqs = args.vllm_gpu_memory_utilization or 0.5, args.vllm_max_num_seqs or 256
        if cuda:
            from transformers import AutoConfig

            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the free memory
            plan = vllm_memory_plan(AutoConfig.from_pretrained(model_path), args, dist_.world,
                                    torch.cuda.get_device_properties(dist_.device).total_memory, kv_ref=args.kl_ref)
            utilization = args.vllm_gpu_memory_utilization or plan["gpu_memory_utilization"]
            max_num_seqs = args.vllm_max_num_seqs or plan["max_num_seqs"]
            if dist_.is_main:
                print(f"vLLM memory plan: trainer shards {plan['trainer_resident_gib']:.1f} GiB of {plan['gpu_gib']:.0f}, "
                      f"gpu_memory_utilization {utilization}, KV cache ~{plan['kv_cache_gib']:.1f} GiB, "
                      f"max_num_seqs {max_num_seqs}", flush=True)
        # per-request seeds (the default) fix every sample; with --unseeded-sampling the engine's own
        # seed draws them, so each rank gets its own (seed + rank) instead of 8 copies of one stream
        engine_seed = args.seed + (dist_.rank if args.unseeded_sampling else 0)
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=args.dtype, seed=engine_seed, generation_config="vllm",
                       distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                       max_model_len=context_length(model_path, args),
                       gpu_memory_utilization=utilization, enable_sleep_mode=self.sleep_level > 0,
                       enable_prefix_caching=True, enforce_eager=args.vllm_enforce_eager or not cuda,
                       max_num_seqs=max_num_seqs, **extra)
        self.max_model_len = self.llm.llm_engine.vllm_config.model_config.max_model_len
        self.sleeping = False

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
        """prompts: list of token-id lists -> per prompt, n dicts {token_ids, logprobs}."""
        from vllm import SamplingParams

        self.wake_up()
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_ids,
                                 max_tokens=max(1, min(max_tokens, self.max_model_len - len(ids))), detokenize=False,
                                 logprobs=0 if logprobs else None)
                  for ids, seed in zip(prompts, seeds)]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids),
                  "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs] if logprobs else None}
                 for c in out.outputs] for out in outs]

    def sleep(self):
        if self.sleep_level > 0 and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self):
        if self.sleeping:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.sleeping = False

    def update_weights(self, named_tensors):
        if self.sleeping:
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver for vLLM
            self.llm.wake_up(tags=["weights"])  # weights first: the KV cache is not needed to load them
        stream = _Drain(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        stream.drain()  # every rank must gather every tensor, even ones vLLM skipped
        if not self.cuda:
            self.llm.collective_rpc(_repack_tied_lm_head)
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down (it also tears down the process group: call last)."""
        self.llm.llm_engine.engine_core.shutdown()


def _repack_tied_lm_head(worker):
    """vLLM on CPU packs lm_head's weight into its GEMM kernel at load time. With tied embeddings
    reload_weights refreshes only the embedding (lm_head.* is skipped), so the packed copy would
    keep the old weights: pack it again. (On GPU lm_head reads the shared weight directly.)"""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class _Drain:
    """An iterator that can be run to its end afterwards (keeps FSDP all-gathers matched across ranks)."""

    def __init__(self, iterable):
        self.it = iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def drain(self):
        for _ in self.it:
            pass


class HFEngine:
    """HF generate on a plain (unsharded) copy of the policy on this rank: --rollout hf."""

    def __init__(self, model_path, args, dist_):
        from transformers import AutoModelForCausalLM

        self.device, self.batch = dist_.device, args.hf_generate_batch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(self.device).eval()
        self.max_model_len = context_length(model_path, args)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.eos_token_id if isinstance(self.model.config.eos_token_id, int) else 0
        self.offloaded = False

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
        self.wake_up()
        results = []
        for start in range(0, len(prompts), self.batch):
            chunk = prompts[start : start + self.batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                attn[i, width - len(p) :] = 1
            if seeds[start] is not None:
                torch.manual_seed(seeds[start])
            greedy = temperature == 0
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                      do_sample=not greedy, temperature=None if greedy else temperature,
                                      top_p=None if greedy else top_p, top_k=None if greedy else 0, repetition_penalty=1.0,
                                      num_return_sequences=n, eos_token_id=stop_ids,
                                      max_new_tokens=max(1, min(max_tokens, self.max_model_len - width)),
                                      pad_token_id=self.pad_id, output_scores=logprobs, return_dict_in_generate=True)
            new = out.sequences[:, width:].cpu()  # [len(chunk) * n, new]
            steps = torch.stack(out.scores, 1).float().log_softmax(-1).cpu() if logprobs else None  # [.., new, V]
            for i in range(len(chunk)):
                group = []
                for j in range(n):
                    row = new[i * n + j].tolist()
                    end = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), len(row))
                    lps = steps[i * n + j, torch.arange(end), new[i * n + j, :end]].tolist() if logprobs else None
                    group.append({"token_ids": row[:end], "logprobs": lps})
                results.append(group)
        return results

    def sleep(self):
        if self.device.type == "cuda" and not self.offloaded:
            self.model.to("cpu")
            self.offloaded = True
            torch.cuda.empty_cache()

    def wake_up(self):
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def close(self):
        pass


def shutdown(engine):
    """Wait for every rank, stop the engine, leave the process group."""
    dist.barrier()
    if engine is not None:
        engine.close()  # vLLM's shutdown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def make_engine(model_path, args, dist_):
    if args.rollout == "vllm":
        try:
            return VLLMEngine(model_path, args, dist_)
        except ImportError as e:
            raise SystemExit(f"--rollout vllm needs vLLM ({e}): pip install -r requirements-full.txt, or use --rollout hf")
    return HFEngine(model_path, args, dist_)


# ---------------------------------------------------------------------------------------------
# 5. Forward passes on the kept rollouts
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
# 6. One optimizer step on the rollouts (ALGORITHM.md section 6, steps 3-6)
# ---------------------------------------------------------------------------------------------
def budget(step, args, group_size):
    """(n_keep, k_frac) of this step (0-based) for args.method: d3s.method_budget."""
    return d3s.method_budget(args.method, step, args.steps, group_size, args.n_init, args.n_final, args.k_init,
                             args.k_final, args.static_n, args.static_k)


def gather_global(local, mine, total, dist_):
    """The [rows, ...] tensors of all ranks as one [total, ...] tensor in GLOBAL order (CPU):
    row r of this rank is global row mine[r]. Every rank gets the same tensor."""
    gathered, _ = gather_rows(local, dist_)
    where, _ = gather_rows(torch.tensor(mine, dtype=torch.long).view(-1, 1), dist_)
    out = torch.empty((total, *gathered.shape[1:]), dtype=gathered.dtype)
    out[where.view(-1)] = gathered
    return out


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


def select_and_assign(rollouts, rewards, step, args, dist_):
    """Step 3 on the GLOBAL batch: d3s.select_samples on the [P, G] rewards of all ranks, then which
    rank forwards which kept rollout (assign_rollouts) and the step's M mini-batches. Every rank
    gets the token ids of every kept rollout (a few MB per step), so that any rank can train any."""
    P_local, G = rewards.shape
    n_keep, k_frac = budget(step, args, G)
    rewards_all, counts = gather_rows(rewards.float(), dist_)  # [P, G], CPU
    generator = torch.Generator().manual_seed(args.seed * 7919 + step)  # "random": same draw on every rank
    keep_all, adv_all = d3s.select_samples(rewards_all, n_keep, args.method, generator=generator)
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
        n_keep=n_keep, k_frac=k_frac, rewards_all=rewards_all, keep_all=keep_all, adv_all=adv_all, kept_all=kept_all,
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
    selects = d3s.LADDER[args.method][2] or full
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
    if not d3s.LADDER[args.method][2]:
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
               explain_prompts=None, full_pass1=False):
    """Steps 3-6 of docs/algorithm.md section 6 on this rank's rollouts, every choice made on the
    global batch: select and assign, pass 1, token selection, the mini-batch updates, metrics.

    rollouts: this rank's prompts x G, rollouts[i][j] = {prompt_ids, response_ids} (global
    prompt order = rank order); rewards: [P_rank, G]; ref_model: the frozen reference, given on
    the steps that measure (or use) the KL, else None; explain_prompts: this rank's problem texts
    on a step that writes an explain page (rank 0 then gets "_explain"), else None; full_pass1:
    forward every kept rollout in pass 1 whatever the method (for tests). Returns a dict of
    metrics (global).
    """
    device = dist_.device
    sel = select_and_assign(rollouts, rewards, step, args, dist_)  # 3) samples, and who forwards them
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
    # for the tests and the explain page: the kept set, in global order
    metrics.update({"_keep": sel.keep_all, "_token_keep": gather_global(token_keep, sel.mine, sel.total, dist_),
                    "_rewards": sel.rewards_all, "_explain": shown})
    return metrics


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


def explain_rows(rollouts, prompts, keep_all, adv_all, rewards_all, first, local_row, seqs, entropy, token_scores,
                 token_keep, dist_):
    """The few rollouts an explain page shows (explain.pick_rollouts on the global batch: the same
    choice on every rank), gathered on rank 0 with their token ids and, when forwarded, entropy,
    score and selection: a few rollouts, never the batch. local_row: flat index p * G + g -> row
    of this rank's forwarded batch. Every rank calls it (gather_object).
    Returns (shown_adv, items, prompt texts) on rank 0, None elsewhere."""
    G = keep_all.shape[1]
    shown_adv = torch.where(keep_all, adv_all, d3s.group_advantages(rewards_all))  # the loss's A on kept cells
    picked, mine = explain.pick_rollouts(shown_adv, keep_all), []
    for index in picked:
        p, g = divmod(index, G)
        if index in local_row:  # forwarded here: its row of entropy / scores / selection
            r = local_row[index]
            ids = list(seqs[r]["response_ids"])
            n = len(ids)
            mine.append({"index": index, "ids": ids, "entropy": entropy[r, :n].tolist(), "score": token_scores[r, :n].tolist(),
                         "selected": token_keep[r, :n].tolist()})
        elif not keep_all[p, g] and first <= p < first + len(rollouts):  # dropped: only its home rank has it
            mine.append({"index": index, "ids": list(rollouts[p - first][g]["response_ids"])})
    parts = [None] * dist_.world if dist_.is_main else None
    dist.gather_object((mine, prompts), parts, dst=0)
    if not dist_.is_main:
        return None
    items = sorted((item for part, _ in parts for item in part), key=lambda item: picked.index(item["index"]))
    return shown_adv, items, [text for _, texts in parts for text in texts]


# ---------------------------------------------------------------------------------------------
# 7. Checkpoints: sharded (DCP) for resume, HF export for vLLM / transformers
# ---------------------------------------------------------------------------------------------
CKPT_RE = re.compile(r"^step_(\d+)$")


def save_checkpoint(model, optimizer, order, step, args, dist_):
    """OUT/checkpoints/step_NNNNNN: model + optimizer shards (DCP), data order, RNG of every rank.

    Written to step_NNNNNN.tmp and renamed when complete: a run killed at any moment leaves
    either a complete checkpoint or a .tmp folder that --resume ignores.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(args.out, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dist_.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if dist_.device.type == "cuda" else None}
    torch.save(rng, os.path.join(tmp, f"rng_rank{dist_.rank}.pt"))
    if dist_.is_main:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "order": order.state_dict(), "world": dist_.world, "model": args.model,
                       "method": args.method, "loss": args.loss, "steps": args.steps}, f, indent=1)
    dist.barrier()
    if dist_.is_main:
        shutil.rmtree(final, ignore_errors=True)  # resumed from an older checkpoint: this step is redone
        os.replace(tmp, final)  # atomic: the checkpoint exists only once it is complete
        done = sorted(d for d in os.listdir(root) if CKPT_RE.match(d))
        for old in done[: max(len(done) - args.keep_checkpoints, 0)]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(spec, out):
    """The folder to resume from: spec itself, or the newest complete OUT/checkpoints/step_*."""
    if spec != "latest":
        if not os.path.exists(os.path.join(spec, "trainer_state.json")):
            raise SystemExit(f"--resume {spec}: not a complete checkpoint (no trainer_state.json)")
        return spec
    root = os.path.join(out, "checkpoints")
    done = sorted(d for d in os.listdir(root) if CKPT_RE.match(d)) if os.path.isdir(root) else []
    done = [d for d in done if os.path.exists(os.path.join(root, d, "trainer_state.json"))]
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(path, model, optimizer, order, dist_):
    """Restore model + optimizer shards (any world size: DCP reshards), data order and RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        meta = json.load(f)
    order.load_state_dict(meta["order"])
    rng_file = os.path.join(path, f"rng_rank{dist_.rank}.pt")
    if meta["world"] == dist_.world and os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and dist_.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    return meta["step"]


def export_hf(model, tokenizer, path, dist_):
    """save_pretrained of the full weights (rank 0), in the base model's dtype: loadable by
    transformers' from_pretrained and by vLLM."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist_.is_main:
        config = model.config
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
        config.use_cache = True
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)  # a plain class for save_pretrained (not FSDP's)
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shell.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in full.items()})
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        config.use_cache = False
    dist.barrier()
    return path


# ---------------------------------------------------------------------------------------------
# 8. Evaluation: k samples per problem -> Pass@1 (mean over k) and Pass@k (unbiased)
# ---------------------------------------------------------------------------------------------
def evaluate(engine, tokenizer, args, dist_, grader, tag="", model_name=None):
    """Every benchmark of --eval-data: this rank takes a contiguous share of the problems."""
    stops = stop_token_ids(tokenizer)
    results = {}
    for spec in args.eval_data:
        name = os.path.splitext(os.path.basename(spec))[0] if os.path.exists(spec) else spec
        rows, dropped = load_rows_once(spec, dist_, limit=args.eval_limit or None)
        problems, too_long = encode_prompts(rows, tokenizer, args.template, max_prompt_len=engine.max_model_len - 1)
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
        for k in [k for k in args.eval_pass_k if k <= n]:
            row[f"pass@{k}"] = 100.0 * sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
        row["correct"] = correct
        results[name] = row
    if results:
        keys = [f"pass@{k}" for k in args.eval_pass_k if k <= args.eval_samples]
        results["average"] = {k: sum(r[k] for r in results.values()) / len(results) for k in keys}
        if dist_.is_main:
            write_eval_report(results, keys, args, tag, model_name or args.model)
    return results


def write_eval_report(results, keys, args, tag, model_name):
    lines = [f"# Evaluation of {model_name}", "",
             f"{args.eval_samples} samples per problem, temperature {args.eval_temperature}, top-p {args.eval_top_p}, "
             f"max {args.eval_max_tokens} tokens, template {args.template}. Pass@1 = mean accuracy over the samples; "
             "Pass@k unbiased (Chen et al., 2021).", "",
             "| benchmark | problems | " + " | ".join(k.replace("pass", "Pass") for k in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for name, row in results.items():
        cells = [f"{row[k]:.1f}" for k in keys]
        lines.append(f"| {name} | {row.get('problems', '')} | " + " | ".join(cells) + " |")
    skipped = {name: (row["dropped"], row["too_long"]) for name, row in results.items() if row.get("dropped") or row.get("too_long")}
    for name, (dropped, too_long) in skipped.items():
        lines.append(f"\nNot evaluated in {name}: {dropped} rows without an answer, {too_long} prompts longer than the context.")
    stem = os.path.join(args.out, f"eval{'_' + tag if tag else ''}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"model": model_name, "settings": {k: getattr(args, k) for k in (
            "eval_samples", "eval_temperature", "eval_top_p", "eval_max_tokens", "template", "eval_limit")},
            "results": results}, f, indent=1)
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------
# 9. The run
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


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def eval_record(step, results):
    """One metrics.jsonl line per evaluation: {benchmark}_pass@k for every benchmark and the average."""
    return {"kind": "eval", "step": step, **{f"{name}_{k}": v for name, row in results.items()
                                             for k, v in row.items() if k.startswith("pass@")}}


def truncate_metrics(path, step):
    """Keep what the checkpoint after `step` steps covers (a killed run may have logged past it):
    train lines of steps 0..step-1 (0-based) and evaluations after at most `step` steps."""
    if not os.path.exists(path):
        return

    def covered(record):
        done = record.get("step", math.inf)
        return done <= step if record.get("kind") == "eval" else done < step

    with open(path) as f:
        kept = [line for line in f if line.strip() and covered(json.loads(line))]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def memory_peak_gb(device):
    """Peak of PyTorch's allocator this step on CUDA (max over ranks); peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: peak RSS of this process


def clock(device):
    """time.perf_counter() after the device has finished its queued work: CUDA kernels run
    asynchronously, so without the synchronize a timer would stop before the GPU does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


PEAK_TFLOPS = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("H800", 989), ("A100", 312), ("A800", 312))  # dense bf16


def peak_flops(device, peak_tflops):
    """Peak dense bf16 FLOP/s of one GPU (for MFU), or None if unknown. The first name in
    PEAK_TFLOPS that the GPU's name contains wins: H100 PCIe 756 TFLOP/s, NVL 835, SXM 989."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS if key in name), None)


def flop_params(model):
    """Parameters that cost 2 FLOPs per token in a forward: all but the input embedding (a
    lookup). A tied LM head shares the embedding's weight but is a real matmul: counted once."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.get_input_embeddings().weight.numel()
    return n


def gpu_used_gb(device):
    """Memory in use on the whole GPU (every allocator, vLLM's included); 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def main(argv=None):
    args = parse_args(argv)
    dist_ = init_distributed(args.device)
    torch.manual_seed(args.seed + dist_.rank)
    random.seed(args.seed + dist_.rank)
    if not args.eval_only and not args.resume and find_checkpoint("latest", args.out):
        raise SystemExit(f"--out {args.out} holds the checkpoints of an earlier run: pass --resume to continue it, "
                         "or a new --out (nothing was overwritten)")
    os.makedirs(args.out, exist_ok=True)
    if dist_.is_main:
        with open(os.path.join(args.out, "args.json" if not args.eval_only else "eval_args.json"), "w") as f:
            json.dump({**vars(args), "world": dist_.world}, f, indent=1)
    tokenizer = load_tokenizer(args.model)
    stops = stop_token_ids(tokenizer)
    say = (lambda *m: print(*m, flush=True)) if dist_.is_main else (lambda *m: None)

    if args.eval_only:
        engine = make_engine(args.model, args, dist_)
        with Grader(args.grader_timeout, workers=args.grader_workers) as grader:
            evaluate(engine, tokenizer, args, dist_, grader)
        shutdown(engine)
        return

    if args.prompts_per_step % dist_.world:
        raise SystemExit(f"--prompts-per-step={args.prompts_per_step} must be divisible by the {dist_.world} ranks")
    rows, dropped = load_rows_once(args.train_data, dist_)
    prompts, too_long = encode_prompts(rows, tokenizer, args.template, args.max_prompt_len)
    if not prompts:
        raise SystemExit(f"{args.train_data}: no prompt of at most --max-prompt-len={args.max_prompt_len} tokens")
    say(f"train data: {len(prompts)} prompts ({dropped} rows without an answer dropped, {too_long} longer than "
        f"{args.max_prompt_len} tokens dropped); {dist_.world} ranks, {args.prompts_per_step // dist_.world} prompts x "
        f"{args.group_size} rollouts per rank per step, method {args.method}, loss {args.loss}")
    order = PromptOrder(len(prompts), args.seed)

    model = load_policy(args, dist_)
    ref_model = load_policy(args, dist_, reference=True) if args.kl_ref else None  # the initial policy, frozen
    optimizer = make_optimizer(model, args)
    step = 0
    ckpt = find_checkpoint(args.resume, args.out) if args.resume else None
    if args.resume and ckpt is None:
        say(f"--resume: no complete checkpoint in {args.out}/checkpoints, starting from step 0")
    if ckpt:
        step = load_checkpoint(ckpt, model, optimizer, order, dist_)
        say(f"resumed from {ckpt} at step {step}")
    n_params = flop_params(model)  # global counts (DTensor.numel is the full size)
    flops_peak = peak_flops(dist_.device, args.peak_tflops)
    engine = make_engine(args.model, args, dist_)
    engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))  # the policy, also after a resume

    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if dist_.is_main:
        truncate_metrics(metrics_path, step)
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, disable=not dist_.is_main, desc="steps", dynamic_ncols=True)
    stop_at = min(args.steps, step + args.stop_after) if args.stop_after else args.steps
    with Grader(args.grader_timeout, workers=args.grader_workers) as grader:
        while step < stop_at:
            if dist_.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dist_.device)
            batch = rank_share([(g, prompts[g]) for g in order.take(args.prompts_per_step)], dist_)
            t0 = clock(dist_.device)
            rollouts = generate(engine, batch, step, args, stops)  # 1) generate
            gen_s = all_reduce(clock(dist_.device) - t0, dist_, dist.ReduceOp.MAX)  # the slowest rank's
            gpu_used_gen = gpu_used_gb(dist_.device)  # trainer + awake vLLM
            engine.sleep()  # free vLLM's GPU memory for training
            t0 = time.perf_counter()
            rewards = grade(rollouts, batch, tokenizer, grader)  # 2) reward
            reward_s = time.perf_counter() - t0
            explain_now = args.explain_every and step % args.explain_every == 0
            stats = train_step(model, optimizer, rollouts, rewards, step, args, dist_, tokenizer.pad_token_id,
                               ref_model=ref_model if measures_kl(step + 1, args) else None,
                               explain_prompts=[p["problem"] for _, p in batch] if explain_now else None)
            if explain_now and dist_.is_main:  # 3-6 above; the page of this step, from the global selection
                shown_adv, items, texts = stats["_explain"]
                for item in items:
                    item["tokens"] = [tokenizer.decode([t]) for t in item.pop("ids")]
                explain.write_step(os.path.join(args.out, "explain"), step=step, rung="train_full", method=args.method,
                                   rewards=stats["_rewards"], adv=shown_adv, keep=stats["_keep"], n_keep=stats["n_keep"],
                                   k_frac=stats["k_frac"], k_real=stats["k_real"], shown=items, prompts=texts,
                                   extra={"loss (mean over optimizer steps)": stats["loss"], "tokens in the loss": stats["kept_tokens"],
                                          "grad norm (before clipping)": stats["grad_norm"], "ranks": dist_.world})
            gpu_used_train = gpu_used_gb(dist_.device)  # trainer (+ sleeping vLLM), before the sync
            t1 = clock(dist_.device)
            engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))  # 7) sync
            sync_s = clock(dist_.device) - t1
            step += 1
            gen_tokens = all_reduce(sum(len(r["response_ids"]) for group in rollouts for r in group), dist_)
            record = {"kind": "train", "step": step - 1, **{k: v for k, v in stats.items() if not k.startswith("_")},
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
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", N=record["n_keep"], K=f"{record['k_frac']:.2f}",
                                gnorm=f"{record['grad_norm'] or float('nan'):.3f}")
                bar.update(1)
            if step % args.save_every == 0 or step == stop_at:
                save_checkpoint(model, optimizer, order, step, args, dist_)
            if args.export_every and step % args.export_every == 0:
                export_hf(model, tokenizer, os.path.join(args.out, f"hf_step_{step:06d}"), dist_)
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                results = evaluate(engine, tokenizer, args, dist_, grader, tag=f"step_{step:06d}",
                                   model_name=f"{args.model} after {step} steps of {args.method}, {args.loss} loss")
                if dist_.is_main and results:
                    append_metrics(metrics_path, eval_record(step, results))
        bar.close()
        if step >= args.steps:
            path = export_hf(model, tokenizer, os.path.join(args.out, "hf_final"), dist_)
            say(f"exported {path}")
            results = evaluate(engine, tokenizer, args, dist_, grader, tag="final",
                               model_name=f"{path} ({args.model} after {step} steps of {args.method}, {args.loss} loss)")
            if dist_.is_main and results:
                append_metrics(metrics_path, eval_record(step, results))
    shutdown(engine)


def entry(argv=None):
    """main() for torchrun: a rank that fails prints its traceback and exits at once (os._exit),
    skipping the interpreter's shutdown (vLLM's engine and the process group would wait there
    for ranks that will never answer). torchrun then stops the other ranks within seconds,
    instead of leaving them in a collective until the 60-minute timeout."""
    try:
        main(argv)
    except SystemExit as e:  # argument and usage errors: their message is already printed
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        rank = os.environ.get("RANK", "0")
        print(f"train_full.py: rank {rank} failed; ending the job (the other ranks are stopped by torchrun)",
              file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    entry()
