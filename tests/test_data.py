"""mathtask.load_problems, the one data loader of both trainers: formats, column names, and every
bad file or row ending in a DataError that names file:line and the fix."""

import json

import pytest

from support.mathtask import DataError, load_problems, normalize_row


def write(tmp_path, name, data):
    path = tmp_path / name
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return str(path)


def test_hub_rows_map_common_column_names():
    assert normalize_row({"question": "1+1?", "answer": "2"}) == {"problem": "1+1?", "answer": "2"}
    assert normalize_row({"problem": "x", "solution": "so \\boxed{\\frac{1}{2}}."})["answer"] == "\\frac{1}{2}"
    chat = {
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": "7"},
    }
    assert normalize_row(chat) == {"problem": "q", "answer": "7"}
    assert normalize_row({"problem": "x", "answer": ""}) is None
    assert normalize_row({"problem": "x", "solution": "no box"}) is None
    gsm8k = {"question": "q", "answer": "Half of 8 is <<8/2=4>>4.\n#### 4"}  # openai/gsm8k's answer column
    assert normalize_row(gsm8k) == {"problem": "q", "answer": "4"}


def test_rows_without_an_answer_are_dropped_and_counted_when_asked(tmp_path):
    path = write(
        tmp_path, "d.jsonl", '{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": ""}\n{"problem": "c"}\n'
    )
    rows, dropped = load_problems(path, drop_missing=True)
    assert [r["problem"] for r in rows] == ["a"] and dropped == 2
    with pytest.raises(DataError, match=r"d.jsonl:2: row has no problem .* or no answer"):
        load_problems(path)


def test_a_byte_order_mark_crlf_and_numeric_answers_are_accepted(tmp_path):
    text = (
        '{"problem": "one", "answer": 2}\r\n{"problem": "half", "answer": 2.5}\r\n{"problem": "two", "answer": 2.0}\r\n'
    )
    path = write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + text.encode())
    rows, _ = load_problems(path)
    assert [(r["problem"], r["answer"]) for r in rows] == [("one", "2"), ("half", "2.5"), ("two", "2")]
    assert rows[0]["id"] == "bom.jsonl:1"
    path = write(tmp_path, "bom.json", b"\xef\xbb\xbf" + json.dumps([{"problem": "p", "answer": 3}]).encode())
    assert load_problems(path)[0][0]["answer"] == "3"
    one = write(tmp_path, "one.jsonl", '{"problem": "p", "answer": ["7"]}\n')  # a one-element list is its element
    assert load_problems(one)[0][0]["answer"] == "7"


@pytest.mark.parametrize(
    "content,fragment",
    [
        (
            b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n',
            r"bad.jsonl:2: byte 0xe9 .* not UTF-8",
        ),
        (b'{"problem": "a", "answer": ["1", "2"]}\n', r"bad.jsonl:1: 'answer' is a list .* one answer"),
        (b'{"problem": "a", "answer": {"value": 1}}\n', r"bad.jsonl:1: 'answer' is a dict"),
        (b'{"problem": "a", "answer": true}\n', r"bad.jsonl:1: 'answer' is a bool"),
        (b'{"problem": {"text": "a"}, "answer": "1"}\n', r"bad.jsonl:1: 'problem' is a dict"),
        (b'{"problem": ["a", "b"], "answer": "1"}\n', r"bad.jsonl:1: 'problem' is a list"),
        (b'{"problem": "a", "answer": "1"}\nnot json\n', r"bad.jsonl:2: not valid JSON"),
        (b"[1, 2]\n", r"bad.jsonl:1: expected a JSON object"),
        (b"\n\n", r"no usable rows"),
    ],
)
def test_a_bad_row_names_the_file_line_and_fix(tmp_path, content, fragment):
    with pytest.raises(DataError, match=fragment):
        load_problems(write(tmp_path, "bad.jsonl", content))


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="is a folder; pass a JSONL"):
        load_problems(str(tmp_path))
    with pytest.raises(DataError, match="file not found"):
        load_problems(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="file not found"):
        load_problems("./nope")
