"""--template chat (issue 55): the prompt rendered by the tokenizer's own chat template, the stop token its turn's end,
a template whose markup is not the tokenizer's refused in one line; a train_small run and a 2-rank train_full run.

The tokenizers are built offline from support/tiny.py's character tokenizer with a Llama-3-style and a Qwen-style
chat template (small Jinja templates with the markup of each family), as a chat model's tokenizer carries one.
"""

import json
import os
import pathlib

import pytest
import torch
from transformers import AutoTokenizer

import train_small
from support import templates, tiny
from support.cli import UsageError
from tests.test_full_faults import flags, run, torchrun

ROOT = pathlib.Path(__file__).resolve().parent.parent

LLAMA3_TOKENS = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = (  # Llama-3's markup: a header per turn, <|eot_id|> closes it
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN = (  # Qwen's ChatML: <|im_start|>role ... <|im_end|>
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_tokenizer():
    return tiny.build_char_tokenizer(LLAMA3_TOKENS, LLAMA3)


def qwen_tokenizer():
    return tiny.build_char_tokenizer(tiny.SPECIAL_TOKENS, QWEN)


def save_model(tokenizer, folder):
    """A tiny model with `tokenizer`, saved as a --model folder (its generation_config's EOS: the tokenizer's)."""
    return tiny.save_tiny(tiny.build_tiny_model(tokenizer, hidden_size=32, num_layers=1), tokenizer, str(folder))


@pytest.mark.parametrize("build", [llama_tokenizer, qwen_tokenizer])
@pytest.mark.parametrize("system", [templates.SYSTEM_PROMPT, ""])
def test_chat_prompt_ids_are_apply_chat_templates(build, system, tmp_path):
    tokenizer = build()
    tokenizer.save_pretrained(tmp_path)  # and as a folder loads it back
    for tok in (tokenizer, AutoTokenizer.from_pretrained(tmp_path)):
        text = templates.format_prompt("What is 1 + 1?", "chat", tok, system)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": "What is 1 + 1?"})
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert tok(text, add_special_tokens=False)["input_ids"] == list(want)
        assert ("system" in text) == bool(system)


def test_the_stop_token_is_the_templates_turn_end():
    llama, qwen = llama_tokenizer(), qwen_tokenizer()
    eot, im_end = llama.convert_tokens_to_ids("<|eot_id|>"), qwen.convert_tokens_to_ids("<|im_end|>")
    assert templates.turn_end_id(llama) == eot and eot in templates.stop_token_ids(llama)
    assert templates.turn_end_id(qwen) == im_end and im_end in templates.stop_token_ids(qwen)
    assert templates.turn_end_id(tiny.build_char_tokenizer()) is None  # no chat template: EOS and <|im_end|> only


def test_a_template_whose_markup_is_not_the_tokenizers_is_refused_in_one_line():
    with pytest.raises(UsageError) as e:
        templates.check_template("qwen-math", llama_tokenizer())
    assert "--template qwen-math" in str(e.value) and "--template chat" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        templates.check_template("chat", tiny.build_char_tokenizer())
    assert "--template chat" in str(e.value) and "no chat template" in str(e.value)
    for template, tok in (("chat", llama_tokenizer()), ("qwen-math", qwen_tokenizer()), ("plain", llama_tokenizer())):
        templates.check_template(template, tok)  # these fit


def test_auto_picks_chat_for_a_chat_model_but_qwen_math_for_qwen25_math():
    assert templates.pick_template("auto", llama_tokenizer(), "/m/Llama-3.1-8B-Instruct") == "chat"
    assert templates.pick_template("auto", qwen_tokenizer(), "Qwen/Qwen2.5-Math-7B") == "qwen-math"
    assert templates.pick_template("auto", tiny.build_char_tokenizer(), "/m/tiny") == "qwen-math"  # no chat template
    assert templates.pick_template("auto", None, None) == "plain"  # train_small's tiny model
    assert templates.pick_template("plain", llama_tokenizer(), "x") == "plain"


SMALL = (
    "--sft-steps 0 --train-size 8 --eval-size 2 --eval-samples 2 --pass-k 2 --prompts-per-step 2 --group-size 4 "
    "--n-init 2 --n-final 4 --max-new-tokens 8 --eval-every 2 --save-every 2 --threads 1 --grade-timeout 5 "
    "--explain-every 0"
).split()


def test_train_small_with_template_chat_runs_and_exports_the_chat_template(tmp_path):
    model = save_model(llama_tokenizer(), tmp_path / "llama")
    out = tmp_path / "run"
    args = ["--model", model, "--steps", "2", "--out", str(out), "--cache-dir", str(tmp_path / "c"), *SMALL]
    threads = torch.get_num_threads()
    try:
        train_small.main(args + ["--template", "auto"])  # auto: the chat template
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((out / "args.json").read_text())
    assert saved["template"] == "chat"
    assert [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2, 2]
    exported = AutoTokenizer.from_pretrained(out / "final")
    assert exported.chat_template == LLAMA3  # the HF folder keeps the template


def test_train_small_refuses_qwen_math_on_a_llama_tokenizer_in_one_line(tmp_path, capsys):
    model = save_model(llama_tokenizer(), tmp_path / "llama")
    capsys.readouterr()  # (save_pretrained's progress bar)
    with pytest.raises(SystemExit) as e:
        train_small.main(["--model", model, "--template", "qwen-math", "--out", str(tmp_path / "r"), *SMALL])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--template qwen-math" in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_train_full_on_two_ranks_with_template_chat(tmp_path):
    model = save_model(llama_tokenizer(), tmp_path / "llama")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(8)))
    out = tmp_path / "full"
    cmd = flags((model, str(data)), out, "--steps", "2", "--save-every", "2", "--max-prompt-len", "200")
    cmd[cmd.index("--template") + 1] = "chat"
    done = run(torchrun(2) + ["train_full.py", *cmd])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "args.json").read_text())["template"] == "chat"
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in train if m.get("kind", "train") == "train"][-1] == 2
    exported = [p for p in pathlib.Path(out).rglob("tokenizer_config.json")]
    assert exported and all(AutoTokenizer.from_pretrained(p.parent).chat_template == LLAMA3 for p in exported)
    cmd[cmd.index("--template") + 1] = "qwen-math"
    cmd[cmd.index("--out") + 1] = str(tmp_path / "bad")
    refused = run(torchrun(2) + ["train_full.py", *cmd])
    ours = sorted({line for line in refused.stderr.splitlines() if line.startswith("train_full.py:")})
    assert refused.returncode != 0 and len(ours) == 1 and "--template qwen-math" in ours[0], refused.stderr[-2000:]


def test_train_full_with_vllm_rollouts_and_template_chat(tmp_path):
    """The same with vLLM's engine (.venv-vllm): the chat prompt's ids reach vLLM, <|eot_id|> among its stop ids; with
    a --reward of your own (the worked example) that also scores the held-out evaluation (--eval-reward train)."""
    from tests import test_full_vllm as vllm_tests

    if not os.path.exists(vllm_tests.VLLM_PYTHON):
        pytest.skip(f"no vLLM interpreter at {vllm_tests.VLLM_PYTHON}")
    tokenizer = llama_tokenizer()  # the default tiny sizes: head_dim 32, one vLLM's CPU attention takes
    model = tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(tmp_path / "llama"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(8)))
    out = tmp_path / "full"
    reward = ["--reward", f"{ROOT / 'integrations' / 'closeness_reward.py'}:closeness", "--eval-reward", "train"]
    cmd = vllm_tests.train_cmd(vllm_tests.VLLM_PYTHON, model, str(data), str(out), "--eval-data", str(data), *reward)
    cmd[cmd.index("--template") + 1], cmd[cmd.index("--steps") + 1] = "chat", "1"
    vllm_tests.run(cmd)
    assert json.loads((out / "args.json").read_text())["template"] == "chat"
    assert [m["step"] for m in vllm_tests.metrics(str(out))] == [1]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (final,) = [m for m in lines if m["kind"] == "eval"]  # after step 1, scored by the function on vLLM's samples
    assert final["eval_scorer"].endswith("closeness_reward.py:closeness") and 0 <= final["train_reward_mean"] <= 1
