"""cli.flag and cli.parser: a rung's knobs, declared one line each, are argparse flags with their defaults, ranges,
choices and one-line errors; methods.flags: the knobs beyond the paper, declared once in support/methods.py, that a rung
adds with one call (the toy's come from there)."""

import os
import re
import sys

import pytest

from support import cli, methods

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy"))
import bandit  # noqa: E402


def knobs():
    f, n = cli.flag, cli.number
    return cli.parser(
        "x.py",
        "a test rung",
        [
            f("--steps", 80, n(int, 1), "training steps"),
            f("--optimizer", "adam", ["adam", "sgd"], "the optimizer"),
            f("--quick", False, bool, "a switch, off by default"),
            f("--no-balance", True, bool, "a switch that turns something off", dest="balance"),
            f("--out", "runs/x", None, "any text"),
            f("--target", [0.5], n(float, 0, 1, low_open=True), "one value or more", nargs="+"),
            f("--resume", None, None, "an optional value", nargs="?", const="latest"),
        ],
    )


def test_each_kind_of_knob_becomes_the_argparse_flag_it_declares():
    defaults = {
        "steps": 80,
        "optimizer": "adam",
        "quick": False,
        "balance": True,
        "out": "runs/x",
        "target": [0.5],
        "resume": None,
    }
    assert vars(knobs().parse_args([])) == defaults
    given = [
        "--steps",
        "3",
        "--optimizer",
        "sgd",
        "--quick",
        "--no-balance",
        "--out",
        "y",
        "--target",
        "0.1",
        "1",
        "--resume",
    ]
    assert vars(knobs().parse_args(given)) == {
        "steps": 3,
        "optimizer": "sgd",
        "quick": True,
        "balance": False,
        "out": "y",
        "target": [0.1, 1.0],
        "resume": "latest",
    }


def test_help_shows_each_knobs_help_and_default():
    text = " ".join(knobs().format_help().split())
    for shown in (
        "training steps (default: 80)",
        "{adam,sgd}",
        "the optimizer (default: adam)",
        "a switch, off by default --no-balance",
        "one value or more (default: [0.5])",
    ):
        assert shown in text, shown


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--steps", "0"], "x.py: error: --steps 0: must be an int >= 1"),
        (["--steps", "2.5"], "x.py: error: --steps '2.5': must be an int >= 1"),
        (["--optimizer", "adagrad"], "x.py: error: --optimizer 'adagrad': not a choice; choose from 'adam', 'sgd'"),
        (["--target", "0.5", "2"], "x.py: error: --target 2: must be in (0, 1]"),
        (["--quick", "yes"], "x.py: error: unrecognized arguments: yes; see x.py --help for the flags"),
        (
            ["--steps"],
            "x.py: error: --steps: expected one value; pass it after the flag (a value that starts with '-' as "
            + "--steps=VALUE)",
        ),
    ],
)
def test_a_bad_value_of_a_declared_knob_is_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as stop:
        knobs().parse_args(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_variants_flags_gives_the_knobs_named_in_that_order():
    assert [name for name, _ in methods.flags("--token-scope", "--schedule")] == ["--token-scope", "--schedule"]
    with pytest.raises(KeyError):
        methods.flags("--no-such-knob")


@pytest.mark.parametrize("value, ok", [("0", True), ("3", True), ("1", False), ("-2", False), ("nan", False)])
def test_the_switch_rule_flag_takes_0_for_off_or_a_ratio_over_1(value, ok, capsys):
    p = cli.parser("x.py", "", methods.flags("--switch-on-spike"))
    if ok:
        assert p.parse_args(["--switch-on-spike", value]).switch_on_spike == float(value)
        return
    with pytest.raises(SystemExit):
        p.parse_args(["--switch-on-spike", value])
    line = f"x.py: error: --switch-on-spike {value}: must be 0 (off) or a number > 1"
    assert capsys.readouterr().err.splitlines() == [line]


def test_the_toy_takes_its_variant_knobs_from_variants_and_only_those_its_loop_runs():
    toy = {action.option_strings[0]: action for action in bandit.build_parser()._actions if action.option_strings}
    declared = dict(methods.FLAGS)
    for name in ("--schedule", "--token-rule", "--token-scope", "--min-token-per-response"):
        assert (toy[name].help, toy[name].default) == (declared[name]["help"], declared[name]["default"]), name
    assert "--switch-on-spike" not in toy  # the toy's loop has no switch rule


# ---------------------------------------------------------------------------------------------
# --help of every entry point: each default once, the way a user reads it
# ---------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = {  # file: the function that parses its command line (it prints --help and exits 0)
    "train_small.py": "parse_args",
    "train_full.py": "parse_args",
    "toy/bandit.py": "parse_args",
    "bench/grader.py": "main",
    "bench/loss_head.py": "parse_args",
    "bench/memory.py": "parse_args",
    "bench/offload_adamw.py": "parse_args",
    "bench/selection.py": "parse_args",
    "bench/tiled_mlp.py": "parse_args",
    "bench/track.py": "main",
    "bench/trl_arm.py": "parse_args",
    "bench/vs_trl.py": "parse_args",
    "experiments/dropped_tokens.py": "parse_args",
    "experiments/headroom.py": "main",
    "experiments/questions_small.py": "parse_args",
    "experiments/questions_toy.py": "parse_args",
    "experiments/small_ladder.py": "parse_args",
    "experiments/toy_ladder.py": "main",
    "scripts/export_checkpoint.py": "main",
}


def test_every_entry_point_with_a_parser_is_in_the_help_table():
    """A script of bench/, experiments/ or scripts/ that parses flags gets a row above (a new one fails this test)."""
    found = set()
    for folder in ("bench", "experiments", "scripts"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            with open(os.path.join(ROOT, folder, name), encoding="utf-8") as f:
                if name.endswith(".py") and ".parse_args(" in f.read():
                    found.add(f"{folder}/{name}")
    assert found - {"scripts/build_warmstart.py"} <= set(ENTRY_POINTS), sorted(found - set(ENTRY_POINTS))


def help_entries(path, function, monkeypatch, capsys):
    """--help of one entry point, in this process: {"--flag ...": its help, on one line}."""
    import importlib.util

    monkeypatch.setenv("COLUMNS", "120")
    for folder in ("", "bench", "experiments", "toy"):
        monkeypatch.syspath_prepend(os.path.join(ROOT, folder))
    spec = importlib.util.spec_from_file_location("help_" + path.replace("/", "_")[:-3], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as stop:
        getattr(module, function)(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    entries, name = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):  # a flag's first line: the flag, then (past two spaces) its help
            name, _, rest = line.strip().partition("  ")
            entries[name] = rest.strip()
        elif name and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None
    assert len(entries) >= 2, text
    return entries


@pytest.mark.parametrize("path", sorted(ENTRY_POINTS))
def test_help_prints_each_default_once_and_the_right_way_round(path, monkeypatch, capsys):
    for flag, text in help_entries(path, ENTRY_POINTS[path], monkeypatch, capsys).items():
        assert len(re.findall(r"\(default\b|\bdefault:", text)) <= 1, (flag, text)  # once, not "(a) (default: b)"
        assert "(default: None)" not in text, (flag, text)  # None says nothing: the help says what happens
        if flag.startswith("--no-"):  # a negated switch is off until given; "(default: True)" reads backwards
            assert not re.search(r"default: (True|False|on|off)", text), (flag, text)


def test_help_shows_no_default_for_a_switch_and_none_for_none():
    text = " ".join(knobs().format_help().split())
    assert "a switch that turns something off --out" in text  # --no-balance: nothing after its help
    assert "an optional value" in text and "(default: None)" not in text
