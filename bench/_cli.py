"""The command lines of the bench scripts: argparse whose errors are one line, and the checks they share.

Every bad flag ends the same way as on train_small.py, train_full.py and toy/bandit.py: ONE line on
stderr, `prog: error: --flag VALUE: what is wrong; what to do`, exit code 2, before any work (no
model, data or timing yet) and never a traceback. Standard library only, so that a script can check
its flags before it imports torch.
"""

import argparse
import math
import os
import re

FLAG = r"argument (--[\w-]+)(?:/\S+)?: "  # argparse's "argument --x: ..." (or "argument --x/-x: ...")


class Parser(argparse.ArgumentParser):
    """argparse, with its own errors rewritten to the one-line form (no usage block), exit 2."""

    def error(self, message):
        message = " ".join(str(message).split())  # one line, whatever argparse put in it
        m = re.match(FLAG + r"(.*)$", message)
        if m:
            flag, rest = m.groups()
            number = re.fullmatch(r"invalid (int|float) value: (.*)", rest)
            choice = re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", rest)
            if re.fullmatch(r"expected (one|\d+) arguments?", rest):  # "--lr -inf": read as a flag, not a value
                message = (f"{flag}: {rest.replace('argument', 'value')}; pass it after the flag (a value that starts "
                           f"with '-' as {flag}=VALUE)")
            elif number:
                kind = "an integer" if number[1] == "int" else "a number"
                message = f"{flag} {number[2]}: not {kind}; pass {kind}"
            elif choice:
                message = f"{flag} {choice[1]}: not a choice; choose from {choice[2]}"
            else:
                message = f"{flag}: {rest}"
        elif message.startswith("unrecognized arguments: "):
            message += f"; see {self.prog} --help for the flags"
        self.exit(2, f"{self.prog}: error: {message}\n")


def finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def check_rules(p, rules):
    """rules: (flag, value, ok, what it must be). A value of None (not given) passes; NaN fails every
    comparison, so `lambda v: 0 < v <= 1` refuses it; unbounded floats use finite()."""
    for flag, value, ok, what in rules:
        if value is not None and not ok(value):
            p.error(f"{flag} {value}: must be {what}")


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


def size_list(p, flag, text, names, lows=(1, 1)):
    """'64x8,256x16' -> [(64, 8), (256, 16)], each part >= its low; names e.g. ('P', 'G')."""
    out = []
    for part in (x.strip() for x in text.split(",")):
        m = re.fullmatch(r"(\d+)[xX](\d+)", part)
        if not m:
            p.error(f"{flag} {text!r}: {part!r} is not {names[0]}x{names[1]}; pass comma-separated sizes, e.g. 64x8,256x16")
        a, b = int(m[1]), int(m[2])
        if a < lows[0] or b < lows[1]:
            p.error(f"{flag} {text}: {part} needs {names[0]} >= {lows[0]} and {names[1]} >= {lows[1]}")
        out.append((a, b))
    return out


def _nearest_existing(path):
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest ancestor that exists: the one makedirs would write into
        parent = os.path.dirname(parent)
    return parent


def check_out_dir(p, flag, path):
    """A folder to write into (made if missing): not empty, not a file, and its nearest existing
    ancestor a folder this process can write."""
    if not path or not path.strip():
        p.error(f"{flag} '': empty; pass a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{flag} {path}: is a file, not a folder; pass a folder (it is made if missing)")
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: {parent} is a file, so the folder cannot be made; pass another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: {parent} is not writable; pass a folder you can write to")


def check_out_file(p, flag, path):
    """A file to write: not empty, not a folder, in a folder that exists and is writable, and
    writable itself if it exists."""
    if path is None:
        return
    if not path.strip():
        p.error(f"{flag} '': empty; pass a file name")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        p.error(f"{flag} {path}: is a folder, not a file; pass a file name, e.g. {os.path.join(path, 'report.md')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        p.error(f"{flag} {path}: the folder {parent} does not exist; create it or pass a file in a folder that exists")
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: {_nearest_file(parent)} is a file, not a folder; pass a file in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: the folder {parent} is not writable; pass a file in a folder you can write to")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        p.error(f"{flag} {path}: the file is not writable; pass another file or make it writable")


def _nearest_file(path):
    """The first path component that is a file (why `path` cannot be a folder)."""
    while path and not os.path.isfile(path):
        path = os.path.dirname(path)
    return path


def check_in_file(p, flag, path, what="a file"):
    """A file to read: exists, is a file (not a folder), readable."""
    if not path or not path.strip():
        p.error(f"{flag} '': empty; pass {what}")
    if not os.path.exists(path):
        p.error(f"{flag} {path}: no such file; pass {what}")
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a folder, not a file; pass {what}")
    if not os.access(path, os.R_OK):
        p.error(f"{flag} {path}: not readable; pass {what} you can read")


def check_program(p, flag, path, fix):
    """An executable to run (a python): exists, is a file, can be executed."""
    if not path or not path.strip():
        p.error(f"{flag} '': empty; {fix}")
    if not os.path.exists(path):
        p.error(f"{flag} {path}: not found; {fix}")
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a folder; pass the python executable itself, e.g. {os.path.join(path, 'bin', 'python')}")
    if not os.access(path, os.X_OK):
        p.error(f"{flag} {path}: not executable; pass a python executable")


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(p, flag, device, cuda_count):
    """cpu, cuda or cuda:N, a CUDA one only where torch sees it (cuda_count: a callable returning
    torch.cuda.device_count(), so that torch is imported only when the device asks for CUDA)."""
    if not DEVICE.fullmatch(device or ""):
        p.error(f"{flag} {device!r}: not a device; pass cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        count = cuda_count()
        if not count:
            p.error(f"{flag} {device}: torch sees no CUDA device; use {flag} cpu, or install torch's CUDA build")
        if ":" in device and int(device.split(":")[1]) >= count:
            p.error(f"{flag} {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}; pass one of them")
