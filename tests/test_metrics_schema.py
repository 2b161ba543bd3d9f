"""metrics.jsonl follows docs/metrics.md in every rung: the toy, train_small.py and train_full.py.

Each rung runs a few steps on tiny settings in a subprocess (about 20 s in all). The two tables of
docs/metrics.md (train lines, eval lines) are read from the page, so the page and the test cannot
drift: every key a rung writes is listed for that rung, every key listed for it is written (a key
typed with `?` on at least one line), each value has the listed type, and the steps follow the
conventions (eval 0 first, train lines 1..S in order, eval line s right after train line s).
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from support import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
RUNGS = ("toy", "small", "full")
STEPS = 2


def read_schema():
    """{kind: [(key pattern, type, optional, rungs)]} from the tables under '## Train lines' and '## Eval lines'."""
    schema, kind = {}, None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"## (Train|Eval) lines$", line)
        if heading:
            kind = heading.group(1).lower()
            schema[kind] = []
        elif line.startswith("## "):
            kind = None
        elif kind and line.startswith("| `"):
            key, type_, rungs = (cell.strip() for cell in line.strip("|").split("|")[:3])
            key = key.strip("`")
            pattern = re.compile(
                "^" + re.sub(r"<\w+>", ".+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">")) + "$"
            )
            rungs = set(RUNGS) if rungs == "all" else {r.strip() for r in rungs.split(",")}
            assert rungs <= set(RUNGS), (key, rungs)
            schema[kind].append((key, pattern, type_.rstrip("?"), type_.endswith("?"), rungs))
    assert set(schema) == {"train", "eval"} and all(schema.values()), "docs/metrics.md lost a table"
    return schema


def type_ok(value, type_):
    if type_.endswith(" or null"):
        return value is None or type_ok(value, type_[: -len(" or null")])
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": number and math.isfinite(value),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value),
        "object": isinstance(value, dict),
    }[type_]


def run(argv, cwd):
    result = subprocess.run([sys.executable, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def read_lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """{rung: the lines of one run's metrics.jsonl}, each rung run for STEPS steps."""
    root = tmp_path_factory.mktemp("schema")
    out = {}
    run(
        [
            str(ROOT / "toy" / "bandit.py"),
            "--seeds",
            "1",
            "--steps",
            str(STEPS),
            "--methods",
            "d3s",
            "--workers",
            "1",
            "--out",
            str(root / "toy"),
        ],
        root,
    )
    out["toy"] = read_lines(root / "toy" / "metrics.jsonl")
    run(
        [
            str(ROOT / "train_small.py"),
            "--hidden-size",
            "32",
            "--num-layers",
            "1",
            "--sft-steps",
            "20",
            "--train-size",
            "100",
            "--eval-size",
            "4",
            "--eval-samples",
            "2",
            "--pass-k",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--n-init",
            "2",
            "--n-final",
            "4",
            "--max-new-tokens",
            "12",
            "--steps",
            str(STEPS),
            "--eval-every",
            "2",
            "--threads",
            "1",
            "--out",
            str(root / "small"),
            "--cache-dir",
            str(root / "cache"),
        ],
        root,
    )
    out["small"] = read_lines(root / "small" / "metrics.jsonl")
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(root / "tiny"))
    data = root / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(8)))
    run(
        [
            str(ROOT / "train_full.py"),
            "--model",
            model,
            "--rollout",
            "hf",
            "--device",
            "cpu",
            "--template",
            "plain",
            "--train-data",
            str(data),
            "--eval-data",
            str(data),
            "--out",
            str(root / "full"),
            "--steps",
            str(STEPS),
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--n-init",
            "2",
            "--n-final",
            "4",
            "--max-response-len",
            "8",
            "--max-prompt-len",
            "64",
            "--micro-batch-size",
            "4",
            "--eval-samples",
            "2",
            "--eval-pass-k",
            "1,2",
            "--eval-max-tokens",
            "4",
            "--eval-limit",
            "2",
            "--grader-workers",
            "1",
            "--hf-generate-batch",
            "2",
            "--eval-every",
            "1",
            "--kl-ref",
        ],
        root,
    )
    out["full"] = read_lines(root / "full" / "metrics.jsonl")
    return out


def test_the_doc_lists_each_key_once_per_kind():
    for kind, rows in read_schema().items():
        keys = [key for key, *_ in rows]
        assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
        for key, _, type_, _, _ in rows:
            assert type_ in ("int", "float", "bool", "str", "list", "object", "float or null"), (kind, key, type_)


@pytest.mark.parametrize("rung", RUNGS)
def test_every_line_follows_the_doc(lines, rung):
    schema = read_schema()
    for kind, rows in schema.items():
        mine = [row for row in rows if rung in row[4]]
        kind_lines = [line for line in lines[rung] if line["kind"] == kind]
        assert kind_lines, (rung, kind)
        mine.sort(key=lambda r: (r[0].count("<"), -len(r[0])))  # the most specific row first: average_pass@<k>
        seen = set()
        for line in kind_lines:
            here = set()
            for name, value in line.items():
                row = next((r for r in mine if r[1].match(name)), None)
                assert row, f"{rung} {kind} line step {line['step']}: {name!r} is not in docs/metrics.md for {rung}"
                assert type_ok(value, row[2]), f"{rung} {kind} {name} = {value!r}: docs/metrics.md says {row[2]}"
                here.add(row[0])
            missing = [key for key, _, _, optional, _ in mine if not optional and key not in here]
            assert not missing, f"{rung} {kind} line step {line['step']} lacks {missing} (docs/metrics.md)"
            seen |= here
        never = [key for key, *_ in mine if key not in seen]
        assert not never, f"{rung} never writes {never}, which docs/metrics.md lists for it ({kind} lines)"


@pytest.mark.parametrize("rung", RUNGS)
def test_steps_count_from_one_with_eval_zero_first(lines, rung):
    order = [(line["kind"], line["step"]) for line in lines[rung]]
    assert order[0] == ("eval", 0), order
    assert [s for kind, s in order if kind == "train"] == list(range(1, STEPS + 1)), order
    for i, (kind, step) in enumerate(order[1:], 1):  # an eval line s > 0 comes right after train line s
        if kind == "eval":
            assert order[i - 1] == ("train", step), order
    assert order[-1] == ("eval", STEPS), order  # every rung evaluates after the last step


@pytest.mark.parametrize("rung", RUNGS)
def test_the_shared_keys_mean_the_same_in_every_rung(lines, rung):
    """What the conventions fix and a line can show: counts add up, N and K follow the schedule's start."""
    train = [line for line in lines[rung] if line["kind"] == "train"]
    for line in train:
        assert line["kept_tokens"] <= line["fwd_tokens"] <= line["gen_tokens"], line
        assert line["k_real"] == pytest.approx(line["kept_tokens"] / line["fwd_tokens"])
        assert line["kept_tokens_frac"] == pytest.approx(line["kept_tokens"] / line["gen_tokens"])
        assert line["acc_train"] == line["reward_mean"] and 0 <= line["reward_mean"] <= 1
        assert line["updates"] >= 1 and line["skipped"] is False
        assert line["grad_norm"] is not None and line["loss"] is not None  # every step here makes an update
    assert train[0]["k_frac"] == pytest.approx(0.05)  # step 1 is the schedule's start (K_init)
    assert train[0]["n_keep"] < train[-1]["n_keep"]  # ... and N grows over the run
