"""bench/questions_small.py: the tiny rung's answers to questions 4 and 5 of docs/questions.md, read
from the metrics.jsonl of `train_small.py --compare` runs (it runs nothing itself).

    .venv/bin/python bench/questions_small.py --question 4 --runs runs/ladder2              # d2s vs d3s
    .venv/bin/python bench/questions_small.py --question 5 --runs runs/q5_small/unaligned --base d3s-i --rows d3s

Question 4 (does the schedule prevent overfitting?), per method and eval step, means over seeds:
  train    the train reward (reward_mean) over the --window steps up to the eval step: the policy on
           the training problems, sampled at the training temperature
  held-out eval_pass1_mean at that step: the same policy on the held-out problems (mean of n samples)
  gap      train - held-out: a policy that fits its training problems and not new ones opens it
  KL all   kl_ref_all at the nearest step that measured it: KL to the warm start on every response token
  KL sel   kl_ref: the same on the row's selected tokens (what the paper's figure compares)
Question 5 (does cross-group selection destabilise?), per method, means ± std over seeds:
  spikes   steps whose grad_norm exceeds --spike x the median of the 10 steps before it
  max/med  the largest such ratio of the run
  KL end   kl_ref_all at the last step
  final    held-out Pass@1 (mean of n) at the last step; paired difference to --base with a 95% t interval
Writes the markdown to stdout and to --out, and a figure of the curves beside it (--plot).
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import _cli  # noqa: E402  (bench/_cli.py: one-line errors, the shared checks)

PROG = "questions_small.py"


def fail(message):
    """One line and exit 2, as every entry point does on bad input."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    p = _cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--question", type=int, choices=(4, 5), required=True)
    p.add_argument("--runs", required=True, help="a train_small.py --compare --out folder (METHOD/seedS/metrics.jsonl)")
    p.add_argument("--rows", default="d2s,d3s", help="methods to report (question 4), or to pair with --base (question 5)")
    p.add_argument("--base", default="d3s-i", help="question 5: the row the others are paired with")
    p.add_argument("--window", type=int, default=10, help="question 4: train steps averaged up to each eval step")
    p.add_argument("--spike", type=float, default=3.0, help="question 5: a spike is grad_norm > this x the median of the 10 steps before")
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--plot", default=None, help="write the figure here (.png)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.runs):
        p.error(f"--runs {args.runs}: not a folder; give the --out folder of a train_small.py --compare run")
    for flag, value in (("--window", args.window), ("--spike", args.spike)):
        if not (_cli.finite(value) and value > 0):
            p.error(f"{flag} {value}: must be a number > 0")
    _cli.check_out_file(p, "--out", args.out)
    _cli.check_out_file(p, "--plot", args.plot)
    for flag, value in (("--rows", args.rows), ("--base", args.base)):
        if not value.strip() or any(not m.strip() for m in value.split(",")):
            p.error(f"{flag} {value!r}: name methods, comma-separated (e.g. d2s,d3s)")
    return args


def load_runs(folder, method):
    """[(train lines, eval lines)] per seed folder of OUT/method, in seed order."""
    base = os.path.join(folder, method)
    if not os.path.isdir(base):
        fail(f"--runs {folder}: no {method}/ in it; run train_small.py --compare with {method}, "
                              "or name the methods it has with --rows/--base")
    runs = []
    for seed in sorted((d for d in os.listdir(base) if d.startswith("seed") and d[4:].isdigit()), key=lambda d: int(d[4:])):
        path = os.path.join(base, seed, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        runs.append(([x for x in lines if x["kind"] == "train"], [x for x in lines if x["kind"] == "eval"]))
    if not runs:
        fail(f"--runs {folder}: {method}/ holds no seed*/metrics.jsonl")
    return runs


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def fmt(value, spec="%.3f"):
    return "—" if value is None else spec % value


def mean_sd(values, spec="%.3f"):
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    return spec % mean(values) + ("" if len(values) < 2 else " ± " + spec % statistics.stdev(values))


def q4_curves(runs, window):
    """{eval step: (train reward, held-out pass1, gap, kl_ref_all, kl_ref)} means over seeds (eval steps > 0)."""
    out = {}
    for step in [e["step"] for e in runs[0][1] if e["step"] > 0]:
        per_seed = []
        for train, evals in runs:
            ev = next((e for e in evals if e["step"] == step), None)
            recent = [t["reward_mean"] for t in train if step - window < t["step"] <= step]
            measured = [t for t in train if t.get("kl_ref_all") is not None and t["step"] <= step]
            last_kl = measured[-1] if measured else None
            if ev is None or not recent:
                continue
            per_seed.append((mean(recent), ev["eval_pass1_mean"], mean(recent) - ev["eval_pass1_mean"],
                             last_kl["kl_ref_all"] if last_kl else None, last_kl["kl_ref"] if last_kl else None))
        if per_seed:
            out[step] = tuple(mean([s[i] for s in per_seed]) for i in range(5))
    return out


def question4(args):
    from toy.bandit import paired_interval

    methods = args.rows.split(",")
    data = {m: load_runs(args.runs, m) for m in methods}
    lines = [f"Question 4 from `{args.runs}` ({', '.join(f'{m}: {len(data[m])} seeds' for m in methods)}); train reward = "
             f"mean of the {args.window} train steps up to the eval step; means over seeds.", "",
             "| method | step | train reward | held-out Pass@1 | gap (train − held-out) | KL all tokens | KL selected tokens |",
             "|---|---|---|---|---|---|---|"]
    curves = {m: q4_curves(data[m], args.window) for m in methods}
    for m in methods:
        for step, (tr, ho, gap, kla, kls) in curves[m].items():
            lines.append(f"| {m} | {step} | {fmt(tr)} | {fmt(ho)} | {fmt(gap, '%+.3f')} | {fmt(kla, '%.5f')} | {fmt(kls, '%.5f')} |")
    if len(methods) >= 2:
        a, b = methods[-1], methods[0]
        gaps = {m: [q4_curves([r], args.window) for r in data[m]] for m in (a, b)}
        last = max(curves[a])
        diffs = [ga[last][2] - gb[last][2] for ga, gb in zip(gaps[a], gaps[b]) if last in ga and last in gb]
        kl = [ga[last][3] - gb[last][3] for ga, gb in zip(gaps[a], gaps[b])
              if last in ga and last in gb and ga[last][3] is not None and gb[last][3] is not None]
        lines.append("")
        for name, d, spec in (("gap", diffs, "%+.3f"), ("KL on all tokens", kl, "%+.5f")):
            m_, lo, hi = paired_interval(d) if d else (None, None, None)
            lines.append(f"At step {last}, {a} − {b} in {name}, same seed, 95% t interval over {len(d)} seeds: {fmt(m_, spec)} "
                         f"[{fmt(lo, spec)}, {fmt(hi, spec)}]")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for i, m in enumerate(methods):
            steps = list(curves[m])
            color = f"C{i}"
            ax1.plot(steps, [curves[m][s][0] for s in steps], "-", color=color, label=f"{m} train reward")
            ax1.plot(steps, [curves[m][s][1] for s in steps], "--", color=color, label=f"{m} held-out Pass@1")
            ax2.plot(steps, [curves[m][s][3] for s in steps], "-o", color=color, label=f"{m} all tokens")
            ax2.plot(steps, [curves[m][s][4] for s in steps], ":x", color=color, label=f"{m} selected tokens")
        ax1.set(xlabel="RL step", ylabel="reward / Pass@1", title="train reward vs held-out")
        ax2.set(xlabel="RL step", ylabel="KL to the warm start (k3)", title="KL on all vs selected tokens", yscale="log")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return lines


def spikes(train, ratio):
    """(spike count, largest grad_norm / median of the 10 steps before) of one run."""
    norms = [t["grad_norm"] for t in train]
    count, worst = 0, 0.0
    for i in range(10, len(norms)):
        before = [n for n in norms[i - 10:i] if n is not None]
        if norms[i] is None or not before:
            continue
        r = norms[i] / max(statistics.median(before), 1e-12)
        worst = max(worst, r)
        count += r > ratio
    return count, worst


def question5(args):
    from toy.bandit import paired_interval

    methods = [args.base] + [m for m in args.rows.split(",") if m != args.base]
    data = {m: load_runs(args.runs, m) for m in methods}
    final = {m: [evals[-1]["eval_pass1_mean"] for _, evals in data[m]] for m in methods}
    lines = [f"Question 5 from `{args.runs}`; spike: grad_norm > {args.spike:g} x the median of the 10 steps before; "
             "mean ± std over seeds.", "",
             f"| method | seeds | spikes per run | largest grad_norm / median | KL all tokens at the end | final Pass@1 | − {args.base} [95% t] |",
             "|---|---|---|---|---|---|---|"]
    for m in methods:
        sp = [spikes(train, args.spike) for train, _ in data[m]]
        kl_end = [next((t["kl_ref_all"] for t in reversed(train) if t.get("kl_ref_all") is not None), None) for train, _ in data[m]]
        diff = "(reference)"
        if m != args.base:
            d, lo, hi = paired_interval([a - b for a, b in zip(final[m], final[args.base])])
            diff = f"{d:+.3f} [{fmt(lo, '%+.3f')}, {fmt(hi, '%+.3f')}]"
        lines.append(f"| {m} | {len(data[m])} | {mean_sd([s[0] for s in sp], '%.1f')} | {mean_sd([s[1] for s in sp], '%.1f')} | "
                     f"{mean_sd(kl_end, '%.4f')} | {mean_sd(final[m])} | {diff} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    lines = question4(args) if args.question == 4 else question5(args)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
