"""experiments/dropped_tokens.py: which tokens D3S's token level drops, and how much of the gradient the kept ones carry.

Question 6 of issue 18 (reviewer 3): do the tokens D3S masks out carry less information? On the tiny rung
(train_small.py), it replays the first half of train_small's step S (the same functions, nothing
re-implemented) on --batches B fresh batches and compares the response tokens of the kept rollouts that the
token level selects with the ones it drops.

    .venv/bin/python experiments/dropped_tokens.py        # train_small's default warm start, built (minutes) or loaded
                                                    # from runs/cache; d3s at step 1 of 100 (N 4 of 16, K 5%), 4 batches
    .venv/bin/python experiments/headroom.py --sft-shortcut 0.5   # builds runs/cache/warmstart-4028f0221846, then:
    .venv/bin/python experiments/dropped_tokens.py --model runs/cache/warmstart-4028f0221846   # that warm start
                                                    # (--sft-shortcut 0.5: runs 1 and 2 of docs/dropped_tokens.md)
    .venv/bin/python experiments/dropped_tokens.py --model runs/small/final --step 100 --out runs/dropped.md \\
        --explain-out runs/dropped_example.md
    .venv/bin/python experiments/dropped_tokens.py --model M --method d2s --token-rule entropy     # another row or rule

Batch b (0..B-1) is train_small.py's step S with --rl-seed SEED + b, up to its update (train_small.train's loop):
sampler.sample of P x G responses to P problems of mathtask.TASKS[--task] (the problems and the sampling
seeded as that step's), train_small.grade (grading.Grader), N and K from d3s.method_budget (the
method's budget at step S of --steps; linear schedule), d3s.select_samples, one sampler.logprobs_entropy
of the kept rollouts (its entropy is d3s.token_entropy), d3s.token_scores and d3s.select_tokens over the whole
kept batch. The weights are never updated: every batch is scored by the same model.

Tables (all over the kept rollouts' response tokens, up to and including EOS; "selected" = token_keep,
"dropped" = the other response tokens of the kept rollouts; "dropped, A != 0": the dropped tokens of rollouts
whose advantage is not zero, i.e. dropped for a low score rather than for a zero advantage):
  1 tokens    count and share; entropy H (nats, of the policy that sampled: logits / temperature) mean and
              median; |A| mean; the share with A = 0; the score |A| * H mean; relative position t / L mean
              (t = 0 the first response token, L the response length with its EOS)
  2 position  t / L in 5 bins: each bin's share of the selected and of the dropped tokens, and the share of
              the bin's tokens that are selected
  3 class     the character class of the token's decoded text (below): its share among the selected and
              among the dropped tokens (each column sums to 1), and the share of the class's tokens selected
  4 gradient  per batch, the gradient of d3s.policy_loss (GRPO, token-mean) w.r.t. all model parameters
              (flattened), on-policy (old log-probs = the detached forward: ratio 1, as mini-batch 1 of
              train_small's update, here over all kept rollouts at once), with mask = every response token
              (g_all), the selected tokens (g_sel), a random selection of as many tokens (g_rand:
              d3s.token_scores rule "random" with a seeded generator, then d3s.select_tokens with the same K
              and scope; --random-draws R of them, each column the mean over the R), and the dropped
              tokens (g_drop):
                cos(sel, all), cos(rand, all), cos(drop, all)   cosine similarity with g_all
                cos(sel, drop)                                  how the selected and the dropped tokens' gradients
                                                                relate (0: orthogonal)
                ‖sel‖ / ‖all‖, ‖rand‖ / ‖all‖                   norm ratio. token-mean divides each loss by its
                                                                own token count, so this is per token
                                                                (the mean gradient of a selected token against
                                                                that of any token). A mean over fewer tokens
                                                                cancels less, so a random selection's ratio is
                                                                above 1 as well: compare sel with rand
                sum ‖sel‖ / ‖all‖, sum ‖rand‖ / ‖all‖,          the same for the summed (un-normalised) gradients:
                sum ‖drop‖ / ‖all‖                              the ratio times n_sel / n_all (n_drop / n_all)
              g_drop is not another backward: n_all g_all = n_sel g_sel + n_drop g_drop (summed gradients add).
              A cosine or ratio whose gradient is zero (no token, or A = 0 everywhere) prints as "–".

Character classes (choice; the tiny model's tokenizer is one token per character, so on the tiny rung each
class is exact; on a BPE tokenizer a token counts by its whole text):
  eos       a stop token (templates.stop_token_ids)
  format    a token inside a "\\boxed{" of the response, a "}", a ".", or a space: the answer's wrapper and
            the separators of the worked steps ("47+8=55. 55-13=42. \\boxed{42}")
  digit     digits only (surrounding spaces ignored): the numbers, intermediate results and the answer
  operator  one of + - = * / only: "=" counts as an operator, not as format (choice)
  other     anything else (letters outside \\boxed{, newlines, ...)

--explain-out FILE.md writes a worked example: from batch 0, the kept rollout with the highest and the one with
the lowest advantage among those with a selected token, the text with the selected tokens in [[ ]] (a run of
consecutive selected tokens shares one pair), reward, advantage, and a table of its tokens: entropy, score, class.

The figures are a measurement on one model and a few batches, not a test: they move with the model, the step
and the machine (sampling in float32 on another CPU draws other tokens).
"""

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
from support import stops  # noqa: E402

PROG = "dropped_tokens.py"
CLASSES = ("digit", "operator", "format", "eos", "other")
OPERATORS, FORMAT_CHARS, BOXED = set("+-=*/"), set(".}"), "\\boxed{"
BINS = 5  # relative-position histogram
SHOWN_TOKENS = 60  # worked example: at most this many tokens in a rollout's table


# ---------------------------------------------------------------------------------------------
# Arguments: every flag checked before any model or data work
# ---------------------------------------------------------------------------------------------
def parse_args(argv):
    """Every flag, before any model or data work (one line, exit 2). The defaults the script shares with
    train_small.py are train_small's own (read from its parser)."""
    import train_small
    from support import methods

    d = vars(train_small.build_parser().parse_args([]))  # train_small's defaults
    f, n = cli.flag, cli.number
    frac, seed = n(float, 0, 1, low_open=True, what="a fraction of tokens in (0, 1]"), n(int, 0, 2**31 - 1)
    group = n(int, 2, 1024, what="an int in [2, 1024] (advantages need 2 rollouts)")
    flags = [
        f("--model", None, None, "a saved model folder (default: train_small's warm start)", metavar="PATH"),
        f("--cache-dir", "runs/cache", None, "without --model: where train_small's warm start is cached"),
        f("--method", "d3s", methods.NAMES, "a row of methods.LADDER"),
        f("--steps", d["steps"], n(int, 1), "the run's length the schedule is read on (train_small's)"),
        f("--step", 1, n(int, 1), "S: the step whose N and K are used and whose seeds batch 0 replays (1-based)"),
        f("--batches", 4, n(int, 1, 10_000), "B: batches of P x G rollouts"),
        f("--prompts-per-step", d["prompts_per_step"], n(int, 1, 4096), "P (train_small's)"),
        f("--group-size", d["group_size"], group, "G (train_small's)"),
        f("--n-init", d["n_init"], n(int, 1), "N at the first step (train_small's)"),
        f("--n-final", d["n_final"], n(int, 1), "N at the last step (train_small's)"),
        f("--k-init", d["k_init"], frac, "K at the first step (train_small's)"),
        f("--k-final", d["k_final"], frac, "K at the last step (train_small's)"),
        f("--k", None, frac, "fix K instead of the method's budget (1.0: every token; a method with a token level)"),
        f("--random-draws", 4, n(int, 1, 1000), "R: random selections per batch, the gradient's reference"),
        f("--token-rule", "adv-entropy", list(methods.TOKEN_RULES), "d3s.token_scores rule (adv-entropy: |A| * H)"),
        f("--token-scope", "batch", ["batch", "sequence"], "top K over the whole batch or per response"),
        f("--task", d["task"], ["steps", "direct"], "train_small's generated task"),
        f("--train-size", d["train_size"], n(int, 1, 10**6, what="an int in [1, 10^6]"), "train_small's problems"),
        f("--template", "auto", ["auto", "plain", "qwen-math"], "auto: the warm start's (warmstart.json), else plain"),
        f("--temperature", d["temperature"], n(float, 0.01, 100), "sampling temperature (train_small's)"),
        f("--max-new-tokens", None, n(int, 1, 65536), f"default: train_small's, {train_small.TINY_MAX_NEW_TOKENS}"),
        f("--grade-timeout", d["grade_timeout"], n(float, 0, 3600, low_open=True), "seconds per answer"),
        f("--seed", 0, seed, "train_small's --seed; batch b's --rl-seed is SEED + b"),
        f("--threads", 1, n(int, 0, 1024), "torch CPU threads (0: torch's default)"),
        f("--out", None, cli.out_file, "also write the markdown report to FILE", metavar="FILE"),
        f("--explain-out", None, cli.out_file, "write a worked example (markdown) to FILE.md", metavar="FILE.md"),
    ]
    p = cli.parser(PROG, __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    if args.model is not None:
        cli.check_model(p, args.model)
    else:
        cli.check_out_dir(p, "--cache-dir", args.cache_dir)
    if args.out and args.explain_out and os.path.abspath(args.out) == os.path.abspath(args.explain_out):
        p.error(f"--explain-out {args.explain_out}: the same file as --out; pass another file")
    if args.max_new_tokens is None:
        args.max_new_tokens = train_small.TINY_MAX_NEW_TOKENS[args.task]
    check_budget(p, args)
    if args.template == "auto":
        args.template = warm_start_template(args.model)
    return args


def check_budget(p, args):
    """The step, N and K together: --step within --steps, N <= G, --k only where the method selects tokens; then
    the budget at step S (args.n_keep, args.k_frac), as train_small reads it."""
    import d3s
    from support import methods

    if args.step > args.steps:
        p.error(f"--step {args.step}: must be in [1, --steps {args.steps}]")
    if args.k is not None and not methods.selects_tokens(args.method):
        p.error(
            f"--k {args.k}: --method {args.method} has no token level (it trains on every token); drop --k or pick "
            f"a method that selects tokens ({', '.join(m for m in methods.NAMES if methods.selects_tokens(m))})"
        )
    if methods.LADDER[args.method].n != "all":
        for flag, value in (("--n-init", args.n_init), ("--n-final", args.n_final)):
            if value > args.group_size:
                p.error(
                    f"{flag} {value} > --group-size {args.group_size}: N counts rollouts kept per prompt and must be "
                    f"<= G; lower {flag} or raise --group-size"
                )
    try:
        args.n_keep, args.k_frac = d3s.method_budget(
            methods.LADDER[args.method],
            step=args.step - 1,
            total_steps=args.steps,
            group_size=args.group_size,
            n_init=args.n_init,
            n_final=args.n_final,
            k_init=args.k_init,
            k_final=args.k_final,
        )
    except ValueError as e:
        p.error(f"--method {args.method}: {' '.join(str(e).split())}")
    if args.k is not None:
        args.k_frac = args.k


def warm_start_template(model):
    """The template the warm start was trained with (its warmstart.json), else plain (the tiny rung's)."""
    import json

    path = os.path.join(model, "warmstart.json") if model else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                return json.load(f).get("template", "plain")
        except (OSError, ValueError):
            pass
    return "plain"


# ---------------------------------------------------------------------------------------------
# The model, and one batch: train_small's step up to its update
# ---------------------------------------------------------------------------------------------
def load_model(args, train_rows):
    """(model, tokenizer, where it came from): --model through warmstart.load_base_model, else train_small's
    default warm start through warmstart.load_warm_start (cached in --cache-dir)."""
    import train_small
    from support import warmstart

    flags = [
        "--seed",
        str(args.seed),
        "--task",
        args.task,
        "--train-size",
        str(args.train_size),
        "--cache-dir",
        args.cache_dir,
    ]
    ts = train_small.parse_args(flags + (["--model", args.model] if args.model else []), train_small.build_parser(PROG))
    if args.model:
        model, tokenizer = warmstart.load_base_model(ts)  # a folder: AutoModelForCausalLM, fp32, left padding
        return model, tokenizer, args.model
    model, tokenizer, info = warmstart.load_warm_start(ts, train_rows)
    return (
        model,
        tokenizer,
        f"{info['path']} (train_small's default warm start{', cached' if info.get('cached') else ''})",
    )


def one_batch(model, tokenizer, grader, train_rows, b, args):
    """Batch b: train_small's step --step with --rl-seed SEED + b, through token selection, and the gradients."""
    import random

    import torch

    import d3s
    import train_small
    from support import methods, sampler, templates

    seed, step, P, G = args.seed + b, args.step, args.prompts_per_step, args.group_size
    torch.manual_seed(train_small.step_seed(seed, step))
    problems = random.Random(train_small.step_seed(seed, step)).sample(train_rows, min(P, len(train_rows)))
    P = len(problems)
    batch = sampler.sample(
        model,
        tokenizer,
        [templates.format_prompt(r["problem"], args.template, tokenizer) for r in problems],
        G,
        args.max_new_tokens,
        args.temperature,
    )
    rewards = train_small.grade(batch, problems, grader)  # [P, G]
    keep, adv = d3s.select_samples(
        rewards,
        args.n_keep,
        methods.LADDER[args.method].samples,
        generator=torch.Generator().manual_seed(train_small.step_seed(seed, step, 1)),
    )
    kept_rows = keep.view(-1).nonzero().squeeze(-1)
    kept = sampler.take_rows(batch, kept_rows)
    kept_adv = adv.view(-1)[kept_rows]
    out = {
        "problems": problems,
        "rewards": rewards,
        "keep": keep,
        "kept_rows": kept_rows,
        "kept": kept,
        "kept_adv": kept_adv,
        "texts": batch["texts"],
    }
    if not len(kept_rows):  # dapo-filter on a batch without spread: nothing forwarded
        out.update(
            entropy=torch.zeros(0, 0),
            scores=torch.zeros(0, 0),
            token_keep=torch.zeros(0, 0, dtype=torch.bool),
            grads=None,
        )
        return out

    logp, entropy = sampler.logprobs_entropy(model, kept, args.temperature)  # with grad, as mini-batch 1
    mask = kept["response_mask"]
    score_gen = torch.Generator().manual_seed(
        train_small.step_seed(seed, step, 2)
    )  # train_small's stream for rule random/adv
    scores = d3s.token_scores(kept_adv, entropy, rule=methods.TOKEN_RULES[args.token_rule], generator=score_gen)
    token_keep = d3s.select_tokens(scores, mask, args.k_frac, scope=args.token_scope)
    rand_keeps = []  # the reference: --random-draws random selections of as many tokens, each a stream of its own
    for d in range(args.random_draws):
        rand_gen = torch.Generator().manual_seed(train_small.step_seed(seed, step, 3 + d))
        rand_keeps.append(
            d3s.select_tokens(
                d3s.token_scores(kept_adv, entropy, rule=methods.random_scores, generator=rand_gen),
                mask,
                args.k_frac,
                scope=args.token_scope,
            )
        )
        assert int(rand_keeps[-1].sum()) == int(token_keep.sum()), (int(rand_keeps[-1].sum()), int(token_keep.sum()))

    params = [q for q in model.parameters() if q.requires_grad]
    old = logp.detach()  # on-policy: ratio 1

    def grad(m):
        loss, _ = d3s.policy_loss(logp, old, kept_adv, m, kind="grpo", agg="token-mean")
        g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return torch.cat(
            [(x if x is not None else torch.zeros_like(q)).reshape(-1) for x, q in zip(g, params)]
        ).double()

    n_all, n_sel = int(mask.sum()), int(token_keep.sum())
    g_all, g_sel, g_rand = grad(mask), grad(token_keep), [grad(m) for m in rand_keeps]
    n_drop = n_all - n_sel
    g_drop = (n_all * g_all - n_sel * g_sel) / n_drop if n_drop else None  # summed gradients add
    out.update(
        entropy=entropy,
        scores=scores,
        token_keep=token_keep,
        grads={"n_all": n_all, "n_sel": n_sel, "all": g_all, "sel": g_sel, "rand": g_rand, "drop": g_drop},
    )
    return out


# ---------------------------------------------------------------------------------------------
# Token classes and the measures
# ---------------------------------------------------------------------------------------------
def token_classes(pieces, is_eos):
    """The class of each token of one response (CLASSES; see the module docstring), from the decoded text of
    each token alone (pieces) and whether it is a stop token."""
    text_pieces = ["" if e else s for s, e in zip(pieces, is_eos)]
    starts, pos = [], 0
    for s in text_pieces:
        starts.append(pos)
        pos += len(s)
    text = "".join(text_pieces)
    boxed = []  # [start, end) of every "\boxed{" of the response
    i = text.find(BOXED)
    while i >= 0:
        boxed.append((i, i + len(BOXED)))
        i = text.find(BOXED, i + 1)
    classes = []
    for s, e, start in zip(pieces, is_eos, starts):
        core = s.strip(" ")
        if e:
            classes.append("eos")
        elif s and any(a <= start and start + len(s) <= z for a, z in boxed):
            classes.append("format")
        elif core == "" and s:
            classes.append("format")  # spaces
        elif core.isdigit() and core.isascii():
            classes.append("digit")
        elif set(core) <= OPERATORS:
            classes.append("operator")
        elif set(core) <= FORMAT_CHARS:
            classes.append("format")
        else:
            classes.append("other")
    return classes


def collect_tokens(out, tokenizer, eos_ids):
    """One record per response token of the kept rollouts: (selected, H, |A|, score, t / L, class, position bin)."""
    records = []
    kept, token_keep = out["kept"], out["token_keep"]
    for r in range(len(out["kept_rows"])):
        n = int(kept["response_mask"][r].sum())
        ids = kept["response_ids"][r, :n].tolist()
        pieces = [tokenizer.decode([t]) for t in ids]
        classes = token_classes(pieces, [t in eos_ids for t in ids])
        a = abs(float(out["kept_adv"][r]))
        for t in range(n):
            records.append(
                {
                    "sel": bool(token_keep[r, t]),
                    "H": float(out["entropy"][r, t]),
                    "absA": a,
                    "score": float(out["scores"][r, t]),
                    "pos": t / n,
                    "cls": classes[t],
                    "bin": min(int(t / n * BINS), BINS - 1),
                }
            )
    return records


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def mean_or_none(xs):
    """The mean of the values that are not None (None if there is none)."""
    return mean([x for x in xs if x is not None])


def fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def cosine(a, b):
    if a is None or b is None:
        return None
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else None


def ratio(a, b):
    if a is None or b is None:
        return None
    nb = float(b.norm())
    return float(a.norm()) / nb if nb > 0 else None


def gradient_row(grads):
    """The gradient measures of one batch (the columns of table 4)."""
    if grads is None:
        return None
    n_all, n_sel = grads["n_all"], grads["n_sel"]
    sel = ratio(grads["sel"], grads["all"])
    rand = mean_or_none([ratio(g, grads["all"]) for g in grads["rand"]])  # the mean over the random draws
    drop = ratio(grads["drop"], grads["all"])
    return {
        "n_all": n_all,
        "n_sel": n_sel,
        "cos_sel": cosine(grads["sel"], grads["all"]),
        "cos_rand": mean_or_none([cosine(g, grads["all"]) for g in grads["rand"]]),
        "cos_drop": cosine(grads["drop"], grads["all"]),
        "cos_sel_drop": cosine(grads["sel"], grads["drop"]),
        "ratio_sel": sel,
        "ratio_rand": rand,
        "sum_sel": None if sel is None else sel * n_sel / n_all,
        "sum_rand": None if rand is None else rand * n_sel / n_all,
        "sum_drop": None if drop is None else drop * (n_all - n_sel) / n_all,
    }


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def table_tokens(records):
    groups = {
        "selected": [x for x in records if x["sel"]],
        "dropped": [x for x in records if not x["sel"]],
        "dropped, A != 0": [x for x in records if not x["sel"] and x["absA"] > 0],
        "all": records,
    }
    total = max(len(records), 1)
    rows = [
        ("tokens", lambda g: str(len(g))),
        ("share of the tokens", lambda g: f"{len(g) / total:.3f}"),
        ("entropy H, mean", lambda g: fmt(mean([x["H"] for x in g]))),
        ("entropy H, median", lambda g: fmt(statistics.median([x["H"] for x in g]) if g else None)),
        ("\\|A\\|, mean", lambda g: fmt(mean([x["absA"] for x in g]))),
        ("share with A = 0", lambda g: fmt(mean([float(x["absA"] == 0) for x in g]))),
        ("score \\|A\\| * H, mean", lambda g: fmt(mean([x["score"] for x in g]))),
        ("relative position t / L, mean", lambda g: fmt(mean([x["pos"] for x in g]))),
    ]
    lines = ["| | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for name, f in rows:
        lines.append(f"| {name} | " + " | ".join(f(g) for g in groups.values()) + " |")
    return "\n".join(lines)


def table_position(records):
    sel, drop = [x for x in records if x["sel"]], [x for x in records if not x["sel"]]
    lines = [
        "| t / L | share of the selected | share of the dropped | tokens | share of the bin selected |",
        "|---|---|---|---|---|",
    ]
    for k in range(BINS):
        in_bin = [x for x in records if x["bin"] == k]
        lines.append(
            f"| [{k / BINS:.1f}, {(k + 1) / BINS:.1f}) | {fmt(mean([float(x['bin'] == k) for x in sel]))} | "
            f"{fmt(mean([float(x['bin'] == k) for x in drop]))} | {len(in_bin)} | "
            f"{fmt(mean([float(x['sel']) for x in in_bin]))} |"
        )
    return "\n".join(lines)


def class_shares(records):
    """{class: (share among selected, among dropped, among dropped A != 0, share of the class selected, count)}."""
    sel, drop = [x for x in records if x["sel"]], [x for x in records if not x["sel"]]
    drop_a = [x for x in drop if x["absA"] > 0]
    out = {}
    for c in CLASSES:
        of_class = [x for x in records if x["cls"] == c]
        out[c] = (
            mean([float(x["cls"] == c) for x in sel]),
            mean([float(x["cls"] == c) for x in drop]),
            mean([float(x["cls"] == c) for x in drop_a]),
            mean([float(x["sel"]) for x in of_class]),
            len(of_class),
        )
    return out


def table_classes(records):
    shares = class_shares(records)
    lines = [
        "| class | share of the selected | share of the dropped | share of the dropped, A != 0 | tokens | "
        "share of the class selected |",
        "|---|---|---|---|---|---|",
    ]
    for c, (s, d, da, k, n) in shares.items():
        lines.append(f"| {c} | {fmt(s)} | {fmt(d)} | {fmt(da)} | {n} | {fmt(k)} |")
    return "\n".join(lines)


def table_gradient(rows):
    keys = (
        "cos_sel",
        "cos_rand",
        "cos_drop",
        "cos_sel_drop",
        "ratio_sel",
        "ratio_rand",
        "sum_sel",
        "sum_rand",
        "sum_drop",
    )
    head = [
        "batch",
        "tokens (all)",
        "selected",
        "cos(sel, all)",
        "cos(rand, all)",
        "cos(drop, all)",
        "cos(sel, drop)",
        "‖sel‖ / ‖all‖ (per token)",
        "‖rand‖ / ‖all‖ (per token)",
        "sum ‖sel‖ / ‖all‖",
        "sum ‖rand‖ / ‖all‖",
        "sum ‖drop‖ / ‖all‖",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for b, row in enumerate(rows):
        if row is None:
            lines.append(f"| {b} | 0 | 0 | " + " | ".join("–" for _ in keys) + " |")
            continue
        lines.append(
            f"| {b} | {row['n_all']} | {row['n_sel']} | " + " | ".join(fmt(row[k], ".4f") for k in keys) + " |"
        )
    done = [r for r in rows if r is not None]
    if len(done) > 1:
        cells = []
        for k in keys:
            vals = [r[k] for r in done if r[k] is not None]
            cells.append(
                "–"
                if not vals
                else f"{mean(vals):.4f} ± {statistics.stdev(vals):.4f}"
                if len(vals) > 1
                else f"{vals[0]:.4f}"
            )
        lines.append(
            f"| mean ± std | {mean([r['n_all'] for r in done]):.0f} | {mean([r['n_sel'] for r in done]):.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def report(args, source, command, batches, records, grad_rows, seconds):
    rewards = [float(o["rewards"].mean()) for o in batches]
    spread = [float((o["rewards"].amax(-1) > o["rewards"].amin(-1)).float().mean()) for o in batches]
    kept = [len(o["kept_rows"]) for o in batches]
    n_sel = sum(x["sel"] for x in records)
    lines = [
        f"# Which tokens are dropped? `{command}`",
        "",
        f"Model: {source}. Method {args.method} at step {args.step} of {args.steps}: N = {args.n_keep} of G = "
        f"{args.group_size} per prompt, K = {args.k_frac:g}{' (--k)' if args.k is not None else ''}, token rule "
        f"{args.token_rule}, scope {args.token_scope}. {args.batches} batch(es) of P x G = {args.prompts_per_step} x "
        f"{args.group_size} rollouts (train_small's step {args.step} with --rl-seed {args.seed}.."
        f"{args.seed + args.batches - 1}), task {args.task}, template {args.template}, temperature "
        f"{args.temperature:g}, max {args.max_new_tokens} new tokens. {seconds:.0f} s, {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "",
        f"Train reward per batch: {', '.join(f'{r:.3f}' for r in rewards)}; groups with spread: "
        f"{', '.join(f'{s:.2f}' for s in spread)}; kept rollouts: {', '.join(map(str, kept))}. Response tokens of "
        f"the kept rollouts: {len(records)}, of which {n_sel} selected ({n_sel / max(len(records), 1):.3f}) and "
        f"{len(records) - n_sel} dropped.",
        "",
        "## 1. Selected and dropped tokens",
        "",
        table_tokens(records),
        "",
        "## 2. Relative position in the response",
        "",
        table_position(records),
        "",
        "## 3. Character class",
        "",
        table_classes(records),
        "",
        "## 4. Gradient share (on-policy, GRPO token-mean loss, all parameters)",
        "",
        "`‖x‖ / ‖all‖` divides the norms of the token-mean gradients, each normalised by its own token count: the "
        "mean gradient per token (a mean over fewer tokens cancels less, so a random selection's is above 1 too). `sum` "
        "multiplies that by n_sel / n_all (n_drop / n_all): the un-normalised (summed) gradients. "
        f"Each random selection has as many tokens as the selected one; the rand columns are the mean of "
        f"{args.random_draws} draws.",
        "",
        table_gradient(grad_rows),
        "",
    ]
    return "\n".join(lines)


def explain_page(args, command, out, tokenizer, eos_ids):
    """The worked example of batch 0 (markdown)."""
    kept, token_keep = out["kept"], out["token_keep"]
    G = args.group_size
    lines = [
        f"# Worked example: which tokens of a rollout D3S keeps (`{command}`)",
        "",
        f"Batch 0: train_small's step {args.step} with --rl-seed {args.seed}, method {args.method}, N = {args.n_keep} of "
        f"{G}, K = {args.k_frac:g} over all {int(kept['response_mask'].sum()) if len(out['kept_rows']) else 0} response "
        f"tokens of the {len(out['kept_rows'])} kept rollouts. Selected tokens are in [[ ]] (consecutive ones share a "
        "pair); H is the entropy of the policy at that token (nats), score = |A| * H.",
        "",
    ]
    candidates = [r for r in range(len(out["kept_rows"])) if bool(token_keep[r].any())]
    if not candidates:
        return "\n".join(lines + ["No kept rollout has a selected token in this batch.", ""])
    adv = out["kept_adv"]
    shown = sorted(
        {max(candidates, key=lambda r: float(adv[r])), min(candidates, key=lambda r: float(adv[r]))},
        key=lambda r: -float(adv[r]),
    )
    for r in shown:
        flat = int(out["kept_rows"][r])
        problem = out["problems"][flat // G]
        n = int(kept["response_mask"][r].sum())
        ids = kept["response_ids"][r, :n].tolist()
        pieces = [tokenizer.decode([t]) for t in ids]
        is_eos = [t in eos_ids for t in ids]
        classes = token_classes(pieces, is_eos)
        sel = token_keep[r, :n].tolist()
        marked, open_ = "", False
        for piece, s, e in zip(pieces, sel, is_eos):
            piece = "<EOS>" if e else piece
            if s and not open_:
                marked += "[["
            if not s and open_:
                marked += "]]"
            open_ = s
            marked += piece
        marked += "]]" if open_ else ""
        lines += [
            f"## Rollout {flat % G} of prompt {flat // G}: reward {float(out['rewards'].view(-1)[flat]):g}, "
            f"A = {float(adv[r]):+.3f}, {sum(sel)} of {n} tokens selected",
            "",
            "Problem: `" + problem["problem"].replace("`", "'") + f"` (answer {problem['answer']})",
            "",
            "```",
            marked,
            "```",
            "",
            "| t | token | class | H | score | selected |",
            "|---|---|---|---|---|---|",
        ]
        for t in range(min(n, SHOWN_TOKENS)):
            piece = pieces[t]
            token = (
                "EOS"
                if is_eos[t]
                else "(space)"
                if piece == " "
                else repr(piece)
                if not piece.strip() or not piece.isprintable()
                else piece.replace("|", "\\|").replace("`", "'")
            )
            lines.append(
                f"| {t} | `{token}` | {classes[t]} | {float(out['entropy'][r, t]):.3f} | "
                f"{float(out['scores'][r, t]):.3f} | {'**yes**' if sel[t] else ''} |"
            )
        if n > SHOWN_TOKENS:
            lines.append(f"| ... | ({n - SHOWN_TOKENS} more) | | | | |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)  # every flag, before any model or data work
    import torch
    from tqdm import tqdm

    from support import mathtask
    from support.grading import Grader
    from support.templates import stop_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    command = " ".join(["python experiments/dropped_tokens.py"] + list(argv))
    t0 = time.time()
    train_rows = mathtask.TASKS[args.task](args.train_size, "train", seed=args.seed)
    try:
        model, tokenizer, source = load_model(args, train_rows)
    except cli.UsageError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    eos_ids = set(stop_token_ids(tokenizer, model.generation_config))
    batches, records, grad_rows = [], [], []
    with Grader(timeout_s=args.grade_timeout) as grader:
        for b in tqdm(range(args.batches), desc=f"{args.method} step {args.step}", dynamic_ncols=True):
            out = one_batch(model, tokenizer, grader, train_rows, b, args)
            if out["grads"] is not None:
                records += collect_tokens(out, tokenizer, eos_ids)
            grad_rows.append(gradient_row(out["grads"]))
            out["grads"] = None  # the flat gradients are not kept
            batches.append(out if b == 0 else {k: out[k] for k in ("rewards", "kept_rows")})
    text = report(args, source, command, batches, records, grad_rows, time.time() - t0)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.explain_out:
        with open(args.explain_out, "w") as f:
            f.write(explain_page(args, command, batches[0], tokenizer, eos_ids))


if __name__ == "__main__":
    stops.interruptible(main, PROG)
