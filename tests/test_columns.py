"""--prompt-key and --answer-key (issue 55): the data's own column names on both rungs; a key the file does not have
is one line naming the file, the key and the columns it has."""

import json

import pytest
import torch

import train_full
import train_small
from support import mathtask, tiny
from support.mathtask import DataError


@pytest.fixture
def other_columns(tmp_path):
    """A JSONL whose problem is `q` and whose answer is `gold` (neither among the default names), plus a column
    `problem` that is NOT the problem: the key must win over the default names."""
    path = tmp_path / "mine.jsonl"
    rows = [{"q": f"{i}+{i}", "gold": str(2 * i), "problem": "a decoy", "note": i} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_keys_name_the_columns(other_columns):
    rows, dropped = mathtask.load_problems(other_columns, keys=("q", "gold"))
    assert dropped == 0 and [(r["problem"], r["answer"]) for r in rows[:2]] == [("0+0", "0"), ("1+1", "2")]
    assert rows[3]["note"] == 3  # the other columns ride along
    with pytest.raises(DataError, match="no usable rows"):  # by the default names: no answer column
        mathtask.load_problems(other_columns, drop_missing=True)


@pytest.mark.parametrize(
    "keys, flag", [(("question", "gold"), "--prompt-key question"), (("q", "ans"), "--answer-key ans")]
)
def test_a_missing_key_names_the_file_the_key_and_the_columns(other_columns, keys, flag):
    with pytest.raises(DataError) as e:
        mathtask.load_problems(other_columns, keys=keys)
    message = str(e.value)
    assert message.startswith(f"{other_columns}:1: {flag}:") and "q, gold, problem, note" in message, message
    assert "\n" not in message


SMALL = (
    "--hidden-size 32 --num-layers 1 --sft-steps 0 --eval-samples 2 --pass-k 2 --prompts-per-step 2 --group-size 4 "
    "--n-init 2 --n-final 4 --max-new-tokens 8 --eval-every 2 --save-every 2 --threads 1 --explain-every 0"
).split()


def test_train_small_reads_the_named_columns_and_refuses_a_missing_one(other_columns, tmp_path, capsys):
    threads = torch.get_num_threads()
    files = ["--train-file", other_columns, "--eval-file", other_columns, "--cache-dir", str(tmp_path / "c")]
    try:
        out = tmp_path / "run"
        train_small.main(
            [*SMALL, *files, "--prompt-key", "q", "--answer-key", "gold", "--steps", "1", "--out", str(out)]
        )
        assert (out / "summary.json").exists()
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train_small.main([*SMALL, *files, "--prompt-key", "question", "--out", str(tmp_path / "bad")])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{other_columns}:1: --prompt-key question: the row has no such column" in err


def test_train_full_reads_the_named_columns_of_train_data(other_columns, tmp_path):
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.save_tiny(
        tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, str(tmp_path / "m")
    )
    flags = ["--model", model, "--train-data", other_columns, "--eval-data", "none", "--template", "plain"]
    flags += ["--device", "cpu", "--rollout", "hf", "--out", str(tmp_path / "o"), "--max-response-len", "16"]
    args = train_full.parse_args([*flags, "--prompt-key", "q", "--answer-key", "gold"])
    _, _, prompts, _, _ = mathtask.load_inputs(args)
    assert [(p["problem"], p["answer"]) for p in prompts[:2]] == [("0+0", "0"), ("1+1", "2")]
    with pytest.raises(DataError, match="--answer-key ans: the row has no such column"):
        mathtask.load_inputs(train_full.parse_args([*flags, "--prompt-key", "q", "--answer-key", "ans"]))
