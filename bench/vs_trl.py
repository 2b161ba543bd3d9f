"""bench/vs_trl.py: TRL's GRPOTrainer against train_small.py (grpo and d3s) and TRL + D3S, same everything else.

    .venv/bin/python bench/vs_trl.py                         # 20 steps x 2 repeats (tens of minutes on 2 cores)
    .venv/bin/python bench/vs_trl.py --quick                 # 2 steps, 1 repeat, tiny batch (the smoke test)
    .venv/bin/python bench/vs_trl.py --arms trl,trl-d3s --seeds 0,1,2 --repeats 1   # TRL + D3S vs TRL, 3 seeds
    .venv/bin/python bench/vs_trl.py --steps 40 --repeats 3 --out docs_table.md

Needs the TRL venv (TRL is not a dependency of the project's own .venv; .ci/run builds it):
    python3 -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl.txt

What is compared. Five arms, each one subprocess, on the same tiny Qwen2 model (train_small.py's
supervised warm start, cached in --cache-dir and loaded from that folder by every arm), the same
generated arithmetic problems (written once to WORK/train.jsonl and WORK/eval.jsonl), the same
batch (P prompts x G rollouts), response length, temperature, learning rate, clipping and seed:
  trl       .venv-trl/bin/python bench/trl_arm.py     trl.GRPOTrainer (HF generate, beta 0), GRPOConfig's
                                                      own default gradient_checkpointing=True
  trl-nogc  the same with gradient_checkpointing=False (no recomputation: train_small's setting)
  grpo      .venv/bin/python train_small.py --method grpo
  d3s       .venv/bin/python train_small.py --method d3s  (N and K on train_small's default schedule)
  trl-d3s   .venv-trl/bin/python bench/trl_arm.py --d3s-method d3s: integrations/trl.py's D3SGRPOTrainer,
            the trl arm's GRPOConfig plus D3S's fields (the same N and K schedule as the d3s arm)
The train_small arms run one optimizer step per batch (--mini-batches 1) and clip 0.2/0.2, as TRL does.
trl_arm.py replays train_small.py's prompt order and per-step sampling seed. The TRL arms draw the same
step-1 rollouts among themselves, and so do the train_small arms; across the two samplers they differ
(train_small encodes a prompt once and repeats its KV cache: HF generate's tokens only up to rounding).
The arms run in the order trl, trl-nogc, grpo, d3s, trl-d3s, trl, ... (--repeats rounds, and
within a round one pass per --seeds entry), so drift of a shared machine hits all of them.
--seeds sets the RL seed of each run (prompt order, sampling, TRL's seed: train_small's --rl-seed);
the data, the warm start and the held-out set stay those of --seed. Every arm uses --threads torch threads (default 1: on a
shared 2-core machine two threads per process oversubscribe the cores and a step gets many
times slower, unevenly across arms).

Measured per arm (means over seeds and repeats; per-step numbers are means over steps 2..S of each run,
step 1 also pays one-off costs such as the grader's first math-verify import):
  gen      rollouts: tokenize + HF generate + decode      (TRL: GRPOTrainer._generate)
  reward   math-verify grading (grading.Grader)           (TRL: GRPOTrainer._calculate_rewards)
  update   everything else in the step: advantages (+ selection), loss forward/backward,
           clipping, AdamW step                            (TRL: step time - gen - reward)
  peak RSS the arm process's peak resident set (os.wait4's ru_maxrss: the largest of the
           process and its reaped children, i.e. the grader's child), and the peak of the sum
           over its process tree sampled every 0.1 s from /proc
  held-out greedy Pass@1 after the run (train_small.evaluate in both environments), and before.
Writes the markdown table and the notes to stdout and to --out, the raw numbers to WORK/results.json.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)

ARMS = ("trl", "trl-nogc", "grpo", "d3s", "trl-d3s")
TRL_ARMS = ("trl", "trl-nogc", "trl-d3s")  # run by trl_arm.py in the TRL venv
PLAIN_TRL_ARMS = ("trl", "trl-nogc")  # GRPOConfig as TRL ships it (gradient checkpointing on), and with it off
TRL_SPLIT = ("prep_other_s", "loss_fwd_s", "backward_s", "optim_s")  # trl_arm.py's split of its update_s


def parse_args(argv=None):
    """Every flag before any work, and before TRL (the TRL venv runs only the arms): the ranges the arms'
    train_small.py and trl_arm.py accept, paths, combinations. A bad one ends in one line, `vs_trl.py: error:
    --flag VALUE: ...`, exit 2."""
    f, n, count = cli.flag, cli.number, cli.number(int, 1, 10**6, what="an int in [1, 10^6]")
    flags = [
        f("--quick", False, bool, "2 steps, 1 repeat, 2 prompts x 4 rollouts, short warm start"),
        f("--steps", 20, n(int, 1), "RL steps per run"),
        f("--repeats", 2, n(int, 1, 1000), "rounds of all arms, in --arms order"),
        f("--arms", ",".join(ARMS), None, "subset/order of " + ",".join(ARMS)),
        f("--prompts-per-step", 16, n(int, 1, 4096), "P"),
        f("--group-size", 16, n(int, 2, 1024, what="an int in [2, 1024] (advantages need 2 rollouts)"), "G"),
        f("--task", "steps", None, "train_small.py's generated task (steps: worked solutions; direct)"),
        f("--max-new-tokens", None, n(int, 1, 65536), "default: train_small.py's for the task"),
        f("--temperature", 1.0, n(float, 0.01, 100), "sampling temperature"),
        f("--lr", 3e-5, n(float, 0, 1, low_open=True), "AdamW's learning rate"),
        f("--max-grad-norm", 1.0, n(float, 0, low_open=True), "the norm the gradient is clipped to"),
        f("--seed", 0, n(int, 0, 2**31 - 1), "seed of the data, the warm start and (without --seeds) the RL runs"),
        f("--seeds", None, None, "comma-separated RL seeds, one run per arm and seed (default: --seed)"),
        f("--train-size", 5000, count, "generated training problems (also the warm start's data)"),
        f("--eval-size", 200, n(int, 1, 10**5, what="an int in [1, 10^5]"), "held-out problems"),
        f(
            "--sft-steps",
            None,
            n(int, 0, 10**6, what="an int in [0, 10^6]"),
            "warm-start steps (default: train_small's; 20 with --quick)",
        ),
        f("--hidden-size", 128, n(int, 8, 4096, what="a multiple of 4 in [8, 4096] (4 heads)"), "the tiny model's"),
        f("--num-layers", 4, n(int, 1, 64), "the tiny model's"),
        f("--threads", 1, n(int, 0, 1024), "torch threads per arm (0: torch's default; 1: no oversubscription)"),
        f("--work", "runs/bench_vs_trl", None, "run folders, data files, logs, results.json"),
        f("--cache-dir", "runs/cache", None, "train_small's warm-start cache"),
        f("--python", os.path.join(ROOT, ".venv", "bin", "python"), None, "the project's python"),
        f("--trl-python", os.path.join(ROOT, ".venv-trl", "bin", "python"), None, "python with trl"),
        f("--out", None, cli.out_file, "also write the markdown here"),
    ]
    p = cli.parser("vs_trl.py", __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    check_args(p, args)
    if args.quick:
        args.steps, args.repeats, args.prompts_per_step, args.group_size = 2, 1, 2, 4
        args.train_size, args.eval_size = min(args.train_size, 200), min(args.eval_size, 16)
        args.sft_steps = 20 if args.sft_steps is None else args.sft_steps
    if args.max_new_tokens is None:
        import train_small

        args.max_new_tokens = train_small.TINY_MAX_NEW_TOKENS[args.task]
    return args


def check_args(p, args):
    """The flags that need each other or the disk (one line, exit 2): the arms, the seeds, the folders, the pythons."""
    if args.hidden_size % 4:
        p.error(f"--hidden-size {args.hidden_size}: must be a multiple of 4 in [8, 4096] (4 heads)")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms:
        p.error(f"--arms {args.arms!r}: empty; pass some of {','.join(ARMS)}")
    for a in arms:
        if a not in ARMS:
            p.error(f"--arms {args.arms}: unknown arm {a!r}; choose from {','.join(ARMS)}")
    if len(set(arms)) != len(arms):
        p.error(f"--arms {args.arms}: an arm is repeated; give each arm once (--repeats runs them again)")
    args.arms = arms
    if args.seeds is None:
        args.seeds = [args.seed]
    else:
        args.seeds = cli.int_list(p, "--seeds", args.seeds, low=0, what="comma-separated integers >= 0", unique=True)
        if max(args.seeds) >= 2**31:
            p.error(f"--seeds {','.join(map(str, args.seeds))}: each seed must be < 2^31")
    cli.check_out_dir(p, "--work", args.work)
    cli.check_out_dir(p, "--cache-dir", args.cache_dir)
    if args.out and os.path.abspath(args.out) == os.path.abspath(os.path.join(args.work, "results.json")):
        p.error(f"--out {args.out}: is WORK/results.json, where the raw numbers go; pass another file")
    fix = "create the project's venv (python3 -m venv .venv && .venv/bin/pip install -r requirements.txt), or pass its python"
    check_python(p, "--python", args.python, fix)  # the warm start runs in it, whatever the arms
    if any(a in TRL_ARMS for a in args.arms):
        fix = "create the TRL venv (see this file's docstring), or run only the train_small arms: --arms grpo,d3s"
        check_python(p, "--trl-python", args.trl_python, fix)
    from support import mathtask  # the tasks (and their lengths) are train_small's; it imports torch, so it comes last

    if args.task not in mathtask.TASKS:
        p.error(f"--task {args.task!r}: not a task of train_small.py; choose {' or '.join(mathtask.TASKS)}")


def check_python(p, flag, path, fix):
    """A python to run: exists, is a file, can be executed."""
    if not os.path.exists(path):
        p.error(f"{flag} {path!r}: not found; {fix}")
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a folder; pass the python executable itself, e.g. {path}/bin/python")
    if not os.access(path, os.X_OK):
        p.error(f"{flag} {path}: not executable; pass a python executable")


# ---------------------------------------------------------------------------------------------
# Setup: data files and the shared warm start (train_small's own cache)
# ---------------------------------------------------------------------------------------------
def small_flags(args):
    """train_small.py flags that fix the model, data and warm start (same for the warm start and the arms)."""
    return [
        "--seed",
        str(args.seed),
        "--hidden-size",
        str(args.hidden_size),
        "--num-layers",
        str(args.num_layers),
        "--template",
        "plain",
        "--task",
        args.task,
        "--train-size",
        str(args.train_size),
        "--eval-size",
        str(args.eval_size),
        "--cache-dir",
        args.cache_dir,
    ] + (["--sft-steps", str(args.sft_steps)] if args.sft_steps is not None else [])


WARM_START_SNIPPET = """
import json, sys
import train_small
from support import mathtask, warmstart
args = train_small.parse_args(sys.argv[1:])
train_rows, eval_rows = mathtask.load_data(args)
for name, rows in (("train", train_rows), ("eval", eval_rows)):
    with open(f"{WORK}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\\n" for r in rows)
_, _, info = warmstart.load_warm_start(args, train_rows)
print("WARM_START=" + json.dumps({k: v for k, v in info.items()}))
"""


def prepare(args):
    """Write WORK/{train,eval}.jsonl (train_small's generated problems) and build/find the warm start."""
    os.makedirs(args.work, exist_ok=True)
    code = WARM_START_SNIPPET.replace("{WORK}", os.path.abspath(args.work))
    proc = subprocess.run([args.python, "-c", code, *small_flags(args)], cwd=ROOT, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("WARM_START=")]
    if proc.returncode != 0 or not line:
        sys.exit(f"vs_trl.py: warm start failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    info = json.loads(line[0][len("WARM_START=") :])
    return info


# ---------------------------------------------------------------------------------------------
# Running one arm: a subprocess, its wall time and peak memory
# ---------------------------------------------------------------------------------------------
def _tree_pids(root):
    pids, stack = [], [root]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def _rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd, log_path, interval=0.1):
    """Run `cmd` (output to log_path); return rc, wall seconds, peak RSS (wait4) and peak tree RSS (sampled)."""
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        peak, done = {"kb": 0}, threading.Event()

        def sample():
            while not done.is_set():
                peak["kb"] = max(peak["kb"], sum(_rss_kb(p) for p in _tree_pids(proc.pid)))
                done.wait(interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (not all children's)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "peak_tree_rss_mb": peak["kb"] / 1024,
    }


def arm_command(arm, args, warm_path, out, seed):
    G = args.group_size
    common = [
        "--steps",
        str(args.steps),
        "--prompts-per-step",
        str(args.prompts_per_step),
        "--group-size",
        str(args.group_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(args.temperature),
        "--lr",
        str(args.lr),
        "--max-grad-norm",
        str(args.max_grad_norm),
        "--train-file",
        os.path.join(args.work, "train.jsonl"),
        "--eval-file",
        os.path.join(args.work, "eval.jsonl"),
        "--train-size",
        str(args.train_size),
        "--eval-size",
        str(args.eval_size),
        "--template",
        "plain",
        "--threads",
        str(args.threads),
        "--model",
        warm_path,
        "--out",
        out,
        # evaluation generates P x G sequences per call, as a training step does, so that the peak
        # memory is the training step's, not that of a larger evaluation batch
        "--gen-batch",
        str(args.prompts_per_step * args.group_size),
    ]
    schedule = ["--n-init", str(max(1, G // 4)), "--n-final", str(G)]  # train_small's N 4 -> 16 of G = 16, scaled to G
    if arm in TRL_ARMS:
        return [
            args.trl_python,
            os.path.join(ROOT, "bench", "trl_arm.py"),
            *common,
            "--seed",
            str(seed),
            "--eval-samples",
            "1",
            "--gradient-checkpointing",
            "off" if arm == "trl-nogc" else "on",
            *(["--d3s-method", "d3s", *schedule] if arm == "trl-d3s" else []),
        ]
    return [
        args.python,
        os.path.join(ROOT, "train_small.py"),
        "--method",
        arm,
        *common,
        "--seed",
        str(args.seed),
        "--rl-seed",
        str(seed),
        "--sft-steps",
        "0",
        "--eval-every",
        str(args.steps),
        "--save-every",
        str(args.steps),
        "--eval-samples",
        "1",
        "--pass-k",
        "1",
        *schedule,
        # one on-policy optimizer step per batch, clip 0.2 / 0.2 and no reference forward, as the TRL arms (beta 0)
        "--mini-batches",
        "1",
        "--clip-low",
        "0.2",
        "--clip-high",
        "0.2",
        "--kl-every",
        "0",
    ]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect(arm, out):
    """Per-step rows and the held-out accuracy of one finished run, in one schema for all arms."""
    rows = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("kind", "train") == "train"]
    steps = [
        {
            "gen_s": r["gen_s"],
            "reward_s": r["reward_s"],
            "update_s": r["update_s"] if arm in TRL_ARMS else r["train_s"],
            "reward_mean": r["reward_mean"],
            "gen_tokens": r["gen_tokens"],
            "fwd_tokens": r.get("fwd_tokens", r["gen_tokens"]),
            "outside_s": r.get("outside_s"),
            "loss_tokens": r.get("loss_tokens", r.get("kept_tokens", r["gen_tokens"])),
            **{k: r.get(k) for k in TRL_SPLIT},
        }
        for r in rows
    ]
    if arm in TRL_ARMS:
        with open(os.path.join(out, "result.json")) as f:
            res = json.load(f)
        acc0, acc = res["eval_greedy_pass1_step0"], res["eval_greedy_pass1"]
    else:
        evals = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("kind") == "eval"]
        acc0, acc = evals[0]["eval_greedy_pass1"], evals[-1]["eval_greedy_pass1"]
    return {"steps": steps, "acc0": acc0, "acc": acc}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def summarize(runs_by_arm):
    """Mean over repeats of the per-run means over steps 2..S (all steps if S = 1)."""
    summary = {}
    for arm, runs in runs_by_arm.items():
        if arm in PLAIN_TRL_ARMS and "grpo" in runs_by_arm:  # how long TRL and grpo stay on the same trajectory
            same = []
            for r_trl, r_grpo in zip(runs, runs_by_arm["grpo"]):
                n = 0
                for a, b in zip(r_trl["steps"], r_grpo["steps"]):
                    if (round(a["reward_mean"], 6), a["gen_tokens"]) != (round(b["reward_mean"], 6), b["gen_tokens"]):
                        break
                    n += 1
                same.append(n)
        per_run = []
        for r in runs:
            steps = r["steps"][1:] or r["steps"]
            m = {
                k: mean([s[k] for s in steps])
                for k in ("gen_s", "reward_s", "update_s", "gen_tokens", "fwd_tokens", "loss_tokens")
            }
            for k in ("outside_s",) + TRL_SPLIT:
                m[k] = mean([s[k] for s in steps])
            m["total_s"] = m["gen_s"] + m["reward_s"] + m["update_s"]
            per_run.append(m)
        s = {k: mean([m[k] for m in per_run]) for k in per_run[0]}
        s["total_sd"] = statistics.stdev([m["total_s"] for m in per_run]) if len(per_run) > 1 else 0.0
        s["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
        s["peak_tree_rss_mb"] = max(r["peak_tree_rss_mb"] for r in runs)
        s["acc0"] = mean([r["acc0"] for r in runs])
        s["acc"] = mean([r["acc"] for r in runs])
        s["accs"] = [r["acc"] for r in runs]
        s["acc_sd"] = statistics.stdev(s["accs"]) if len(runs) > 1 else 0.0
        s["update_sd"] = statistics.stdev([m["update_s"] for m in per_run]) if len(per_run) > 1 else 0.0
        s["seeds"] = [r["seed"] for r in runs]
        s["wall_s"] = mean([r["wall_s"] for r in runs])
        s["n_runs"] = len(runs)
        s["step1"] = [(round(r["steps"][0]["reward_mean"], 6), r["steps"][0]["gen_tokens"]) for r in runs]
        if arm in PLAIN_TRL_ARMS and "grpo" in runs_by_arm:
            s["same_as_grpo"] = same
        summary[arm] = s
    return summary


def ratio(a, b):
    return f"{a / b:.2f}x" if b and b == b and a == a else "n/a"


def render(args, summary, warm, versions, started, total_s):
    ref_arm = next((a for a in args.arms if a in PLAIN_TRL_ARMS), next((a for a in args.arms if a in TRL_ARMS), None))
    ref = summary.get(ref_arm)
    lines = [
        "| arm | gen s/step | reward s/step | update s/step | total s/step | total vs TRL | update vs TRL | "
        "response tokens/step (gen / fwd / loss) | peak RSS MB (process) | peak RSS MB (tree) | "
        "held-out greedy Pass@1 (before -> after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "trl": f"TRL GRPOTrainer {versions.get('trl', '')}".strip(),
        "trl-nogc": f"TRL GRPOTrainer {versions.get('trl', '')}, gradient_checkpointing=False".strip(),
        "grpo": "train_small.py grpo",
        "d3s": "train_small.py d3s",
        "trl-d3s": f"TRL GRPOTrainer {versions.get('trl', '')} + D3S (integrations/trl.py)",
    }
    for arm in args.arms:
        s = summary[arm]
        sd = f" ± {s['total_sd']:.3f}" if s["n_runs"] > 1 else ""
        accs = ", ".join(f"{a:.3f}" for a in s["accs"])
        acc_sd = f" ± {s['acc_sd']:.3f}" if s["n_runs"] > 1 else ""
        lines.append(
            f"| {names[arm]} | {s['gen_s']:.3f} | {s['reward_s']:.3f} | {s['update_s']:.3f} | {s['total_s']:.3f}{sd} | "
            f"{ratio(s['total_s'], ref['total_s']) if ref else 'n/a'} | {ratio(s['update_s'], ref['update_s']) if ref else 'n/a'} | "
            f"{s['gen_tokens']:.0f} / {s['fwd_tokens']:.0f} / {s['loss_tokens']:.0f} | {s['peak_rss_mb']:.0f} | "
            f"{s['peak_tree_rss_mb']:.0f} | {s['acc0']:.3f} -> {s['acc']:.3f}{acc_sd} ({accs}) |"
        )
    same = []
    for arm in (a for a in args.arms if a in PLAIN_TRL_ARMS and "grpo" in summary):
        t1, g1 = summary[arm]["step1"], summary["grpo"]["step1"]
        same.append(
            f"`{arm}` vs `grpo`: step-1 rollouts "
            + (
                "identical (same mean reward and generated-token count in every repeat)"
                if t1 == g1
                else f"different: {t1} vs {g1} (mean reward, generated tokens)"
            )
            + "; steps until the runs first differ in (mean reward, generated tokens), per repeat: "
            + ", ".join(f"{n} of {args.steps}" for n in summary[arm]["same_as_grpo"])
            + ".  "
        )
    cmd = "python bench/vs_trl.py " + " ".join(sys.argv[1:])
    header = [
        f"Command: `{cmd}`  ",
        f"Date: {started:%Y-%m-%d %H:%M} ({total_s / 60:.1f} min in all). Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs ({platform.processor() or 'cpu'}), Python {platform.python_version()}, torch "
        f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}, trl {versions.get('trl', '?')}; "
        f"torch threads {args.threads or 'default'}.  ",
        f"Setup: tiny Qwen2 (hidden {args.hidden_size}, {args.num_layers} layers) warm-started by train_small.py "
        f"({warm.get('sft_steps')} supervised steps, cached at `{warm.get('path')}`); P = {args.prompts_per_step} "
        f"prompts x G = {args.group_size} rollouts per step, {args.max_new_tokens} new tokens max, temperature "
        f"{args.temperature}, AdamW lr {args.lr}, grad clip {args.max_grad_norm}, beta 0, one update per batch, seed "
        f"{args.seed} (data, warm start), RL seeds {','.join(map(str, args.seeds))}; {args.steps} steps per run, "
        f"{args.repeats} repeat(s) x {len(args.seeds)} seed(s) per arm, arms alternating "
        f"{' -> '.join(args.arms)}; held-out set {args.eval_size} generated problems.  ",
        *(
            ["Same weights, prompts and sampling seed, so the same trajectory until rounding differs:  "] + same
            if same
            else []
        ),
        "",
    ]
    notes = [""]
    for arm in (a for a in args.arms if a in TRL_ARMS):
        t = summary[arm]
        notes += [
            f"`{arm}` update, split (s/step): "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {t[k]:.3f}" for k in TRL_SPLIT)
            + f"; outside the step (logging, "
            f"dataloader) {t['outside_s']:.3f}.  "
        ]
    if ref:
        notes += [
            "(prep other = padding, advantages and metrics in `_generate_and_score_completions`; loss fwd = "
            "`compute_loss`; backward includes gradient checkpointing's recomputation; optim = grad clip + "
            "AdamW + zero_grad.)",
            "",
        ]
    notes += [
        "Columns: per-step seconds and tokens are means over steps 2..S of each run (step 1 also pays one-off costs), "
        "then over runs (seeds x repeats; ± = standard deviation of the per-run totals across runs). gen = tokenize + HF `generate` + "
        "decode; reward = math-verify grading; update = the rest of the step (advantages, selection, loss "
        "forward/backward, clipping, AdamW). Ratios are against the TRL row. Response tokens per step: generated / "
        "forwarded with gradients (the kept rollouts') / in the loss (the selected tokens). Peak RSS (process): `os.wait4` ru_maxrss of the arm's process (the largest of "
        "it and its reaped children, e.g. the grader's math-verify child); (tree): the peak of the summed VmRSS of the "
        "process tree, sampled every 0.1 s (evaluation generates at most P x G sequences per call, so the peaks are "
        "the training steps'). Held-out: greedy Pass@1 with `train_small.evaluate` in both "
        "environments, before and after the run (mean ± standard deviation over runs; per run in parentheses, in "
        "the order repeat by repeat, seed by seed).",
    ]
    if "trl-d3s" in summary:
        notes += [
            "",
            '`trl-d3s` is the `trl` arm with `D3SGRPOTrainer` and `D3SGRPOConfig(d3s_method="d3s", n_init=G/4, '
            "n_final=G, k_init=0.05, k_final=0.20)`: the same GRPOConfig, generation, grader and seeds. Its "
            "prep other includes `d3s.select_samples` on the batch; its loss fwd forwards only the kept rollouts "
            "and includes `d3s.select_tokens` and `d3s.policy_loss`.",
        ]
    return "\n".join(header + lines + notes) + "\n"


DIFFERENCES = """
What differs between the arms beyond the algorithm (TRL 1.16.0 as installed, read from `trl/trainer/grpo_trainer.py`,
`grpo_config.py` and `trl/kernels/chunked_logprob.py`; train_small.py as in this repository):

- Same work, by construction: the same model folder, tokenizer, prompts at every step (trl_arm.py replays
  train_small's prompt order; TRL's sampler is not shuffled), left padding, `generate` settings (sampling,
  temperature, top_k 0, top_p 1, EOS = the tokenizer's and the generation config's), sampling seed per step
  (`torch.manual_seed(step_seed)` right before generate), grader, fp32, AdamW (torch) with a constant lr, no
  weight decay, grad-norm clip 1.0, one optimizer step per batch of P x G, on-policy (ratio exactly 1), beta 0.
  The header above says for how many steps TRL and grpo then stay on the very same trajectory.
- Extra forward pass in TRL by default: GRPOConfig sets `gradient_checkpointing=True` (unlike
  TrainingArguments), so the backward recomputes every decoder layer's forward: one extra backbone forward
  per step, to save activation memory. The `trl-nogc` row turns it off; the difference between the two TRL
  rows is that recomputation. train_small.py does not checkpoint. (GRPOConfig also defaults to bf16=True;
  trl_arm.py sets bf16=False, as the project trains in fp32.)
- One prompt forward per group in train_small: its loss forward runs each distinct prompt once (keys and
  values with grad, the logits of o_1) and the G responses on those keys and values
  (`sampler.logprobs_entropy`), as its sampler does for generation. TRL forwards
  prompt + completion for every row, so the prompt (~56 characters here, against ~26 completion tokens)
  is forwarded and backpropagated G times. Same log-probs and gradients up to fp32 rounding (tested).
- No old-log-prob or reference forward: with `num_iterations=1`, `steps_per_generation =
  gradient_accumulation_steps = 1`, `beta=0` and `use_vllm=False`, `_generate_and_score_completions` skips
  the no-grad forward for `old_per_token_logps` (the loss uses `per_token_logps.detach()`) and loads no
  reference model. (With `num_iterations > 1` or gradient accumulation TRL adds one no-grad forward over the
  whole batch.)
- Loss head: TRL patches the model with a fused LM head (`add_fused_lm_head`, `ChunkedLogProbFunction`):
  log-probs and entropies in tiles, never materializing [B, L, V] logits, recomputing the projection in
  backward. On a device without Triton (this CPU) it scores every position of prompt + completion and masks
  afterwards (on CUDA only the completion positions); train_small computes logits only for the last T + 1
  positions (`logits_to_keep`) with a full `log_softmax`, plus `d3s.token_entropy` (no grad). Both compute
  the entropy every step (TRL for a logged metric, train_small for token selection, which grpo does not use).
- Position ids: train_small passes `cumsum(attention_mask) - 1` (as generate does); TRL's loss forward passes
  none, so left-padded rows get positions shifted by their padding. With rotary embeddings only relative
  positions matter: the log-probs agree up to rounding.
- Advantages: TRL divides by (std + 1e-4), d3s.group_advantages by (std + 1e-6); both use the unbiased std
  and give 0 to groups with equal rewards. Loss aggregation: TRL `loss_type="dapo"` (its default) = token
  mean over the batch's completion tokens = d3s.policy_loss "token-mean" for grpo. TRL's `"grpo"` loss type
  (per-sequence mean, then mean) would be a different objective.
- Per-step bookkeeping in TRL: the HF Trainer/accelerate loop, padding lists of token ids into tensors,
  metric gathering (`accelerator.gather`, `.item()`, clip-ratio statistics) inside the step, and after it
  `_maybe_log_save_evaluate` and the dataloader (collating P x G dataset rows); the split above shows these
  are milliseconds. train_small's step is the six lines of its docstring plus a dict of metrics.
- d3s vs grpo (the algorithm): d3s forwards and backpropagates only the kept rollouts (N per prompt on the
  schedule, cross-group) and puts only the top-K |A| x H tokens in the loss; it still generates and grades
  all P x G rollouts, so gen and reward are the same and only update shrinks (plus the selection itself).
- Memory: the process peaks are close (same model, same eval batch). The process-tree peak is higher for
  train_small.py because grading.Grader's child is started with multiprocessing "spawn", which re-imports
  the main module: train_small.py imports torch, numpy and tqdm at the top, so its grader child holds about
  260 MB, while trl_arm.py imports them inside main() and its grader child holds about 60 MB.
- Held-out accuracy: identical trajectories give identical accuracy; once rounding (fused head vs full
  log_softmax, position ids, advantage eps) flips one sampled token the runs drift apart, and after a few
  steps the difference is noise, not implementation.
"""


def main(argv=None):
    args = parse_args(argv)
    started = datetime.datetime.now()
    t0 = time.perf_counter()
    print(f"preparing data and warm start in {args.work} (cache {args.cache_dir}) ...", flush=True)
    warm = prepare(args)
    print(f"warm start: {warm.get('path')} ({'cached' if warm.get('cached') else 'built'})", flush=True)
    runs = {arm: [] for arm in args.arms}
    versions = {}
    for rep, seed in ((rep, seed) for rep in range(args.repeats) for seed in args.seeds):
        for arm in args.arms:
            name = f"{arm}-r{rep}" + (f"-s{seed}" if len(args.seeds) > 1 else "")
            out = os.path.join(args.work, name)
            cmd = arm_command(arm, args, warm["path"], out, seed)
            print(f"[repeat {rep + 1}/{args.repeats}, seed {seed}] {arm}: {' '.join(cmd)}", flush=True)
            m = run_measured(cmd, os.path.join(args.work, f"{name}.log"))
            if m["rc"] != 0:
                with open(os.path.join(args.work, f"{name}.log")) as f:
                    tail = f.read()[-3000:]
                sys.exit(f"vs_trl.py: arm {arm} failed (rc {m['rc']}); log {args.work}/{name}.log:\n{tail}")
            r = {**collect(arm, out), **m, "seed": seed}
            if arm in TRL_ARMS:
                with open(os.path.join(out, "result.json")) as f:
                    versions = json.load(f)["versions"]
            runs[arm].append(r)
            s = r["steps"][1:] or r["steps"]
            print(
                f"    {m['wall_s']:.0f} s wall, {mean([x['gen_s'] for x in s]):.3f} gen + "
                f"{mean([x['reward_s'] for x in s]):.3f} reward + {mean([x['update_s'] for x in s]):.3f} update s/step, "
                f"peak RSS {m['peak_rss_mb']:.0f} MB, held-out {r['acc0']:.3f} -> {r['acc']:.3f}",
                flush=True,
            )
    summary = summarize(runs)
    if not versions:
        import torch
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    text = render(args, summary, warm, versions, started, time.perf_counter() - t0) + DIFFERENCES
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump(
            {"args": vars(args), "warm_start": warm, "versions": versions, "summary": summary, "runs": runs},
            f,
            indent=1,
        )
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
