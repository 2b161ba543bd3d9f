"""support/grading.py: how an answer is scored, and Pass@k.

    extract_boxed, Grader   the 0/1 reward: the last \\boxed{} against the gold answer by math-verify, under a hard time
                            limit, in a pool of child processes (default_grader_workers: its size per rank)
    pass_at_k, best_of_k    the unbiased Pass@k estimator (Chen et al., 2021), and its real-valued form
    eval_rewards            the held-out rewards: math-verify's, or --eval-reward train: the run's own (eval_scorer)
    held_out_pass           train_small.py's evaluation: greedy Pass@1, mean Pass@1 and Pass@k, by level
    evaluate                train_full.py's: every benchmark sampled on every rank, OUT/eval_TAG.md/.json

The grader runs math-verify in child processes; one is killed and replaced when its answer takes longer than
`timeout_s`: math-verify's own time limit is signal.alarm, which cannot stop a long C-level computation (e.g. sympy
expanding 9^{9^{9^9}}), and adversarial completions must neither hang nor crash a training run.
"""

import collections
import contextlib
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time

import torch.distributed as dist

from support import reward_function, run, stops
from support.mathtask import extract_boxed, sample_seeds


MAX_BOXED_CHARS = 400  # a final answer longer than this is not an answer: reward 0
GRADER_START_TIMEOUT_S = 120.0  # a child must import math-verify + sympy within this (seconds on a loaded node)
GRADER_WORKERS_CAP = 8  # default_grader_workers' cap; the reasoning is in its docstring


def _verify(pred, gold):
    """1.0 if math-verify finds `pred` equal to `gold`, else 0.0 (runs in the child)."""
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return 1.0 if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0


def _grader_worker(conn, reward=None):
    """Child process: answer (pred, gold) requests (math-verify), or (problem, completion, columns) ones with the
    --reward function `reward` (reward_function.call_once), until the pipe closes. A preemption notice (SIGTERM, SIGUSR1) or a
    Ctrl-C (SIGINT) sent to the whole process group is the parent's to act on: the child ignores it and grades on
    until the parent closes the pipe or ends (a parent stopped at once: the answer has no reader, the child returns)."""
    for notice in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # a Ctrl-C too: the parent stops after its step
        signal.signal(notice, signal.SIG_IGN)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the parent enforces the time limit
    _verify("1", "1")  # import math-verify + sympy now, so the time limit counts grading only
    function = reward_function.load_reward(reward) if reward else None
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            value = reward_function.call_once(function, *message) if len(message) == 3 else _verify(*message)
        except Exception:  # a parser bug on odd input is a wrong answer, not a crash
            value = 0.0
        try:
            conn.send(value)
        except OSError:  # the parent is gone (BrokenPipeError)
            return


def default_grader_workers(ranks_per_node, cores=None, cap=GRADER_WORKERS_CAP):
    """Grader processes per rank: max(1, min(cap, cores // ranks_per_node)).

    `cores` defaults to the CPUs this process may run on (its affinity, which Slurm or a cgroup narrows;
    os.cpu_count() where unknown), shared by the ranks of a node. Why cap at 8: one answer takes 11-45 ms to grade on
    this 2-core CPU (256 math500 gold answers in 2.8 s; 512 math500/minerva/olympiadbench answers in 23 s under load,
    bench/grader.py), so a rank's share of 1024 answers on 8 GPUs (128) is ~1.5-6 s on one child and ~0.2-0.7 s on 8.
    More would save a fraction of a second next to a step of minutes, while each costs a core and memory: a spawned
    child re-imports the main script, ~260 MB of RSS with (CPU) torch, 64 MB without: 8 ranks x 8 children ~17 GB.

    >>> default_grader_workers(8, cores=224), default_grader_workers(8, cores=16), default_grader_workers(8, cores=4)
    (8, 2, 1)
    """
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r}: must be an int >= 1 "
            "(processes per node, e.g. int(os.environ['LOCAL_WORLD_SIZE']) under torchrun)"
        )
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cap, cores // ranks_per_node))


class _Child:
    """One grader process and what it is doing: "starting" (importing), "idle", or "busy" with `key`; `deadline`
    (time.monotonic()): when a starting child must be ready, or a busy one must answer."""

    def __init__(self, ctx, reward=None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_grader_worker, args=(child, reward), daemon=True)
        with stops.sigint_ignored():  # from its first instruction (while it imports): a Ctrl-C is the parent's
            self.proc.start()
        child.close()  # the child holds the only other end: its death reads as EOF here
        self.state, self.key, self.deadline = "starting", None, time.monotonic() + GRADER_START_TIMEOUT_S

    def give(self, key, timeout_s, message):
        self.conn.send(message)
        self.state, self.key, self.deadline = "busy", key, time.monotonic() + timeout_s  # the limit starts now

    def kill(self):
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class Grader(contextlib.AbstractContextManager):
    """0/1 math reward: last \\boxed{} of the completion vs the gold answer, with a hard time limit.

    grader = Grader(timeout_s=5.0, workers=4)
    grader.score(completion, gold) -> 1.0 or 0.0;  grader.score_batch(completions, golds) -> [0/1, ...]
    Use as a context manager or call close(). Pass all of a step's answers in one score_batch call: the children
    grade one call's answers.

    Design. `workers` child processes each run math-verify on one (answer, gold) at a time. score_batch drops what
    needs no grading (no \\boxed{}, too long, cached, a repeat within the batch), then loops: hand a waiting answer
    to every idle child, wait (multiprocessing.connection.wait) for the first reply or deadline, repeat. An answer
    that takes longer than timeout_s from when its child got it scores 0 and counts in `timeouts`; its child is
    killed, as is one that dies on an answer. Children start when answers wait, all at once (~2 s to import
    math-verify); a killed one is replaced the same way. A child that dies before it is ready raises RuntimeError
    (math-verify does not import, or the main script lacks its `__main__` guard): restarting would only loop.
    Rewards come back in input order, independent of `workers`. The limit is wall-clock: with more busy children
    than free cores, an answer needing nearly timeout_s of CPU can run past it (so each child gets a core)."""

    def __init__(self, timeout_s=5.0, workers=1, reward=None):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}: must be a number of seconds > 0 (per answer)")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"workers={workers!r}: must be an int >= 1 (grader processes; "
                "grading.default_grader_workers(ranks_per_node) picks one)"
            )
        self.timeout_s, self.workers, self.reward = timeout_s, workers, reward  # reward: --reward's spec, or None
        self.timeouts = 0  # how many answers hit the time limit or killed their child (logged by the trainers)
        self._ctx = mp.get_context("spawn")  # safe beside CUDA and vLLM (no fork of their threads)
        self._children = []  # at most `workers` _Child; a killed one is dropped and replaced when needed
        self._cache = {}  # (pred, gold) -> reward

    def start(self):
        """Start all `workers` children now and wait until they are ready: their ~2 s out of the first step."""
        self._children += [_Child(self._ctx, self.reward) for _ in range(self.workers - len(self._children))]
        while any(c.state == "starting" for c in self._children):
            self._wait({})

    def score(self, completion, gold):
        return self.score_batch([completion], [gold])[0]

    def rewards(self, completions, rows, world=None):
        """One reward per completion, rows[i] its problem's row: math-verify's 0/1 against row["answer"]
        (score_batch), or with --reward its function's float (reward_function.call_once in the children, the same
        time limit: a call past it scores 0 and counts in `timeouts`). A function that fails raises RewardError naming
        it and the row (file:line, else its id); with a `world` (train_full.py's ranks), the same line on every rank."""
        if self.reward is None:
            return self.score_batch(completions, [row["answer"] for row in rows])
        jobs = {("reward", i): (row["problem"], text, row) for i, (text, row) in enumerate(zip(completions, rows))}
        got = self._grade(list(jobs), jobs)
        failed = [(i, value) for (_, i), value in sorted(got.items()) if isinstance(value, str)]
        line = ""
        if failed:  # the first failing completion
            i, value = failed[0]
            line = (
                f"--reward {self.reward}: {value} on the row {rows[i].get('where', rows[i].get('id'))} (completion {i})"
            )
        if world is not None and world.size > 1:  # the lowest rank's line with a failure, on every rank
            every = [None] * world.size
            dist.all_gather_object(every, line)
            line = next((text for text in every if text), "")
        if line:
            raise reward_function.RewardError(line)
        return [got[("reward", i)] for i in range(len(completions))]

    def score_batch(self, completions, golds):
        completions, golds = list(completions), list(golds)
        if len(completions) != len(golds):
            raise ValueError(
                f"score_batch: {len(completions)} completions but {len(golds)} golds; pass one gold per completion"
            )
        rewards = [0.0] * len(completions)
        to_grade = {}  # (pred, gold) -> indices of the completions that need it, in input order
        for i, (completion, gold) in enumerate(zip(completions, golds)):
            pred = extract_boxed(completion)
            if pred is None or not pred.strip() or len(pred) > MAX_BOXED_CHARS:
                continue  # no final answer: 0
            key = (pred, gold)
            if key in self._cache:
                rewards[i] = self._cache[key]
            else:
                to_grade.setdefault(key, []).append(i)
        for key, reward in self._grade(list(to_grade)).items():
            if len(self._cache) < 100_000:
                self._cache[key] = reward
            for i in to_grade.get(key, ()):  # (a key left busy by an interrupted call is not ours)
                rewards[i] = reward
        return rewards

    def _grade(self, keys, messages=None):
        """{key: reward} for distinct (pred, gold) keys (or keys of `messages`, each child's request), graded
        concurrently by the children."""
        waiting, rewards = collections.deque(keys), {}
        while waiting or any(c.state == "busy" for c in self._children):
            # Start children (together) while more answers wait than children are free or starting.
            free = sum(c.state != "busy" for c in self._children)
            for _ in range(min(self.workers - len(self._children), len(waiting) - free)):
                self._children.append(_Child(self._ctx, self.reward))
            for child in list(self._children):
                if child.state == "idle" and waiting:
                    try:
                        child.give(waiting[0], self.timeout_s, messages[waiting[0]] if messages else waiting[0])
                        waiting.popleft()
                    except OSError:  # it died between answers (killed from outside): replace it
                        self._drop(child)
            self._wait(rewards)
        return rewards

    def _wait(self, rewards):
        """Wait for the first message or deadline of a starting or busy child; handle all that came."""
        active = [c for c in self._children if c.state != "idle"]
        if not active:
            return
        wait_s = max(0.0, min(c.deadline for c in active) - time.monotonic())
        ready = mp_connection.wait([c.conn for c in active], wait_s)
        for child in active:
            if child.conn in ready:
                self._receive(child, rewards)
            elif time.monotonic() >= child.deadline:
                self._fail(child, rewards)

    def _receive(self, child, rewards):
        try:
            message = child.conn.recv()
        except (EOFError, OSError):  # the child died (e.g. killed for memory)
            return self._fail(child, rewards)
        if child.state == "busy":
            rewards[child.key] = message
        child.state = "idle"  # answered, or ready after its imports

    def _fail(self, child, rewards):
        """A child missed its deadline or died: score its answer 0 and drop it, or stop if it never started."""
        if child.state == "starting":
            self.close()
            raise RuntimeError(
                "the math-verify grader process did not start (see its error above); "
                "check that math-verify imports, and that the main script has an "
                "`if __name__ == '__main__':` guard (the child is spawned)"
            )
        self.timeouts += 1
        rewards[child.key] = 0.0
        self._drop(child)

    def _drop(self, child):
        child.kill()
        self._children.remove(child)

    def close(self):
        for child in self._children:
            child.kill()
        self._children = []

    def __exit__(self, *exc):
        self.close()


def pass_at_k(n, c, k):
    """Unbiased Pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 2)
    (0.25, 0.5, 0.0)
    """
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: must be in [1, n={n}] (samples per problem)")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def best_of_k(values, k):
    """The expected best of k of a problem's n sampled rewards `values` (a random k of them, unbiased): Pass@k's
    estimator for real-valued rewards, the same number as pass_at_k for 0/1 ones (sum_i v_(i) C(i-1, k-1) / C(n, k),
    v_(1) <= ... <= v_(n)).

    >>> best_of_k([0.0, 1.0, 0.0, 0.0], 2), pass_at_k(4, 1, 2), best_of_k([0.5, 0.0, 1.0], 2)
    (0.5, 0.5, 0.8333333333333334)
    """
    n = len(values)
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: must be in [1, n={n}] (samples per problem)")
    return sum(v * math.comb(i, k - 1) for i, v in enumerate(sorted(values))) / math.comb(n, k)


def eval_scorer(args):
    """What scores the held-out evaluations with --eval-reward train: "--reward FILE.py:FUNCTION", or "math-verify"
    (no --reward); None with --eval-reward math-verify (the default: the eval lines as they always were)."""
    if getattr(args, "eval_reward", "math-verify") == "train":
        return f"--reward {args.reward}" if getattr(args, "reward", None) else "math-verify"
    return None


def eval_rewards(grader, texts, rows, args, world=None):
    """The held-out rewards of `texts` (rows[i]: the row of texts[i]): math-verify's 0/1 against each row's answer, or
    with --eval-reward train the run's own (Grader.rewards: --reward's function, else math-verify's)."""
    if eval_scorer(args):
        return grader.rewards(texts, rows, world)
    return grader.score_batch(texts, [row["answer"] for row in rows])


def held_out_pass(rows, sample, grader, n, k, chunk, args=None):
    """Held-out Pass@1 and Pass@k of a policy, overall and by the rows' `level`: greedy Pass@1 (one greedy answer
    per problem), mean Pass@1 over n sampled answers, unbiased Pass@k from them. sample(prompts, n, greedy) -> the
    answers' texts, prompt-major; `chunk` problems per call. rows: {"prompt", "answer"[, "level"]}. With --eval-reward
    train (args), scored by the run's own reward (eval_rewards): the Pass@1 numbers are mean rewards, and where a
    reward is other than 0 or 1, Pass@k is the expected best of k (best_of_k); `eval_scorer` names the function."""
    greedy, correct, values = [], [], []  # [E], [E] (correct samples out of n: the sum of their rewards), [E][n]
    for start in run.progress_bar(range(0, len(rows), chunk), desc="eval", leave=False, every_s=60.0):
        part = rows[start : start + chunk]
        prompts = [r["prompt"] for r in part]
        greedy += eval_rewards(grader, sample(prompts, 1, True), part, args)
        right = eval_rewards(grader, sample(prompts, n, False), [r for r in part for _ in range(n)], args)
        values += [right[i * n : (i + 1) * n] for i in range(len(prompts))]
        correct += [sum(right[i * n : (i + 1) * n]) for i in range(len(prompts))]
    binary = all(v in (0.0, 1.0) for v in greedy + [v for problem in values for v in problem])
    passk = lambda i: pass_at_k(n, int(correct[i]), k) if binary else best_of_k(values[i], k)
    out = {
        "eval_greedy_pass1": sum(greedy) / len(greedy),
        "eval_pass1_mean": sum(correct) / (n * len(correct)),
        "eval_passk": sum(passk(i) for i in range(len(correct))) / len(correct),
        "k": k,
        "n": n,
    }
    for level in sorted({r["level"] for r in rows if "level" in r}):  # by difficulty: the spread that gives signal
        idx = [i for i, r in enumerate(rows) if r.get("level") == level]
        out[f"eval_pass1_mean_level{level}"] = sum(correct[i] for i in idx) / (n * len(idx))
        out[f"eval_passk_level{level}"] = sum(passk(i) for i in idx) / len(idx)
        out[f"eval_greedy_pass1_level{level}"] = sum(greedy[i] for i in idx) / len(idx)
    if eval_scorer(args):
        out["eval_scorer"] = eval_scorer(args)
    return out


def evaluation_due(metrics_path, step, args, world):
    """Whether the evaluation after `step` steps (--eval-every) is due and not yet in metrics.jsonl: step 0 of a new
    run, or, on --resume, the one that a preemption notice, a full disk or a kill cut off after that step's
    checkpoint. Rank 0 reads the file; every rank gets its answer."""
    if not args.eval_every or step % args.eval_every or step >= args.steps:
        return False
    done = world.is_main and any(
        m.get("kind") == "eval" and m.get("step") == step for m in run.read_metrics(metrics_path)
    )
    return not stops.any_rank(done, world)


def evaluate(
    engine, grader, *, tokenizer, stop_ids, eval_sets, args, world, tag=None, model_name=None, step=None, trackers=None
):
    """train_full.py's evaluation of every benchmark: this rank samples --eval-samples answers for its contiguous
    share of the problems; rank 0 writes OUT/eval_TAG.md/.json (TAG: step_NNNNNN by default; --eval-only: none) and,
    after `step` training steps (None: --eval-only), a metrics.jsonl line (and sends it to `trackers`: run.Run's)."""
    if tag is None and step is not None:
        tag = f"step_{step:06d}"
        model_name = f"{args.model} after {step} steps of {args.method}, {args.loss} loss" if step else None
        model_name = model_name or f"{args.model} before training"
    results, own = {}, bool(eval_scorer(args))
    for name, problems, dropped, too_long in eval_sets:
        per = math.ceil(len(problems) / world.size)
        mine = list(range(world.rank * per, min((world.rank + 1) * per, len(problems))))
        greedy = args.eval_temperature == 0  # one answer per problem, counted n times: one rule for every engine
        outs = []
        if mine:
            outs = engine.generate(
                [problems[i]["prompt_ids"] for i in mine],
                n=1 if greedy else args.eval_samples,
                temperature=args.eval_temperature,
                top_p=args.eval_top_p,
                max_tokens=args.eval_max_tokens,
                seeds=sample_seeds(args, 10**6, mine, args.eval_samples),
                stop_ids=stop_ids,
            )
        outs = [group * args.eval_samples for group in outs] if greedy else outs
        texts = [tokenizer.decode(c["token_ids"], skip_special_tokens=True) for group in outs for c in group]
        rewards = eval_rewards(grader, texts, [problems[i] for i, group in zip(mine, outs) for _ in group], args, world)
        n = args.eval_samples
        sums = [sum(rewards[j * n : (j + 1) * n]) for j in range(len(outs))]  # 0/1: the correct samples per problem
        gathered = [None] * world.size
        dist.all_gather_object(gathered, (sums, all(r in (0.0, 1.0) for r in rewards)))
        sums = [c for part, _ in gathered for c in part]  # rank order = problem order
        row = {"problems": len(sums), "samples": n, "dropped": dropped, "too_long": too_long}
        if own:  # --eval-reward train: the mean reward; Pass@k only where every reward is 0 or 1
            row["reward_mean"] = sum(sums) / max(n * len(sums), 1)
        if all(binary for _, binary in gathered):
            correct = [int(c) for c in sums]
            for k in args.eval_pass_k:
                row[f"pass@{k}"] = 100.0 * sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
            row["correct"] = correct
        results[name] = row
    with stops.attempt(args.out, args.out, world):  # a full disk while rank 0 writes: DiskFull on every rank
        if results:
            keys = ["reward_mean"] * own + [f"pass@{k}" for k in args.eval_pass_k]
            keys = [k for k in keys if all(k in r for r in results.values())]  # Pass@k: on 0/1 rewards
            results["average"] = {k: sum(r[k] for r in results.values()) / len(results) for k in keys}
            if world.is_main:
                write_eval_report(results, keys, args, tag, model_name or args.model)
                if step is not None:
                    run.append_metrics(
                        os.path.join(args.out, "metrics.jsonl"), line := eval_record(step, results, args)
                    )
                    if trackers is not None:
                        trackers.log(line)
    return results


def eval_record(step, results, args=None):
    """One metrics.jsonl line per evaluation: {benchmark}_pass@k for every benchmark and the average; with
    --eval-reward train, {benchmark}_reward_mean too (Pass@k only on 0/1 rewards) and eval_scorer (eval_scorer)."""
    scores = lambda k: k.startswith("pass@") or k == "reward_mean"
    line = {"kind": "eval", "step": step}
    line.update({f"{name}_{k}": v for name, row in results.items() for k, v in row.items() if scores(k)})
    return {**line, "eval_scorer": eval_scorer(args)} if eval_scorer(args) else line


def write_eval_report(results, keys, args, tag, model_name):
    if args.eval_temperature == 0:
        sampled = f"One greedy answer per problem (--eval-temperature 0), counted as all {args.eval_samples} samples"
    else:
        sampled = (
            f"{args.eval_samples} samples per problem, temperature {args.eval_temperature}, top-p {args.eval_top_p}"
        )
    lines = [
        f"# Evaluation of {model_name}",
        "",
        f"{sampled}, max {args.eval_max_tokens} tokens, template {args.template}. Pass@1 = mean accuracy over the "
        "samples; Pass@k unbiased (Chen et al., 2021).",
        "",
        "| benchmark | problems | " + " | ".join(k.replace("pass", "Pass") for k in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    if eval_scorer(args):
        lines[2] += (
            f" Scored by the run's own reward (--eval-reward train: {eval_scorer(args)}): reward_mean = the mean "
            "reward of a sample; Pass@k only where every reward is 0 or 1."
        )
    cell = lambda k, v: f"{v:.3f}" if k == "reward_mean" else f"{v:.1f}"
    for name, row in results.items():
        lines.append(f"| {name} | {row.get('problems', '')} | " + " | ".join(cell(k, row[k]) for k in keys) + " |")
    for name, row in results.items():
        if row.get("dropped") or row.get("too_long"):
            why = f"{row['dropped']} rows without an answer, {row['too_long']} prompts longer than the context."
            lines.append(f"\nNot evaluated in {name}: {why}")
    stem = os.path.join(args.out, f"eval{'_' + tag if tag else ''}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    settings = ("eval_samples", "eval_temperature", "eval_top_p", "eval_max_tokens", "template", "eval_limit")
    settings += ("eval_reward", "reward") if eval_scorer(args) else ()
    report = {"model": model_name, "settings": {k: getattr(args, k) for k in settings}, "results": results}
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(lines), flush=True)
