"""integrations/trl.py: D3SGRPOTrainer inside TRL's GRPOTrainer, on CPU with a tiny model.

These tests need TRL, which lives in its own venv (.venv-trl, `pip install -r requirements-trl.txt`;
.ci/run builds it). Run them there directly:

    .venv-trl/bin/python -m pytest tests/test_integration_trl.py -q

Under the project's .venv (no TRL), `test_trl_suite_in_trl_venv` runs this file under
.venv-trl in a subprocess (so `pytest tests` in CI runs them), and skips when .venv-trl is absent.

What they check:
  - d3s_method="grpo" is TRL's GRPOTrainer: rewards, loss and parameters after 3 steps agree;
  - d3s and d3s-i keep the rollouts d3s.select_samples keeps and the tokens d3s.select_tokens
    keeps, given the same rewards and the logits of a plain forward (d3s.token_entropy);
  - gradient accumulation (pass 1 + pass 2) gives the update of one micro-batch;
  - two processes (torchrun, gloo) keep the same global set, and update the same, as one;
  - misconfigurations stop before training with one error naming the field;
  - the "Use D3S from TRL" example in docs/trl.md runs.
"""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

try:
    import trl  # noqa: F401

    HAVE_TRL = True
except ImportError:
    HAVE_TRL = False

needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="needs trl: runs under .venv-trl (test_trl_suite_in_trl_venv runs them)")


# ---------------------------------------------------------------------------------------------
# Under .venv: run this file under .venv-trl
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_TRL, reason="trl is importable here: the tests below run in this process")
@pytest.mark.skipif(not os.path.exists(TRL_PYTHON),
                    reason=f"{TRL_PYTHON} not found: python3 -m venv .venv-trl && .venv-trl/bin/pip install -r requirements-trl.txt")
def test_trl_suite_in_trl_venv():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([TRL_PYTHON, "-m", "pytest", os.path.abspath(__file__), "-q", "-ra", "-p", "no:cacheprovider",
                           "-k", "not test_trl_suite_in_trl_venv"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


# ---------------------------------------------------------------------------------------------
# Under .venv-trl
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import tiny

    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, hidden_size=64, num_layers=2)
    return tiny.save_tiny(model, tokenizer, str(tmp_path_factory.mktemp("tiny")))


def load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(model_dir))


def dataset():
    from datasets import Dataset
    from trl_worker import PROMPTS

    return Dataset.from_dict({"prompt": PROMPTS})


def run(trainer_cls, config, model_dir):
    from trl_worker import parity_reward

    model, tokenizer = load(model_dir)
    torch.manual_seed(0)
    trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=parity_reward, args=config,
                          train_dataset=dataset())
    trainer.train()
    return trainer


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


def max_param_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@needs_trl
def test_grpo_method_matches_trl_grpotrainer_step_for_step(tiny_model_dir, tmp_path):
    from trl import GRPOConfig, GRPOTrainer
    from trl_worker import make_config

    from integrations.trl import D3SGRPOTrainer

    plain = run(GRPOTrainer, make_config(str(tmp_path / "plain"), config_class=GRPOConfig), tiny_model_dir)
    ours = run(D3SGRPOTrainer, make_config(str(tmp_path / "d3s"), d3s_method="grpo"), tiny_model_dir)
    a, b = train_logs(plain), train_logs(ours)
    assert len(a) == len(b) == 3
    for la, lb in zip(a, b):
        assert la["reward"] == lb["reward"] and la["num_tokens"] == lb["num_tokens"], (la, lb)  # same rollouts
        assert lb["loss"] == pytest.approx(la["loss"], abs=1e-6), (la["loss"], lb["loss"])
        assert lb["grad_norm"] == pytest.approx(la["grad_norm"], rel=1e-4)
        assert lb["d3s/kept_rollouts"] == 16 and lb["d3s/k_realised"] == 1.0  # every rollout, every token
    initial, _ = load(tiny_model_dir)
    assert max_param_diff(plain.model, initial) > 1e-3  # the 3 steps did move the weights ...
    assert max_param_diff(plain.model, ours.model) < 1e-6  # ... and the two trainers moved them alike


def reference_selection(batch, method, n_keep, model_dir):
    """From d3s.py alone: the kept rollouts and, from a plain forward's logits, the kept tokens."""
    import d3s

    rewards = batch["rewards"].view(-1, 4)
    keep, adv = d3s.select_samples(rewards, n_keep, method, eps=1e-4)
    keep, adv = keep.view(-1), adv.view(-1)
    model, _ = load(model_dir)
    model.load_state_dict(batch["weights"])
    rows = keep.nonzero().view(-1)
    prompt_len = batch["prompt_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)[rows]
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)[rows]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_len - 1 : -1]  # [n, T, V]
    entropy = d3s.token_entropy(logits)  # temperature 1
    mask = batch["completion_mask"][rows].bool()
    tokens = d3s.select_tokens(adv[rows].abs().unsqueeze(1) * entropy, mask, batch["k_frac"])
    return keep, adv, {int(r): t for r, t in zip(rows, tokens)}


@needs_trl
@pytest.mark.parametrize("method", ["d3s", "d3s-i"])
def test_kept_rollouts_and_tokens_are_d3s_py_selections(tiny_model_dir, tmp_path, method):
    import d3s
    from trl_worker import RecordingTrainer, kept_tokens_by_row, make_config

    config = make_config(str(tmp_path / "out"), d3s_method=method, max_steps=4)
    trainer = run(RecordingTrainer, config, tiny_model_dir)
    assert len(trainer.batches) == 4
    for batch in trainer.batches:
        step = batch["step"]
        n_keep, k_frac = d3s.method_budget(method, step, 4, 4, config.n_init, config.n_final, config.k_init, config.k_final)
        assert batch["k_frac"] == k_frac < 1.0
        keep, adv, tokens = reference_selection(batch, method, n_keep, tiny_model_dir)
        assert torch.equal(batch["d3s_keep"], keep) and 0 < int(keep.sum()) < keep.numel()
        assert torch.allclose(batch["advantages"], adv, atol=1e-6)
        got = {r: m for (s, r), m in kept_tokens_by_row(trainer).items() if s == step}
        assert set(got) == set(tokens)  # the loss saw exactly the kept rollouts
        for r, ref in tokens.items():
            width = got[r].shape[0]  # the trainer cut the completion columns no kept row uses
            assert not ref[width:].any() and torch.equal(got[r], ref[:width]), (step, r)
        assert sum(int(m.sum()) for m in got.values()) == sum(int(t.sum()) for t in tokens.values()) > 0


@needs_trl
def test_gradient_accumulation_gives_the_update_of_one_micro_batch(tiny_model_dir, tmp_path):
    from integrations.trl import D3SGRPOTrainer
    from trl_worker import make_config

    one = run(D3SGRPOTrainer, make_config(str(tmp_path / "one"), max_steps=2), tiny_model_dir)
    two = run(D3SGRPOTrainer, make_config(str(tmp_path / "two"), max_steps=2, per_device_train_batch_size=8,
                                          gradient_accumulation_steps=2), tiny_model_dir)
    for a, b in zip(train_logs(one), train_logs(two)):
        assert a["reward"] == b["reward"]
        assert a["d3s/kept_rollouts"] == b["d3s/kept_rollouts"] and a["d3s/kept_tokens"] == b["d3s/kept_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert max_param_diff(one.model, two.model) < 1e-6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_trl
def test_two_processes_keep_the_global_set_of_one(tiny_model_dir, tmp_path):
    worker = os.path.join(ROOT, "tests", "trl_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    procs = [
        subprocess.Popen([sys.executable, worker, "--model", tiny_model_dir, "--out", str(one)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                          worker, "--model", tiny_model_dir, "--out", str(two), "--rows-per-process", "8"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    ]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-4000:]
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert (a["processes"], b["processes"]) == (1, 2)
    assert a["completions"] == b["completions"] and len(a["completions"]) == 32  # the same 2 x 16 rollouts
    assert a["keep"] == b["keep"] and 0 < sum(a["keep"].values()) < 32  # the same kept rollouts ...
    assert a["tokens"] == b["tokens"]  # ... and tokens, chosen over both processes' rows
    logs = [[h for h in r["log_history"] if "grad_norm" in h] for r in (a, b)]
    assert len(logs[0]) == len(logs[1]) == 2
    for la, lb in zip(*logs):  # the loss and the gradient of the whole batch (global normalizer), not twice one half
        assert lb["loss"] == pytest.approx(la["loss"], abs=1e-6) and lb["grad_norm"] == pytest.approx(la["grad_norm"], rel=1e-5)
    assert max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"]) < 1e-6  # same update


@needs_trl
@pytest.mark.parametrize("overrides, field", [
    ({"n_final": 5}, "n_final=5"),                    # above num_generations = 4
    ({"n_init": 0}, "n_init=0"),
    ({"d3s_method": "d4s"}, "d3s_method='d4s'"),
    ({"k_final": 1.5}, "k_final=1.5"),
    ({"token_scope": "group"}, "token_scope='group'"),
    ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
    ({"scale_rewards": "batch"}, "scale_rewards='batch'"),
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
    ({"static_n": 9, "d3s_method": "pods"}, "static_n=9"),
    ({"normalize_by": "all", "loss_type": "grpo"}, "normalize_by='all'"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 3}, "steps_per_generation=3"),
])
def test_misconfiguration_is_one_clear_error_before_training(tmp_path, overrides, field):
    from trl_worker import make_config

    with pytest.raises(ValueError, match=re.escape(f"D3SGRPOConfig.{field}")):
        make_config(str(tmp_path), **overrides)


@needs_trl
def test_trainer_wants_a_d3s_config_and_a_supported_trl(tiny_model_dir, tmp_path):
    from trl import GRPOConfig

    from integrations.trl import SUPPORTED_TRL, D3SGRPOTrainer, check_trl_version
    from trl_worker import parity_reward

    model, tokenizer = load(tiny_model_dir)
    with pytest.raises(TypeError, match="pass a D3SGRPOConfig"):
        D3SGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=parity_reward,
                       args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False), train_dataset=dataset())
    check_trl_version()  # the installed one is supported
    for version in ("1.15.0", "1.17.0", "2.0.0"):
        with pytest.raises(RuntimeError, match=re.escape(f"supports trl{SUPPORTED_TRL}")):
            check_trl_version(version)


@needs_trl
def test_use_d3s_from_trl_example_runs(tmp_path):
    with open(os.path.join(ROOT, "docs", "trl.md")) as f:
        text = f.read()
    code = re.search(r"```python\n(# train_trl_d3s\.py.*?)```", text, re.S).group(1)
    script = tmp_path / "train_trl_d3s.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'d3s/kept_rollouts'" in proc.stdout and "'d3s/k_realised'" in proc.stdout, proc.stdout[-2000:]
