"""support/mathtask.py: the math task shared by train_small.py and train_full.py.

What two rungs share beyond d3s.py lives here, once:
  - load_problems: JSONL / JSON / Parquet files or hub datasets -> rows with `problem` and `answer`,
    checked row by row (errors name file:line), one loader for both trainers; fit_context: the rows
    whose prompt fits the model's context (a longer one is named with file:line, or dropped)
  - prompt templates (the Qwen2.5-Math chat template by default for real models)
  - extract_boxed + Grader: the 0/1 verifiable reward with math-verify, under a hard time limit,
    graded by a pool of child processes (default_grader_workers picks its size per rank)
  - pass_at_k: the unbiased Pass@k estimator (Chen et al., 2021)
  - arithmetic_problems: generated word problems with difficulty levels (tiny models, CPU tests)

The grader runs math-verify in child processes; one is killed and replaced when its answer
takes longer than `timeout_s`: math-verify's own time limit is signal.alarm, which cannot stop
a long C-level computation (e.g. sympy expanding 9^{9^{9^9}}), and adversarial completions
must neither hang nor crash a training run.
"""

import collections
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import time

# Qwen2.5-Math eval harness "qwen25-math-cot" template (also Dr.GRPO / SimpleRL-Zoo / LIMR).
QWEN_MATH_TEMPLATE = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)
# Plain template for tiny character-level models (no chat tokens in their vocabulary).
PLAIN_TEMPLATE = "{problem}\nAnswer: "

MAX_BOXED_CHARS = 400  # a final answer longer than this is not an answer: reward 0


def stop_token_ids(tokenizer, generation_config=None):
    """The token ids that end a response, one rule for every rung and engine: the tokenizer's EOS,
    the model's generation_config.eos_token_id (an int or a list), and Qwen's <|im_end|> when the
    vocabulary has it (the chat template ends the assistant turn with it).

    >>> import tiny; tok = tiny.build_char_tokenizer(); stop_token_ids(tok) == [tok.eos_token_id, 2]
    True
    """
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(generation_config, "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, line and fix."""


# ---------------------------------------------------------------------------------------------
# Data: one loader for both trainers (local JSONL / JSON / Parquet, or a hub dataset)
# ---------------------------------------------------------------------------------------------
PROBLEM_KEYS = ("problem", "question", "prompt", "query", "input")
ANSWER_KEYS = ("answer", "final_answer", "gt_answer", "ground_truth", "target", "solution")


def _read_rows(path):
    """Yield (line_no, row) from .jsonl, .json (a list) or .parquet. UTF-8, with or without a byte-order
    mark; CRLF line ends are fine. A byte that is not UTF-8 raises DataError naming its line."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert to JSONL") from e
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's own errors: not Parquet, truncated, ...
            raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); check the file") from e
        yield from enumerate(table.to_pylist(), start=1)
        return
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    for i, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{i}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not UTF-8; "
                f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from e
    text = raw.decode("utf-8-sig")  # a leading byte-order mark is dropped
    if path.endswith(".json"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{e.lineno}: not valid JSON ({e.msg}); expected a list of objects, or use .jsonl"
            ) from e
        if not isinstance(rows, list):
            raise DataError(
                f"{path}: expected a JSON list of objects with 'problem' and 'answer', got {type(rows).__name__}"
            )
        yield from enumerate(rows, start=1)
        return
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg}); fix or delete that line") from e


def _text_field(value, where, name):
    """A problem or answer as a string: numbers are written as text; a one-element list is its element;
    a chat list ([{"role": "user", "content": ...}], problems only) is its last user turn. Other lists,
    dicts and booleans raise DataError: a row has one problem and one answer (the grader compares the
    last \\boxed{} with one gold answer)."""
    if isinstance(value, list) and name == "problem" and value and all(isinstance(m, dict) for m in value):
        value = next((m.get("content") for m in reversed(value) if m.get("role") == "user"), None)
    elif isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or isinstance(value, (list, dict, tuple)):
        raise DataError(
            f"{where}: '{name}' is a {type(value).__name__} ({json.dumps(value)[:60]}); give one "
            f"{name} as a string or a number (a list is accepted only with one element)"
        )
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 2.0 -> "2"
    return None if value is None else str(value).strip()


def normalize_row(row, where="row"):
    """{problem, answer} from a row's common column names, or None if it has no problem or no answer.

    Problem: the first of PROBLEM_KEYS present. Answer: the first of ANSWER_KEYS, or
    reward_model.ground_truth (verl's format); a `solution` gives its last \\boxed{}; a GSM8K
    answer ("... #### 72") gives what follows ####.
    >>> normalize_row({"question": "1+1?", "solution": "so \\\\boxed{2}."})
    {'problem': '1+1?', 'answer': '2'}
    >>> normalize_row({"question": "1+1?", "answer": "1 + 1 = 2\\n#### 2"})
    {'problem': '1+1?', 'answer': '2'}
    >>> normalize_row({"problem": "half of 5?", "answer": 2.5})
    {'problem': 'half of 5?', 'answer': '2.5'}
    """
    problem_key = next((k for k in PROBLEM_KEYS if row.get(k) not in (None, "", [])), None)
    answer_key = next((k for k in ANSWER_KEYS if row.get(k) not in (None, "", [])), None)
    problem = _text_field(row[problem_key], where, "problem") if problem_key else None
    answer = _text_field(row[answer_key], where, "answer") if answer_key else None
    if answer_key is None and isinstance(row.get("reward_model"), dict):
        answer = _text_field(row["reward_model"].get("ground_truth"), where, "answer")
    if answer_key == "solution" and answer is not None:
        answer = extract_boxed(answer)  # a worked solution: its final \boxed{} is the answer
    if answer is not None and "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()  # GSM8K style: "...reasoning... #### 72"
    if not problem or not answer:
        return None
    return {"problem": problem, "answer": answer}


def load_problems(spec, drop_missing=False, limit=None):
    """Rows {problem, answer, id, ...} from a local JSONL / JSON / Parquet file, or a hub dataset
    `name`, `name:split` or `name:config:split` (needs `pip install datasets`).

    Returns (rows, n_dropped). Column names are mapped by normalize_row; a row's other fields
    (e.g. `level`) are kept, and `where` (file:line) is added. drop_missing=False: a row without a problem or an answer raises
    DataError naming file:line; drop_missing=True: such rows are skipped and counted (hub
    datasets and train_full.py's large files). A row whose problem or answer is a list, dict or
    boolean always raises DataError (see _text_field). No usable row at all raises DataError.
    """
    if os.path.isdir(spec):
        raise DataError(f"{spec}: is a folder; pass a JSONL/JSON/Parquet file with 'problem' and 'answer'")
    if os.path.exists(spec):
        raws = ((f"{spec}:{i}", f"{os.path.basename(spec)}:{i}", raw) for i, raw in _read_rows(spec))
    elif spec.endswith((".jsonl", ".json", ".parquet")) or spec.startswith((".", "/", "~")):
        raise DataError(f"{spec}: file not found; pass an existing JSONL/JSON/Parquet file with 'problem' and 'answer'")
    else:
        raws = _hub_rows(spec)
    rows, dropped = [], 0
    for where, default_id, raw in raws:
        if not isinstance(raw, dict):
            raise DataError(f"{where}: expected a JSON object with 'problem' and 'answer', got {type(raw).__name__}")
        row = normalize_row(raw, where)
        if row is None:
            if drop_missing:
                dropped += 1
                continue
            raise DataError(
                f"{where}: row has no problem ({'/'.join(PROBLEM_KEYS)}) or no answer "
                f"({'/'.join(ANSWER_KEYS)}); every row needs a non-empty 'problem' and 'answer' "
                f"(fix or delete the row)"
            )
        rows.append({**raw, **row, "id": str(raw.get("id", default_id)), "where": where})  # where: for fit_context
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{spec}: no usable rows (empty, or no row has a problem and an answer)")
    return rows, dropped


SHORT_BYTES = 16  # fit_context: a prompt of at most limit - SHORT_BYTES UTF-8 bytes is not tokenized


def fit_context(rows, prompt, tokenizer, limit, why, drop=False):
    """(the rows whose prompt fits in `limit` tokens, how many did not). prompt(row) -> the prompt's text; `why`
    says where the limit comes from ("the model's context 1024 less --max-new-tokens 48"). A longer prompt raises
    DataError naming its file:line (the row's `where`, else its id), its length and the limit, before any work;
    with drop=True (--drop-long-prompts, a choice) such rows are left out and counted. Only a prompt of more than
    limit - SHORT_BYTES UTF-8 bytes is tokenized: byte-level BPE and a character vocabulary give at most one token
    per byte, sentencepiece at most one more (its leading "_"), so a large file of short rows costs no tokenizing.
    >>> class Chars:
    ...     def __call__(self, text, **flags):
    ...         return {"input_ids": list(text)}
    >>> rows = [{"problem": "1+1", "id": "a"}, {"problem": "9" * 40, "id": "b", "where": "t.jsonl:2"}]
    >>> fit_context(rows, lambda r: r["problem"], Chars(), 20, "a context of 20", drop=True)[1]
    1
    >>> fit_context(rows, lambda r: r["problem"], Chars(), 20, "a context of 20")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mathtask.DataError: t.jsonl:2: the prompt is 40 tokens; a context of 20 leaves 20 for it: shorten or delete ...
    """
    kept, dropped = [], 0
    for row in rows:
        text = prompt(row)
        n = len(text.encode("utf-8"))
        if n > limit - SHORT_BYTES:
            n = len(
                tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            )  # no warning: this line says it
        if n <= limit:
            kept.append(row)
        elif drop:
            dropped += 1
        else:
            raise DataError(
                f"{row.get('where', row.get('id'))}: the prompt is {n} tokens; {why} leaves {limit} for it: "
                "shorten or delete the row, or add --drop-long-prompts (choice: such rows are left out and "
                "counted)"
            )
    return kept, dropped


def _hub_rows(spec):
    """(where, default id, row) of a hub dataset `name[:config]:split` (default split: train)."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"{spec}: not a local file, and loading it from the hub needs `pip install datasets` "
            "(requirements/full.txt)"
        ) from e
    parts = spec.split(":")  # name, name:split, or name:config:split
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1 else "train")
    try:
        table = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # no network, no such dataset, split or config
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{spec}: cannot load this hub dataset ({first}); pass a local file, or check the name, config and split"
        ) from e
    for i, raw in enumerate(table):
        yield f"{spec} row {i}", f"{name}:{i}", raw


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
    """(problem text, None (no worked solution), integer answer) of one random problem of `level` (answers >= 0)."""
    who, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 4:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = rng.randint(1, min(9, a + b))
        return f"{who} had {a} {items}, got {b}, lost {c}. How many left?", None, a + b - c
    a = rng.randint(1, 9) if level == 1 else rng.randint(10, 99)
    b = rng.randint(10, 99) if level == 3 else rng.randint(1, 9)
    if level > 1 and rng.random() < 0.5 and a >= b:
        return f"{who} had {a} {items}, lost {b}. How many left?", None, a - b
    return f"{who} had {a} {items}, got {b} more. How many now?", None, a + b


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
    return _generated(n, split, seed, levels, eval_fraction, ARITHMETIC_LEVELS, _arithmetic_problem, "arith")


def _generated(n, split, seed, levels, eval_fraction, level_names, draw, prefix):
    """n distinct problems from draw(rng, level) -> (text, solution or None, answer), levels cycling;
    a problem's split is fixed by a hash of its text, so train and eval are disjoint."""
    import random
    import zlib

    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: choose 'train' or 'eval'")
    if not levels or any(level not in level_names for level in levels):
        raise ValueError(f"levels={levels!r}: choose from {sorted(level_names)}")
    rng = random.Random(f"{'arithmetic' if prefix == 'arith' else prefix}-{seed}-{split}")
    rows, seen = [], set()
    for attempt in range(200 * n + 1000):
        if len(rows) == n:
            break
        level = levels[len(rows) % len(levels)]
        problem, solution, answer = draw(rng, level)
        is_eval = zlib.crc32(problem.encode()) % 1000 < 1000 * eval_fraction
        if problem in seen or is_eval != (split == "eval"):
            continue
        seen.add(problem)
        row = {"id": f"{prefix}-{split}-{seed}-{len(rows)}", "problem": problem, "answer": str(answer), "level": level}
        rows.append(row if solution is None else {**row, "solution": solution})
    if len(rows) < n:
        raise ValueError(f"n={n}: could not draw that many distinct {split} problems of levels {levels}")
    return rows


# Worked solutions: multi-step word problems whose answers write every intermediate result
# (the default task of train_small.py; arithmetic_problems above is --task direct)
STEP_LEVELS = {
    1: "a + b, one digit each (one step)",
    2: "a + b - c, one digit each (two steps)",
    3: "a + b - c, a two-digit, b and c one-digit (two steps)",
    4: "a + b - c, a and b two-digit, c one-digit (two steps, carries)",
}


def _step_problem(rng, level):
    """(problem text, worked solution, integer answer) of one random problem of `level`."""
    who, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{who} had {a} {items}, got {b} more. How many now?", f"{a}+{b}={a + b}.", a + b
    a = rng.randint(1, 9) if level == 2 else rng.randint(10, 99)
    b = rng.randint(10, 99) if level == 4 else rng.randint(1, 9)
    c = rng.randint(1, min(9, a + b))
    text = f"{who} had {a} {items}, got {b}, lost {c}. How many left?"
    return text, f"{a}+{b}={a + b}. {a + b}-{c}={a + b - c}.", a + b - c


def step_problems(n, split="train", seed=0, levels=(1, 2, 3, 4), eval_fraction=0.2):
    """`n` distinct word problems whose `solution` works every step out before the answer, rows like
    load_problems' (+ `level` and `solution`). A response is the solution then \\boxed{answer}:

        Ann had 47 pens, got 8, lost 13. How many left?   ->   47+8=55. 55-13=42. \\boxed{42}

    so every intermediate result is a decision the policy can get wrong (and the grader, which
    reads the last \\boxed{}, scores only the end). Levels (STEP_LEVELS) cycle as in
    arithmetic_problems, and train / eval are disjoint by a hash of the problem text.

    >>> r = step_problems(4, seed=0)[3]; r["level"], r["solution"].count("="), r["answer"] == r["solution"].split("=")[-1][:-1]
    (4, 2, True)
    """
    return _generated(n, split, seed, levels, eval_fraction, STEP_LEVELS, _step_problem, "steps")


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
    """Child process: answer (pred, gold) requests until the pipe closes. A preemption notice (SIGTERM, SIGUSR1) or a
    Ctrl-C (SIGINT) sent to the whole process group is the parent's to act on: the child ignores it and grades on
    until the parent closes the pipe or ends (a parent stopped at once: the answer has no reader, the child returns)."""
    import logging
    import signal

    for notice in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # a Ctrl-C too: the parent stops after its step
        signal.signal(notice, signal.SIG_IGN)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the parent enforces the time limit
    _verify("1", "1")  # import math-verify + sympy now, so the time limit counts grading only
    conn.send("ready")
    while True:
        try:
            pred, gold = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            reward = _verify(pred, gold)
        except Exception:  # a parser bug on odd input is a wrong answer, not a crash
            reward = 0.0
        try:
            conn.send(reward)
        except OSError:  # the parent is gone (BrokenPipeError)
            return


GRADER_START_TIMEOUT_S = 120.0  # a child must import math-verify + sympy within this (seconds on a loaded node)
GRADER_WORKERS_CAP = 8  # default_grader_workers' cap; the reasoning is in its docstring


def default_grader_workers(ranks_per_node, cores=None, cap=GRADER_WORKERS_CAP):
    """Grader processes per rank: max(1, min(cap, cores // ranks_per_node)).

    `cores` defaults to the CPUs this process may run on (its affinity, which Slurm or a cgroup
    narrows; os.cpu_count() where affinity is unknown); the ranks of a node share them.
    Why cap at 8: one answer takes 11-45 ms to grade on this 2-core CPU (256 math500 gold
    answers in 2.8 s; 512 math500/minerva/olympiadbench answers in 23 s under load, see
    bench_grader), so a rank's share of 1024 answers on 8 GPUs (128) is ~1.5-6 s on one child
    and ~0.2-0.7 s on 8. More children would save a fraction of a second next to a step of
    minutes and next to the per-answer time limit that bounds the slowest answer, while each
    costs a core and memory: a spawned child re-imports the main script, ~260 MB of RSS when
    that script imports (CPU) torch, 64 MB without, so 8 ranks x 8 children is ~17 GB of RAM.

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
    """One grader process and what it is doing: "starting" (importing), "idle", or "busy" with `key`.

    `deadline` (time.monotonic()) is when a starting child must be ready, or a busy one must answer.
    """

    def __init__(self, ctx):
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_grader_worker, args=(child,), daemon=True)
        from support import common

        with common.sigint_ignored():  # from its first instruction (while it imports): a Ctrl-C is the parent's
            self.proc.start()
        child.close()  # the child holds the only other end: its death reads as EOF here
        self.conn = parent
        self.state, self.key, self.deadline = "starting", None, time.monotonic() + GRADER_START_TIMEOUT_S

    def give(self, key, timeout_s):
        self.conn.send(key)
        self.state, self.key, self.deadline = "busy", key, time.monotonic() + timeout_s  # the limit starts now

    def kill(self):
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class Grader:
    """0/1 math reward: last \\boxed{} of the completion vs the gold answer, with a hard time limit.

    grader = Grader(timeout_s=5.0, workers=4)
    grader.score(completion, gold) -> 1.0 or 0.0;  grader.score_batch(completions, golds) -> [0/1, ...]
    Use as a context manager or call close(); grader.start() starts the children ahead of time.
    Pass all of a step's answers in one score_batch call: the children grade one call's answers.

    Design. `workers` child processes each run math-verify on one (answer, gold) at a time.
    score_batch drops what needs no grading (no \\boxed{}, too long, already in the cache, a
    repeat within the batch), then loops: hand a waiting answer to every idle child, wait
    (multiprocessing.connection.wait) for the first reply or deadline, repeat. An answer that
    takes longer than timeout_s, counted from when its child got it, scores 0 and counts in
    `timeouts`; its child is killed. So is a child that dies on an answer. Children start
    when answers wait for them, all at once (each takes ~2 s to import math-verify), and a
    killed one is replaced the same way, while the others keep grading. A child that dies
    before it is ready raises RuntimeError (math-verify does not import, or the main script
    lacks its `__main__` guard): restarting it would only loop. Rewards come back in input
    order and do not depend on `workers`: each answer is graded alone, by the same code. The
    limit is wall-clock, though: with more busy children than free cores, an answer that needs
    nearly timeout_s of CPU can run past it (why default_grader_workers gives each child a core).
    """

    def __init__(self, timeout_s=5.0, workers=1):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}: must be a number of seconds > 0 (per answer)")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"workers={workers!r}: must be an int >= 1 (grader processes; "
                "mathtask.default_grader_workers(ranks_per_node) picks one)"
            )
        self.timeout_s, self.workers = timeout_s, workers
        self.timeouts = 0  # how many answers hit the time limit or killed their child (logged by the trainers)
        self._ctx = mp.get_context("spawn")  # safe beside CUDA and vLLM (no fork of their threads)
        self._children = []  # at most `workers` _Child; a killed one is dropped and replaced when needed
        self._cache = {}  # (pred, gold) -> reward

    def start(self):
        """Start all `workers` children now, together, and wait until they are ready (optional:
        score_batch starts them when answers wait; this moves the ~2 s out of the first step)."""
        while len(self._children) < self.workers:
            self._children.append(_Child(self._ctx))
        while any(c.state == "starting" for c in self._children):
            self._wait({})
        return self

    def score(self, completion, gold):
        return self.score_batch([completion], [gold])[0]

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

    def _grade(self, keys):
        """{key: reward} for distinct (pred, gold) keys, graded concurrently by the children."""
        waiting, rewards = collections.deque(keys), {}
        while waiting or any(c.state == "busy" for c in self._children):
            # Start children (together) while more answers wait than children are free or starting.
            free = sum(c.state != "busy" for c in self._children)
            for _ in range(min(self.workers - len(self._children), len(waiting) - free)):
                self._children.append(_Child(self._ctx))
            for child in list(self._children):
                if child.state == "idle" and waiting:
                    try:
                        child.give(waiting[0], self.timeout_s)
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
            message = None
        if message is None:
            self._fail(child, rewards)
            return
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


def held_out_pass(rows, sample, grader, n, k, chunk):
    """Held-out Pass@1 and Pass@k of a policy, overall and by the rows' `level`: greedy Pass@1 (one greedy answer
    per problem), mean Pass@1 over n sampled answers, unbiased Pass@k from them. sample(prompts, n, greedy) -> the
    answers' texts, prompt-major; `chunk` problems per call. rows: {"prompt", "answer"[, "level"]}."""
    from tqdm import tqdm

    greedy, correct = [], []  # [E], [E] (correct samples out of n)
    for start in tqdm(range(0, len(rows), chunk), desc="eval", leave=False, dynamic_ncols=True):
        prompts, golds = (
            [r["prompt"] for r in rows[start : start + chunk]],
            [r["answer"] for r in rows[start : start + chunk]],
        )
        greedy += grader.score_batch(sample(prompts, 1, True), golds)
        right = grader.score_batch(sample(prompts, n, False), [g for g in golds for _ in range(n)])
        correct += [sum(right[i * n : (i + 1) * n]) for i in range(len(prompts))]
    out = {
        "eval_greedy_pass1": sum(greedy) / len(greedy),
        "eval_pass1_mean": sum(correct) / (n * len(correct)),
        "eval_passk": sum(pass_at_k(n, int(c), k) for c in correct) / len(correct),
        "k": k,
        "n": n,
    }
    for level in sorted({r["level"] for r in rows if "level" in r}):  # by difficulty: the spread that gives signal
        idx = [i for i, r in enumerate(rows) if r.get("level") == level]
        out[f"eval_pass1_mean_level{level}"] = sum(correct[i] for i in idx) / (n * len(idx))
        out[f"eval_passk_level{level}"] = sum(pass_at_k(n, int(correct[i]), k) for i in idx) / len(idx)
        out[f"eval_greedy_pass1_level{level}"] = sum(greedy[i] for i in idx) / len(idx)
    return out


# ---------------------------------------------------------------------------------------------
# Benchmark (not a test): python -m support.mathtask --bench-grader [--n 512] [--workers 1,2] [--slow]
# ---------------------------------------------------------------------------------------------
def bench_grader(n=512, workers=(1, 2), data_dir=None, timeout_s=5.0, slow=False):
    """Print the wall time of Grader(timeout_s, w).score_batch on `n` real answers for each w in `workers`.

    The answers are gold answers of math500, minerva_math and olympiadbench (the repo's data/),
    evenly spaced rows, boxed: even positions get their own gold (right), odd positions the next
    row's gold (a real answer, wrong here). slow=True puts first one answer math-verify never
    finishes (a power tower), which costs one child timeout_s. Every w gets a fresh grader (empty
    cache), whose children are started, and timed, before the timed call. Returns {w: seconds}.
    """
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is in support/
    data_dir = data_dir or os.path.join(repository, "data")
    golds = [
        r["answer"]
        for name in ("math500.jsonl", "minerva_math.jsonl", "olympiadbench.jsonl")
        for r in load_problems(os.path.join(data_dir, name))[0]
    ]
    golds = [golds[i * len(golds) // n] for i in range(n)]
    completions = [f"The answer is \\boxed{{{golds[i if i % 2 == 0 else (i + 1) % n]}}}." for i in range(n)]
    if slow:
        completions, golds = ["\\boxed{9^{9^{9^{9^{9^{9}}}}}}"] + completions[1:], ["7"] + golds[1:]
    print(
        f"{n} answers{' (the first one slow)' if slow else ''}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at the start, timeout {timeout_s} s"
    )
    times, first = {}, None
    for w in workers:
        with Grader(timeout_s, workers=w) as grader:
            t0 = time.perf_counter()
            grader.start()
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            rewards = grader.score_batch(completions, golds)
            times[w] = time.perf_counter() - t0
        first = first or (rewards, times[w])
        print(
            f"workers={w}: start {start_s:.2f} s, score_batch {times[w]:.2f} s ({n / times[w]:.0f} answers/s, "
            f"x{first[1] / times[w]:.2f} vs workers={workers[0]}), reward sum {sum(rewards):.0f}, "
            f"timeouts {grader.timeouts}, rewards identical to workers={workers[0]}: {rewards == first[0]}"
        )
    return times


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="support/mathtask.py helpers; see the module docstring")
    parser.add_argument("--bench-grader", action="store_true", help="time Grader.score_batch for each --workers")
    parser.add_argument("--n", type=int, default=512, help="answers to grade (--bench-grader)")
    parser.add_argument("--workers", default="1,2", help="comma-separated grader process counts (--bench-grader)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer (--bench-grader)")
    parser.add_argument("--slow", action="store_true", help="first answer hits the time limit (--bench-grader)")
    args = parser.parse_args()
    if not args.bench_grader:
        parser.error("nothing to do: pass --bench-grader")
    bench_grader(args.n, [int(w) for w in args.workers.split(",")], timeout_s=args.timeout, slow=args.slow)
