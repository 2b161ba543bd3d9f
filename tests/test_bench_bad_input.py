"""Bad input to the bench scripts the docs tell users to run: one line, exit 2, never a traceback.

For each script, a table of (argv, fragment): run as a subprocess, every case must exit 2 with
exactly one non-empty line on stderr, `<prog>: error: ...` containing the fragment (the flag, its
value and what is wrong), no "Traceback", and nothing on stdout (no work started). The checks run
before any work: bench/vs_trl.py's flags and experiments/headroom.py's --out before torch is imported
(vs_trl.py needs the TRL venv only for its arms, so this runs in the project's .venv); the others right
after their imports (about 2 s). experiments/headroom.py hands the rest of its flags to train_small.py's
parser and checks, under its own name.

Paths in the tables: {file} an existing text file, {dir} an existing empty folder, {missing} a path
that does not exist, {json} a JSON file with no model_type (all made in a temporary folder).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VS_TRL = [
    (["--steps", "0"], "--steps 0: must be an int >= 1"),
    (["--quick", "--repeats", "-1"], "--repeats -1: must be"),  # checked as given, before --quick's sizes
    (["--steps", "x"], "--steps 'x': must be an int >= 1"),
    (["--lr", "nan"], "--lr nan: must be in (0, 1]"),
    (["--lr=-inf"], "--lr -inf: must be in (0, 1]"),
    (["--lr", "-inf"], "--lr -inf: must be in (0, 1]"),  # read as the flag's value, not as a flag (cli.Parser)
    (["--temperature", "0"], "--temperature 0: must be in [0.01, 100]"),
    (["--max-grad-norm", "inf"], "--max-grad-norm inf: must be a finite number > 0"),
    (["--max-grad-norm", "-1"], "--max-grad-norm -1: must be a finite number > 0"),
    (["--group-size", "1"], "--group-size 1: must be an int in [2, 1024]"),
    (["--prompts-per-step", "0"], "--prompts-per-step 0: must be"),
    (["--hidden-size", "6"], "--hidden-size 6: must be a multiple of 4"),
    (["--train-size", "0"], "--train-size 0: must be"),
    (["--sft-steps", "-1"], "--sft-steps -1: must be"),
    (["--threads", "-1"], "--threads -1: must be"),
    (["--seed", "-1"], "--seed -1: must be"),
    (["--arms", "foo"], "unknown arm 'foo'"),
    (["--arms", ","], "--arms ',': empty"),
    (["--arms", "grpo,grpo"], "an arm is repeated"),
    (["--seeds", "a,b"], "--seeds 'a,b': must be comma-separated integers"),
    (["--seeds", "0,0"], "--seeds 0,0: a value is repeated"),
    (["--seeds", "-1"], "each value must be >= 0"),
    (["--work", "{file}"], "--work {file}: is a file, not a folder"),
    (["--cache-dir", "{file}/cache"], "is a file, so the folder cannot be made"),
    (["--out", "{dir}"], "--out {dir}: is a folder, not a file"),
    (["--out", "{missing}/vs_trl.md"], "does not exist"),
    (["--python", "{missing}"], "--python '{missing}': not found"),
    (["--python", "{dir}"], "--python {dir}: is a folder"),
    (["--python", "{file}"], "--python {file}: not executable"),
    (["--trl-python", "{missing}"], "--trl-python '{missing}': not found; create the TRL venv"),
    # without a TRL arm the TRL python is not needed: the next bad flag is the one reported
    (
        ["--arms", "grpo,d3s", "--trl-python", "{missing}", "--task", "nope"],
        "--task 'nope': not a task of train_small.py",
    ),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

MEMORY = [
    (["--ranks", "0"], "--ranks 0: must be an int in [1, 65536]"),
    (["--micro-batch-size", "-1"], "--micro-batch-size -1: must be"),
    (["--response-len", "x"], "--response-len 'x': must be an int in [1, 2^20]"),
    (["--steps", "0"], "--steps 0: must be"),
    (["--k-frac", "nan"], "--k-frac nan: must be a fraction of the tokens in (0, 1]"),
    (["--k-frac", "1.5"], "--k-frac 1.5: must be"),
    (["--method", "ppo"], "--method 'ppo': not a choice; choose from 'grpo'"),
    (["--preset", "{missing}"], "no such preset, folder or file"),
    (["--preset", "{dir}"], "the folder holds no config.json"),
    (["--preset", "{file}"], "not a readable JSON config"),
    (["--preset", "{json}"], "no 'model_type' field"),
    (
        ["--", "--lr", "nan"],
        "--lr nan: must be in (0, 1] (the recipe's: 1e-6) (a train_full.py flag, given after '--')",
    ),
    (["--", "--bogus"], "unrecognized arguments after '--': --bogus"),
]

SELECTION = [
    (["--keep-frac", "0"], "--keep-frac 0: must be a fraction of each group in (0, 1]"),
    (["--k-frac", "nan"], "--k-frac nan: must be"),
    (["--sizes", "64x1"], "--sizes 64x1: 64x1 needs P >= 1 and G >= 2"),
    (["--sizes", "abc"], "'abc' is not PxG"),
    (["--token-sizes", "64"], "'64' is not BxT"),
    (["--entropy-tokens", "0"], "--entropy-tokens 0: each value must be >= 1"),
    (["--chunk-sweep", "x"], "--chunk-sweep 'x': must be comma-separated chunk sizes"),
    (["--skip", "foo"], "--skip foo: 'foo' is not a table"),
    (["--device", "tpu"], "--device 'tpu': not a choice; choose from 'cpu', 'cuda'"),
    (["--budget", "inf"], "--budget inf: must be a finite number of seconds > 0"),
    (["--repeats", "0"], "--repeats 0: must be an int >= 1"),
    (["--rewards", "gauss"], "--rewards 'gauss': not a choice"),
    (["--out", "{dir}"], "--out {dir}: is a folder, not a file"),
    (["--out", "{file}/bench.md"], "is a file, not a folder"),
]

LOSS_HEAD = [
    (["--rollouts", "0"], "--rollouts 0: must be an int in [1, 65536]"),
    (["--prompt-len", "-1"], "--prompt-len -1: must be"),
    (["--response-len", "x"], "--response-len 'x': must be an int in [1, 2^20]"),
    (["--repeats", "0"], "--repeats 0: must be an int >= 1"),
    (["--threads", "-2"], "--threads -2: must be"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
]

TILED_MLP = [
    (["--hidden", "500"], "--hidden 500: gives 7 heads of 71 dimensions"),
    (["--hidden", "0"], "--hidden 0: must be an int in [14, 65536]"),
    (["--layers", "0"], "--layers 0: must be"),
    (["--rows", "0"], "--rows 0: must be"),
    (["--seq-len", "0"], "--seq-len 0: must be"),
    (["--chunk-tokens", "0"], "--chunk-tokens 0: must be an int >= 1"),
    (["--device", "gpu"], "--device 'gpu': not a choice; choose from 'cpu', 'cuda'"),
    (["--dtype", "fp8"], "--dtype 'fp8': not a choice"),
    (["--hidden"], "--hidden: expected one value"),
]

HEADROOM = [  # (argv, fragment): its own --out, then train_small.py's flags and checks under its name
    (["--out"], "--out: expected one value"),
    (["--out", "{dir}"], "--out {dir}: is a folder, not a file"),
    (["--out={missing}/headroom.md"], "does not exist"),
    (["--out", "{file}/headroom.md"], "is a file, not a folder"),
    (["--out="], "--out '': empty"),
    (["--lr", "nan"], "--lr nan: must be in (0, 1]"),
    (["--eval-samples", "0"], "--eval-samples 0: must be"),
    (["--train-file", "{dir}"], "--train-file {dir}: is a folder"),
    (["--steps", "x"], "--steps 'x': must be an int >= 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

QUESTIONS_TOY = [
    (["--seeds", "1"], "--seeds 1: must be an int in [2, 1000]"),
    (["--seeds", "x"], "--seeds 'x': must be an int in [2, 1000]"),
    (["--steps", "0"], "--steps 0: must be an int in [1, 100000]"),
    (["--workers", "0"], "--workers 0: must be an int in [1, 64]"),
    (["--question", "5"], "--question '5': not a choice"),
    (["--out", "{file}"], "--out {file}: is a file, not a folder"),
    (["--out", "{file}/sub"], "is a file, so the folder cannot be made"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

QUESTIONS_SMALL = [
    (["--question", "4"], "the following arguments are required: --runs"),
    (["--question", "6", "--runs", "{dir}"], "--question 6: not a choice; choose from 1, 2, 3, 4, 5, 7"),
    (["--question", "7", "--runs", "{dir}"], "--question 7 needs --rows: METHOD folders under --runs"),
    (["--question", "1", "--runs", "{dir}", "--rows", "a/d3s"], "--runs {dir}: no a/d3s/ in it"),
    (
        ["--question", "2", "--runs", "{dir}", "--rows", "a/d3s,,b"],
        "--rows 'a/d3s,,b': name METHOD folders under --runs",
    ),
    (["--question", "4", "--runs", "{missing}"], "--runs {missing}: not a folder"),
    (["--question", "4", "--runs", "{dir}"], "--runs {dir}: no d2s/ in it"),
    (["--question", "5", "--runs", "{dir}", "--spike", "nan"], "--spike nan: must be a finite number > 0"),
    (["--question", "4", "--runs", "{dir}", "--window", "0"], "--window 0: must be an int >= 1"),
    (["--question", "4", "--runs", "{dir}", "--rows", "d2s,"], "--rows 'd2s,': name methods"),
    (["--question", "4", "--runs", "{dir}", "--out", "{dir}"], "--out {dir}: is a folder, not a file"),
    (["--question", "4", "--runs", "{dir}", "--plot", "{missing}/q4.png"], "does not exist"),
]

DROPPED_TOKENS = [
    (["--model", "{missing}"], "--model {missing}: no such folder"),
    (["--model", "{file}"], "--model {file}: is a file"),
    (["--model", "{dir}"], "--model {dir}: has no config.json"),
    (["--batches", "0"], "--batches 0: must be an int in [1, 10000]"),
    (["--method", "ppo"], "--method 'ppo': not a choice; choose from 'grpo'"),
    (["--out", "{dir}"], "--out {dir}: is a folder, not a file"),
    (["--explain-out", "{missing}/example.md"], "does not exist"),
    (["--step", "0"], "--step 0: must be an int >= 1"),
    (["--step", "101"], "--step 101: must be in [1, --steps 100]"),
    (["--k", "0"], "--k 0: must be a fraction of tokens in (0, 1]"),
    (["--k", "0.5", "--method", "d1s-cross"], "--k 0.5: --method d1s-cross has no token level"),
    (["--group-size", "8"], "--n-final 16 > --group-size 8: N counts rollouts kept per prompt"),
    (["--token-rule", "loud"], "--token-rule 'loud': not a choice"),
    (["--task", "proofs"], "--task 'proofs': not a choice; choose from 'steps', 'direct'"),
    (["--temperature", "nan"], "--temperature nan: must be in [0.01, 100]"),
    (["--random-draws", "0"], "--random-draws 0: must be"),
    (["--cache-dir", "{file}"], "--cache-dir {file}: is a file, not a folder"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

TOY_LADDER = [  # the toy's flags, its checks
    (["--steps", "-3"], "--steps -3"),
    (["--lr", "nan"], "--lr nan"),
    (["--methods", "nope"], "--methods"),
    (["--out", "{file}"], "is a file"),
    (["--seeds", "0"], "--seeds 0"),
    (["--no-such-flag"], "--no-such-flag"),
]
SMALL_LADDER = [  # train_small.py's flags and checks, and the compare's own
    ([], "the following arguments are required: --compare"),
    (["--compare", "grpo,dss"], "--compare 'dss': unknown method"),
    (["--compare", "d3s", "--seeds", "0"], "--seeds 0: must be an int in [1, 1000]"),
    (["--compare", "d3s", "--workers", "0"], "--workers 0: must be"),
    (["--compare", "d3s", "--stop-after", "3"], "--stop-after 3: stops one run"),
    (["--compare", "d3s", "--lr", "nan"], "--lr nan: must be in (0, 1]"),
    (["--compare", "d3s", "--out", "{file}"], "is a file, not a folder"),
    (["--compare", "grpo", "--out", "{dangling}"], "links to"),
]
OFFLOAD_ADAMW = [
    (["--threads", "0"], "--threads '0': must be thread counts like 1,2"),
    (["--threads", "1,x"], "--threads '1,x': must be thread counts"),
    (["--ranks", "0"], "--ranks 0: must be an int in [1, 4096]"),
    (["--preset", "3b"], "--preset '3b': not a choice; choose from '1.5b', '7b'"),
    (["--repeats", "0"], "--repeats 0: must be"),
    (["--repeats"], "--repeats: expected one value"),
]
TRACK = [
    (["--lines", "0"], "--lines 0: must be an int in [1, 1e+06]"),
    (["--lines", "x"], "--lines 'x': must be an int"),
    (["--step-s", "0"], "--step-s 0: must be a finite number > 0"),
    (["--report-to", "nope"], "--report-to 'nope': not a choice"),
    (["--report-to"], "--report-to: expected at least one value"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]
GRADER = [
    (["--n", "0"], "--n 0: must be an int in [1, 1e+06]"),
    (["--n"], "--n: expected one value"),
    (["--workers", "0"], "--workers 0: each value must be >= 1"),
    (["--workers", "x"], "--workers 'x': must be comma-separated process counts"),
    (["--timeout", "nan"], "--timeout nan: must be in (0, 3600]"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]
TABLES = {
    "grader.py": GRADER,
    "toy_ladder.py": TOY_LADDER,
    "small_ladder.py": SMALL_LADDER,
    "vs_trl.py": VS_TRL,
    "memory.py": MEMORY,
    "selection.py": SELECTION,
    "loss_head.py": LOSS_HEAD,
    "tiled_mlp.py": TILED_MLP,
    "offload_adamw.py": OFFLOAD_ADAMW,
    "headroom.py": HEADROOM,
    "questions_toy.py": QUESTIONS_TOY,
    "questions_small.py": QUESTIONS_SMALL,
    "dropped_tokens.py": DROPPED_TOKENS,
    "track.py": TRACK,
}
CASES = [
    (script, *case) if len(case) == 3 else (script, *case, script) for script, table in TABLES.items() for case in table
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input")
    (base / "notes.txt").write_text("hello\n")
    (base / "empty").mkdir()
    (base / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (base / "compare").mkdir()
    (base / "compare" / "grpo").symlink_to(base / "never-made")  # a method folder linked to runs that were never made
    return {
        "file": str(base / "notes.txt"),
        "dir": str(base / "empty"),
        "missing": str(base / "missing"),
        "json": str(base / "config.json"),
        "dangling": str(base / "compare"),
    }


EXPERIMENTS = {
    "toy_ladder.py",
    "small_ladder.py",
    "questions_toy.py",
    "questions_small.py",
    "dropped_tokens.py",
    "headroom.py",
}  # experiments/, not bench/


def script_path(script):
    return os.path.join(ROOT, "experiments" if script in EXPERIMENTS else "bench", script)


def run_bad(script, argv):
    res = subprocess.run(
        [sys.executable, script_path(script), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return res


def assert_one_line(res, prog, fragment):
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), res.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert fragment in lines[0], (fragment, lines[0])
    assert res.stdout == "", res.stdout[-3000:]  # nothing started


@pytest.mark.parametrize("script,argv,fragment,prog", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_input_is_one_line_and_exit_2(script, argv, fragment, prog, paths):
    argv = [a.format(**paths) for a in argv]
    res = run_bad(script, argv)
    assert_one_line(res, prog, fragment.format(**paths))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
@pytest.mark.parametrize(
    "script,flag",
    [
        ("vs_trl.py", "--out"),
        ("selection.py", "--out"),
        ("headroom.py", "--out"),
        ("vs_trl.py", "--work"),
        ("dropped_tokens.py", "--out"),
    ],
)
def test_an_output_in_a_folder_that_cannot_be_written(script, flag, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        res = run_bad(script, [flag, str(locked / ("run" if flag == "--work" else "report.md"))])
    finally:
        locked.chmod(0o700)
    assert_one_line(res, script, "not writable")


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_unwritable_folder_in_process(kind, tmp_path, monkeypatch, capsys):
    """The same refusal where the tests run as root (which may write anywhere): os.access says no."""
    from support import cli

    monkeypatch.setattr(cli.os, "access", lambda path, mode: not mode & os.W_OK)
    path = str(tmp_path / ("report.md" if kind == "file" else "run"))
    p = cli.parser("x.py", "", [cli.flag("--out", None, cli.out_file if kind == "file" else None, "")])
    with pytest.raises(SystemExit) as exit_info:
        args = p.parse_args(["--out", path])
        cli.check_out_dir(p, "--out", args.out)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"x.py: error: --out {path}: ") and "not writable" in err


INTERNAL = {
    "trl_arm.py",
    "stats.py",
}  # trl_arm.py: run by vs_trl.py with flags it builds; stats.py: a module, not a script


def test_every_bench_script_the_docs_name_has_a_table():
    """A bench script the README or docs/ mention gets a table here (a new one fails this test)."""
    pages = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")
    ]
    named = set()
    for page in pages:
        with open(page, encoding="utf-8") as f:
            named |= set(re.findall(r"(?:bench|experiments)/(\w+\.py)", f.read()))
    assert named - INTERNAL <= set(TABLES), sorted(named - INTERNAL - set(TABLES))
    assert all(len(table) >= 6 for table in TABLES.values())
