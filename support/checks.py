"""support/checks.py: what both trainers refuse before any work, each time with one line (exit 2) naming the fix.

    check_run           the flags both trainers share, checked together: --stop-after, the method (methods.check_flags),
                        the loss's aggregation and clip range where not given
    check_args          train_full.py's flags together and its paths (its machine: engines.check_machine)
    check_finite        NaN or inf in a model's weights or in the logits of its first forward, both trainers
    check_finite_files  the same in a saved model's files (train_full.py --eval-only), each rank its share

The checks of one flag (its range, its choices) are in its declaration (support/cli.py).
"""

import glob
import itertools
import os
import re

import torch

import d3s
from support import cli, grading, methods, reward_function, stops, track
from support.cli import UsageError
from support.templates import format_prompt

MAX_ROLLOUTS = 2**20  # rollouts per step (P x G) and samples per problem beyond which a value is a typo [choice]
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "org/name" or "name": not a local path


def check_run(p, args, method_names):
    """The checks and defaults both trainers share: the method rows (methods.check_flags: LADDER rows, N <= G, the
    switch rule) and the static N and K they fill in; the loss's aggregation and clip range where not given
    (d3s.CLIP_DEFAULTS: grpo 0.2 / 0.28, DAPO's clip-higher; gspo 3e-4 / 4e-4)."""
    if args.stop_after is not None and args.stop_after > args.steps:
        p.error(f"--stop-after {args.stop_after}: must be an int in [1, --steps {args.steps}]")
    args.static_n, args.static_k = methods.check_flags(p, args, method_names)
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    clip = d3s.CLIP_DEFAULTS[args.loss]
    args.clip_low = clip[0] if args.clip_low is None else args.clip_low
    args.clip_high = clip[1] if args.clip_high is None else args.clip_high


def check_finite(model, name, prompt_ids, world=None):
    """NaN or inf in `model`'s weights (one tensor at a time, under FSDP2 each rank its shards: no copy of the model)
    or in the logits of a first forward of `prompt_ids` (its last 64 tokens; every rank together under FSDP2: its
    all-gathers): UsageError naming the model (`name`), on every rank (world: one all-reduce), before any work."""
    bad, fix = "", "its weights are damaged or were saved from a diverged run: pass another model, or run it in float32"
    with torch.no_grad():
        for where, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
            if not bad and local.is_floating_point() and not bool(torch.isfinite(local).all()):
                bad = f"its weights hold NaN or inf ({where})"
        if not stops.any_rank(bad, world):
            training, device = model.training, world.device if world else next(model.parameters()).device
            logits = model.eval()(input_ids=torch.tensor([list(prompt_ids)[-64:]], device=device)).logits
            model.train(training)
            if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters whole after a forward: shards again, so
                model.reshard()  # that the optimizer and the checkpoints meet the sharded parameters they know
            if not bool(torch.isfinite(logits).all()):
                bad = "its first forward gives NaN or inf logits (weights finite: an overflow in its dtype?)"
    if stops.any_rank(bad, world):
        raise UsageError(f"{name}: {bad or 'its weights hold NaN or inf (on another rank)'}; {fix}")


def check_finite_files(model, world):
    """check_finite for --eval-only (no policy of its own): --model's local safetensors files, one tensor at a time,
    each rank a share. A hub name, or a folder without safetensors files, is not checked here."""
    from safetensors import safe_open

    bad, index = "", itertools.count()
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))) if os.path.isdir(model) else []:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if bad or next(index) % world.size != world.rank:  # this rank's share: every size-th tensor
                    continue
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = f"its weights hold NaN or inf ({name})"
    if stops.any_rank(bad, world):
        raise UsageError(
            f"--model {model}: {bad or 'its weights hold NaN or inf (found by another rank)'}; its weights are "
            "damaged or were saved from a diverged run: pass another model"
        )


# === train_small.py ===================================================================================================
def finite_warm_start(warm, args, train_rows):
    """check_finite on train_small.py's warm start (model, tokenizer, info) and its first training prompt; returns
    `warm`. The line names --model (or the tiny model) and the warm start's cache folder, where there is one."""
    model, tokenizer, info = warm
    name = f"--model {args.model}" if args.model else "the tiny model"
    name += f" (warm start {info['path']}: delete it to build it again)" if info.get("sft_steps") else ""
    prompt = format_prompt(train_rows[0]["problem"], args.template, tokenizer, args.system_prompt)
    check_finite(model, name, tokenizer(prompt, add_special_tokens=False).input_ids)
    return warm


# === train_full.py ====================================================================================================
def check_args(p, args, ranks):
    """The checks of several flags together and of the paths, before any work (no model, data or process group yet);
    fills in the defaults that depend on other flags (check_run's, --kl-every, the grader's workers, device, dtype)."""
    check_run(p, args, [args.method])  # --stop-after, the method, N <= G, the switch rule; loss and clip defaults
    reward_function.check_flag(p, args.reward)  # a --reward that does not load: one line
    args.eval_pass_k = sorted(set(cli.int_list(p, "--eval-pass-k", args.eval_pass_k, what="comma-separated ints")))
    if not all(1 <= k <= args.eval_samples for k in args.eval_pass_k):
        p.error(
            f"--eval-pass-k {','.join(map(str, args.eval_pass_k))}: each k must be in [1, --eval-samples "
            f"{args.eval_samples}] (Pass@k from k <= n samples); lower k or raise --eval-samples"
        )
    if args.prompts_per_step * args.group_size > MAX_ROLLOUTS:
        p.error(
            f"--prompts-per-step {args.prompts_per_step}: x --group-size {args.group_size} is more than "
            f"{MAX_ROLLOUTS} rollouts per step; lower one of them"
        )
    if args.prompts_per_step % ranks:
        p.error(
            f"--prompts-per-step {args.prompts_per_step}: must be divisible by the {ranks} ranks; change it or the "
            "number of ranks"
        )
    if args.mini_batches > args.prompts_per_step * args.group_size:
        p.error(
            f"--mini-batches {args.mini_batches}: more than the {args.prompts_per_step * args.group_size} rollouts "
            "of a step; lower it"
        )
    if args.kl_coef > 0 and not args.kl_ref:
        p.error(f"--kl-coef {args.kl_coef}: a KL penalty needs the reference model; add --kl-ref")
    args.kl_every = (args.eval_every or 10) if args.kl_every is None else args.kl_every
    if args.kl_ref and args.kl_coef == 0 and args.kl_every == 0:
        p.error(
            "--kl-every 0: with --kl-ref and --kl-coef 0 the reference would never be used; drop --kl-ref, or "
            "measure the KL every N > 0 steps"
        )
    if args.normalize_by == "all" and args.loss_agg != "token-mean":
        p.error(
            f"--normalize-by all: applies to --loss-agg token-mean ({args.loss_agg} divides by the responses); drop "
            "it or add --loss-agg token-mean"
        )
    if args.grader_workers is None:
        args.grader_workers = grading.default_grader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and args.rollout == "vllm" and args.vllm_sleep_level < 2 and not args.vllm_allow_awake:
        p.error(
            f"--vllm-sleep-level {args.vllm_sleep_level}: costs memory while the trainer runs (0: vLLM's whole "
            "share of the GPU; 1: its bf16 weights in CPU RAM, 2 bytes x parameters per GPU); level 2, the default, "
            "frees both; add --vllm-allow-awake to go on"
        )
    # paths: what is read must exist, what is written must be writable
    if not args.model:
        p.error("--model '': empty; pass a model folder or a hub name")
    if os.path.exists(args.model):  # a local folder: config.json, weights and a tokenizer, each named if missing
        cli.check_model(p, args.model)
    elif not HUB_NAME.fullmatch(args.model):
        p.error(
            f"--model {args.model}: no such folder; pass a model folder (config.json, weights, tokenizer) or a hub name"
        )
    specs = [("--train-data", args.train_data)] * (not args.eval_only) + [("--eval-data", s) for s in args.eval_data]
    for flag, spec in specs:
        check_data_spec(p, flag, spec)
    args.eval_data = expand_specs(args.eval_data)
    if args.resume and args.out is None:
        p.error("--resume: pass --out, the folder of the run to continue")
    cli.check_out_dir(p, "--out", "runs/full" if args.out is None else args.out)  # default: a new folder in runs/full
    track.check(p, args)  # --report-to: a tracker that is not installed is one line here
    return args


def check_data_spec(p, flag, spec):
    """A data file that exists and is a file, a glob that matches, 'none' (eval), or a hub name."""
    for item in (s.strip() for s in spec.split(",")) if flag == "--eval-data" else [spec]:
        if item == "none" and flag == "--eval-data":
            continue
        if not item:
            p.error(
                f"{flag} {spec!r}: empty; pass a JSONL/JSON/Parquet file"
                + (", or none" if flag == "--eval-data" else "")
            )
        if any(c in item for c in "*?["):
            if not glob.glob(item):
                p.error(f"{flag} {item}: no file matches; check the pattern")
        elif os.path.isdir(item):
            p.error(f"{flag} {item}: is a folder; pass a JSONL/JSON/Parquet file with 'problem' and 'answer'")
        elif not os.path.exists(item) and (
            item.endswith((".jsonl", ".json", ".parquet")) or not HUB_NAME.fullmatch(item.split(":")[0])
        ):
            p.error(f"{flag} {item}: no such file; pass an existing JSONL/JSON/Parquet file or a hub dataset")


def expand_specs(items):
    """['a.jsonl,b.jsonl', 'dir/*.jsonl', 'none'] -> the list of files / hub names ('none' drops out)."""
    specs = []
    for item in items:
        for spec in (s.strip() for s in item.split(",")):
            if spec and spec != "none":
                specs += sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
    return specs
