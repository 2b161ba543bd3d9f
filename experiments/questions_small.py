"""experiments/questions_small.py: the tiny rung's answers to the questions of docs/questions.md, read
from the metrics.jsonl of `experiments/small_ladder.py --compare` runs (it runs nothing itself).

    .venv/bin/python experiments/questions_small.py --question 4 --runs runs/ladder2              # d2s vs d3s
    .venv/bin/python experiments/questions_small.py --question 5 --runs runs/q5_small/sft200 --base d3s-i --rows d3s
    .venv/bin/python experiments/questions_small.py --question 7 --runs runs \
        --rows ladder2/grpo,ladder2/d1s-cross,q7_small/dapo-filter@ladder2/d1s-cross,ladder2/d3s,q7_small/dapo-filter-k@ladder2/d3s

Questions 1, 2, 3 and 7 compare rows run in different --compare folders from the same warm start
and RL seeds, so a row is a METHOD folder's path under --runs, and rows pair seed by seed:
  final    held-out Pass@1 (mean of n) at the last step, mean ± std over seeds
  − ref    the same-seed difference to the row's reference (ROW@REF, else --base, else the first
           row), mean [95% t interval]; ≠ marks an interval that excludes 0 as printed
  run mean held-out Pass@1 averaged over the eval steps after 0: a speed measure that leaves no seed out
  to GRPO  the first step at which the row's Pass@1 reaches the same seed's --grpo row's final,
           interpolated between evals; the mean over the seeds that get there (their count)
  tokens   tokens trained (the loss's kept tokens) per run, in thousands
  kept H   the mean entropy of the kept tokens (entropy_kept) over the steps that kept any: what the token rule picks

Question 4 (does the schedule prevent overfitting?), per method and eval step, means over seeds:
  train    the train reward (reward_mean) over the --window steps up to the eval step: the policy on
           the training problems, sampled at the training temperature
  held-out eval_pass1_mean at that step: the same policy on the held-out problems (mean of n samples)
  gap      train - held-out: a policy that fits its training problems and not new ones opens it
  KL all   kl_ref_all at the nearest step that measured it: KL to the warm start on every response token
  KL sel   kl_ref: the same on the row's selected tokens (what the paper's figure compares)
Question 5 (does cross-group selection destabilise?), per method, means ± std over seeds:
  spikes   steps whose grad_norm exceeds --spike x the median of the 10 steps before it (steps with no
           signal, grad_norm 0 or null, are left out of both)
  max/med  the largest such ratio of the run
  KL end   kl_ref_all at the last step
  switch   the runs in which --switch-on-spike (= --spike) would have fired, and the step it would have moved
           to the intra-group twin from: methods.switch_to_intra reads only these norms, so a run in which it does
           not fire is, with the switch on, the same run number for number
  final    held-out Pass@1 (mean of n) at the last step; paired difference to --base with a 95% t interval
Writes the markdown to stdout and to --out, and a figure of the curves beside it (--plot).
"""

import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
from support import stops  # noqa: E402

PROG = "questions_small.py"


def fail(message):
    """One line and exit 2, as every entry point does on bad input."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    f, n = cli.flag, cli.number
    flags = [
        f("--question", None, [1, 2, 3, 4, 5, 7], "which question's table", type=int, required=True),
        f(
            "--runs",
            None,
            None,
            "an experiments/small_ladder.py --compare --out folder (METHOD/seedS/metrics.jsonl); questions 1, 2, 3, "
            "7: the folder the --rows paths start from",
            required=True,
        ),
        f(
            "--rows",
            None,
            None,
            "question 4: methods to report (d2s,d3s if not given); question 5: methods to pair with --base (d3s); "
            "questions 1, 2, 3, 7: METHOD folders under --runs, each ROW or ROW@REF",
        ),
        f(
            "--base",
            None,
            None,
            "question 5: the method the others are paired with (d3s-i if not given); questions 1, 2, 3, 7: the "
            "reference of rows without @REF (the first row)",
        ),
        f(
            "--grpo",
            None,
            None,
            "questions 1, 2, 3, 7: the row whose final Pass@1 'to GRPO' counts the steps to (default: the first row "
            "named .../grpo)",
        ),
        f("--window", 10, n(int, 1), "question 4: train steps averaged up to each eval step"),
        f(
            "--spike",
            3.0,
            n(float, 0, low_open=True),
            "question 5: a spike is grad_norm > this x the median of the 10 steps before",
        ),
        f("--out", None, cli.out_file, "also write the markdown here"),
        f("--plot", None, cli.out_file, "write the figure here (.png)"),
    ]
    p = cli.parser(PROG, __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    if not os.path.isdir(args.runs):
        p.error(
            f"--runs {args.runs}: not a folder; give the --out folder of an experiments/small_ladder.py --compare run"
        )
    table = args.question in (1, 2, 3, 7)
    if args.rows is None:
        if table:
            p.error(
                f"--question {args.question} needs --rows: METHOD folders under --runs, e.g. ladder2/grpo,ladder2/d3s"
            )
        args.rows = "d2s,d3s" if args.question == 4 else "d3s"
    if args.base is None and args.question == 5:
        args.base = "d3s-i"
    for flag, value in (("--rows", args.rows), ("--base", args.base), ("--grpo", args.grpo)):
        if value is not None and (not value.strip() or any(not m.strip() for m in value.split(","))):
            p.error(
                f"{flag} {value!r}: name "
                + (
                    "METHOD folders under --runs, comma-separated (e.g. ladder2/grpo,ladder2/d3s)"
                    if table
                    else "methods, comma-separated (e.g. d2s,d3s)"
                )
            )
    return args


def load_runs(folder, method, with_seeds=False):
    """[(train lines, eval lines)] per seed folder of OUT/method, in seed order (and the seeds, if asked)."""
    base = os.path.join(folder, method)
    if not os.path.isdir(base):
        fail(
            f"--runs {folder}: no {method}/ in it; run experiments/small_ladder.py --compare with {method}, "
            "or name the methods it has with --rows/--base"
        )
    runs, seeds = [], []
    for seed in sorted(
        (d for d in os.listdir(base) if d.startswith("seed") and d[4:].isdigit()), key=lambda d: int(d[4:])
    ):
        path = os.path.join(base, seed, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        runs.append(([x for x in lines if x["kind"] == "train"], [x for x in lines if x["kind"] == "eval"]))
        seeds.append(int(seed[4:]))
    if not runs:
        fail(f"--runs {folder}: {method}/ holds no seed*/metrics.jsonl")
    return (runs, seeds) if with_seeds else runs


def method_of(row):
    """The method a row names: "d3s" for "d3s", "ref_d3s/d3s" or "ref_d3s/d3s/"."""
    return os.path.basename(row.rstrip("/"))


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


def two_panels():
    """(figure, left axes, right axes): the side-by-side figure every question draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    return fig, ax1, ax2


def save(fig, path, *legend_axes):
    for ax in legend_axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
            per_seed.append(
                (
                    mean(recent),
                    ev["eval_pass1_mean"],
                    mean(recent) - ev["eval_pass1_mean"],
                    last_kl["kl_ref_all"] if last_kl else None,
                    last_kl["kl_ref"] if last_kl else None,
                )
            )
        if per_seed:
            out[step] = tuple(mean([s[i] for s in per_seed]) for i in range(5))
    return out


def question4(args):
    from stats import paired_interval

    names = args.rows.split(",")
    data = {m: load_runs(args.runs, m) for m in names}
    lines = [
        f"Question 4 from `{args.runs}` ({', '.join(f'{m}: {len(data[m])} seeds' for m in names)}); train reward = "
        f"mean of the {args.window} train steps up to the eval step; means over seeds.",
        "",
        "| method | step | train reward | held-out Pass@1 | gap (train − held-out) | KL all tokens | KL selected tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    curves = {m: q4_curves(data[m], args.window) for m in names}
    for m in names:
        for step, (tr, ho, gap, kla, kls) in curves[m].items():
            lines.append(
                f"| {m} | {step} | {fmt(tr)} | {fmt(ho)} | {fmt(gap, '%+.3f')} | {fmt(kla, '%.5f')} | {fmt(kls, '%.5f')} |"
            )
    if len(names) >= 2:
        a, b = names[-1], names[0]
        gaps = {m: [q4_curves([r], args.window) for r in data[m]] for m in (a, b)}
        last = max(curves[a])
        diffs = [ga[last][2] - gb[last][2] for ga, gb in zip(gaps[a], gaps[b]) if last in ga and last in gb]
        kl = [
            ga[last][3] - gb[last][3]
            for ga, gb in zip(gaps[a], gaps[b])
            if last in ga and last in gb and ga[last][3] is not None and gb[last][3] is not None
        ]
        lines.append("")
        for name, d, spec in (("gap", diffs, "%+.3f"), ("KL on all tokens", kl, "%+.5f")):
            m_, lo, hi = paired_interval(d) if d else (None, None, None)
            lines.append(
                f"At step {last}, {a} − {b} in {name}, same seed, 95% t interval over {len(d)} seeds: {fmt(m_, spec)} "
                f"[{fmt(lo, spec)}, {fmt(hi, spec)}]"
            )
    if args.plot:
        fig, ax1, ax2 = two_panels()
        for i, m in enumerate(names):
            steps = list(curves[m])
            color = f"C{i}"
            ax1.plot(steps, [curves[m][s][0] for s in steps], "-", color=color, label=f"{m} train reward")
            ax1.plot(steps, [curves[m][s][1] for s in steps], "--", color=color, label=f"{m} held-out Pass@1")
            ax2.plot(steps, [curves[m][s][3] for s in steps], "-o", color=color, label=f"{m} all tokens")
            ax2.plot(steps, [curves[m][s][4] for s in steps], ":x", color=color, label=f"{m} selected tokens")
        ax1.set(xlabel="RL step", ylabel="reward / Pass@1", title="train reward vs held-out")
        ax2.set(
            xlabel="RL step", ylabel="KL to the warm start (k3)", title="KL on all vs selected tokens", yscale="log"
        )
        save(fig, args.plot, ax1, ax2)
    return lines


def spikes(train, ratio):
    """(spike count, largest grad_norm / median of the 10 steps before, the first step after a spike or None) of
    one run: methods.spike_ratios, the switch rule's own measure (a step with no signal, norm 0 or none, is left out)."""
    from support import methods  # here, not at the top: questions 1-4 and bad flags do not need torch

    ratios = methods.spike_ratios([t["grad_norm"] for t in train])
    found = [r for r in ratios if r is not None]
    first = next(
        (train[i]["step"] + 1 for i, r in enumerate(ratios[:-1]) if r is not None and r > ratio), None
    )  # a spike
    # on the last step switches nothing
    return sum(r > ratio for r in found), max(found, default=0.0), first


def question5(args):
    from support import methods
    from stats import paired_interval

    names = [args.base] + [m for m in args.rows.split(",") if m != args.base]
    data = {m: load_runs(args.runs, m) for m in names}
    final = {m: [evals[-1]["eval_pass1_mean"] for _, evals in data[m]] for m in names}
    lines = [
        f"Question 5 from `{args.runs}`; spike: grad_norm > {args.spike:g} x the median of the 10 steps before; "
        "mean ± std over seeds.",
        "",
        f"| method | seeds | spikes per run | largest grad_norm / median | KL all tokens at the end | final Pass@1 | − {args.base} [95% t] "
        f"| spikes − {args.base} | KL − {args.base} | switch would fire (from step) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    spike_counts = {m: [spikes(train, args.spike) for train, _ in data[m]] for m in names}
    kl_ends = {
        m: [
            next((t["kl_ref_all"] for t in reversed(train) if t.get("kl_ref_all") is not None), None)
            for train, _ in data[m]
        ]
        for m in names
    }

    def paired(a, b, spec):
        pairs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
        if not pairs:
            return "—"
        d, lo, hi = paired_interval(pairs)
        return f"{spec % d} [{fmt(lo, spec)}, {fmt(hi, spec)}]"

    for m in names:
        sp, kl_end = spike_counts[m], kl_ends[m]
        diffs = ["(reference)"] * 3
        if m != args.base:
            diffs = [
                paired(final[m], final[args.base], "%+.3f"),
                paired([s[0] for s in sp], [s[0] for s in spike_counts[args.base]], "%+.1f"),
                paired(kl_end, kl_ends[args.base], "%+.4f"),
            ]
        fired = [s[2] for s in sp if s[2] is not None]
        switch = f"{len(fired)}/{len(sp)}" + (f" ({', '.join(map(str, fired))})" if fired else "")
        switch = switch if method_of(m) in methods.INTRA_TWIN else "— (no intra-group twin)"
        lines.append(
            f"| {m} | {len(data[m])} | {mean_sd([s[0] for s in sp], '%.1f')} | {mean_sd([s[1] for s in sp], '%.1f')} | "
            f"{mean_sd(kl_end, '%.4f')} | {mean_sd(final[m])} | {' | '.join(diffs)} | {switch} |"
        )
    if args.plot:  # one thin line per seed: the gradient norm (spikes show as jumps) and the KL on all tokens
        fig, ax1, ax2 = two_panels()
        for i, m in enumerate(names):
            for j, (train, _) in enumerate(data[m]):
                label = m if j == 0 else None
                ax1.plot(
                    [t["step"] for t in train],
                    [t["grad_norm"] or float("nan") for t in train],
                    "-",
                    lw=0.7,
                    alpha=0.6,
                    color=f"C{i}",
                    label=label,
                )  # a step with no signal (norm 0 or none) is a gap
                kl = [(t["step"], t["kl_ref_all"]) for t in train if t.get("kl_ref_all") is not None]
                ax2.plot([k[0] for k in kl], [k[1] for k in kl], "-o", ms=3, lw=0.8, color=f"C{i}", label=label)
        ax1.set(
            xlabel="RL step",
            ylabel="grad norm (before clipping)",
            yscale="log",
            title="gradient norm, one line per seed",
        )
        ax2.set(xlabel="RL step", ylabel="KL to the warm start, all tokens (k3)", title="KL on all response tokens")
        save(fig, args.plot, ax1, ax2)
    return lines


def steps_to(evals, target):
    """The first step at which held-out Pass@1 reaches `target`, interpolated linearly between evals; None if never."""
    points = [(e["step"], e["eval_pass1_mean"]) for e in evals]
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if p1 >= target:
            return s0 + (s1 - s0) * (target - p0) / (p1 - p0) if p0 < target else s0
    return None


def row_numbers(runs):
    """{seed: (final Pass@1, mean Pass@1 over the evals after step 0, kept tokens, evals, mean entropy of the kept
    tokens)} of one row."""
    data, seeds = runs
    return {
        seed: (
            evals[-1]["eval_pass1_mean"],
            mean([e["eval_pass1_mean"] for e in evals if e["step"] > 0]),
            sum(t.get("kept_tokens") or 0 for t in train),
            evals,
            mean([t.get("entropy_kept") for t in train if t.get("kept_tokens")]),
        )  # a step that kept no token logs 0
        for (train, evals), seed in zip(data, seeds)
    }


def question_table(args):
    """Questions 1, 2, 3, 7: rows from any --compare folders, paired seed by seed with their reference."""
    from stats import excludes_zero, paired_interval

    specs = [r.split("@", 1) for r in args.rows.split(",")]
    rows = [(spec[0], spec[1] if len(spec) > 1 else (args.base or specs[0][0])) for spec in specs]
    grpo = args.grpo or next((r for r, _ in rows if method_of(r) == "grpo"), None)
    names = list(dict.fromkeys([r for r, _ in rows] + [ref for _, ref in rows] + ([grpo] if grpo else [])))
    loaded = {name: load_runs(args.runs, name, with_seeds=True) for name in names}
    numbers = {name: row_numbers(loaded[name]) for name in names}

    def paired(row, ref, i):
        seeds = [s for s in numbers[row] if s in numbers[ref]]
        d, lo, hi = paired_interval([numbers[row][s][i] - numbers[ref][s][i] for s in seeds])
        mark = " **≠**" if excludes_zero(lo, hi, "%+.3f") else ""
        return f"{d:+.3f} [{fmt(lo, '%+.3f')}, {fmt(hi, '%+.3f')}]{mark}" if seeds else "— (no common seed)"

    lines = [
        f"Question {args.question} from `{args.runs}`: held-out Pass@1 (mean of n samples), mean ± std over seeds; "
        "− ref: same-seed differences, mean [95% t interval], **≠** where it excludes 0"
        + (f"; to GRPO: steps to `{grpo}`'s final on the same seed" if grpo else "")
        + ".",
        "",
        "| row | seeds | final Pass@1 | − ref (95%) | mean Pass@1 over the run | − ref (95%) | steps to GRPO's final (seeds) "
        "| tokens trained (k) | entropy of the kept tokens | ref |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, ref in rows:
        n = numbers[row]
        to_grpo = "—"
        if grpo:
            reached = [steps_to(n[s][3], numbers[grpo][s][0]) for s in n if s in numbers[grpo]]
            reached = [x for x in reached if x is not None]
            to_grpo = f"{mean_sd(reached, '%.0f')} ({len(reached)}/{len(n)})" if reached else f"– (0/{len(n)})"
        same = row == ref
        lines.append(
            f"| `{row}` | {len(n)} | {mean_sd([v[0] for v in n.values()])} | "
            f"{'(reference)' if same else paired(row, ref, 0)} | {mean_sd([v[1] for v in n.values()])} | "
            f"{'(reference)' if same else paired(row, ref, 1)} | {to_grpo} | "
            f"{mean([v[2] for v in n.values()]) / 1000:.1f} | {fmt(mean([v[4] for v in n.values()]), '%.2f')} | `{ref}` |"
        )
    if args.plot:
        fig, ax1, ax2 = two_panels()
        for i, row in enumerate(dict.fromkeys(r for r, _ in rows)):  # a row paired with two references: one curve
            runs, _seeds = loaded[row]
            steps = [e["step"] for e in runs[0][1]]
            ax1.plot(
                steps,
                [
                    mean([next((e["eval_pass1_mean"] for e in ev if e["step"] == s), None) for _, ev in runs])
                    for s in steps
                ],
                "-o",
                ms=3,
                color=f"C{i % 10}",
                label=row,
            )
            length = min(len(tr) for tr, _ in runs)
            per_step = [mean([tr[j].get("kept_tokens") or 0 for tr, _ in runs]) for j in range(length)]
            smooth = [mean(per_step[max(0, j - 4) : j + 1]) for j in range(length)]  # the mean of the last 5 steps
            ax2.plot([tr["step"] for tr in runs[0][0][:length]], smooth, "-", color=f"C{i % 10}", label=row)
        ax1.set(xlabel="RL step", ylabel="held-out Pass@1 (mean of n)", title="held-out Pass@1, mean over seeds")
        ax2.set(
            xlabel="RL step",
            ylabel="tokens trained per step",
            title="tokens in the loss (mean of the last 5 steps)",
            yscale="log",
        )
        save(fig, args.plot, ax1)
    return lines


def main(argv=None):
    args = parse_args(argv)
    lines = {4: question4, 5: question5}.get(args.question, question_table)(args)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    stops.interruptible(main, PROG)
