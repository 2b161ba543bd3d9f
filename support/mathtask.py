"""support/mathtask.py: where a run's problems come from, and which prompts fit (support/templates.py makes them).

load_problems        JSONL / JSON / Parquet files or hub datasets -> rows with `problem` and `answer`, checked row
                     by row (an error names file:line); one loader for both trainers
step_problems, arithmetic_problems   the tiny model's generated tasks (TASKS), with difficulty levels
fit_context, fit_prompts   the rows whose prompt fits the model's context (a longer one named with file:line, or dropped)
load_data            train_small.py's rows: the generated task or --train-file / --eval-file
PromptOrder, rank_share, sample_seeds   train_full.py's: one global prompt order, each rank's share of a step's
                     prompts, and one sampling seed per prompt
load_inputs          train_full.py's tokenizer, stop ids, prompts and benchmarks, read on every rank before the process
                     group exists, so that a bad model folder or data file stops every rank at once
load_tokenizer, load_generation_config, context_length   a model's tokenizer, its EOS ids, the tokens a sequence holds
"""

import json
import os
import random
import zlib

import torch

from support import cli
from support.cli import UsageError
from support.templates import SYSTEM_PROMPT, check_template, format_prompt, pick_template, stop_token_ids


def extract_boxed(text):
    """The content of the last \\boxed{...} in `text` whose "{" is closed (braces balanced), or None. Linear time: one
    pass pairs the braces with a stack.

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


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, line and fix."""


PROBLEM_KEYS = ("problem", "question", "prompt", "query", "input")
ANSWER_KEYS = ("answer", "final_answer", "gt_answer", "ground_truth", "target", "solution")
FLAGS = [  # the data's columns, both trainers: train_small's --train-file and --eval-file, train_full's --train-data
    cli.flag(
        "--prompt-key",
        None,
        None,
        f"the data's problem column (default: the first of {'/'.join(PROBLEM_KEYS)} in a row)",
        metavar="COLUMN",
    ),
    cli.flag(
        "--answer-key",
        None,
        None,
        f"the data's gold-answer column (default: the first of {'/'.join(ANSWER_KEYS)}, or verl's "
        "reward_model.ground_truth)",
        metavar="COLUMN",
    ),
]


def _read_rows(path):
    """Yield (line_no, row) from .jsonl, .json (a list) or .parquet. UTF-8, with or without a byte-order mark; CRLF
    line ends are fine. A byte that is not UTF-8 raises DataError naming its line."""
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
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:  # its line and column: count the line ends before it
        i = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(
            f"{path}:{i}: byte 0x{raw[e.start]:02x} at column {column} is not UTF-8; "
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
    """A problem or answer as a string: numbers are written as text; a one-element list is its element; a chat list
    ([{"role": "user", "content": ...}], problems only) is its last user turn. Other lists, dicts and booleans raise
    DataError: a row has one problem and one answer (the grader compares the last \\boxed{} with one gold answer)."""
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


def normalize_row(row, where="row", keys=(None, None), need_answer=True):
    """{problem, answer} from a row's common column names, or None if it has no problem or no answer.

    Problem: the first of PROBLEM_KEYS present. Answer: the first of ANSWER_KEYS, or reward_model.ground_truth
    (verl's format); a `solution` gives its last \\boxed{}; a GSM8K answer ("... #### 72") gives what follows ####.
    keys: --prompt-key and --answer-key, the one column each reads where given; need_answer=False (a --reward that
    may not read it): a row without an answer has answer None.
    >>> normalize_row({"question": "1+1?", "solution": "so \\\\boxed{2}."})
    {'problem': '1+1?', 'answer': '2'}
    >>> normalize_row({"question": "1+1?", "answer": "1 + 1 = 2\\n#### 2"})
    {'problem': '1+1?', 'answer': '2'}
    >>> normalize_row({"problem": "half of 5?", "answer": 2.5})
    {'problem': 'half of 5?', 'answer': '2.5'}
    """
    problem_keys, answer_keys = ((key,) if key else names for key, names in zip(keys, (PROBLEM_KEYS, ANSWER_KEYS)))
    problem_key = next((k for k in problem_keys if row.get(k) not in (None, "", [])), None)
    answer_key = next((k for k in answer_keys if row.get(k) not in (None, "", [])), None)
    problem = _text_field(row[problem_key], where, "problem") if problem_key else None
    answer = _text_field(row[answer_key], where, "answer") if answer_key else None
    if answer_key is None and keys[1] is None and isinstance(row.get("reward_model"), dict):
        answer = _text_field(row["reward_model"].get("ground_truth"), where, "answer")
    if answer_key == "solution" and answer is not None:
        answer = extract_boxed(answer)  # a worked solution: its final \boxed{} is the answer
    if answer is not None and "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()  # GSM8K style: "...reasoning... #### 72"
    if not problem or (need_answer and not answer):
        return None
    return {"problem": problem, "answer": answer}


def load_problems(spec, drop_missing=False, limit=None, keys=(None, None), need_answer=True):
    """Rows {problem, answer, id, ...} from a local JSONL / JSON / Parquet file, or a hub dataset `name`,
    `name:split` or `name:config:split` (needs `pip install datasets`).

    Returns (rows, n_dropped). Column names are mapped by normalize_row; a row's other fields (e.g. `level`) are
    kept, and `where` (file:line) is added. drop_missing=False: a row without a problem or an answer raises
    DataError naming file:line; drop_missing=True: such rows are skipped and counted (hub datasets and
    train_full.py's large files). No usable row at all raises DataError. keys: --prompt-key and --answer-key (None:
    the default names); a row without such a column raises DataError naming file:line, the key and its columns.
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
        for flag, key in zip(("--prompt-key", "--answer-key"), keys):
            if key is not None and key not in raw:
                raise DataError(
                    f"{where}: {flag} {key}: the row has no such column (its columns: {', '.join(map(str, raw))}); "
                    f"pass {flag} one of them"
                )
        row = normalize_row(raw, where, keys, need_answer)
        if row is None:
            if drop_missing:
                dropped += 1
                continue
            raise DataError(
                f"{where}: row has no problem ({keys[0] or '/'.join(PROBLEM_KEYS)}) or no answer "
                f"({keys[1] or '/'.join(ANSWER_KEYS)}); every row needs a non-empty 'problem' and 'answer' "
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
        if n > limit - SHORT_BYTES:  # verbose=False: no tokenizer warning, the DataError below says it
            n = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
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


def fit_prompts(rows, *, template, tokenizer, window, budget, drop, name, system_prompt=SYSTEM_PROMPT):
    """The rows whose prompt fits the model's context of `window` positions less the response's `budget` (flag,
    tokens), one check for both trainers (fit_context: a longer prompt is one line naming its file:line, or dropped
    and counted with drop=True, --drop-long-prompts). Returns (rows, how many were dropped); a window of None: no
    limit. A budget that leaves no room, or no row that fits, is one line naming `budget`'s flag or `name`."""
    flag, tokens = budget
    if not window:
        return rows, 0
    if tokens >= window:
        raise UsageError(
            f"{flag} {tokens}: the model's context is {window} positions (max_position_embeddings), prompt "
            "included; lower it"
        )
    limit, why = window - tokens, f"the model's context of {window} positions less {flag} {tokens}"

    def prompt(row):
        return format_prompt(row["problem"], template, tokenizer, system_prompt)

    kept, dropped = fit_context(rows, prompt, tokenizer, limit, why, drop)
    if not kept:
        raise DataError(f"{name}: no prompt fits in {limit} tokens ({why}); shorten them or raise the limit")
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


ARITHMETIC_LEVELS = {
    1: "a + b, one digit each",
    2: "two-digit +/- one-digit",
    3: "two-digit +/- two-digit",
    4: "a + b - c, one digit each (two steps)",
}
_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo")
_ITEMS = ("pens", "cups", "eggs", "hats", "keys", "maps", "nuts", "figs", "jars", "toys")
EVAL_FRACTION = 0.2  # the share of all generated problem texts that are held out ("eval")


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


def arithmetic_problems(n, split="train", seed=0):
    """`n` distinct short arithmetic word problems, rows like load_problems' (+ `level`).

    Levels (ARITHMETIC_LEVELS) cycle 1, 2, 3, 4, 1, ... so every level has n / len(levels) rows. A problem's split
    is fixed by a hash of its text (EVAL_FRACTION of all texts are "eval"), so the "train" and "eval" sets are
    disjoint whatever n and seed. They share arithmetic facts (there are only 81 one-digit sums), not problems: a
    held-out problem is a new (name, item, numbers) combination.

    >>> arithmetic_problems(2, seed=0)[1]["level"], arithmetic_problems(2, "eval")[0]["id"]
    (2, 'arith-eval-0-0')
    >>> train = {r["problem"] for r in arithmetic_problems(500)}
    >>> any(r["problem"] in train for r in arithmetic_problems(500, "eval"))
    False
    """
    return _generated(n, split, seed, ARITHMETIC_LEVELS, _arithmetic_problem, "arith")


def _generated(n, split, seed, level_names, draw, prefix):
    """n distinct problems from draw(rng, level) -> (text, solution or None, answer), levels cycling, split by hash."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: choose 'train' or 'eval'")
    levels = tuple(level_names)
    rng = random.Random(f"{'arithmetic' if prefix == 'arith' else prefix}-{seed}-{split}")
    rows, seen = [], set()
    for attempt in range(200 * n + 1000):
        if len(rows) == n:
            break
        level = levels[len(rows) % len(levels)]
        problem, solution, answer = draw(rng, level)
        is_eval = zlib.crc32(problem.encode()) % 1000 < 1000 * EVAL_FRACTION
        if problem in seen or is_eval != (split == "eval"):
            continue
        seen.add(problem)
        row = {"id": f"{prefix}-{split}-{seed}-{len(rows)}", "problem": problem, "answer": str(answer), "level": level}
        rows.append(row if solution is None else {**row, "solution": solution})
    if len(rows) < n:
        raise ValueError(f"n={n}: could not draw that many distinct {split} problems of levels {levels}")
    return rows


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


def step_problems(n, split="train", seed=0):
    """`n` distinct word problems whose `solution` works every step out before the answer, rows like load_problems'
    (+ `level` and `solution`). A response is the solution then \\boxed{answer}:

        Ann had 47 pens, got 8, lost 13. How many left?   ->   47+8=55. 55-13=42. \\boxed{42}

    so every intermediate result is a decision the policy can get wrong (and the grader, which reads the last
    \\boxed{}, scores only the end). Levels (STEP_LEVELS) cycle as in arithmetic_problems, and train / eval are
    disjoint by a hash of the problem text.

    >>> r = step_problems(4, seed=0)[3]; r["level"], r["solution"].count("="), r["answer"] == r["solution"].split("=")[-1][:-1]
    (4, 2, True)
    """
    return _generated(n, split, seed, STEP_LEVELS, _step_problem, "steps")


TASKS = {"steps": step_problems, "direct": arithmetic_problems}  # mathtask's generated tasks


def load_data(args):
    """(train_rows, eval_rows): --train-file / --eval-file, else the --task's generated split."""

    def rows(path, size, split):
        if not path:
            return TASKS[args.task](size, split, seed=args.seed)
        columns = (args.prompt_key, args.answer_key)
        return load_problems(path, limit=size, keys=columns, need_answer=not args.reward)[0]

    return rows(args.train_file, args.train_size, "train"), rows(args.eval_file, args.eval_size, "eval")


class PromptOrder:
    """A fresh seeded permutation of the training prompts each epoch, identical on every rank.

    take(P) returns the next P prompt indices of the global batch; state_dict() is the data position saved in
    checkpoints, so a resumed run sees exactly the prompts it would have seen.
    """

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def take(self, count):
        out = []
        while len(out) < count:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)  # the epoch's permutation
            perm = torch.randperm(self.n, generator=generator).tolist()
            chunk = perm[self.pos : self.pos + count - len(out)]
            out += chunk
            self.pos += len(chunk)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state):
        if state["n"] != self.n:
            raise DataError(
                f"checkpoint was made with {state['n']} training prompts, this run has {self.n}; "
                "resume with the same --train-data and --max-prompt-len"
            )
        self.epoch, self.pos = state["epoch"], state["pos"]


def rank_share(items, world):
    """This rank's contiguous share of a global list (rank order = global order)."""
    per = len(items) // world.size
    return items[world.rank * per : (world.rank + 1) * per]


def sample_seeds(args, step, indices, n):
    """One sampling seed per (step, global prompt index): generation does not depend on the rank count.

    vLLM seeds sample j of a request with seed + j, so the seeds of one call are n apart: no two samples of a step
    share a noise stream.
    """
    if args.unseeded_sampling:
        return [None] * len(indices)
    return [(args.seed * 1_000_003 + (step * 1_000_003 + index) * n) % (2**31 - 1) for index in indices]


# === train_full.py's inputs: its tokenizer, prompts and benchmarks ======================================================
def context_length(model_path, args):
    """Prompt + response tokens one sequence may hold: the model's context window, capped at
    max(prompt + response budget, 4096) so a long-context model does not reserve a huge sequence."""
    from transformers import AutoConfig

    window = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 10**9
    return min(window, max(args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens), 4096))


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_generation_config(path):
    """The model's generation_config.json (its EOS ids feed templates.stop_token_ids), or None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # the folder (or hub repo) has none
        return None


def load_inputs(args):
    """(tokenizer, stop_ids, prompts (None with --eval-only), eval sets, a note on what was dropped); exit 2 on every
    rank for a bad one. The prompts fit the context less --max-response-len (mathtask.fit_context); --max-prompt-len,
    a budget, drops (and counts) those that fit but are longer."""
    import transformers
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoConfig

    transformers.utils.logging.disable_progress_bar()  # one bar per rank and model load would flood the log
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # offline, the hub's retries would print a line each
    try:
        tokenizer = load_tokenizer(args.model)
        generation_config = load_generation_config(args.model)
    except (OSError, ValueError) as e:  # not a model folder, not on the hub (or offline), no tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--model {args.model}: cannot load its tokenizer ({first}); pass a folder with config.json "
            "and the tokenizer files, or a hub name"
        ) from None
    finally:
        hub_logging.set_verbosity(verbosity)
    args.template = pick_template(args.template, tokenizer, args.model)  # auto: chat, or qwen-math (in args.json)
    check_template(args.template, tokenizer)  # markup the tokenizer does not know: one line
    probe = format_prompt("What is 1 + 1?", args.template, tokenizer, args.system_prompt)
    if not tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise UsageError(
            f"--model {args.model}: its tokenizer encodes a prompt to no tokens; pass a folder whose "
            "tokenizer matches its model (tokenizer.save_pretrained of the model's own tokenizer)"
        )
    stop_ids = stop_token_ids(tokenizer, generation_config)
    eval_sets = _load_eval_sets(args, tokenizer, context_length(args.model, args))
    if args.eval_only:
        return tokenizer, stop_ids, None, eval_sets, ""
    columns = (args.prompt_key, args.answer_key)
    rows, dropped = load_problems(args.train_data, drop_missing=True, keys=columns, need_answer=not args.reward)
    window = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    rows, args.dropped_long_prompts = fit_prompts(  # in args.json
        rows,
        template=args.template,
        tokenizer=tokenizer,
        window=window,
        budget=("--max-response-len", args.max_response_len),
        drop=args.drop_long_prompts,
        name=f"--train-data {args.train_data}",
        system_prompt=args.system_prompt,
    )
    prompts, too_long = _encode_prompts(rows, tokenizer, args, args.max_prompt_len)
    if not prompts:
        raise UsageError(
            f"--max-prompt-len {args.max_prompt_len}: no prompt of {args.train_data} is that short "
            f"({too_long} longer); raise it"
        )
    n_long = args.dropped_long_prompts
    over_context = f", {n_long} longer than the model's context dropped (--drop-long-prompts)" if n_long else ""
    note = (
        f"{len(prompts)} prompts ({dropped} rows without an answer dropped, {too_long} longer than "
        f"{args.max_prompt_len} tokens dropped{over_context})"
    )
    return tokenizer, stop_ids, prompts, eval_sets, note


def _load_eval_sets(args, tokenizer, context):
    """Every --eval-data benchmark, read and tokenized: [(name, problems, rows without an answer, prompts too long)].
    With --eval-reward train, read as --train-data is: --prompt-key/--answer-key, the answer optional with --reward."""
    sets, own = [], getattr(args, "eval_reward", "math-verify") == "train"
    columns = {"keys": (args.prompt_key, args.answer_key), "need_answer": not args.reward} if own else {}
    for spec in args.eval_data:
        rows, dropped = load_problems(spec, drop_missing=True, limit=args.eval_limit or None, **columns)
        problems, too_long = _encode_prompts(rows, tokenizer, args, max_prompt_len=context - 1)
        name = os.path.splitext(os.path.basename(spec))[0] if os.path.exists(spec) else spec
        sets.append((name, problems, dropped, too_long))
    return sets


def _encode_prompts(rows, tokenizer, args, max_prompt_len):
    """Apply --template (and --system-prompt) and tokenize; prompts longer than max_prompt_len are dropped and counted."""
    out, too_long = [], 0
    for row in rows:
        text = format_prompt(row["problem"], args.template, tokenizer, args.system_prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_len:
            too_long += 1
            continue
        out.append({**row, "prompt_ids": ids})  # the row's other columns: --reward's function reads them by name
    return out, too_long
