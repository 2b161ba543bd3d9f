"""support/cli.py: the command lines of every entry point: argparse whose errors are one line, and the checks they share.

Every bad flag, path or file ends the same way on train_small.py, train_full.py, toy/bandit.py and the bench and
experiments scripts: ONE line on stderr, `prog: error: --flag VALUE: what is wrong; what to do`, exit code 2,
before any work (no model, data or timing yet), never a traceback. A rung (and a bench or experiments script)
declares its knobs as a list, one line each: `flag("--steps", 80, number(int, 1), "training steps per run")`, its
name, default, what it may be (a numeric flag carries its range: number) and help; parser() turns the list into
argparse flags, whose --help shows each default once (Help). Standard library only, so that a script can check its
flags before it imports torch.
"""

import argparse
import json
import math
import os
import re
import sys

FLAG = r"argument (--[\w-]+)(?:/\S+)?: "  # argparse's "argument --x: ..." (or "argument --x/-x: ...")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")
DROP_LONG_PROMPTS_HELP = (
    "(choice) leave out the rows whose prompt does not fit the model's context less the response "
    "length, and count them; default: stop before any work, naming the row's file:line"
)


class UsageError(ValueError):
    """A flag, file, model or checkpoint that cannot be used: `--flag VALUE: what is wrong; what to do`."""


class Help(argparse.HelpFormatter):
    """--help shows a flag's default once, the way a user reads it: not where the help already says "default:",
    not for None (not given) or '', and not for an on/off switch, which is off until given (a "--no-x" beside
    "(default: True)" reads backwards)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or action.nargs == 0 or action.default in (None, "", argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if action.option_strings else text


class Parser(argparse.ArgumentParser):
    """argparse, with every error rewritten to one line (no usage block) and exit 2; defaults shown in --help (Help).
    A value that starts with '-' ("--lr -inf") is read as the flag's value, not as another flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        options = {o for action in self._actions for o in action.option_strings}
        one_value = {o for a in self._actions if a.nargs is None and a.const is None for o in a.option_strings}
        glued = []  # ["--lr", "-inf"] -> ["--lr=-inf"]: argparse would take "-inf" for a flag
        for arg in sys.argv[1:] if args is None else args:
            if glued and glued[-1] in one_value and arg.startswith("-") and arg not in options:
                glued[-1] += "=" + arg
            else:
                glued.append(arg)
        if "--config" in options:  # a file of flags: its values first, the command line over them
            namespace = self.read_config(glued, namespace or argparse.Namespace())
        return super().parse_args(glued, namespace)

    def read_config(self, argv, namespace):
        """--config FILE (JSON, or YAML by its .yaml/.yml name): {flag: value}, a key being the flag's name without
        "--" (max-grad-norm or max_grad_norm), each value checked as the flag checks its text; they are set on
        `namespace`, which the command line then overrides. An unknown key or a bad value is one line naming the file
        and the key. A run's own OUT/args.json (it holds "run") relaunches that run: what it records beside the flags
        (world, run, ...) is skipped."""
        self.configured = {}  # flag -> "FILE, key KEY": where a value that a later check refuses came from
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv)[0].config
        if path is None:
            return namespace
        try:
            with open(path) as f:
                text = f.read()
            data = _yaml_or_json(text, path)
        except OSError as e:
            self.error(f"--config {path}: cannot be read ({e.strerror}); pass a JSON or YAML file of flags")
        except ValueError as e:
            self.error(f"--config {path}: not valid {'YAML' if path.endswith(YAML) else 'JSON'} ({e}); fix the file")
        if not isinstance(data, dict):
            self.error(f"--config {path}: holds no mapping of flags to values; write one key a flag, e.g. lr: 1e-6")
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")}
        for key, value in data.items():
            action = actions.get(str(key).replace("-", "_"))
            if action is None:
                if "run" in data:  # a run's args.json: its records beside the flags
                    continue
                self.error(f"--config {path}: unknown key '{key}'; the keys are the flags without --, as --help lists")
            setattr(namespace, action.dest, self._config_value(f"--config {path}: {key}", action, value))
            if not set(action.option_strings) & {arg.split("=")[0] for arg in argv}:  # not overridden on the line
                self.configured.update(dict.fromkeys(action.option_strings, f"{path}, key {key}"))
        return namespace

    def _config_value(self, where, action, value):
        """A config value as the flag would give it: its type and choices applied (a list joined with commas where
        the flag takes one text, as --eval-pass-k 1,8)."""
        if value is None:
            return None
        if action.nargs == 0:  # an on/off switch
            if not isinstance(value, bool):
                self.error(f"{where}: {value!r} must be true or false")
            return value
        many = action.nargs in ("+", "*")
        if isinstance(value, list) and not many:
            value = ",".join(map(str, value))
        items = []
        for item in value if many and isinstance(value, list) else [value]:
            if isinstance(item, (dict, list)):
                self.error(f"{where}: {item!r} must be a number or a text")
            if action.type is not None:
                try:
                    item = action.type(str(item))
                except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                    self.error(f"{where}: {e}")
            if action.choices is not None and item not in action.choices:
                choices = ", ".join(map(str, action.choices))
                self.error(f"{where}: {item!r} is not a choice; choose from {choices}")
            items.append(item)
        return items if many else items[0]

    def error(self, message):
        message = " ".join(str(message).split())  # one line, whatever argparse put in it
        if m := re.match(FLAG + r"(.*)$", message):
            flag, rest = m.groups()
            if re.fullmatch(r"expected (one|at least one|\d+) arguments?", rest):  # a flag without its value
                message = (
                    f"{flag}: {rest.replace('argument', 'value')}; pass it after the flag (a value that starts "
                    f"with '-' as {flag}=VALUE)"
                )
            elif number := re.fullmatch(r"invalid (int|float) value: (.*)", rest):
                kind = "an integer" if number[1] == "int" else "a number"
                message = f"{flag} {number[2]}: not {kind}; pass {kind}"
            elif choice := re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", rest):
                message = f"{flag} {choice[1]}: not a choice; choose from {choice[2]}"
            elif re.match(r"(not allowed|ignored explicit)", rest):
                message = f"{flag}: {rest}"
            else:  # a check of ours: "VALUE: what is wrong; what to do"
                message = f"{flag} {rest}"
        elif message.startswith("unrecognized arguments: "):
            message += f"; see {self.prog} --help for the flags"
        flag = message.split(" ", 1)[0].rstrip(":")
        if flag in getattr(self, "configured", {}):  # a value a checker refused after parsing came from --config
            message += f" (set by --config {self.configured[flag]})"
        self.say(f"{self.prog}: error: {message}")
        sys.exit(2)

    @staticmethod
    def say(line):
        """Print the error line (train_full.py prints it once per job: rank 0 only)."""
        print(line, file=sys.stderr, flush=True)


YAML = (".yaml", ".yml")
CONFIG_HELP = (
    "JSON or YAML of flags (keys: the flags without --; OUT/args.json relaunches a run); the command line wins"
)


def _yaml_or_json(text, path):
    """The mapping of a config file: YAML by its name (PyYAML, which transformers installs), else JSON."""
    if not path.endswith(YAML):
        return json.loads(text)
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None


def number(kind, low=None, high=None, low_open=False, high_open=False, what=None, also=()):
    """An argparse type: the text as `kind` (int or float), finite, in [low, high] (low_open, high_open: exclusive);
    the values in `also` pass too (0 for "off"). Else "VALUE: must be WHAT", which the Parser prefixes with the flag.

    >>> number(int, 1)("3"), number(float, 0, 1, low_open=True)("0.5")
    (3, 0.5)
    """
    if what is None:
        bounds = "an int" if kind is int else ""
        if low is not None and high is not None:
            what = f"{bounds} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}".strip()
        elif low is not None:
            what = f"{bounds or 'a finite number'} {'>' if low_open else '>='} {low:g}"
        else:
            what = bounds or "a finite number"

    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}") from None
        if value not in also and not (
            math.isfinite(value)
            and (low is None or (low < value if low_open else low <= value))
            and (high is None or (value < high if high_open else value <= high))
        ):
            raise argparse.ArgumentTypeError(f"{text}: must be {what}")
        return value

    parse.__name__ = kind.__name__
    return parse


def flag(name, default=None, what=None, help="", **more):
    """One knob of a rung, declared on one line: its flag, default, what it may be and help. `what`: a number(...)
    range, a list of choices, bool for an on/off switch (store_true; store_false where the default is True), or None
    for any text. `more`: argparse's other keywords (nargs, metavar, dest, const). A list default is passed on as
    is: build the list of flags inside the rung's build_parser, so that each parser has its own.

    >>> flag("--optimizer", "adam", ["adam", "sgd"], "the optimizer")
    ('--optimizer', {'default': 'adam', 'help': 'the optimizer', 'choices': ['adam', 'sgd']})
    """
    kw = {"default": default, "help": help, **more}
    if what is bool:
        kw["action"] = "store_false" if default else "store_true"
    elif isinstance(what, (list, tuple)):
        kw["choices"] = list(what)
    elif what is not None:
        kw["type"] = what
    return name, kw


def parser(prog, description, flags, **more):
    """A Parser (one-line errors) with the flags of a list of flag(...) entries, in order.

    >>> p = parser("toy", "a toy", [flag("--steps", 80, number(int, 1), "steps"), flag("--quick", False, bool, "fewer")])
    >>> vars(p.parse_args(["--steps", "3"]))
    {'steps': 3, 'quick': False}
    """
    p = Parser(prog=prog, description=description, **more)
    for name, kw in flags:
        p.add_argument(name, **kw)
    return p


def check_model(p, model):
    """--model: a hub name (org/name, loaded later), or a local folder with all a model needs: config.json, weights
    (WEIGHTS, or any *.safetensors) and a tokenizer (TOKENIZER); a folder that lacks one is named before any work."""
    if not model:
        p.error("--model '': empty; pass a model folder or a hub name like Qwen/Qwen2.5-Math-1.5B")
    if os.path.isfile(model):
        p.error(f"--model {model}: is a file; pass the model's folder (with config.json) or a hub name")
    if os.path.isdir(model):
        files = set(os.listdir(model))
        if "config.json" not in files:
            p.error(f"--model {model}: has no config.json; pass a folder saved with save_pretrained, or a hub name")
        if not files & set(WEIGHTS) and not any(f.endswith(".safetensors") for f in files):
            p.error(f"--model {model}: has no weights ({', '.join(WEIGHTS)}); pass a folder saved with save_pretrained")
        if not files & set(TOKENIZER):
            p.error(
                f"--model {model}: has no tokenizer ({', '.join(TOKENIZER)}); save one into it "
                "(tokenizer.save_pretrained), or pass the folder of a complete model"
            )
    elif model.startswith((".", "/", "~")) or model.count("/") != 1:
        p.error(f"--model {model}: no such folder (and not a hub name like Qwen/Qwen2.5-Math-1.5B); check the path")


def int_list(p, flag, text, low=None, what="comma-separated integers", allow_empty=False, unique=False):
    """'1,2,3' -> [1, 2, 3], each >= low; a one-line error otherwise."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = [int(x) for x in items]
    except ValueError:
        p.error(f"{flag} {text!r}: must be {what}, e.g. 1,2,3")
    if not values and not allow_empty:
        p.error(f"{flag} {text!r}: empty; pass {what}, e.g. 1,2,3")
    if low is not None and any(v < low for v in values):
        p.error(f"{flag} {text}: each value must be >= {low}")
    if unique and len(set(values)) != len(values):
        p.error(f"{flag} {text}: a value is repeated; give each once")
    return values


def check_out_dir(p, flag, path):
    """A folder to write into (made if missing): not empty, not a file, and its nearest existing ancestor a
    folder this process can write."""
    if not path or not path.strip():
        p.error(f"{flag} '': empty; pass a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{flag} {path}: is a file, not a folder; pass a folder (it is made if missing)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest ancestor that exists: the one makedirs would write into
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: {parent} is a file, so the folder cannot be made; pass another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: {parent} is not writable; pass a folder you can write to")


def out_file(path):
    """An argparse type: a file to write (a report), checked at parsing: not a folder, in a folder that exists and
    this process can write."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.strip():
        raise argparse.ArgumentTypeError(f"{path!r}: empty; pass a file name")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        why = f"is a folder, not a file; pass a file name, e.g. {os.path.join(path, 'report.md')}"
    elif not os.path.exists(folder):
        why = f"the folder {folder} does not exist; create it or pass a file in a folder that exists"
    elif not os.path.isdir(folder):  # it exists, so it is the file in the way
        why = f"{folder} is a file, not a folder; pass a file in a folder"
    elif not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        why = "not writable; pass a file you can write, in a folder you can write to"
    else:
        return path
    raise argparse.ArgumentTypeError(f"{path}: {why}")
