"""experiments/small_ladder.py: docs/small_compare.md's tables: train_small.py's methods over RL seeds, paired with GRPO.

Every method of --compare runs from the same warm start (support/warmstart.py, cached) for --seeds RL seeds each, into
OUT/<method>/seed<S>/ (each a train_small.py run: metrics.jsonl, summary.json, final/); then OUT/compare.md and
OUT/compare.png: held-out Pass@1 at the last step (mean ± std over seeds; each row minus GRPO seed by seed, with a
95% t interval), the training speed-up to GRPO's final Pass@1 (in steps, update seconds and whole-step seconds),
Pass@1 by level, the costs and the paper's metrics, where a step's time goes. Takes every train_small.py flag.

    python experiments/small_ladder.py --compare grpo,d1s,d1s-cross,d2s,d3s,d3s-i --seeds 3   # the ladder (names as notes on the paper quote them)
    python experiments/small_ladder.py --compare grpo,d3s --seeds 5 --workers 2 --threads 1   # 2 runs at a time
    python experiments/small_ladder.py --compare grpo,d3s --seeds 5 --resume                  # finish a killed compare
"""

import copy
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from support import checkpoint, cli, run, stops  # noqa: E402
import train_small  # noqa: E402
from support import methods, warmstart, mathtask  # noqa: E402
from support.mathtask import DataError  # noqa: E402
from stats import crossing, paired_interval  # noqa: E402

PROG = "small_ladder.py"


def parse_args(argv=None):
    """train_small.py's flags, and --compare, --seeds, --workers; one line and exit 2 on a bad one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = train_small.build_parser(PROG)
    p.add_argument("--compare", required=True, metavar="M1,M2,...", help="the methods to run from the same warm start")
    p.add_argument(
        "--seeds",
        type=cli.number(int, 1, 1000),
        default=1,
        help="RL seeds per method (--rl-seed, --rl-seed + 1, ...); the warm start is the same for all",
    )
    p.add_argument(
        "--workers",
        type=cli.number(int, 1, 64),
        default=1,
        help="runs at once, each a train_small.py process "
        "(give each --threads 1 on a small machine: 2 workers x 1 thread on 2 cores)",
    )
    p.set_defaults(mid_eval_samples=2)  # (choice) smaller evaluations before the last: a 7 x 5 ladder in under an hour
    p.set_defaults(out="runs/ladder")  # one folder per ladder (a run of train_small.py: a new one each time)
    names = p.parse_args(argv).compare.split(",")
    for m in names:
        if m not in methods.LADDER:
            hint = " (d3s-static is now d2s, the paper's name)" if m == "d3s-static" else ""
            p.error(f"--compare {m!r}: unknown method{hint}; choose from {', '.join(methods.NAMES)}")
    args = train_small.parse_args(argv, p, method_names=names)
    if args.stop_after is not None:
        p.error(f"--stop-after {args.stop_after}: stops one run; drop it with --compare")
    for m in names:  # a method's folder linked to the runs of another compare that were never made
        folder = os.path.join(args.out, m)
        if os.path.islink(folder) and not os.path.exists(folder):
            p.error(
                f"--out {args.out}: {folder} links to {os.readlink(folder)}, which does not exist; make those runs "
                "first, or remove the link"
            )
    args.argv, args.command = argv, " ".join(["python experiments/small_ladder.py"] + argv)
    return args


def compare(args):
    """Every method of --compare from the same warm start, for --seeds RL seeds each, into OUT/<method>/seed<S>/;
    then OUT/compare.md (mean ± std over seeds) and OUT/compare.png."""
    t0 = time.time()
    names = args.compare.split(",")
    seeds = [args.rl_seed + i for i in range(args.seeds)]
    train_rows, eval_rows = warmstart.fit_files(args, *mathtask.load_data(args), prog=PROG)  # prompts that fit
    warmstart.load_warm_start(args, train_rows)  # build the cache once, outside the timed runs
    if args.workers > 1:
        summaries = compare_in_processes(args, names, seeds)
        write_compare(args, names, seeds, summaries, time.time() - t0)
        return summaries
    summaries, group = {m: [] for m in names}, args.run_group or os.path.basename(os.path.normpath(args.out))
    for seed in seeds:  # seed-major: an interrupted compare has every method of the first seeds
        for method in names:
            sub = copy.copy(args)
            sub.method, sub.rl_seed, sub.compare = method, seed, None
            sub.switch_on_spike = (
                args.switch_on_spike if method in methods.INTRA_TWIN else 0.0
            )  # as compare_in_processes
            sub.out = os.path.join(args.out, method, f"seed{seed}")
            sub.run_name, sub.run_group = f"{method}__{seed}", group  # --report-to: one view per ladder
            done = os.path.join(sub.out, "summary.json")
            lines = run.read_metrics(os.path.join(sub.out, "metrics.jsonl"))
            if os.path.exists(done) and lines and lines[-1]["step"] == args.steps:
                with open(done) as f:
                    summaries[method].append(json.load(f))  # finished before the kill
                continue
            sub.resume = "auto"  # a killed run resumes from its checkpoint, as compare_in_processes' runs do
            flags = {k: getattr(sub, k) for k in train_small.RUN_FLAGS}
            with run.out_lock(sub.out, "train_small.py"):
                resume = checkpoint.start(sub, flags, "train_small.py")
                run.write_args(sub, flags)
                warm = warmstart.load_warm_start(sub, train_rows)
                summaries[method].append(train_small.train(sub, train_rows, eval_rows, warm, resume))
    write_compare(args, names, seeds, summaries, time.time() - t0)
    return summaries


def compare_in_processes(args, names, seeds):
    """--compare with --workers W: each run is `python train_small.py --method M --rl-seed S --out
    OUT/M/seedS` with the compare's other flags, W at a time, seed-major (so the methods share the
    machine's load alike); a finished run (summary.json at the last step) is not run again, a
    killed one resumes from its checkpoint. Its log goes to OUT/M/seedS.log."""
    drop = {"--compare": 1, "--seeds": 1, "--workers": 1, "--out": 1, "--method": 1, "--rl-seed": 1, "--resume": 0}
    drop.update({"--run-name": 1, "--run-group": 1})  # each run's own, in one group: a ladder is one tracker view
    group = args.run_group or os.path.basename(os.path.normpath(args.out))
    base, i = [], 0
    while i < len(args.argv):
        flag = args.argv[i].split("=")[0]
        if flag in drop:
            has_value = drop[flag] and "=" not in args.argv[i]
            i += 1 + (
                has_value
                if flag != "--resume"
                else int(i + 1 < len(args.argv) and not args.argv[i + 1].startswith("--"))
            )
            continue
        base.append(args.argv[i])
        i += 1
    jobs = []
    for seed in seeds:
        for method in names:
            out = os.path.join(args.out, method, f"seed{seed}")
            lines = run.read_metrics(os.path.join(out, "metrics.jsonl"))
            if os.path.exists(os.path.join(out, "summary.json")) and lines and lines[-1]["step"] == args.steps:
                continue
            resume = ["--resume", "auto"]  # a killed run resumes from its checkpoint, else starts
            switch = ["--switch-on-spike", "0"] if method not in methods.INTRA_TWIN else []  # a row without a twin: off
            jobs.append(
                (
                    out,
                    [
                        sys.executable,
                        os.path.join(ROOT, "train_small.py"),
                        *base,
                        "--method",
                        method,
                        "--rl-seed",
                        str(seed),
                        "--out",
                        out,
                        *resume,
                        *switch,
                        "--run-name",
                        f"{method}__{seed}",
                        "--run-group",
                        group,
                        "--mid-eval-samples",
                        str(args.mid_eval_samples),
                    ],
                )
            )

    def run_one(job):  # one train_small.py process; its log in OUT/M/seedS.log
        out, cmd = job
        os.makedirs(out, exist_ok=True)
        with open(out + ".log", "w") as log:
            return out, subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode

    pool = ThreadPoolExecutor(args.workers)  # threads that wait on processes: --workers runs at a time, in order
    try:
        for out, code in tqdm(pool.map(run_one, jobs), total=len(jobs), desc=f"--compare, {args.workers} workers"):
            if code != 0:
                raise cli.UsageError(
                    f"--compare: the run in {out} failed (exit {code}); see {out}.log, fix it and rerun "
                    "the same command with --resume"
                )
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure, the runs not yet started are not started
    summaries = {m: [] for m in names}
    for seed in seeds:
        for method in names:
            with open(os.path.join(args.out, method, f"seed{seed}", "summary.json")) as f:
                summaries[method].append(json.load(f))
    return summaries


def fmt_mean_std(values, fmt="%.3f"):
    """'m ± s' over seeds (sample std; just 'm' for one seed)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return fmt % m
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{fmt % m} ± {fmt % s}"


def ladder_rows(summaries, names, base="grpo"):
    """The numbers of compare.md, per method (summaries[m]: one summary per seed, in the same seed
    order for every method):
      final:  held-out Pass@1 (mean of n) at the last step, one per seed;
      diff:   (mean, lower, upper) of the same-seed differences to `base`, 95% t interval over seeds
              (stats.paired_interval); verdict 'better' / 'worse' only if the interval excludes 0;
      to_target: the paper's "training speed-up", both ways: on the seed-mean curve of Pass@1, the
              step, the update seconds and the whole-step seconds (generate + grade + update) at which
              it first reaches `base`'s final mean Pass@1 (interpolated; None: never), and the
              speed-up = base's / this row's (> 1: faster than base).
    """
    base_final = [s["final"]["pass1_mean"] for s in summaries[base]]
    target = sum(base_final) / len(base_final)
    curves = {}
    for m in names:
        evals = [s["evals"] for s in summaries[m]]
        n_evals = min(len(e) for e in evals)
        mean = lambda key: [sum(e[i][key] for e in evals) / len(evals) for i in range(n_evals)]
        curves[m] = {
            "step": mean("step"),
            "pass1": mean("pass1_mean"),
            "update_s": mean("update_s"),
            "step_s": mean("rl_s"),
        }
    rows = {}
    for m in names:
        final = [s["final"]["pass1_mean"] for s in summaries[m]]
        c = curves[m]
        to_target = {x: crossing(c[x], c["pass1"], target) for x in ("step", "update_s", "step_s")}
        row = {"final": final, "to_target": to_target, "curve": c}
        if m != base:
            d, lo, hi = paired_interval([a - b for a, b in zip(final, base_final)])
            row["diff"] = (d, lo, hi)
            row["verdict"] = (
                "no interval (1 seed)" if lo is None else "better" if lo > 0 else "worse" if hi < 0 else "no difference"
            )
        rows[m] = row
    for m in names:
        rows[m]["speedup"] = {
            x: (
                None
                if rows[m]["to_target"][x] in (None, 0.0) or rows[base]["to_target"][x] is None
                else rows[base]["to_target"][x] / rows[m]["to_target"][x]
            )
            for x in ("step", "update_s", "step_s")
        }
    return target, rows


def write_compare(args, names, seeds, summaries, total_s):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s0 = summaries[names[0]][0]
    k, n = s0["final"]["k"], s0["final"]["n"]
    base = "grpo" if "grpo" in names else names[0]
    S = len(seeds)
    target, lrows = ladder_rows(summaries, names, base)
    avg = lambda values: sum(values) / len(values)
    fmt_x = lambda v, f="%.0f": "never" if v is None else f % v
    fmt_r = lambda v: "" if v is None else f" ({v:.2f}x)"

    outcome = [
        f"| method | Pass@1 (mean of {n}) | Δ vs {base}, 95% interval | verdict | greedy Pass@1 | Pass@{k} |",
        "|---|---|---|---|---|---|",
    ]
    speed = [f"| method | steps to {target:.3f} | update s to it | whole-step s to it |", "|---|---|---|---|"]
    levels = sorted(key for key in s0["final"] if key.startswith("level"))
    by_level = [
        "| method | " + " | ".join(f"L{key[5:]} start → end" for key in levels) + " |",
        "|---" * (len(levels) + 1) + "|",
    ]
    costs = [
        "| method | rollouts trained | tokens in loss | tokens forwarded | SUR | K realised / scheduled | KL to start "
        "(last) | entropy all / kept | mean grad norm |",
        "|---" * 9 + "|",
    ]
    times = [
        "| method | generate s/step | grade s/step | pass 1 s/step | update s/step | whole step s |",
        "|---" * 6 + "|",
    ]
    for m in names:
        runs, r = summaries[m], lrows[m]
        col = lambda f, fmt="%.3f": fmt_mean_std([f(s) for s in runs], fmt)
        if m == base:
            diff, verdict = "(reference)", ""
        else:
            d, lo, hi = r["diff"]
            diff = f"{d:+.3f}" + ("" if lo is None else f" [{lo:+.3f}, {hi:+.3f}]")
            verdict = r["verdict"]
        outcome.append(
            f"| {m} | {fmt_mean_std(r['final'])} | {diff} | {verdict} | {col(lambda s: s['final']['greedy_pass1'])} | "
            f"{col(lambda s: s['final']['passk'])} |"
        )
        t, sp = r["to_target"], r["speedup"]
        speed.append(
            f"| {m} | {fmt_x(t['step'], '%.1f')}{fmt_r(sp['step'])} | {fmt_x(t['update_s'])}{fmt_r(sp['update_s'])} | "
            f"{fmt_x(t['step_s'])}{fmt_r(sp['step_s'])} |"
        )
        by_level.append(
            f"| {m} | "
            + " | ".join(
                f"{avg([s['warm_start'].get(key, 0) for s in runs]):.2f} → {avg([s['final'][key] for s in runs]):.2f}"
                for key in levels
            )
            + " |"
        )
        kl = [s["final_kl_ref"] for s in runs if s.get("final_kl_ref") is not None]
        costs.append(
            f"| {m} | {col(lambda s: s['samples_trained'], '%.0f')} | {col(lambda s: s['tokens_trained'], '%.0f')} | "
            f"{col(lambda s: s['tokens_forwarded'], '%.0f')} | {col(lambda s: s['mean_sur'], '%.2f')} | "
            f"{col(lambda s: s['mean_k_real'])} / {col(lambda s: s['mean_k_frac'])} | "
            f"{fmt_mean_std(kl) if kl else 'n/a'} | {col(lambda s: s['mean_entropy'])} / "
            f"{col(lambda s: s['mean_entropy_kept'] or 0.0)} | {col(lambda s: s['mean_grad_norm'] or 0.0)} |"
        )
        tp = {key: avg([s["time_per_step"][key] for s in runs]) for key in ("gen", "reward", "pass1", "train")}
        times.append(
            f"| {m} | {tp['gen']:.2f} | {tp['reward']:.2f} | {tp['pass1']:.2f} | {tp['train'] - tp['pass1']:.2f} | "
            f"{tp['gen'] + tp['reward'] + tp['train']:.2f} |"
        )
    w = s0["warm_start"]
    text = "\n".join(
        [
            f"# train_small.py --compare ({args.loss} loss, {args.steps} steps, {S} RL seed{'s' * (S > 1)}: "
            f"{', '.join(map(str, seeds))})",
            "",
            f"Command: `{args.command}`  ",
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
            f"total time {total_s / 60:.1f} min.  ",
            f"Warm start (the same for every run): held-out greedy Pass@1 {w['greedy_pass1']:.3f}, Pass@1 mean@{w.get('n', n)} "
            f"{w['pass1_mean']:.3f}, Pass@{w.get('k', k)} {w['passk']:.3f}.",
            "",
            "## Held-out Pass@1 at the last step",
            "",
            *outcome,
            "",
            f"Mean ± std over the {S} seeds (same warm start, data and held-out set; the seed sets prompt order, sampling and "
            f"random selection). Δ: the mean of the same-seed differences to {base}, with a 95% Student-t interval over the "
            f"{S} paired differences (mean ± t(0.975, {S - 1}) · sd / √{S}); a row differs from {base} only if its interval "
            f"excludes 0. Held-out set: {args.eval_size} problems, {n} samples each at temperature {args.temperature} "
            f"({args.mid_eval_samples} at the evaluations before the last).",
            "",
            f"## Training speed-up: reaching {base}'s final mean Pass@1 ({target:.3f})",
            "",
            *speed,
            "",
            f"On the seed-mean curve of held-out Pass@1 (evaluated every {args.eval_every} steps), the first point at which a "
            f"row reaches {base}'s final mean, interpolated linearly between evaluations; in steps, in update seconds "
            f"(forward, backward, optimizer) and in whole-step seconds (generate + grade + update; evaluation excluded). "
            f"In brackets: the speed-up, {base}'s figure / the row's (> 1: faster). 'never': not reached in {args.steps} steps.",
            "",
            "## Where RL helped: held-out Pass@1 by level (mean over seeds)",
            "",
            *by_level,
            "",
            "## Costs and the paper's metrics (mean ± std over seeds)",
            "",
            *costs,
            "",
            "Tokens in loss: the response tokens that token selection kept; tokens forwarded: the response tokens of the kept "
            "rollouts (the forward/backward cost). SUR: the share of trained rollouts with a non-zero advantage. KL: k3 to the "
            "warm start on the selected tokens, at the last step that measured it. Entropy: per token, of all forwarded tokens "
            "/ of the selected ones, mean over steps.",
            "",
            "## Where a step's time goes (mean over steps and seeds)",
            "",
            *times,
            "",
            "Pass 1: the no-grad forward for the old log-probs of mini-batches 2..M (and the reference on KL steps); update: "
            "token selection and the M forward/backward/optimizer steps.",
            "",
        ]
    )
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(text)

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for i, m in enumerate(names):
        color, style = f"C{i % 10}", "-" if methods.selects_tokens(m) else "--"  # dashed: no token selection
        evals = [s["evals"] for s in summaries[m]]
        n_evals = min(len(e) for e in evals)
        acc = torch.tensor([[e["pass1_mean"] for e in ev[:n_evals]] for ev in evals])  # [seeds, evals]
        curve = lrows[m]["curve"]
        for ax, x in ((axes[0], curve["step"]), (axes[1], curve["step_s"])):
            mean, std = acc.mean(0), (acc.std(0) if len(acc) > 1 else torch.zeros(acc.shape[1]))
            ax.plot(x, mean, style, color=color, label=m, lw=1.3)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.12, lw=0)
        if m != base:
            d, lo, hi = lrows[m]["diff"]
            axes[2].errorbar(
                [d], [i], xerr=None if lo is None else [[d - lo], [hi - d]], fmt="o", color=color, capsize=4
            )
        train = [
            [t for t in run.read_metrics(os.path.join(s["out"], "metrics.jsonl")) if t["kind"] == "train"]
            for s in summaries[m]
        ]
        gnorm = torch.tensor(
            [[t["grad_norm"] if t.get("grad_norm") is not None else math.nan for t in tr] for tr in train]
        )
        axes[3].plot([t["step"] for t in train[0]], gnorm.nanmean(0), style, color=color, label=m, lw=1.0)
    for ax in axes[:2]:
        ax.axhline(target, color="grey", lw=0.8, ls=":")
    axes[0].set(xlabel="RL step", ylabel=f"held-out Pass@1 (mean of {n})", title="mean ± std over seeds")
    axes[1].set(xlabel="whole-step seconds (generate + grade + update)", ylabel=f"held-out Pass@1 (mean of {n})")
    axes[2].axvline(0, color="grey", lw=0.8)
    axes[2].set(
        yticks=range(len(names)),
        yticklabels=names,
        xlabel=f"final Pass@1 − {base} (same seed), 95% interval",
        title="paired differences",
    )
    axes[3].set(xlabel="RL step", ylabel="gradient norm before clipping (seed mean)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"train_small.py --compare: tiny Qwen2, --task {args.task}, {args.loss} loss, {S} seed{'s' * (S > 1)}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "compare.png"), dpi=100)
    plt.close(fig)
    print("\n" + text + f"\nwrote {os.path.join(args.out, 'compare.md')} and compare.png")


def main(argv=None):
    args = parse_args(argv)
    try:  # every bad flag, file or model stops here, before training, with one line
        mathtask.load_data(args)
        with run.out_lock(args.out, "train_small.py"):
            return compare(args)
    except (cli.UsageError, DataError) as e:
        stops.fail(PROG, e)


if __name__ == "__main__":
    stops.interruptible(
        main,
        PROG,
        "the finished runs are kept and each stopped one resumes from its checkpoint: run the same command again",
    )
