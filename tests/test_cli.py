"""cli.flag and cli.parser: a rung's knobs, declared one line each, are argparse flags with their defaults, ranges,
choices and one-line errors; methods.flags: the knobs beyond the paper, declared once in support/methods.py, that a rung
adds with one call (the toy's come from there)."""

import os
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
        "a switch, off by default (default: False)",
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
