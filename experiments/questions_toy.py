"""experiments/questions_toy.py: the toy's answers to the questions of docs/questions.md, one command per table.

    .venv/bin/python experiments/questions_toy.py --question 1     # sensitivity to N_init, N_final, K_init, K_final; heatmap
    .venv/bin/python experiments/questions_toy.py --question 2     # the schedule's shape (--schedule), and d2s
    .venv/bin/python experiments/questions_toy.py --question 3     # the token rule (--token-rule) under both --token-scope
    .venv/bin/python experiments/questions_toy.py --question 7     # DAPO's filter against max-Var(A) selection

Each variant is toy/bandit.py's run() with a few flags added (all others at their defaults: 80 steps,
G = 32), on seeds 0..S-1; seed s fixes the task, the initial policy and the prompt order of every
variant. Per variant: the final expected reward and its mean over the run (mean ± std over seeds);
each minus its reference row seed by seed, mean [95% t interval] (a difference counts only where the
interval excludes 0); the steps until the expected reward first reaches GRPO's final reward on the
same seed (mean over the seeds that get there, counted); the rollouts and tokens trained in the run, and
the optimizer steps taken (a dapo-filter step whose groups all lack spread takes none); the share of the
trained tokens at decision positions (the ones the reward reads), mean over steps.
Writes OUT/qN.md (table and command), OUT/qN.json (per-seed numbers) and the figures OUT/qN*.png.
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
sys.path.insert(0, os.path.join(ROOT, "toy"))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
from support import stops  # noqa: E402

PROG = "questions_toy.py"
REF = "d3s"  # the paper's method at the toy's defaults: the reference row unless a row names another

# A variant: (label, method, toy flags, reference label). The label is what the table shows.
SWEEPS = {"n-init": (4, 12, 16, 24), "n-final": (16, 20, 24), "k-init": (0.02, 0.1, 0.2), "k-final": (0.1, 0.3, 0.5)}
GRID_N, GRID_K = (4, 8, 16, 32), (0.02, 0.05, 0.1, 0.2)  # question 1's K_init x N_init heatmap


def grid_cell(n, k):
    """Question 1's heatmap cell N_init = n, K_init = k as a variant (the default's flags left out)."""
    flags = (() if n == 8 else ("--n-init", str(n))) + (() if k == 0.05 else ("--k-init", f"{k:g}"))
    return (" ".join(("d3s",) + flags), "d3s", flags, REF)


def variants(question):
    base = [("grpo", "grpo", (), REF), (REF, "d3s", (), REF)]
    if question == 1:
        sweep = [
            (f"d3s --{flag} {v:g}", "d3s", (f"--{flag}", f"{v:g}"), REF) for flag, vals in SWEEPS.items() for v in vals
        ]
        labels = {label for label, *_ in base + sweep}
        return base + sweep + [cell for n in GRID_N for k in GRID_K if (cell := grid_cell(n, k))[0] not in labels]
    if question == 2:
        kinds = [
            (f"d3s --schedule {kind}", "d3s", ("--schedule", kind), REF)
            for kind in ("cosine", "step", "constant", "adaptive")
        ]
        return base + kinds + [("d2s", "d2s", (), REF)]
    if question == 3:
        return base + [
            (
                f"d3s --token-rule {rule} --token-scope {scope}",
                "d3s",
                ("--token-rule", rule, "--token-scope", scope),
                REF,
            )
            for scope in ("batch", "sequence")
            for rule in ("adv-entropy", "entropy", "adv", "random")
            if (rule, scope) != ("adv-entropy", "batch")
        ]
    # question 7: the filter against the max-variance rule, without token selection and with D3S's
    return base[:1] + [
        ("d1s-cross", "d1s-cross", (), "grpo"),
        ("dapo-filter", "dapo-filter", (), "d1s-cross"),
        (REF, "d3s", (), "grpo"),
        ("dapo-filter-k", "dapo-filter-k", (), REF),
    ]


def run_one(job):
    """One toy run: (method, flags, seed, steps) -> its log (toy/bandit.py's run)."""
    import torch

    import bandit

    method, flags, seed, steps = job
    torch.set_num_threads(1)
    from toy_ladder import columns

    return job, columns(
        bandit.run(method, seed, bandit.parse_args(list(flags) + ["--steps", str(steps), "--workers", "1"]))
    )


def run_all(rows, seeds, steps, workers):
    """{(method, flags): [log of seed 0, 1, ...]}, each distinct run once, in `workers` processes."""
    import multiprocessing as mp

    jobs = sorted({(m, f, s, steps) for _, m, f, _ in rows for s in range(seeds)})
    with stops.sigint_ignored():  # the workers leave a Ctrl-C to this process (one line, no traceback each)
        pool = mp.get_context("spawn").Pool(workers) if workers > 1 else None
    logs = {}
    try:
        for (method, flags, seed, _), log in pool.imap_unordered(run_one, jobs) if pool else map(run_one, jobs):
            logs.setdefault((method, flags), {})[seed] = log
    except BaseException:  # a Ctrl-C (or a failed run): the workers end now
        if pool:
            pool.terminate()
        raise
    if pool:
        pool.close(), pool.join()
    return {key: [runs[s] for s in range(seeds)] for key, runs in logs.items()}


def measures(logs, grpo):
    """Per seed: final reward, mean reward over the run, steps to GRPO's final on that seed, tokens trained."""
    import toy_ladder

    return {
        "final": [log["eval_reward"][-1] for log in logs],
        "mean": [sum(log["eval_reward"]) / len(log["eval_reward"]) for log in logs],
        "steps": [toy_ladder.steps_to(log, ref["eval_reward"][-1]) for log, ref in zip(logs, grpo)],
        "tokens": [sum(log["kept_tokens"]) for log in logs],
        "rollouts": [sum(log["kept_samples"]) for log in logs],
        "updates": [sum(log["updates"]) for log in logs],
        "decision": [sum(log["decision_share"]) / len(log["decision_share"]) for log in logs],
    }


def table(rows, numbers):
    """Markdown: one row per variant, paired with its reference row."""
    import stats

    def diff(label, ref, key, fmt):
        if label == ref:
            return "(reference)"
        m, lo, hi = stats.paired_interval([a - b for a, b in zip(numbers[label][key], numbers[ref][key])])
        mark = " **≠**" if stats.excludes_zero(lo, hi, fmt) else ""
        return (fmt % m) + (" [%s, %s]" % (fmt % lo, fmt % hi) if lo is not None else "") + mark

    head = [
        "variant",
        "final reward",
        "− reference (95%)",
        "mean reward over the run",
        "− reference (95%)",
        "steps to GRPO's final (seeds)",
        "rollouts trained (k)",
        "tokens trained (k)",
        "updates",
        "decision share",
        "reference",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, _, _, ref in rows:
        n = numbers[label]
        reached = [s for s in n["steps"] if s is not None]
        steps = ("%.0f ± %.0f" % stats.mean_std(reached) if reached else "–") + " (%d/%d)" % (
            len(reached),
            len(n["steps"]),
        )
        out.append(
            "| "
            + " | ".join(
                [
                    f"`{label}`",
                    "%.3f ± %.3f" % stats.mean_std(n["final"]),
                    diff(label, ref, "final", "%+.3f"),
                    "%.3f ± %.3f" % stats.mean_std(n["mean"]),
                    diff(label, ref, "mean", "%+.3f"),
                    steps,
                    "%.1f" % (stats.mean_std(n["rollouts"])[0] / 1000),
                    "%.1f" % (stats.mean_std(n["tokens"])[0] / 1000),
                    "%.1f" % stats.mean_std(n["updates"])[0],
                    "%.2f" % stats.mean_std(n["decision"])[0],
                    f"`{ref}`",
                ]
            )
            + " |"
        )
    return "\n".join(out)


def grid_table(numbers):
    """Question 1's K_init x N_init grid as a markdown matrix: final reward, its difference to the default
    (** where the 95% interval excludes 0), and the steps to GRPO's final (seeds that reach it)."""
    import stats

    out = ["| K_init \\ N_init | " + " | ".join(map(str, GRID_N)) + " |", "|---|" + "---|" * len(GRID_N)]
    for k in GRID_K:
        cells = []
        for n in GRID_N:
            mine, ref = numbers[grid_cell(n, k)[0]], numbers[REF]
            m, lo, hi = stats.paired_interval([a - b for a, b in zip(mine["final"], ref["final"])])
            reached = [s for s in mine["steps"] if s is not None]
            diff = (
                "default"
                if (n, k) == (8, 0.05)
                else ("**%+.3f**" if stats.excludes_zero(lo, hi, "%+.3f") else "%+.3f") % m
            )
            cells.append(
                "%.3f (%s); %s steps (%d/%d)"
                % (
                    stats.mean_std(mine["final"])[0],
                    diff,
                    "%.0f" % stats.mean_std(reached)[0] if reached else "–",
                    len(reached),
                    len(mine["steps"]),
                )
            )
        out.append(f"| {k:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_curves(rows, logs, path, title, budget=False):
    """Expected reward against step, mean over seeds (band: ± one std), one line per variant; with budget,
    a second panel: the tokens trained per step (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, axes = plt.subplots(1, 2 if budget else 1, figsize=(12 if budget else 7.5, 4.2), squeeze=False)
    ax = axes[0][0]
    for i, (label, method, flags, _) in enumerate(rows):
        runs, color, style = (
            logs[(method, flags)],
            "C%d" % (i % 10),
            "--" if method in ("grpo", "d2s", "d1s-cross") else "-",
        )
        reward = torch.tensor([log["eval_reward"] for log in runs])
        mean, std = reward.mean(0), reward.std(0)
        ax.plot(runs[0]["eval_step"], mean, color=color, lw=1.3, label=label, ls=style)
        ax.fill_between(runs[0]["eval_step"], mean - std, mean + std, color=color, alpha=0.08, lw=0)
        if budget and method != "grpo":
            tokens = torch.tensor([log["kept_tokens"] for log in runs], dtype=torch.float).mean(0)
            axes[0][1].plot(runs[0]["step"], tokens, color=color, lw=1.3, ls=style, label=label)
    ax.set(xlabel="step", ylabel="expected reward, all prompts", title=title)
    ax.legend(fontsize=7)
    if budget:
        axes[0][1].set(
            xlabel="step",
            ylabel="tokens in the loss per step (mean over seeds)",
            title="the budget each variant trains on (GRPO: 2048)",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_grid(numbers, path, seeds):
    """Question 1's heatmap, K_init x N_init: final reward, mean reward over the run, steps to GRPO's final."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell(n, k, key):
        values = [v for v in numbers[grid_cell(n, k)[0]][key] if v is not None]
        return (sum(values) / len(values) if values else float("nan")), len(values)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name, cmap in (
        (axes[0], "final", "final reward (mean)", "viridis"),
        (axes[1], "mean", "mean reward over the run (mean)", "viridis"),
        (axes[2], "steps", "steps to GRPO's final (mean; seeds that reach it)", "viridis_r"),
    ):
        grid = [[cell(n, k, key) for n in GRID_N] for k in GRID_K]
        image = ax.imshow([[v for v, _ in row] for row in grid], cmap=cmap, origin="lower", aspect="auto")
        for y, row in enumerate(grid):
            for x, (v, count) in enumerate(row):
                text = "%.3f" % v if key != "steps" else "%.0f\n(%d/%d)" % (v, count, seeds)
                r, g, b, _ = image.cmap(image.norm(v))
                ax.text(
                    x,
                    y,
                    text,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white",
                )
        ax.set(
            xticks=range(len(GRID_N)),
            xticklabels=GRID_N,
            yticks=range(len(GRID_K)),
            yticklabels=GRID_K,
            xlabel="N_init (N_final = 32)",
            ylabel="K_init (K_final = 0.2)",
            title=name,
        )
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv):
    f, n = cli.flag, cli.number
    flags = [
        f("--question", "all", ["1", "2", "3", "7", "all"], "which table"),
        f("--seeds", 10, n(int, 2, 1000, what="an int in [2, 1000] (an interval needs 2)"), "seeds per variant"),
        f("--steps", 80, n(int, 1, 100_000), "training steps per run (the toy's)"),
        f("--workers", 1, n(int, 1, 64), "runs in parallel (processes)"),
        f("--out", "runs/questions_toy", None, "output folder"),
    ]
    p = cli.parser(PROG, __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    cli.check_out_dir(p, "--out", args.out)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)  # before torch: a bad flag costs no import
    os.makedirs(args.out, exist_ok=True)
    for question in [1, 2, 3, 7] if args.question == "all" else [int(args.question)]:
        start, rows = time.time(), variants(question)
        logs = run_all(rows, args.seeds, args.steps, args.workers)
        grpo = logs[("grpo", ())]
        numbers = {label: measures(logs[(method, flags)], grpo) for label, method, flags, _ in rows}
        text = table(rows, numbers) + ("\n\n" + grid_table(numbers) if question == 1 else "")
        command = " ".join(
            [
                "experiments/questions_toy.py",
                "--question",
                str(question),
                "--seeds",
                str(args.seeds),
                "--steps",
                str(args.steps),
            ]
        )
        done = "%d runs in %.0f s; %s, %s" % (
            len({(m, f) for _, m, f, _ in rows}) * args.seeds,
            time.time() - start,
            command,
            time.strftime("%Y-%m-%d %H:%M %Z"),
        )
        name = os.path.join(args.out, f"q{question}")
        with open(name + ".md", "w") as f:
            f.write(f"{text}\n\n{done}\n")
        with open(name + ".json", "w") as f:
            json.dump({"command": command, "seeds": args.seeds, "steps": args.steps, "numbers": numbers}, f)
        if question == 1:
            plot_grid(numbers, name + "_grid.png", args.seeds)
            shown = (
                "grpo",
                REF,
                "d3s --n-final 16",
                "d3s --k-final 0.1",
                "d3s --k-final 0.5",
                "d3s --n-init 32 --k-init 0.2",
            )
            plot_curves(
                [r for r in rows if r[0] in shown],
                logs,
                name + ".png",
                f"D3S, one end of the schedule moved, mean ± std of {args.seeds} seeds",
            )
        else:
            titles = {
                2: "schedule shapes (d3s --schedule) and d2s",
                3: "token rules and scopes (d3s)",
                7: "DAPO's filter against max-Var(A) selection",
            }
            shown = rows if question != 3 else [r for r in rows if "random" not in r[0] or "batch" in r[0]]
            plot_curves(
                shown,
                logs,
                name + ".png",
                titles[question] + f", mean ± std of {args.seeds} seeds",
                budget=question in (2, 7),
            )
        print(f"## Question {question}\n\n{text}\n\n{done}\n", flush=True)


if __name__ == "__main__":
    stops.interruptible(main, PROG)
