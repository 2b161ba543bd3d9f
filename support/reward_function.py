"""support/reward_function.py: --reward FILE.py:FUNCTION (or module:function), your own reward in place of math-verify's.

The function is called as TRL calls its reward functions, on a batch (here of one completion, so that the grader's
time limit is per completion, as math-verify's is):

    function(prompts=[problem], completions=[text], **{column: [value] for each other column of the row})
        -> [one float]

`prompts` are the data's problems (the prompt column, before --template, as TRL passes its dataset's prompts), the
completions the decoded responses; every other column of the row comes by its name (answer, id, level, ...; not
`prompt`, which TRL passes as `prompts`). It runs in the grader's child processes (support/grading.py): a call that
outlasts --grade-timeout / --grader-timeout is killed, scored 0 and counted (grader_timeouts). One that raises,
returns other than one value, or a NaN or inf stops the run: one line naming the function and the row, exit 2, the
last checkpoint intact. A worked example: integrations/closeness_reward.py. The held-out evaluations stay
math-verify's unless --eval-reward train (grading.eval_rewards): then the function scores them too, on --eval-data's
(--eval-file's) rows.

    FLAGS            --reward and --eval-reward, on both trainers
    load_reward, check_flag   the function of a spec, or one line naming --reward and the fix (before any work)
    call_once        one completion's reward (in the child): a float, or the text of what went wrong
    RewardError      the line that stops a run
"""

import importlib
import importlib.util
import math
import os

from support import cli
from support.cli import UsageError

FLAGS = [
    cli.flag(
        "--reward",
        None,
        None,
        "your reward function in place of math-verify's 0/1 (TRL's form: f(prompts=, completions=, **columns) -> "
        "floats); held-out evaluation: --eval-reward",
        metavar="FILE.py:FUNCTION",
    ),
    cli.flag(
        "--eval-reward",
        "math-verify",
        ["math-verify", "train"],
        "what scores the held-out evaluation: math-verify's 0/1 (Pass@k), or train: the run's own reward (--reward's "
        "function on the eval rows, read with --prompt-key/--answer-key, the answer optional; a real-valued reward "
        "reports its mean) (choice)",
    ),
]
RESERVED = ("prompts", "completions", "prompt", "where", "prompt_ids")  # not passed by name (TRL's: prompt is prompts)


class RewardError(UsageError):
    """A reward function that raised, returned the wrong number of values, or NaN: the run stops with this line."""


def load_reward(spec):
    """The function named by `spec`: "path/to/file.py:name" or "package.module:name"."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"--reward {spec}: expected FILE.py:FUNCTION or module:function")
    if where.endswith(".py") and not os.path.isfile(where):
        raise UsageError(f"--reward {spec}: no such file {where}; pass an existing Python file")
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], os.path.abspath(where))
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as e:  # a syntax error, a failed import inside it, no such module
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"--reward {spec}: importing {where} failed ({type(e).__name__}: {first}); fix it") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"--reward {spec}: {where} has no function {name}; name one it defines")
    return function


def check_flag(parser, spec):
    """--reward at parsing (both trainers): a spec that does not load is the parser's one line, before any work."""
    try:
        spec and load_reward(spec)
    except UsageError as e:
        parser.error(str(e))


def call_once(function, problem, completion, columns):
    """function(prompts=[problem], completions=[completion], **columns as one-element lists): its one float, or a
    str saying what went wrong (the parent names the function and the row)."""
    kwargs = {k: [v] for k, v in columns.items() if k not in RESERVED}
    try:
        out = function(prompts=[problem], completions=[completion], **kwargs)
        values = [float(v) for v in out]
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"raised {type(e).__name__}: {first}"
    if len(values) != 1:
        return f"returned {len(values)} values for 1 completion (one float per completion)"
    if not math.isfinite(values[0]):
        return f"returned {values[0]} (a reward must be a finite float)"
    return values[0]
