"""Long and broken inputs get one line (issue 35), in both trainers, before any work: exit 2, `prog: error: ...`,
no traceback.

- A problem whose prompt does not fit the model's context (config max_position_embeddings less the response
  length: --max-new-tokens, --max-response-len) is named with file:line, its token length and the limit (a 2 MB
  line used to make train_small try to allocate 640 GB). --drop-long-prompts (choice) leaves such rows out and
  counts them instead.
- NaN or inf in a model's weights, or in the logits of its first forward (weights finite, an overflow), names the
  model (it used to end in `RuntimeError: probability tensor contains either inf, nan or element < 0`).
train_full.py runs on CPU with --rollout hf (one process: world 1, gloo), as tests/test_full_faults.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from support import tiny, warmstart
import train_small
from support import mathtask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
LONG = "1+2+" * 500_000  # a 2 MB problem: 2,000,000 characters, as many tokens for the character tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model saved three times: as built, with one NaN weight, and with finite weights whose first forward
    overflows to inf (a huge final norm times large tied embeddings)."""
    root, tokenizer = tmp_path_factory.mktemp("models"), tiny.build_char_tokenizer()
    saved = {}
    for kind in ("fine", "nan", "inf"):
        model = tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1)
        with torch.no_grad():
            if kind == "nan":
                model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
            if kind == "inf":
                model.model.norm.weight.fill_(1e38)
                model.model.embed_tokens.weight.mul_(1e10)
        saved[kind] = tiny.save_tiny(model, tokenizer, str(root / kind))
    return saved


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rows = [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)]
    (root / "short.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "long.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:2] + [{"problem": LONG, "answer": "1"}] + rows[2:])
    )
    return str(root / "short.jsonl"), str(root / "long.jsonl")


def run(cmd):
    return subprocess.run([sys.executable] + cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def one_line(result, prog):
    assert result.returncode == 2 and "Traceback" not in result.stderr, (result.returncode, result.stderr[-3000:])
    (line,) = [line for line in result.stderr.splitlines() if line.startswith(prog)]
    assert line.startswith(f"{prog}: error: ")
    return line


SMALL = [
    "--template",
    "plain",
    "--steps",
    "1",
    "--max-new-tokens",
    "8",
    "--eval-size",
    "2",
    "--eval-samples",
    "1",
    "--pass-k",
    "1",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--n-init",
    "1",
    "--n-final",
    "2",
    "--threads",
    "1",
]


def test_train_small_names_a_problem_longer_than_the_context_before_any_work(data, tmp_path):
    short, long = data
    line = one_line(
        run(
            [
                "train_small.py",
                "--train-file",
                long,
                "--out",
                str(tmp_path / "out"),
                "--cache-dir",
                str(tmp_path / "cache"),
                *SMALL,
            ]
        ),
        "train_small.py",
    )
    assert line == (
        f"train_small.py: error: {long}:3: the prompt is {len(LONG) + len(chr(10) + 'Answer: ')} tokens; the "
        "model's context of 1024 positions less --max-new-tokens 8 leaves 1016 for it: shorten or delete the "
        "row, or add --drop-long-prompts (choice: such rows are left out and counted)"
    ), line
    assert not os.path.exists(tmp_path / "cache")  # no warm start was built: it stopped before any work
    line = one_line(
        run(
            [
                "train_small.py",
                "--train-file",
                short,
                "--eval-file",
                long,
                "--out",
                str(tmp_path / "out"),
                "--cache-dir",
                str(tmp_path / "cache"),
                *SMALL,
                "--eval-size",
                "5",
            ]
        ),
        "train_small.py",
    )
    assert line.startswith(f"train_small.py: error: {long}:3: the prompt is ")  # the held-out file too


def test_train_small_drop_long_prompts_leaves_them_out_and_counts_them(data, capsys):
    short, long = data
    args = train_small.parse_args(["--train-file", long, "--eval-file", long, "--drop-long-prompts", *SMALL])
    train_rows, eval_rows = warmstart.fit_files(args, *mathtask.load_data(args))
    assert [r["problem"] for r in train_rows] == [f"{i}+{i}" for i in range(8)] and len(eval_rows) == 2  # --eval-size 2
    assert args.dropped_long_prompts == 1  # the train file's; the eval file's first 2 rows are short
    assert capsys.readouterr().err == (
        f"train_small.py: --drop-long-prompts: left out 1 of the 9 rows of {long} (prompts longer than 1016 tokens)\n"
    )


@pytest.mark.parametrize(
    "kind,says",
    [
        ("nan", "its weights hold NaN or inf (model.layers.0.mlp.down_proj.weight)"),
        ("inf", "its first forward gives NaN or inf logits"),
    ],
)
def test_train_small_names_a_model_with_nan_weights_or_logits(models, data, tmp_path, kind, says):
    line = one_line(
        run(
            ["train_small.py", "--model", models[kind], "--train-file", data[0], "--out", str(tmp_path / "out"), *SMALL]
        ),
        "train_small.py",
    )
    assert line.startswith(f"train_small.py: error: --model {models[kind]}: {says}"), line
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # no evaluation, no step


def full(model, train, out, *extra):
    return [
        "train_full.py",
        "--model",
        model,
        "--train-data",
        train,
        "--eval-data",
        "none",
        "--out",
        str(out),
        "--template",
        "plain",
        "--rollout",
        "hf",
        "--device",
        "cpu",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--n-init",
        "1",
        "--n-final",
        "2",
        "--max-response-len",
        "8",
        "--max-prompt-len",
        "64",
        "--steps",
        "1",
        "--grader-workers",
        "1",
        *extra,
    ]


def test_train_full_names_a_problem_longer_than_the_context_before_any_work(models, data, tmp_path):
    line = one_line(run(full(models["fine"], data[1], tmp_path / "out")), "train_full.py")
    assert line == (
        f"train_full.py: error: {data[1]}:3: the prompt is {len(LONG) + len(chr(10) + 'Answer: ')} tokens; "
        "the model's context of 1024 positions less --max-response-len 8 leaves 1016 for it: shorten or "
        "delete the row, or add --drop-long-prompts (choice: such rows are left out and counted)"
    ), line
    assert not os.path.exists(tmp_path / "out")  # before the process group and args.json


def test_train_full_drop_long_prompts_leaves_them_out_counted(models, data, tmp_path):
    done = run(full(models["fine"], data[1], tmp_path / "out", "--drop-long-prompts"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "8 prompts (0 rows without an answer dropped, 0 longer than 64 tokens dropped, 1 longer than the model's "
        "context dropped (--drop-long-prompts))" in done.stdout
    ), done.stdout[-2000:]
    assert json.loads((tmp_path / "out" / "args.json").read_text())["dropped_long_prompts"] == 1


@pytest.mark.parametrize(
    "kind,says",
    [
        ("nan", "its weights hold NaN or inf (model.layers.0.mlp.down_proj.weight)"),
        ("inf", "its first forward gives NaN or inf logits"),
    ],
)
def test_train_full_names_a_model_with_nan_weights_or_logits(models, data, tmp_path, kind, says):
    line = one_line(run(full(models[kind], data[0], tmp_path / "out")), "train_full.py")
    assert line.startswith(f"train_full.py: error: --model {models[kind]}: {says}"), line
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
