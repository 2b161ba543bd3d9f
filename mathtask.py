"""mathtask.py: the math task shared by train_small.py and train_full.py.

What two rungs share beyond d3s.py lives here, once:
  - load_problems: JSONL / JSON / Parquet rows with `problem` and `answer`, checked row by row
  - prompt templates (the Qwen2.5-Math chat template by default for real models)
  - extract_boxed + Grader: the 0/1 verifiable reward with math-verify, under a hard time limit
  - pass_at_k: the unbiased Pass@k estimator (Chen et al., 2021)
  - arithmetic_problems: generated word problems with difficulty levels (tiny models, CPU tests)

The grader runs math-verify in a child process that is killed and restarted when one answer
takes longer than `timeout_s`: math-verify's own time limit is signal.alarm, which cannot stop
a long C-level computation (e.g. sympy expanding 9^{9^{9^9}}), and adversarial completions
must neither hang nor crash a training run.
"""

import json
import math
import multiprocessing as mp
import os

# Qwen2.5-Math eval harness "qwen25-math-cot" template (also Dr.GRPO / SimpleRL-Zoo / LIMR).
QWEN_MATH_TEMPLATE = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)
# Plain template for tiny character-level models (no chat tokens in their vocabulary).
PLAIN_TEMPLATE = "{problem}\nAnswer: "

MAX_BOXED_CHARS = 400  # a final answer longer than this is not an answer: reward 0


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, line and fix."""


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def _read_rows(path):
    """Yield (line_no, row) from .jsonl, .json (a list) or .parquet."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert to JSONL") from e
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e}); expected a list of objects or use .jsonl") from e
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected a JSON list of objects with 'problem' and 'answer'")
            yield from enumerate(rows, start=1)
            return
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg}); fix or delete that line") from e


def load_problems(path, drop_missing=False, limit=None):
    """Load rows with a non-empty `problem` and `answer` from a JSONL/JSON/Parquet file.

    Returns (rows, n_dropped); rows are dicts with at least `problem`, `answer` (str) and `id`.
    drop_missing=False: a row without `problem` or `answer` raises DataError naming file:line.
    drop_missing=True: such rows are skipped and counted (train_full.py on big hub data).
    An empty file (or one with no usable row) always raises DataError.
    """
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found; pass an existing JSONL/JSON/Parquet file with 'problem' and 'answer'")
    rows, dropped = [], 0
    for line_no, row in _read_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object with 'problem' and 'answer', got {type(row).__name__}")
        missing = [k for k in ("problem", "answer") if row.get(k) is None or str(row.get(k)).strip() == ""]
        if missing:
            if drop_missing:
                dropped += 1
                continue
            raise DataError(f"{path}:{line_no}: row has no {' or '.join(repr(k) for k in missing)}; "
                            f"every row needs a non-empty 'problem' and 'answer' (fix or delete the row)")
        rows.append({**row, "problem": str(row["problem"]), "answer": str(row["answer"]),
                     "id": str(row.get("id", f"{os.path.basename(path)}:{line_no}"))})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{path}: no usable rows (empty file, or every row lacks 'problem'/'answer')")
    return rows, dropped


# ---------------------------------------------------------------------------------------------
# Generated task: short arithmetic word problems, for tiny character-level models and CPU tests
# ---------------------------------------------------------------------------------------------
ARITHMETIC_LEVELS = {
    1: "a + b, one digit each",
    2: "two-digit +/- one-digit",
    3: "two-digit +/- two-digit",
    4: "a + b - c, one digit each (two steps)",
}
_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo")
_ITEMS = ("pens", "cups", "eggs", "hats", "keys", "maps", "nuts", "figs", "jars", "toys")


def _arithmetic_problem(rng, level):
    """(problem text, integer answer) of one random problem of `level` (answers are >= 0)."""
    who, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 4:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = rng.randint(1, min(9, a + b))
        return f"{who} had {a} {items}, got {b}, lost {c}. How many left?", a + b - c
    a = rng.randint(1, 9) if level == 1 else rng.randint(10, 99)
    b = rng.randint(10, 99) if level == 3 else rng.randint(1, 9)
    if level > 1 and rng.random() < 0.5 and a >= b:
        return f"{who} had {a} {items}, lost {b}. How many left?", a - b
    return f"{who} had {a} {items}, got {b} more. How many now?", a + b


def arithmetic_problems(n, split="train", seed=0, levels=(1, 2, 3, 4), eval_fraction=0.2):
    """`n` distinct short arithmetic word problems, rows like load_problems' (+ `level`).

    Levels (ARITHMETIC_LEVELS) cycle 1, 2, 3, 4, 1, ... so every level has n / len(levels)
    rows. A problem's split is fixed by a hash of its text (`eval_fraction` of all texts are
    "eval"), so the "train" and "eval" sets are disjoint whatever n and seed. They share
    arithmetic facts (there are only 81 one-digit sums), not problems: a held-out problem is
    a new (name, item, numbers) combination. Answers are short for a one-token-per-character
    tokenizer: "\\boxed{42}" is 10 characters.

    >>> arithmetic_problems(2, seed=0)[1]["level"], arithmetic_problems(2, "eval")[0]["id"]
    (2, 'arith-eval-0-0')
    >>> train = {r["problem"] for r in arithmetic_problems(500)}
    >>> any(r["problem"] in train for r in arithmetic_problems(500, "eval"))
    False
    """
    import random
    import zlib

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: choose 'train' or 'eval'")
    if not levels or any(level not in ARITHMETIC_LEVELS for level in levels):
        raise ValueError(f"levels={levels!r}: choose from {sorted(ARITHMETIC_LEVELS)}")
    rng = random.Random(f"arithmetic-{seed}-{split}")
    rows, seen = [], set()
    for attempt in range(200 * n + 1000):
        if len(rows) == n:
            break
        level = levels[len(rows) % len(levels)]
        problem, answer = _arithmetic_problem(rng, level)
        is_eval = zlib.crc32(problem.encode()) % 1000 < 1000 * eval_fraction
        if problem in seen or is_eval != (split == "eval"):
            continue
        seen.add(problem)
        rows.append({"id": f"arith-{split}-{seed}-{len(rows)}", "problem": problem,
                     "answer": str(answer), "level": level})
    if len(rows) < n:
        raise ValueError(f"n={n}: could not draw that many distinct {split} problems of levels {levels}")
    return rows


# ---------------------------------------------------------------------------------------------
# Reward: last \boxed{...} graded against the gold answer by math-verify, in a killable child
# ---------------------------------------------------------------------------------------------
def extract_boxed(text):
    """The content of the last \\boxed{...} in `text` (braces balanced), or None. Linear time.

    One pass matches every brace with a stack, then the last "\\boxed{" whose "{" is closed
    wins (an unclosed one falls back to the one before). Scanning forward from each
    "\\boxed{" instead would be quadratic: 100k characters of "\\boxed{" took minutes.

    >>> extract_boxed("so x = 2, and \\\\boxed{\\\\frac{1}{2}} done")
    '\\\\frac{1}{2}'
    """
    closing, open_braces = {}, []  # closing[i] = index of the "}" that closes the "{" at i
    for j, c in enumerate(text):
        if c == "{":
            open_braces.append(j)
        elif c == "}" and open_braces:
            closing[open_braces.pop()] = j
    start = text.rfind("\\boxed{")
    while start != -1:
        brace = start + len("\\boxed")
        if brace in closing:
            return text[brace + 1 : closing[brace]]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try the previous one
    return None


def _verify(pred, gold):
    """1.0 if math-verify finds `pred` equal to `gold`, else 0.0 (runs in the child)."""
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0


def _grader_worker(conn):
    """Child process: answer (pred, gold) requests until the pipe closes."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the parent enforces the time limit
    _verify("1", "1")  # import math-verify + sympy now, so the time limit counts grading only
    conn.send("ready")
    while True:
        try:
            pred, gold = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            conn.send(_verify(pred, gold))
        except Exception:  # a parser bug on odd input is a wrong answer, not a crash
            conn.send(0.0)


class Grader:
    """0/1 math reward: last \\boxed{} of the completion vs the gold answer, with a hard time limit.

    grader = Grader(timeout_s=5.0)
    grader.score(completion, gold) -> 1.0 or 0.0;  grader.score_batch(completions, golds)
    A completion whose check takes longer than timeout_s scores 0; the child is then killed
    and restarted. Use as a context manager or call close().
    """

    def __init__(self, timeout_s=5.0):
        self.timeout_s = timeout_s
        self.timeouts = 0  # how many answers hit the time limit (logged by the trainers)
        self._ctx = mp.get_context("spawn")  # safe beside CUDA and vLLM (no fork of their threads)
        self._proc = None
        self._cache = {}

    def _start(self):
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_grader_worker, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # Wait for the imports (seconds) outside the time limit: a child restarted after a
        # timeout must not fail the next, ordinary answer too.
        try:
            ready = parent.poll(120.0) and parent.recv() == "ready"
        except EOFError:  # the child died while starting (its traceback is on stderr)
            ready = False
        if not ready:
            self._kill()
            raise RuntimeError("the math-verify grader process did not start (see its error above); "
                               "check that math-verify imports, and that the main script has an "
                               "`if __name__ == '__main__':` guard (the child is spawned)")

    def _kill(self):
        if self._proc is not None and self._proc.pid is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = None

    def score(self, completion, gold):
        pred = extract_boxed(completion)
        if pred is None or not pred.strip() or len(pred) > MAX_BOXED_CHARS:
            return 0.0
        key = (pred, gold)
        if key in self._cache:
            return self._cache[key]
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send(key)
        try:
            answered = self._conn.poll(self.timeout_s)
            reward = self._conn.recv() if answered else None
        except EOFError:  # the child died on this answer (e.g. killed for memory): score 0
            reward = None
        if reward is None:  # too slow or dead: kill the child, score 0, restart lazily
            self.timeouts += 1
            self._kill()
            reward = 0.0
        if len(self._cache) < 100_000:
            self._cache[key] = reward
        return reward

    def score_batch(self, completions, golds):
        return [self.score(c, g) for c, g in zip(completions, golds)]

    def close(self):
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
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
