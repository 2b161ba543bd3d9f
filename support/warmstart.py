"""support/warmstart.py: train_small.py's model and data: the task, the tiny model (or any HF model), and the supervised
warm start that RL starts from, cached so that every run of a comparison starts from the very same weights.

    load_warm_start(args, rows)   (model, tokenizer, info): --model or the tiny Qwen2 (support/tiny.py), after --sft-steps of
                                  supervised training on the answers; cached in --cache-dir/warmstart-<hash>/
    FLAGS, fill_defaults(args)    the flags of the model, data and warm start (--model, --task, --sft-*, ...): declared
                                  here, added by train_small.py with one call
    fit_files(args, ...)          --train-file's and --eval-file's prompts that fit the model's context; rows without
                                  an answer (--reward): the warm start skips them, math-verify's evaluation refuses them

The default warm start ships in weights/warmstart-<hash>/ (2.5 MB), so the first run starts RL at once; any other
flags build their own. Rebuild the shipped one (1 thread, ~5 min) with:

    python scripts/build_warmstart.py          # -> weights/warmstart-<hash>/ and its build.json
"""

import hashlib
import inspect
import json
import os
import random
import re
import shutil
import sys
import time
import zlib
from pathlib import Path

import torch

from support import cli, mathtask, run, sampler, templates
from support.cli import UsageError
from support.mathtask import TASKS
from support.templates import format_prompt

# warm-start length per task: a start with headroom (docs/small_compare.md)
TINY_SFT_STEPS = {"steps": 600, "direct": 1000}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (this file is in support/)
SHIPPED_DIR = os.path.join(ROOT, "weights")  # the default's warm start, built once

n = cli.number  # FLAGS: cli.flag entries, which train_small.py adds with *warmstart.FLAGS
FLAGS = [
    cli.flag("--model", None, None, "any HF causal LM instead of the tiny model", metavar="PATH_OR_HUB_NAME"),
    cli.flag(
        "--template",
        "auto",
        ["auto", *templates.TEMPLATES],
        "prompt template (chat: the tokenizer's own; auto: plain for the tiny model, with --model chat, but "
        "qwen-math for Qwen2.5-Math or a tokenizer without a chat template)",
    ),
    cli.flag("--system-prompt", templates.SYSTEM_PROMPT, None, "the system turn of qwen-math and chat prompts"),
    cli.flag(
        "--hidden-size", 128, n(int, 8, 4096, what="a multiple of 4 in [8, 4096] (4 heads)"), "tiny model: hidden size"
    ),
    cli.flag("--num-layers", 4, n(int, 1, 64), "tiny model: transformer layers"),
    cli.flag(
        "--task",
        "steps",
        list(TASKS),
        "the tiny model's generated task: steps (worked solutions, every intermediate result a decision) or direct "
        "(the answer only)",
    ),
    cli.flag(
        "--train-file", None, None, "JSONL/JSON/Parquet with 'problem' and 'answer' (default: the generated task)"
    ),
    cli.flag("--eval-file", None, None, "held-out JSONL/JSON/Parquet (default: generated, disjoint from train)"),
    cli.flag("--train-size", 5000, n(int, 1, 10**6), "training problems (or the first rows of --train-file)"),
    cli.flag("--eval-size", 200, n(int, 1, 10**5), "held-out problems (or the first rows of --eval-file)"),
    cli.flag("--cache-dir", "runs/cache", None, "where the warm-started model is cached"),
    cli.flag(
        "--sft-steps",
        None,
        n(int, 0, 10**6),
        f"supervised warm-start steps (default: tiny model {TINY_SFT_STEPS['steps']} for --task steps, "
        f"{TINY_SFT_STEPS['direct']} for direct; 0 with --model); on the rows with an answer (--reward data "
        "without any: pass 0)",
    ),
    cli.flag(
        "--sft-shortcut",
        0.7,
        n(float, 0, 1, what="a share in [0, 1]"),
        "share of the multi-step demonstrations that box the first step's result: a habit RL can unlearn (0.7: "
        "held-out Pass@1 near 0.35) (choice)",
    ),
    cli.flag("--sft-lr", 1e-3, n(float, 0, 1, low_open=True), "supervised learning rate (linear decay to 10%%)"),
    cli.flag("--sft-batch", 64, n(int, 1, 65536), "supervised batch size"),
]


def fill_defaults(args):
    """The defaults that depend on other flags: --sft-steps and --template."""
    if args.sft_steps is None:
        args.sft_steps = 0 if args.model else TINY_SFT_STEPS[args.task]
    if args.template == "auto":  # the tiny model: plain; --model: chat or qwen-math, by its tokenizer
        args.template = templates.pick_template("auto", _model_tokenizer(args.model), args.model)


def _model_tokenizer(model):
    """--model's tokenizer, or None (the tiny model, or one that does not load: load_base_model says why)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(model)) if model else None
    except (OSError, ValueError):
        return None


def load_base_model(args):
    """(model, tokenizer): --model from a folder or the hub, else a fresh tiny Qwen2 (support/tiny.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here: the grader's child process re-imports the rung

    if args.model is None:
        from support.tiny import build_char_tokenizer, build_tiny_model

        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
        return sampler.shared_kv_attention(model), tokenizer
    path = os.path.expanduser(args.model)
    looks_like_path = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1 or 2 * os.sep in args.model
    if looks_like_path and not os.path.isdir(path):
        raise UsageError(
            f"--model {args.model}: no such folder; pass a folder with config.json (save_pretrained) or a hub name"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        probe = format_prompt("What is 1 + 1?", args.template, tokenizer, args.system_prompt)
        empty = not tokenizer(probe, add_special_tokens=False).input_ids
        model = None if empty else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(
            f"--model {args.model}: cannot load it ({first_line}); pass a local folder with config.json, "
            f"or a hub name with internet access"
        ) from e
    if empty:
        raise UsageError(
            f"--model {args.model}: its tokenizer encodes a prompt to no tokens; pass a folder whose "
            "tokenizer matches its model (tokenizer.save_pretrained of the model's own tokenizer)"
        )
    tokenizer.padding_side = "left"  # generation appends to the right of every prompt
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return sampler.shared_kv_attention(model), tokenizer


def fit_files(args, train_rows, eval_rows, prog="train_small.py"):
    """--train-file's and --eval-file's rows whose prompt fits the model's context less --max-new-tokens
    (mathtask.fit_prompts, before any work): a longer one stops the run with one line (file:line, length, limit;
    exit 2) or, with --drop-long-prompts (choice), is left out and counted (args.dropped_long_prompts: summary.json).
    The generated task's prompts are short by construction; a model that does not load is load_base_model's. Rows
    without an answer (a --reward run's): check_answers first."""
    args.dropped_long_prompts = 0
    check_answers(args, train_rows, eval_rows)
    given = (("--train-file", args.train_file, train_rows), ("--eval-file", args.eval_file, eval_rows))
    files = [(flag, path, rows) for flag, path, rows in given if path]
    if args.model is None:
        from support import tiny  # (the tiny model's tokenizer and context)

        tokenizer = tiny.build_char_tokenizer()
        window = inspect.signature(tiny.build_tiny_model).parameters["max_position_embeddings"].default
    else:
        from transformers import AutoConfig, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.model))
            window = getattr(AutoConfig.from_pretrained(os.path.expanduser(args.model)), "max_position_embeddings", 0)
        except (OSError, ValueError):
            return train_rows, eval_rows
    templates.check_template(args.template, tokenizer)  # markup the tokenizer does not know: one line
    fitted = {}
    for flag, path, rows in files:
        fitted[flag], dropped = mathtask.fit_prompts(
            rows,
            template=args.template,
            tokenizer=tokenizer,
            window=window,
            budget=("--max-new-tokens", args.max_new_tokens),
            drop=getattr(args, "drop_long_prompts", False),
            name=f"{flag} {path}",
            system_prompt=args.system_prompt,
        )
        if dropped:
            limit = window - args.max_new_tokens
            left = f"left out {dropped} of the {len(rows)} rows of {path} (prompts longer than {limit} tokens)"
            print(f"{prog}: --drop-long-prompts: {left}", file=sys.stderr, flush=True)
        args.dropped_long_prompts += dropped
    return fitted.get("--train-file", train_rows), fitted.get("--eval-file", eval_rows)


def check_answers(args, train_rows, eval_rows):
    """The rows a --reward run may give without an answer, before any work: the supervised warm start learns from the
    rows with one (sft_rows), and math-verify's held-out evaluation needs one in every row; else one line (exit 2)."""
    if args.sft_steps and not sft_rows(train_rows):
        raise UsageError(
            f"--sft-steps {args.sft_steps}: the supervised warm start needs rows with an answer, and no row of "
            f"--train-file {args.train_file} has one; pass --sft-steps 0 (RL from the model as it is: --model) or an "
            "--answer-key"
        )
    missing = next((r for r in eval_rows if not r.get("answer")), None)
    if missing and getattr(args, "eval_reward", "math-verify") == "math-verify":
        raise UsageError(
            f"{missing.get('where', '--eval-file')}: no answer, which the held-out evaluation by math-verify needs; "
            "pass --eval-reward train (your --reward's function) or an --eval-file with answers"
        )


def sft_rows(rows):
    """The rows the supervised warm start learns from: those with an answer (a --reward run's data may lack it)."""
    return [r for r in rows if r.get("answer")]


def warm_start_key(args, train_rows):
    """Everything the warm-started weights depend on; its hash names the cache folder."""
    data = hashlib.sha256(
        json.dumps([[r["problem"], sft_target(r, args.sft_shortcut)] for r in sft_rows(train_rows)]).encode()
    ).hexdigest()
    return {
        "model": args.model or f"tiny-qwen2-h{args.hidden_size}-l{args.num_layers}",
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "sft_lr": args.sft_lr,
        "sft_batch": args.sft_batch,
        "template": args.template,
        **({} if args.system_prompt == templates.SYSTEM_PROMPT else {"system_prompt": args.system_prompt}),
        "train_data": data[:16],
        "version": 2,
    }


def warm_start_path(args, train_rows):
    """The cache folder of this warm start: --cache-dir/warmstart-<12 hex digits of its key's hash>."""
    key = json.dumps(warm_start_key(args, train_rows), sort_keys=True).encode()
    return os.path.join(args.cache_dir, "warmstart-" + hashlib.sha256(key).hexdigest()[:12])


def load_warm_start(args, train_rows):
    """(model, tokenizer, info): the base model after --sft-steps of supervised training, cached in
    CACHE_DIR/warmstart-<hash>/ with save_pretrained; one of the same hash in weights/ is loaded from
    there instead of being built."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    if not sys.stderr.isatty():  # a log file: transformers' own bars would be \r frames (run.progress_bar: lines)
        logging.disable_progress_bar()

    if args.sft_steps == 0:
        model, tokenizer = load_base_model(args)
        return model, tokenizer, {"sft_steps": 0, "path": args.model or "tiny (fresh)"}
    path = warm_start_path(args, train_rows)
    for folder in (path, os.path.join(SHIPPED_DIR, os.path.basename(path))):
        record = Path(folder, "warmstart.json")
        if record.exists():
            info = json.loads(record.read_text())
            tokenizer = AutoTokenizer.from_pretrained(folder)
            tokenizer.padding_side = "left"
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            return sampler.shared_kv_attention(model), tokenizer, {**info, "cached": True}
    model, tokenizer, info, _ = build_warm_start(args, train_rows, path)
    return model, tokenizer, {**info, "cached": False}


def build_warm_start(args, train_rows, path, record_path=None):
    """Train the warm start and save it into `path` (atomically; info's path: record_path or path); returns (model,
    tokenizer, info, losses)."""
    model, tokenizer = load_base_model(args)
    t0 = time.time()
    losses = supervised_warm_start(model, tokenizer, train_rows, args)
    info = {
        **warm_start_key(args, train_rows),
        "path": record_path or path,
        "sft_loss_first": losses[0],
        "sft_loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "sft_s": round(time.time() - t0, 1),
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    tmp = path + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    Path(tmp, "warmstart.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # atomic: a half-written cache folder is never picked up
    return model, tokenizer, info, losses


def supervised_warm_start(model, tokenizer, train_rows, args, max_steps=None):
    """Teacher-forced cross-entropy on sft_target(row) + <eos> after each prompt (prompt tokens masked), over the rows
    with an answer (sft_rows); the losses. max_steps: stop after the first steps of the --sft-steps schedule
    (tests/test_warmstart_shipped.py)."""
    rng = random.Random(args.seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    eos = [tokenizer.eos_token_id]
    examples = [  # (prompt token ids, target token ids)
        (
            encode(format_prompt(row["problem"], args.template, tokenizer, args.system_prompt)),
            encode(sft_target(row, args.sft_shortcut)) + eos,
        )
        for row in sft_rows(train_rows)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.01)
    warmup_then_decay = lambda s: min(1.0, (s + 1) / 20) * (1 - 0.9 * s / args.sft_steps)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    model.train()
    losses = []
    steps = args.sft_steps if max_steps is None else min(max_steps, args.sft_steps)
    for _ in (bar := run.progress_bar(range(steps), desc="warm start (supervised)")):
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

    With `shortcut` > 0, that share of the multi-step solutions (chosen by a hash of the problem) works every step
    out but boxes the first step's result: '47+8=55. 55-13=42. \\boxed{55}'. The warm-started model then has a habit
    the reward punishes and RL can unlearn: which result to copy into the box, one decision per response
    (--sft-shortcut). One-step problems (level 1) are unaffected: their first result is the answer.
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
        input_ids[i, length - len(prompt) - len(target) :] = torch.tensor(prompt + target)
        labels[i, length - len(target) :] = torch.tensor(target)
        attention_mask[i, length - len(prompt) - len(target) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate does for left padding
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}
