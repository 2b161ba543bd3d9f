"""experiments/headroom.py: how much room the tiny rung's warm start leaves RL, per level.

    .venv/bin/python experiments/headroom.py                      # the default task and warm start (cached in runs/cache)
    .venv/bin/python experiments/headroom.py --sft-shortcut 0     # any train_small.py flag that shapes the task or warm start
    .venv/bin/python experiments/headroom.py --out runs/headroom.md

It builds (or loads from the cache) train_small.py's warm start with the given flags, then prints
held-out greedy Pass@1, Pass@1 (mean of --eval-samples samples) and Pass@k per level of the task,
with Pass@k / Pass@1: the gap between what the policy does on average and what it can reach with
k tries, which is what RL can convert. It also prints how often a sample takes the shortcut the
warm start was taught (--sft-shortcut: working every step out, then boxing the first result) and the mean response
length in tokens. The figures are a benchmark, not a test: they move with the machine (sampling
in float32 on a different CPU draws other tokens).
"""

import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
from support import stops  # noqa: E402

PROG = "headroom.py"
OUT_HELP = "also write the markdown table to FILE (train_small's --out, a run folder, is not used)"


def is_shortcut(text):
    """Does a sample work several steps out and box the first result ('47+8=55. 55-13=42. \\boxed{55}')?"""
    results = re.findall(r"=(\d+)\.", text)
    boxed = re.findall(r"\\boxed\{(\d+)\}", text)
    return len(results) > 1 and bool(boxed) and boxed[-1] == results[0] != results[-1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    own = cli.parser(PROG, None, [cli.flag("--out", None, cli.out_file, OUT_HELP)], add_help=False, allow_abbrev=False)
    out, argv = own.parse_known_args(argv)  # before torch: a bad --out costs no import; the rest is train_small's
    import torch

    import train_small
    from support import sampler  # noqa: E402
    from support import warmstart, mathtask, templates
    from support.mathtask import DataError
    from support.grading import Grader, pass_at_k

    p = train_small.build_parser(PROG)  # train_small.py's flags and checks
    p.epilog = f"This script's own --out FILE: {OUT_HELP}."
    args = train_small.parse_args(argv, p)
    try:
        train_rows, eval_rows = warmstart.fit_files(args, *mathtask.load_data(args), prog=PROG)
        model, tokenizer, info = warmstart.load_warm_start(args, train_rows)
    except (cli.UsageError, DataError) as e:
        stops.fail(PROG, " ".join(str(e).split()))
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    torch.manual_seed(args.rl_seed)
    n, k = args.eval_samples, args.pass_k
    prompts = [templates.format_prompt(r["problem"], args.template, tokenizer, args.system_prompt) for r in eval_rows]
    with Grader(timeout_s=args.grade_timeout) as grader:
        greedy = sampler.sample(model, tokenizer, prompts, 1, args.max_new_tokens, greedy=True)
        greedy_ok = train_small.grade(greedy, eval_rows, grader).view(-1).tolist()
        batch = sampler.sample(model, tokenizer, prompts, n, args.max_new_tokens, args.temperature)
        ok = train_small.grade(batch, eval_rows, grader)  # [E, n]
    lengths = batch["response_mask"].sum(-1).float().view(-1, n)
    shortcut = torch.tensor(
        [[is_shortcut(t) for t in batch["texts"][i * n : (i + 1) * n]] for i in range(len(eval_rows))],
        dtype=torch.float,
    )
    levels = sorted({r.get("level", 0) for r in eval_rows})
    lines = [
        f"# Headroom of the warm start: `python experiments/headroom.py {' '.join(argv)}`".rstrip(),
        "",
        f"Warm start: {info['path']} ({args.sft_steps} supervised steps, --sft-shortcut {args.sft_shortcut}); held-out "
        f"set: {len(eval_rows)} problems, {n} samples each at temperature {args.temperature}; {time.time() - t0:.0f} s.",
        "",
        f"| level | problems | greedy Pass@1 | Pass@1 (mean of {n}) | Pass@{k} | Pass@{k} / Pass@1 | shortcut samples | "
        "response tokens |",
        "|---" * 8 + "|",
    ]
    for level in levels + ["all"]:
        idx = [i for i, r in enumerate(eval_rows) if level == "all" or r.get("level", 0) == level]
        p1 = float(ok[idx].mean())
        pk = sum(pass_at_k(n, int(ok[i].sum()), k) for i in idx) / len(idx)
        lines.append(
            f"| {level} | {len(idx)} | {sum(greedy_ok[i] for i in idx) / len(idx):.3f} | {p1:.3f} | {pk:.3f} | "
            f"{pk / p1 if p1 else float('inf'):.2f}x | {float(shortcut[idx].mean()):.2f} | {float(lengths[idx].mean()):.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if out.out:
        with open(out.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    stops.interruptible(main, PROG)
