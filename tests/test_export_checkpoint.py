"""scripts/export_checkpoint.py turns any checkpoint of train_full.py (OUT/checkpoints/step_N) into an HF folder on CPU
(issue 54, item 5): AutoModelForCausalLM.from_pretrained loads it, its logits equal those of the model train_full
itself exported at that step (--export-every 1, and hf_final at the last), and the tokenizer loads from beside it.

One real run on 2 gloo ranks with the tiny model (support/tiny.py, --rollout hf), 3 steps, a checkpoint after each.
The tiny model's answers hold no \\boxed{}, so every reward is 0 and the gradient too; AdamW's decoupled weight decay
(--weight-decay 0.1 at --lr 1e-2) still moves every weight at every step, so the three steps' models differ and an
export of the wrong step cannot pass. Bad input: one line on stderr, exit 2, nothing on stdout.
"""

import json
import shutil
import sys

import pytest
import torch

from test_full_faults import ROOT, flags, inputs, run, torchrun  # noqa: F401 (inputs: a fixture)

SCRIPT = str(ROOT / "scripts" / "export_checkpoint.py")
PROG = "export_checkpoint.py"
# as many characters each: one batch without padding (the tiny tokenizer: a character a token)
TEXTS = ["12+12=24.", "7+8=15 ok"]


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory):
    """OUT of a 3-step run: checkpoints/step_00000{1,2,3}, train_full's own hf_step_00000{1,2,3} and hf_final."""
    out = tmp_path_factory.mktemp("export") / "run"
    steps = ["--steps", "3", "--save-every", "1", "--keep-checkpoints", "3", "--export-every", "1"]
    done = run(torchrun() + [str(ROOT / "train_full.py"), *flags(inputs, out, *steps, "--weight-decay", "0.1")])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def export(*argv):
    return run([sys.executable, SCRIPT, *map(str, argv)])


def logits(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer(text)["input_ids"] for text in TEXTS])
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()(input_ids=ids).logits


def test_an_exported_step_has_the_logits_of_train_fulls_own_export_of_that_step(trained, inputs, tmp_path):
    from transformers import AutoTokenizer

    # step 1 to its default folder, OUT/hf_step_000001: refused while train_full's export of step 1 is there
    first = trained / "checkpoints" / "step_000001"
    refused = export(first)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-3000:]
    assert refused.stderr.splitlines() == [
        f"{PROG}: error: --out {trained / 'hf_step_000001'}: already exists (an earlier export?); remove it, or pass "
        "another --out"
    ]
    reference = tmp_path / "train_fulls_step_1"
    shutil.move(trained / "hf_step_000001", reference)
    done = export(first)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported step 1 of {first} (d3s, grpo loss) to {trained / 'hf_step_000001'} (float32)" in done.stdout
    step1 = logits(trained / "hf_step_000001")
    assert torch.equal(step1, logits(reference))

    # the last step, elsewhere: train_full's hf_step_000003 and hf_final, bit for bit; another model than step 1's
    done = export(trained / "checkpoints" / "step_000003", "--out", tmp_path / "last")
    assert done.returncode == 0, done.stderr[-3000:]
    last = logits(tmp_path / "last")
    assert torch.equal(last, logits(trained / "hf_final")) and torch.equal(last, logits(trained / "hf_step_000003"))
    assert not torch.equal(last, step1) and not torch.equal(step1, logits(inputs[0]))  # the steps trained

    # the tokenizer beside the weights: the base model's, token for token, and the base's generation config
    base = AutoTokenizer.from_pretrained(inputs[0])
    for folder in (trained / "hf_step_000001", tmp_path / "last"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert [tokenizer(t)["input_ids"] for t in TEXTS] == [base(t)["input_ids"] for t in TEXTS]
        assert tokenizer.pad_token == base.pad_token and (folder / "generation_config.json").is_file()


def test_dtype_bfloat16_writes_the_checkpoints_weights_rounded_once(trained, tmp_path):
    from safetensors.torch import load_file

    done = export(trained / "checkpoints" / "step_000002", "--out", tmp_path / "bf16", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    ours, theirs = (
        load_file(tmp_path / "bf16" / "model.safetensors"),
        load_file(trained / "hf_step_000002" / "model.safetensors"),
    )
    assert set(theirs) <= set(ours) | {"lm_head.weight"}  # (the tied LM head: saved once, or under both names)
    for name in ours:
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name].to(torch.bfloat16)), name
    assert logits(tmp_path / "bf16", torch.bfloat16).dtype == torch.bfloat16  # from_pretrained loads it


@pytest.mark.parametrize(
    "case", ["none named", "the run's folder", "no such folder", "base model moved", "another model"]
)
def test_bad_input_is_one_line_and_exit_2(trained, tmp_path, case):
    checkpoint, wide = trained / "checkpoints" / "step_000001", tmp_path / "wide"
    argv, start, end = {
        "none named": (
            [],
            "no checkpoint named; pass a checkpoint folder of train_full.py ",
            "(OUT/checkpoints/step_NNNNNN)",
        ),
        "the run's folder": ([trained], f"{trained}: not a complete checkpoint (no trainer_state.json); ", ""),
        "no such folder": (
            [tmp_path / "nothing"],
            f"{tmp_path / 'nothing'}: no such folder; pass a checkpoint folder of train_full.py ",
            "(OUT/checkpoints/step_NNNNNN)",
        ),
        "base model moved": (
            [moved_base(checkpoint, tmp_path / "elsewhere" / "step_000001"), "--out", tmp_path / "x"],
            f"{tmp_path / 'elsewhere' / 'step_000001'}: its run's base model {tmp_path / 'gone'} (trainer_state.json) "
            "is not here; pass --model with the base model's folder or hub name (its config and tokenizer)",
            "",
        ),
        "another model": (
            [checkpoint, "--out", tmp_path / "x", "--model", wider_model(wide)],
            f"{checkpoint}: its shards do not fit the model of {wide} (Size mismatch between saved ",
            "for model.model.embed_tokens.weight); pass the run's base model as --model",
        ),
    }[case]
    proc = export(*argv)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (said,) = proc.stderr.splitlines()
    assert said.startswith(f"{PROG}: error: {start}") and said.endswith(end), said
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()  # nothing written


def moved_base(checkpoint, copy):
    """The checkpoint copied, as on another machine where the run's --model is at another path."""
    shutil.copytree(checkpoint, copy)
    state = json.loads((copy / "trainer_state.json").read_text())
    state["run"]["model"] = str(copy.parent.parent / "gone")
    (copy / "trainer_state.json").write_text(json.dumps(state))
    return copy


def wider_model(folder):
    """The tiny model at twice the width: its embedding cannot hold the checkpoint's."""
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    return tiny.save_tiny(tiny.build_tiny_model(tokenizer, hidden_size=256), tokenizer, str(folder))
