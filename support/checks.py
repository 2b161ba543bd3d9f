"""support/checks.py: what both trainers refuse before any work, each time with one line (exit 2) naming the fix.

    check_run           the flags both trainers share, checked together: --stop-after, the method (methods.check_flags),
                        the loss's aggregation and clip range where not given
    check_args          train_full.py's flags together and its paths (its machine: engines.check_machine)
    fit_prompts         train_small.py's --train-file / --eval-file prompts that fit the model's context (and
                        load_inputs', for train_full.py): mathtask.fit_context, a longer one named with file:line
    check_finite        NaN or inf in a model's weights or in the logits of its first forward, both trainers
    check_finite_files  the same in a saved model's files (train_full.py --eval-only), each rank its share
    load_inputs         train_full.py's tokenizer, prompts and benchmarks, read on every rank before the process group
                        exists, so that a bad model folder or data file stops every rank at once

The checks of one flag (its range, its choices) are in its declaration (support/cli.py).
"""

import glob
import inspect
import itertools
import os
import re
import sys

import torch

import d3s
from support import cli, grading, methods, stops
from support.cli import UsageError
from support.mathtask import DataError, fit_context, format_prompt, load_problems, stop_token_ids

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
    prompt = format_prompt(train_rows[0]["problem"], args.template)
    check_finite(model, name, tokenizer(prompt, add_special_tokens=False).input_ids)
    return warm


def fit_prompts(args, train_rows, eval_rows, prog="train_small.py"):
    """train_small.py's --train-file and --eval-file rows whose prompt fits the model's context less --max-new-tokens
    (mathtask.fit_context, before any work): a longer one stops the run with one line (file:line, length, limit; exit
    2) or, with --drop-long-prompts (choice), is left out and counted (args.dropped_long_prompts: summary.json). The
    generated task's prompts are short by construction; a model that does not load is warmstart.load_base_model's."""
    args.dropped_long_prompts = 0
    given = (("--train-file", args.train_file, train_rows), ("--eval-file", args.eval_file, eval_rows))
    files = [(flag, path, rows) for flag, path, rows in given if path]
    if not files:
        return train_rows, eval_rows
    if args.model is None:
        from support import tiny  # (the tiny model's tokenizer and context)

        tokenizer = tiny.build_char_tokenizer()
        window = inspect.signature(tiny.build_tiny_model).parameters["max_position_embeddings"].default
    else:
        from transformers import AutoConfig, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.model))
            config = AutoConfig.from_pretrained(os.path.expanduser(args.model))
            window = getattr(config, "max_position_embeddings", None)
        except (OSError, ValueError):
            return train_rows, eval_rows
    if not window:  # a model without a position limit: nothing to check
        return train_rows, eval_rows
    if args.max_new_tokens >= window:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens}: the model's context is {window} positions "
            "(max_position_embeddings), prompt included; lower it"
        )
    limit = window - args.max_new_tokens
    why = f"the model's context of {window} positions less --max-new-tokens {args.max_new_tokens}"
    fitted = {}
    drop = getattr(args, "drop_long_prompts", False)
    prompt = lambda r: format_prompt(r["problem"], args.template)
    for flag, path, rows in files:
        fitted[flag], dropped = fit_context(rows, prompt, tokenizer, limit, why, drop=drop)
        if not fitted[flag]:
            raise DataError(f"{flag} {path}: no prompt fits in {limit} tokens ({why}); shorten them or raise the limit")
        if dropped:
            left = f"left out {dropped} of the {len(rows)} rows of {path} (prompts longer than {limit} tokens)"
            print(f"{prog}: --drop-long-prompts: {left}", file=sys.stderr, flush=True)
        args.dropped_long_prompts += dropped
    return fitted.get("--train-file", train_rows), fitted.get("--eval-file", eval_rows)


# === train_full.py ====================================================================================================
def check_args(p, args, ranks):
    """The checks of several flags together and of the paths, before any work (no model, data or process group yet);
    fills in the defaults that depend on other flags (check_run's, --kl-every, the grader's workers, device, dtype)."""
    check_run(p, args, [args.method])  # --stop-after, the method, N <= G, the switch rule; loss and clip defaults
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
    cli.check_out_dir(p, "--out", args.out)
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


def load_inputs(args):
    """(tokenizer, stop_ids, prompts (None with --eval-only), eval sets, a note on what was dropped); exit 2 on every
    rank for a bad one. The prompts fit the context less --max-response-len (mathtask.fit_context); --max-prompt-len,
    a budget, drops (and counts) those that fit but are longer."""
    import transformers
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoConfig

    from support.engines import context_length
    from support.fsdp import load_generation_config, load_tokenizer

    transformers.utils.logging.disable_progress_bar()  # one bar per rank and model load would flood the log
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # offline, the hub's retries would print a line each
    try:
        tokenizer = load_tokenizer(args.model)
        generation_config = load_generation_config(args.model)
    except (OSError, ValueError) as e:  # not a model folder, not on the hub (or offline), no tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--model {args.model}: cannot load its tokenizer ({first}); pass a folder with config.json "
            "and the tokenizer files, or a hub name"
        ) from None
    finally:
        hub_logging.set_verbosity(verbosity)
    if not tokenizer(format_prompt("What is 1 + 1?", args.template), add_special_tokens=False)["input_ids"]:
        raise UsageError(
            f"--model {args.model}: its tokenizer encodes a prompt to no tokens; pass a folder whose "
            "tokenizer matches its model (tokenizer.save_pretrained of the model's own tokenizer)"
        )
    stop_ids = stop_token_ids(tokenizer, generation_config)
    eval_sets = _load_eval_sets(args, tokenizer, context_length(args.model, args))
    if args.eval_only:
        return tokenizer, stop_ids, None, eval_sets, ""
    rows, dropped = load_problems(args.train_data, drop_missing=True)
    window, args.dropped_long_prompts = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", 0), 0
    if window and window > args.max_response_len:  # else no limit, or none left for a prompt: not this check's to say
        why = f"the model's context of {window} positions less --max-response-len {args.max_response_len}"
        prompt = lambda r: format_prompt(r["problem"], args.template)
        limit, drop = window - args.max_response_len, args.drop_long_prompts
        rows, args.dropped_long_prompts = fit_context(rows, prompt, tokenizer, limit, why, drop=drop)  # in args.json
    prompts, too_long = _encode_prompts(rows, tokenizer, args.template, args.max_prompt_len)
    if not prompts:
        raise UsageError(
            f"--max-prompt-len {args.max_prompt_len}: no prompt of {args.train_data} is that short "
            f"({too_long} longer); raise it"
        )
    n_long = args.dropped_long_prompts
    over_context = f", {n_long} longer than the model's context dropped (--drop-long-prompts)" if n_long else ""
    note = (
        f"{len(prompts)} prompts ({dropped} rows without an answer dropped, {too_long} longer than "
        f"{args.max_prompt_len} tokens dropped{over_context})"
    )
    return tokenizer, stop_ids, prompts, eval_sets, note


def _load_eval_sets(args, tokenizer, context):
    """Every --eval-data benchmark, read and tokenized: [(name, problems, rows without an answer, prompts too long)]."""
    sets = []
    for spec in args.eval_data:
        rows, dropped = load_problems(spec, drop_missing=True, limit=args.eval_limit or None)
        problems, too_long = _encode_prompts(rows, tokenizer, args.template, max_prompt_len=context - 1)
        name = os.path.splitext(os.path.basename(spec))[0] if os.path.exists(spec) else spec
        sets.append((name, problems, dropped, too_long))
    return sets


def _encode_prompts(rows, tokenizer, template, max_prompt_len):
    """Apply the template and tokenize; prompts longer than max_prompt_len are dropped and counted."""
    out, too_long = [], 0
    for row in rows:
        ids = tokenizer(format_prompt(row["problem"], template), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_len:
            too_long += 1
            continue
        out.append({"id": row["id"], "problem": row["problem"], "answer": row["answer"], "prompt_ids": ids})
    return out, too_long
