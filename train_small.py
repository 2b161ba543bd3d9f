"""train_small.py: D3S on a real `transformers` causal LM with verifiable math rewards, on a CPU.

The second rung: the d3s.py functions of the toy drive a Qwen2-architecture model that answers arithmetic word
problems in \\boxed{}, graded by math-verify. With no arguments it builds a tiny model, warm-starts it with a short
supervised phase (both cached: support/warmstart.py), trains it with D3S, evaluates it on held-out problems and prints a
summary, in minutes on a laptop CPU. One RL step (docs/algorithm.md, section 6): 1 rollout, 2 compute_rewards,
3 d3s.select_samples, 4 forward_kept (d3s.token_entropy of the same logits), 5 d3s.token_scores + d3s.select_tokens,
6 update_policy (d3s.policy_loss per mini-batch, AdamW). With --mini-batches 1 it is on-policy (ratio 1: no clipping,
GSPO = GRPO); with M > 1 the later mini-batches are off-policy. Left out: value functions, reward models, ranks.

    python train_small.py                                  # D3S, tiny model, runs/small/
    python train_small.py --method grpo --loss gspo --mini-batches 4
    python train_small.py --resume                         # continue the killed run in --out
    python train_small.py --model Qwen/Qwen2.5-0.5B-Instruct --max-new-tokens 512 \\
        --train-file data/gsm8k.jsonl --eval-file data/gsm8k.jsonl
    python experiments/small_ladder.py --compare grpo,d3s --seeds 3    # methods x seeds, paired: docs/small_compare.md
"""

import copy
import math
import os
import random
import time

import torch
from tqdm import tqdm

from support import cli, common
import d3s
from support import explain, methods, warmstart, mathtask
from support.grading import Grader, held_out_pass
from support.mathtask import stop_token_ids

PROG = "train_small.py"
TINY_MAX_NEW_TOKENS, HF_MAX_NEW_TOKENS = {"steps": 48, "direct": 16}, 512  # a worked answer + EOS: 34 tokens (tiny)
RUN_FLAGS = (
    "method loss steps seed rl_seed model template hidden_size num_layers train_file train_size sft_steps "
    "sft_shortcut sft_lr sft_batch prompts_per_step group_size n_init n_final k_init k_final static_n static_k "
    "schedule token_rule token_scope min_token_per_response switch_on_spike lr warmup_steps max_grad_norm loss_agg "
    "clip_low clip_high mini_batches task kl_coef temperature max_new_tokens"
).split()  # a resume must repeat them
ADDED_RUN_FLAGS = {"switch_on_spike": 0.0}  # RUN_FLAGS added later, and the value older checkpoints ran with
EPILOG = "Paper recipe (Qwen2.5-Math-7B): G >= 32, N 8 -> 32, K 5% -> 20%, lr 1e-6, clip 0.2/0.28, 3k tokens. The CPU "
EPILOG += "defaults are scaled down; each flag says so."


def build_parser(prog=PROG):
    f, n = cli.flag, cli.number  # one knob a line: f(flag, default, what it may be, help)
    frac, seed = n(float, 0, 1, low_open=True, what="a fraction of tokens in (0, 1]"), n(int, 0, 2**31 - 1)
    group = n(int, 2, 1024, what="an int in [2, 1024] (advantages need 2 rollouts)")
    clip = n(float, 0, 1, high_open=True, what="in [0, 1): the ratio is clipped at 1 - eps_low")
    flags = [
        f("--method", "d3s", None, f"what to train on, a row of methods.LADDER: {', '.join(methods.NAMES)}"),
        f("--loss", "grpo", ["grpo", "gspo"], "policy loss: token ratios (grpo) or the sequence ratio (gspo)"),
        f("--steps", 100, n(int, 1), "RL steps (one optimizer batch of P x G rollouts each)"),
        f("--resume", None, None, "continue from PATH or OUT/checkpoint.pt", nargs="?", const="latest", metavar="PATH"),
        f("--out", "runs/small", None, "run folder: metrics.jsonl, checkpoint.pt, summary.json, final/, explain/"),
        f("--seed", 0, seed, "seed of the tiny model, the generated data and the warm start"),
        f("--rl-seed", None, seed, "seed of the RL run: prompt order, sampling, random selection (default: --seed)"),
        f("--threads", 0, n(int, 0, 1024), "torch CPU threads (0: torch's default)"),
        *warmstart.flags(),  # the model, the data and the supervised warm start: --model, --task, --sft-steps, ...
        f("--prompts-per-step", 16, n(int, 1, 4096), "P: prompts per step (scaled down for CPU)"),
        f("--group-size", 16, group, "G: rollouts per prompt (paper: 32, [inferred] from N_final = 32; scaled down)"),
        f("--n-init", 4, n(int, 1), "N at the first step: rollouts kept per prompt (paper: 8 of 32)"),
        f("--n-final", 16, n(int, 1), "N at the last step (paper: 32 of 32)"),
        f("--k-init", 0.05, frac, "K at the first step (paper: 0.05)"),
        f("--k-final", 0.20, frac, "K at the last step (paper: 0.20)"),
        f("--static-n", None, n(int, 1), "N of d1s, d1s-cross, d2s, pods (default: the schedule's midpoint) (choice)"),
        f("--static-k", None, frac, "K of d2s (default: the midpoint) (choice)"),
        *methods.flags("--schedule", "--token-rule", "--token-scope", "--switch-on-spike", "--min-token-per-response"),
        f("--lr", 5e-5, n(float, 0, 1, low_open=True), "AdamW learning rate (recipe, 7B: 1e-6)"),
        f("--warmup-steps", 10, n(int, 0, what="an int >= 0 (0: no warmup)"), "the RL lr rises over W steps (choice)"),
        f("--max-grad-norm", 1.0, n(float, 0, low_open=True), "gradient clipping (logged before clipping)"),
        f("--loss-agg", None, ["token-mean", "seq-mean-token-mean"], "None: d3s.DEFAULT_AGG of --loss"),
        f("--clip-low", None, clip, "eps_low (default: 0.2 grpo, 3e-4 gspo (GSPO paper))"),
        f("--clip-high", None, n(float, 0, 100), "eps_high (default: 0.28 grpo, DAPO's clip-higher; 4e-4 gspo)"),
        f("--mini-batches", 4, n(int, 1, 4096), "M: updates per batch ([recipe]: verl's 1024 / 256 = 4); 1: on-policy"),
        f("--kl-coef", 0.0, n(float, 0), "beta of the k3 KL penalty to the warm start (recipe: 0)"),
        f("--kl-every", None, n(int, 0), "the KL metric's cadence with --kl-coef 0 (None: --eval-every; 0: never)"),
        f("--temperature", 1.0, n(float, 0.01, 100), "sampling temperature (rollouts and eval samples)"),
        f("--max-new-tokens", None, n(int, 1, 65536), f"None: {TINY_MAX_NEW_TOKENS}, {HF_MAX_NEW_TOKENS} with --model"),
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
    ]
    return cli.parser(prog, __doc__.split("\n\n")[0], flags, epilog=EPILOG)


def parse_args(argv=None, parser=None, method_names=None):
    """The flags, checked together before any work (one line, exit 2), and the defaults that depend on others.
    method_names: the rows the run will train (experiments/small_ladder.py: several); default [--method]."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    args.static_n, args.static_k = methods.check_flags(p, args, method_names or [args.method])  # rows, N <= G, ...
    if args.hidden_size % 4:
        p.error(f"--hidden-size {args.hidden_size}: must be a multiple of 4 in [8, 4096] (4 heads)")
    if args.pass_k > args.eval_samples:
        p.error(
            f"--pass-k {args.pass_k}: must be an int in [1, --eval-samples {args.eval_samples}] (Pass@k needs k <= n)"
        )
    if args.stop_after is not None and args.stop_after > args.steps:
        p.error(f"--stop-after {args.stop_after}: must be an int in [1, --steps {args.steps}]")
    for flag, path in (("--out", args.out), ("--cache-dir", args.cache_dir)):
        cli.check_out_dir(p, flag, path)
    for flag, path in (("--train-file", args.train_file), ("--eval-file", args.eval_file)):
        if path is not None and os.path.isdir(path):
            p.error(f"{flag} {path}: is a folder; pass a JSONL, JSON or Parquet file")
    if args.model is not None:
        cli.check_model(p, args.model)
    args.kl_every = args.eval_every if args.kl_every is None else args.kl_every
    args.mid_eval_samples = min(args.mid_eval_samples or args.eval_samples, args.eval_samples)
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    clip = d3s.CLIP_DEFAULTS[args.loss]  # grpo 0.2 / 0.28 (DAPO's clip-higher), gspo 3e-4 / 4e-4
    args.clip_low, args.clip_high = (
        clip[0] if args.clip_low is None else args.clip_low,
        clip[1] if args.clip_high is None else args.clip_high,
    )
    if args.max_new_tokens is None:
        args.max_new_tokens = HF_MAX_NEW_TOKENS if args.model else TINY_MAX_NEW_TOKENS[args.task]
    warmstart.fill_defaults(args)  # --sft-steps and --template: by --model and --task
    return args


# === The pieces of a step =============================================================================================
@torch.no_grad()
def rollout(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, greedy=False):
    """1) `group_size` responses per prompt (row p*G + g), o_t ~ softmax(logits / T) or greedy: HF generate's loop, with
    each prompt encoded once and its KV cache repeated G times. Returns prompt_ids [B, Lp], prompt_mask (left-padded),
    response_ids [B, T], response_mask (1 up to and including the first EOS) and texts."""
    from transformers import DynamicCache

    enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompt_mask = enc.attention_mask  # [P, Lp], left-padded
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as generate: left padding does not shift positions
    eos = torch.tensor(stop_token_ids(tokenizer, model.generation_config))  # the one rule of every rung
    model.eval()
    cache = DynamicCache()
    logits = model(
        input_ids=enc.input_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # [P, V]: the prefill, once per prompt
    cache.batch_repeat_interleave(group_size)  # the prompt's keys and values, shared by its G rollouts
    logits = logits.repeat_interleave(group_size, 0)  # [B, V]: each row's last logits (an ended row's: stale)
    attention_mask = prompt_mask.repeat_interleave(group_size, 0)  # [live, Lp + t]
    position = positions[:, -1:].repeat_interleave(group_size, 0)  # [live, 1]
    B = logits.shape[0]
    response_ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id)
    ended, live = torch.zeros(B, dtype=torch.bool), torch.arange(B)  # live: the rows still in the cache
    for t in range(max_new_tokens):
        if greedy:
            token = logits.float().argmax(-1)  # [B]
        else:  # over all B rows, ended ones too: the same random draws whichever rows are still live
            token = torch.multinomial((logits.float() / temperature).softmax(-1), 1).squeeze(1)  # o_t ~ pi
        response_ids[:, t] = torch.where(ended, tokenizer.pad_token_id, token)
        ended |= torch.isin(token, eos)
        if bool(ended.all()) or t == max_new_tokens - 1:
            break
        go_on = (~ended[live]).nonzero().squeeze(1)  # an ended row leaves the cache: no more forwards for it
        if len(go_on) < len(live):
            cache.batch_select_indices(go_on)
            live, attention_mask, position = live[go_on], attention_mask[go_on], position[go_on]
        attention_mask = torch.cat([attention_mask, torch.ones(len(live), 1, dtype=attention_mask.dtype)], 1)
        position = position + 1
        logits[live] = model(
            input_ids=token[live, None],
            attention_mask=attention_mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
    response_ids = response_ids[:, : t + 1]  # [B, T]
    is_eos = torch.isin(response_ids, eos)
    response_mask = (~((is_eos.cumsum(-1) - is_eos.long()) > 0)).long()  # 0 strictly after the first EOS
    texts = [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(response_ids, response_mask.sum(-1).tolist())
    ]
    return {
        "prompt_ids": enc.input_ids.repeat_interleave(group_size, 0),
        "prompt_mask": prompt_mask.repeat_interleave(group_size, 0),
        "response_ids": response_ids,
        "response_mask": response_mask,
        "texts": texts,
    }


def compute_rewards(grader, texts, golds):
    """2) 0/1 rewards: math-verify on the last \\boxed{} of each text, killed after the time limit."""
    return torch.tensor(grader.score_batch(texts, golds), dtype=torch.float32)


def forward_logprobs_entropy(model, batch, temperature=1.0, with_entropy=True):
    """log pi(o_t | prompt, o_<t) [B, T] (logits / temperature: the policy that sampled) and the entropy H_t [B, T] of
    the same logits (d3s.token_entropy, no grad). Each distinct prompt is forwarded once, then every response on its
    prompt's keys and values: a plain forward's log-probs and gradients (tested) for about half the positions."""
    from transformers import DynamicCache

    model.train()
    Lp = batch["prompt_ids"].shape[1]
    prompts, row_prompt = torch.unique(
        torch.cat([batch["prompt_ids"], batch["prompt_mask"]], 1), dim=0, return_inverse=True
    )  # [U, 2 Lp] distinct prompts; row b's is row_prompt[b]
    prompt_ids, prompt_mask = prompts[:, :Lp], prompts[:, Lp:]
    first = int(prompt_mask.any(0).int().argmax())  # drop the columns that are padding in every prompt
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp']
    cache = DynamicCache()
    first_logits = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits  # [U, 1, V]: predicts o_1
    for layer in cache.layers:  # each row's prompt keys and values; the backward adds the rows up in a fixed order
        layer.keys, layer.values = layer.keys.index_select(0, row_prompt), layer.values.index_select(0, row_prompt)
    attention_mask = torch.cat([prompt_mask[row_prompt], batch["response_mask"]], 1)  # [B, Lp' + T]
    position_ids = prompt_pos[row_prompt, -1:] + batch["response_mask"].cumsum(-1)  # as cumsum(mask) - 1 above
    logits = model(
        input_ids=batch["response_ids"],
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits  # [B, T, V]: position t predicts o_{t+1}
    logits = torch.cat([first_logits[row_prompt], logits[:, :-1]], 1).float() / temperature  # [B, T, V]: o_1 .. o_T
    logp = logits.log_softmax(-1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)  # [B, T]
    return logp, (d3s.token_entropy(logits) if with_entropy else None)


def take_rows(batch, rows):
    """The rollouts `rows` of a rollout batch, trimmed to their longest response (none: [0, 0])."""
    T = int(batch["response_mask"][rows].sum(-1).max()) if len(rows) else 0
    return {
        "prompt_ids": batch["prompt_ids"][rows],
        "prompt_mask": batch["prompt_mask"][rows],
        "response_ids": batch["response_ids"][rows, :T],
        "response_mask": batch["response_mask"][rows, :T],
    }


def forward_kept(model, ref_model, kept, parts, temperature):
    """4) The kept rollouts before any update: mini-batch 1 with grad (on-policy: its forward gives its old log-probs
    too), mini-batches 2..M without (pass 1), ref_model's log-probs when given. Returns (logp of mini-batch 1, with
    grad; old_logp [B, T]; entropy [B, T]; ref_logp; pass-1 seconds)."""
    B, T = kept["response_ids"].shape
    old_logp, entropy = torch.zeros(B, T), torch.zeros(B, T)
    if not parts:  # nothing kept (dapo-filter on a step without a group with spread): no forward
        return None, old_logp, entropy, None, 0.0
    first = take_rows(kept, parts[0])
    width = first["response_ids"].shape[1]
    first_logp, first_entropy = forward_logprobs_entropy(model, first, temperature)  # [b, width], with grad
    old_logp[parts[0], :width], entropy[parts[0], :width] = first_logp.detach(), first_entropy
    t0 = time.time()
    with torch.no_grad():
        for rows in parts[1:]:
            part = take_rows(kept, rows)
            width = part["response_ids"].shape[1]
            old_logp[rows, :width], entropy[rows, :width] = forward_logprobs_entropy(model, part, temperature)
        ref_logp = forward_logprobs_entropy(ref_model, kept, temperature, with_entropy=False)[0] if ref_model else None
    return first_logp, old_logp, entropy, ref_logp, time.time() - t0


def update_policy(model, optimizer, kept, parts, first_logp, old_logp, kept_adv, token_keep, ref_logp, args):
    """6) The M mini-batches in order, one optimizer step each: d3s.policy_loss over the mini-batch's selected tokens
    (its own normalizer), backward, clip, AdamW; a NaN/inf loss or gradient skips the step (logged)."""
    grad_norms, clip_fracs, losses, kls, skipped = [], [], [], [], 0
    for i, rows in enumerate(parts):
        if not bool(token_keep[rows].any()):  # no selected token in this part: nothing to learn from
            continue
        part = take_rows(kept, rows)
        logp = first_logp if i == 0 else forward_logprobs_entropy(model, part, args.temperature, with_entropy=False)[0]
        width = logp.shape[1]
        loss, stats = d3s.policy_loss(
            logp,
            old_logp[rows, :width],
            kept_adv[rows],
            token_keep[rows, :width],
            kind=args.loss,
            clip_low=args.clip_low,
            clip_high=args.clip_high,
            beta=args.kl_coef,
            agg=args.loss_agg,
            ref_logp=ref_logp[rows, :width] if ref_logp is not None else None,
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
    kl_ref = sum(k * n for k, n in kls) / max(sum(n for _, n in kls), 1.0) if ref_logp is not None else None
    return {"grad_norms": grad_norms, "clip_fracs": clip_fracs, "losses": losses, "skipped": skipped, "kl_ref": kl_ref}


@torch.no_grad()
def kl_ref_all(model, ref_model, batch, temperature=1.0):
    """k3 KL of the policy before the step's update to the warm start on every response token (the same tokens for
    every row)."""
    logp = forward_logprobs_entropy(model, batch, temperature, with_entropy=False)[0]  # [P*G, T]
    ref_logp = forward_logprobs_entropy(ref_model, batch, temperature, with_entropy=False)[0]
    return float(d3s.kl_k3(logp, ref_logp)[batch["response_mask"].bool()].mean())


def step_metrics(step, batch, rewards, keep, adv, n_keep, k_frac, kept, entropy, token_keep, update, grader):
    """The step's line of metrics.jsonl (docs/metrics.md)."""
    grad_norms, response_mask = update["grad_norms"], kept["response_mask"]
    gen_tokens, fwd_tokens, kept_tokens = (
        int(batch["response_mask"].sum()),
        int(response_mask.sum()),
        int(token_keep.sum()),
    )
    return {
        "kind": "train",
        "step": step,
        "reward_mean": float(rewards.mean()),
        "acc_train": float(rewards.mean()),  # the reward is correctness (0/1): the same number
        "groups_mixed": float((rewards.amax(-1) > rewards.amin(-1)).float().mean()),  # groups with signal
        "n_keep": n_keep,
        "k_frac": k_frac,
        "k_real": kept_tokens / max(fwd_tokens, 1),  # of the forwarded tokens
        "kept_samples": int(keep.sum()),
        "sur": d3s.usefulness_rate(adv, keep),  # kept rollouts with A != 0
        "kept_tokens": kept_tokens,
        "fwd_tokens": fwd_tokens,
        "gen_tokens": gen_tokens,  # in the loss, forwarded, generated
        "kept_tokens_frac": kept_tokens / max(gen_tokens, 1),
        "kept_adv_var": d3s.kept_variance(adv, keep),
        "grad_norm": common.mean([g for g in grad_norms if math.isfinite(g)]),  # null: no finite norm this step
        "entropy_mean": float(
            (entropy * response_mask).sum() / response_mask.sum().clamp(min=1)
        ),  # all forwarded tokens
        "entropy_kept": float(entropy[token_keep].mean()) if token_keep.any() else 0.0,  # the selected tokens
        "kl_ref": update["kl_ref"],  # k3 to the warm start on the selected tokens; None where not measured
        "clip_frac": sum(c * n for c, n in update["clip_fracs"]) / max(sum(n for _, n in update["clip_fracs"]), 1),
        "clip_frac_by_minibatch": [c for c, _ in update["clip_fracs"]],
        "loss": common.mean([x for x in update["losses"] if math.isfinite(x)]),  # over optimizer steps; null: none
        "updates": len(grad_norms) - sum(not math.isfinite(g) for g in grad_norms),
        "skipped": update["skipped"] > 0,
        "response_len": gen_tokens / rewards.numel(),
        "grader_timeouts": grader.timeouts,
    }


def step_seed(seed, step, salt=0):
    """Every step (and eval) reseeds from (seed, step): the trajectory depends on neither when evaluations happen nor
    whether the run was resumed."""
    return (seed * 1_000_003 + step * 7_919 + salt) % 2**31


def evaluate(model, tokenizer, grader, eval_rows, step, args):
    """Held-out greedy Pass@1, mean Pass@1 over n samples and unbiased Pass@k (grading.held_out_pass); n is
    --eval-samples at the last step, --mid-eval-samples before it (k <= n)."""
    t0, n = time.time(), args.eval_samples if step == args.steps else args.mid_eval_samples
    torch.manual_seed(step_seed(args.rl_seed, step, 2))
    rows = [{**r, "prompt": mathtask.format_prompt(r["problem"], args.template)} for r in eval_rows]
    sample = lambda prompts, n, greedy: rollout(
        model,
        tokenizer,
        prompts,
        n,
        args.max_new_tokens,
        1.0 if greedy else args.temperature,
        greedy=greedy,
    )["texts"]
    metrics = held_out_pass(rows, sample, grader, n, min(args.pass_k, n), max(1, args.gen_batch // n))
    return {"kind": "eval", "step": step, **metrics, "eval_s": round(time.time() - t0, 3)}


# === The run ==========================================================================================================
def train(args, train_rows, eval_rows, warm):
    """Warm start -> RL with args.method -> held-out evaluations -> summary (dict). Writes into args.out."""
    t_start = time.time()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer, warm_info = common.finite_warm_start(warm, args, train_rows)  # NaN/inf weights, logits: one line
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the warm start: reference of the logged KL
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start_step, totals, history = common.start_run(args, model, optimizer, RUN_FLAGS, PROG, ADDED_RUN_FLAGS)  # --resume
    rl_start, G = time.time(), args.group_size
    with Grader(timeout_s=args.grade_timeout) as grader, common.Preemption(PROG) as notice:  # notice: stop after a step
        if start_step == 0:  # the warm start's evaluation: step 0
            info = {k: v for k, v in warm_info.items() if k != "cached"}
            common.log_eval(args, evaluate(model, tokenizer, grader, eval_rows, 0, args), totals, warm_start=info)
        desc, steps = f"{args.method} ({args.loss}, seed {args.rl_seed})", range(start_step + 1, args.steps + 1)
        bar = tqdm(steps, desc=desc, dynamic_ncols=True, initial=start_step, total=args.steps)
        for step in bar:
            for group in optimizer.param_groups:  # linear warmup: lr * min(1, step / W)
                group["lr"] = args.lr * min(1.0, step / args.warmup_steps) if args.warmup_steps else args.lr
            torch.manual_seed(step_seed(args.rl_seed, step))
            n_prompts = min(args.prompts_per_step, len(train_rows))
            problems = random.Random(step_seed(args.rl_seed, step)).sample(train_rows, n_prompts)
            t0 = time.time()
            # 1) generate G rollouts per prompt, 2) reward them 0/1
            prompts = [mathtask.format_prompt(r["problem"], args.template) for r in problems]
            batch = rollout(model, tokenizer, prompts, G, args.max_new_tokens, args.temperature)
            gen_s, golds = time.time() - t0, [r["answer"] for r in problems for _ in range(G)]
            rewards = compute_rewards(grader, batch["texts"], golds).view(-1, G)  # [P, G]
            reward_s, t1 = time.time() - t0 - gen_s, time.time()
            # 3) select samples: N per prompt by max Var(A) (the row: --method, or its twin once the switch rule fired)
            row = methods.switch_to_intra(args.method, [h["grad_norm"] for h in history], args.switch_on_spike)
            n_keep, k_frac = methods.budget(args, row, step, history=[h["reward_mean"] for h in history])
            gen = torch.Generator().manual_seed(step_seed(args.rl_seed, step, 1))
            keep, adv = d3s.select_samples(rewards, n_keep, methods.LADDER[row].samples, generator=gen)
            kept_rows = keep.view(-1).nonzero().squeeze(-1)  # [B] indices of the kept rollouts
            kept, kept_adv = take_rows(batch, kept_rows), adv.view(-1)[kept_rows]  # [B, T], [B]
            with_kl = common.measures_kl(step, args)
            kl_all = kl_ref_all(model, ref_model, batch, args.temperature) if with_kl else None  # all tokens, a metric
            # 4) forward the kept rollouts only: old log-probs, entropy (and the reference's log-probs on KL steps)
            parts = [rows for rows in torch.arange(len(kept_rows)).tensor_split(args.mini_batches) if len(rows)]
            first_logp, old_logp, entropy, ref_logp, pass1_s = forward_kept(
                model, ref_model if with_kl else None, kept, parts, args.temperature
            )
            # 5) select tokens: the top K of |A| * H over the whole batch
            gen = torch.Generator().manual_seed(step_seed(args.rl_seed, step, 2))
            scores = d3s.token_scores(kept_adv, entropy, rule=methods.TOKEN_RULES[args.token_rule], generator=gen)
            floor = int(args.min_token_per_response)  # each kept response's best token (off: plain top K)
            token_keep = d3s.select_tokens(
                scores, kept["response_mask"], k_frac, scope=args.token_scope, min_per_seq=floor
            )
            # 6) M mini-batches, one optimizer step each: d3s.policy_loss, backward, clip, AdamW
            update = update_policy(
                model, optimizer, kept, parts, first_logp, old_logp, kept_adv, token_keep, ref_logp, args
            )
            m = {
                **step_metrics(
                    step, batch, rewards, keep, adv, n_keep, k_frac, kept, entropy, token_keep, update, grader
                ),
                "kl_ref_all": kl_all,
                "sample_rule": methods.rule_name(row),
                "gen_s": round(gen_s, 3),
                "reward_s": round(reward_s, 3),
                "train_s": round(time.time() - t1, 3),
                "pass1_s": round(pass1_s, 3),
            }
            if args.explain_every and (step == 1 or step % args.explain_every == 0):  # OUT/explain/step_N.html
                page = (tokenizer, problems, batch, rewards, keep, adv, kept_rows, n_keep, k_frac, entropy, scores)
                explain.small_page(os.path.join(args.out, "explain"), step, *page, token_keep, m, args, row)
            common.log_step(args, m, history, totals)  # metrics.jsonl, the run's totals
            bar.set_postfix(reward=f"{m['reward_mean']:.2f}", N=n_keep, K=f"{k_frac:.2f}", gnorm=m["grad_norm"])
            if step % args.eval_every == 0 or step == args.steps:
                common.log_eval(args, evaluate(model, tokenizer, grader, eval_rows, step, args), totals, bar.write)
            if common.end_step(args, step, model, optimizer, RUN_FLAGS, totals, notice, PROG, bar.write):
                return None  # --stop-after: this step's checkpoint; --resume continues
        timeouts = grader.timeouts
    common.export_pretrained(model, tokenizer, os.path.join(args.out, "final"))  # from_pretrained loads it
    lines = common.read_metrics(os.path.join(args.out, "metrics.jsonl"))
    rl_s, wall_s = time.time() - rl_start, time.time() - t_start
    return common.write_summary(args, lines, warm_info, totals, timeouts, rl_s=rl_s, wall_s=wall_s)


def main(argv=None):
    args = parse_args(argv)
    try:  # every bad flag, file, model or checkpoint stops here, before training, with one line
        train_rows, eval_rows = common.fit_prompts(args, *mathtask.load_data(args))  # prompts that fit the context
        if args.resume:  # checked before the warm start: a bad checkpoint stops here
            common.read_resume(args, RUN_FLAGS, PROG, ADDED_RUN_FLAGS)
        with common.out_lock(args.out, PROG):
            return train(args, train_rows, eval_rows, warmstart.load_warm_start(args, train_rows))
    except Exception as e:  # bad input (exit 2) or a full disk (exit 74): one line; anything else is raised on
        common.fail(PROG, e, args.out)


if __name__ == "__main__":
    common.interruptible(main, PROG, "the last checkpoint in --out, if any, is intact; continue with --resume")
