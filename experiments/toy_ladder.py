"""experiments/toy_ladder.py: docs/toy.md's tables and figure: the toy's methods over seeds, paired with GRPO.

Runs toy/bandit.py (the same flags; its metrics.jsonl), then writes OUT/results.md and OUT/toy.png:
per method, mean ± std over seeds of the steps until the exact expected reward first reaches each --target
(seeds that never do are counted, not averaged), the reward after the last step and its mean over the run, the
prompts with E[R | p] >= 0.5, the gradient norm (before clipping; and at GRPO's normalizer), the Sample
Usefulness Rate, the rollouts and tokens trained on. Then each method paired by seed with grpo: the differences
as mean [95% t interval over seeds] and the verdict, which needs an interval, as printed, to exclude 0.
Per-seed numbers move with the CPU's floating-point path; the verdicts should not.

    python experiments/toy_ladder.py                         # 8 methods x 30 seeds x 80 steps -> runs/toy/
    python experiments/toy_ladder.py --seeds 3 --methods grpo d3s --filler-logit 0
    python experiments/toy_ladder.py --report-to tensorboard    # + each run in a tracker, the ladder one group

With --report-to (support/track.py), each run (method, seed) goes to the trackers once the ladder is done, as
METHOD__SEED in one group (--run-group, default: the --out folder's name), its tracker files under OUT/track/.
"""

import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from stats import excludes_zero, mean_std, paired_interval  # noqa: E402
from toy import bandit  # noqa: E402

from support import stops, methods, track  # noqa: E402


def columns(lines):
    """A run's metrics.jsonl lines as one list per key: eval_step (0..S) and the eval keys; step (1..S) and the
    train keys."""
    log = {}
    for line in lines:
        prefix = "eval_" if line["kind"] == "eval" else ""
        for k, v in line.items():
            if k not in ("kind", "method", "seed"):
                log.setdefault(prefix + k if k == "step" else k, []).append(v)
    return log


def steps_to(log, target):
    """The updates after which the expected reward first is >= target (0: already at the start); None: never."""
    return next((s for s, r in zip(log["eval_step"], log["eval_reward"]) if r >= target), None)


def mean_finite(values):
    """The mean of the values that are not None (a skipped update logs grad_norm None); None if there are none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(logs, args, reference="grpo"):
    """Markdown: one row per method, mean ± std over seeds; then, when `reference` ran, each method paired by seed
    with it (same task, initial policy and prompt order) with 95% t intervals."""
    head = ["method"] + ["steps to reward ≥ %g" % t for t in args.target]
    head += [
        "final reward",
        "mean reward over the run",
        "prompts solved /%d" % args.prompts,
        "mean grad norm",
        "… at GRPO's normalizer",
        "SUR",
        "rollouts trained",
        "tokens trained",
        "K realised / scheduled",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in logs.items():
        cells = [method]
        for target in args.target:  # seeds that never reach the target are counted, not averaged
            reached = [h for h in (steps_to(log, target) for log in runs) if h is not None]
            cells.append(
                "%.0f ± %.0f (%d/%d)" % (*mean_std(reached), len(reached), len(runs))
                if reached
                else "– (0/%d)" % len(runs)
            )
        for key, reduce, fmt in (
            ("eval_reward", lambda v: v[-1], "%.3f ± %.3f"),
            ("eval_reward", lambda v: sum(v) / len(v), "%.3f ± %.3f"),
            ("eval_solved", lambda v: v[-1], "%.1f ± %.1f"),
            ("grad_norm", mean_finite, "%.3f ± %.3f"),
            ("grad_norm_grpo_scale", mean_finite, "%.3f ± %.3f"),
            ("sur", lambda v: sum(v) / len(v), "%.2f"),
            ("kept_samples", sum, "%.0f"),
            ("kept_tokens", sum, "%.0f ± %.0f"),
        ):
            values = [v for v in (reduce(log[key]) for log in runs) if v is not None]  # None: a run with no update
            cells.append(fmt % mean_std(values)[: fmt.count("%")] if values else "–")
        realised = [sum(log["k_real"]) / len(log["k_real"]) for log in runs]
        scheduled = [sum(log["k_frac"]) / len(log["k_frac"]) for log in runs]
        cells.append("%.3f / %.3f" % (sum(realised) / len(runs), sum(scheduled) / len(runs)))
        rows.append("| " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    if reference in logs and len(logs) > 1:
        table += "\n\n" + paired_table(logs, args, reference)
    return table


def paired_table(logs, args, reference="grpo"):
    """Each method minus `reference`, seed by seed: mean [95% t interval], and the verdict: it differs only where
    the interval, as printed, excludes 0."""
    fmt_interval = lambda m, lo, hi, f: (
        (f % m) + (" [%s, %s]" % (f % lo, f % hi) if lo is not None else " (no interval: 1 seed)")
    )
    head = ["method", f"final reward − {reference}'s", "seeds better", f"mean reward over the run − {reference}'s"]
    head += [f"steps to ≥ {t:g} − {reference}'s (seeds where both reach it)" for t in args.target]
    head += [f"differs from {reference} (95%)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = logs[reference]
    for method, runs in logs.items():
        if method == reference:
            continue
        verdict, cells = [], [method]
        for name, key, reduce in (
            ("final reward", "eval_reward", lambda v: v[-1]),
            ("mean reward over the run", "eval_reward", lambda v: sum(v) / len(v)),
        ):
            diffs = [reduce(log[key]) - reduce(ref[key]) for log, ref in zip(runs, base)]
            m, lo, hi = paired_interval(diffs)
            cells.append(fmt_interval(m, lo, hi, "%+.3f"))
            if name == "final reward":
                cells.append("%d/%d" % (sum(d > 0 for d in diffs), len(diffs)))
            if excludes_zero(lo, hi, "%+.3f"):
                verdict.append(("higher " if lo > 0 else "lower ") + name)
        for target in args.target:
            pairs = [(steps_to(log, target), steps_to(ref, target)) for log, ref in zip(runs, base)]
            diffs = [a - b for a, b in pairs if a is not None and b is not None]
            if not diffs:
                cells.append("– (0/%d)" % len(runs))
                continue
            m, lo, hi = paired_interval(diffs)
            cells.append(fmt_interval(m, lo, hi, "%+.1f") + " (%d/%d)" % (len(diffs), len(runs)))
            if excludes_zero(lo, hi, "%+.1f"):
                verdict.append(("slower" if lo > 0 else "faster") + " to %g" % target)
        cells.append(", ".join(verdict) if verdict else "no")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(logs, args, path):
    """Expected reward and gradient norm against step: mean over seeds, band = ± one std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, (ax_r, ax_g) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (method, runs) in enumerate(logs.items()):
        color, style = "C%d" % (i % 10), "-" if methods.selects_tokens(method) else "--"  # dashed: no token selection
        reward = torch.tensor([log["eval_reward"] for log in runs])  # [seeds, steps + 1]: after 0..S updates
        grad_norm = torch.tensor([[math.nan if g is None else g for g in log["grad_norm"]] for log in runs])
        smooth = min(5, grad_norm.shape[1])  # running mean over 5 steps: the raw curve is noisy
        grad_norm = grad_norm.unfold(1, smooth, 1).mean(-1)  # [seeds, steps - smooth + 1]
        for ax, x, y in ((ax_r, runs[0]["eval_step"], reward), (ax_g, runs[0]["step"][smooth - 1 :], grad_norm)):
            mean, std = y.mean(0), (y.std(0) if len(runs) > 1 else torch.zeros_like(y[0]))
            lower = (
                (mean - std).clamp(min=0.0) if ax is ax_r else (mean - std).clamp(min=mean / 3)
            )  # log axis: no band to 0
            ax.plot(x, mean, style, color=color, label=method, lw=1.2)
            ax.fill_between(x, lower, mean + std, color=color, alpha=0.12, lw=0)
    for target in args.target:
        ax_r.axhline(target, color="grey", lw=0.6, ls=":")
    ax_r.set(xlabel="step", ylabel="expected reward, all prompts", title="reward (mean ± std of %d seeds)" % args.seeds)
    positive = any(v is not None and v > 0 for runs in logs.values() for log in runs for v in log["grad_norm"])
    ax_g.set(
        xlabel="step",
        ylabel="gradient norm before clipping",
        yscale="log" if positive else "linear",
        title="gradient norm (mean ± std, 5-step mean)",
    )
    ax_r.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    from PIL import Image  # comes with matplotlib

    Image.open(path).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)  # ~3x fewer bytes


def notes(args, reference="grpo"):
    """What the tables' numbers are, written under them in results.md."""
    return (
        "First table: mean ± std over the %d seeds; steps to a target average the seeds that reach it (counted in "
        "brackets). Second table: each method minus %s on the same seed (same task, initial policy and prompt "
        "order), mean [95%% t interval over seeds: mean ± t_{0.975, n-1} · sd / √n]; steps to a target over the "
        "seeds where both reach it (counted in brackets). A method differs from %s only where the interval, as "
        "printed, excludes 0. Per-seed numbers move with the CPU's floating-point path (RL amplifies a last-bit "
        "difference); the interval verdicts should not." % (args.seeds, reference, reference)
    )


def main(argv=None):
    start, p = time.time(), bandit.build_parser("toy_ladder.py")
    for name, kw in track.FLAGS:  # --report-to, --run-name, --run-group, --project
        p.add_argument(name, **kw)
    track.check(p, p.parse_args(argv))  # a tracker that is not installed: one line before any run
    args, runs = bandit.main(argv, p)
    report(runs, args)
    logs = {method: [columns(lines) for lines in seeds] for method, seeds in runs.items()}
    table = summarize(logs, args)
    done = "%d runs in %.1f s (static N=%d, K=%.3f)" % (
        sum(map(len, runs.values())),
        time.time() - start,
        args.static_n,
        args.static_k,
    )
    command = " ".join(["experiments/toy_ladder.py"] + list(argv if argv is not None else sys.argv[1:]))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("%s\n\n%s\n\n%s; %s, %s\n" % (table, notes(args), done, command, time.strftime("%Y-%m-%d %H:%M %Z")))
    plot(logs, args, os.path.join(args.out, "toy.png"))
    print(table)
    print(done + "; wrote %s/{results.md,metrics.jsonl,toy.png}" % args.out)
    return logs


def report(runs, args):
    """Each run's metrics.jsonl lines to the trackers of --report-to: one tracker run per method and seed
    (METHOD__SEED), the ladder one group; nothing without --report-to."""
    group = args.run_group or os.path.basename(os.path.normpath(args.out))
    for method, seeds in runs.items():
        for lines in seeds:
            args.run_name = f"{method}__{lines[0]['seed']}"
            trackers = track.Trackers(args, os.path.join(args.out, "track", args.run_name), 0, group=group)
            for line in lines:
                trackers.log(line)
            trackers.close()


if __name__ == "__main__":
    stops.interruptible(main, "toy_ladder.py")
