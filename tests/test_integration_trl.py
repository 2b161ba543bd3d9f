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
  - dapo-filter and dapo-filter-k keep the groups with spread, whole (d3s/kept_rollouts = G x their count);
    with no group with spread nothing is kept and the weights stay, but an empty step after one with
    signal still moves them by AdamW's momentum (TRL's loop always steps the optimizer);
  - gradient accumulation (pass 1 + pass 2) gives the update of one micro-batch;
  - two processes (torchrun, gloo) keep the same global set, and update the same, as one;
  - misconfigurations stop before training with one error naming the field;
  - the "Use D3S from TRL" example in docs/trl.md runs.
"""

import math
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


def run(trainer_cls, config, model_dir, reward=None):
    from trl_worker import parity_reward

    model, tokenizer = load(model_dir)
    torch.manual_seed(0)
    trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=reward or parity_reward, args=config,
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


def spread_groups(rewards):
    """[P] bool: the groups (of num_generations = 4) whose rewards are not all equal."""
    rewards = rewards.view(-1, 4)
    return rewards.amax(-1) > rewards.amin(-1)


@needs_trl
@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_trains_on_every_rollout_of_the_groups_with_spread(tiny_model_dir, tmp_path, method):
    """d3s_method="dapo-filter" (every token) and "dapo-filter-k" (+ D3S's top K), 3 steps, rewards with
    spread in some groups only (half_flat_reward): the kept rollouts are exactly the groups with spread,
    whole; the logged d3s/kept_rollouts is G x their count, every kept rollout has A != 0, and the loss
    sees the kept rows only, with the tokens d3s.select_tokens keeps."""
    import d3s
    from trl_worker import RecordingTrainer, half_flat_reward, kept_tokens_by_row, make_config

    config = make_config(str(tmp_path / "out"), d3s_method=method, max_steps=3)
    trainer = run(RecordingTrainer, config, tiny_model_dir, reward=half_flat_reward)
    logs = train_logs(trainer)
    assert len(trainer.batches) == len(logs) == 3
    partial = 0
    for batch, log in zip(trainer.batches, logs):
        step, spread = batch["step"], spread_groups(batch["rewards"])
        n_keep, k_frac = d3s.method_budget(method, step, 3, 4, config.n_init, config.n_final, config.k_init, config.k_final)
        assert n_keep == 4 and batch["k_frac"] == k_frac and (k_frac == 1.0) == (method == "dapo-filter")
        assert torch.equal(batch["d3s_keep"], spread.repeat_interleave(4))  # whole groups (one process: rows in order)
        partial += 0 < int(spread.sum()) < len(spread)
        assert log["d3s/kept_rollouts"] == 4 * int(spread.sum()) and log["d3s/n_keep"] == 4
        assert log["d3s/k_frac"] == pytest.approx(k_frac)
        assert log["d3s/sample_usefulness_rate"] == (1.0 if spread.any() else 0.0)
        keep, adv, tokens = reference_selection(batch, method, n_keep, tiny_model_dir)
        assert torch.equal(batch["d3s_keep"], keep) and torch.allclose(batch["advantages"], adv, atol=1e-6)
        got = {r: m for (s, r), m in kept_tokens_by_row(trainer).items() if s == step}
        assert set(got) == set(tokens) == set(keep.nonzero().view(-1).tolist())  # the loss saw the kept rows only
        for r, ref in tokens.items():
            width = got[r].shape[0]
            assert not ref[width:].any() and torch.equal(got[r], ref[:width]), (step, r)
        n_selected = sum(int(t.sum()) for t in tokens.values())
        assert log["d3s/kept_tokens"] == n_selected
        if method == "dapo-filter":  # every token of the kept rollouts, as GRPO
            assert log["d3s/k_realised"] == (1.0 if spread.any() else 0.0)
    assert partial >= 1  # some step dropped some groups and kept others (half the prompts reward 0 throughout)


@needs_trl
@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_without_spread_keeps_nothing_and_leaves_the_weights(tiny_model_dir, tmp_path, method):
    """Every reward 1 (flat_reward): no group has spread, nothing is kept on any step. TRL's loop still
    calls optimizer.step() (integrations/trl.py cannot skip it): each process forwards one dummy row with
    a zero loss, so every gradient is exactly 0, and AdamW with weight_decay 0 and moments still at 0
    moves no weight (m = v = 0: the step is 0 / (0 + eps)). The weights stay bit for bit."""
    from trl_worker import flat_reward, make_config

    from integrations.trl import D3SGRPOTrainer

    trainer = run(D3SGRPOTrainer, make_config(str(tmp_path / "out"), d3s_method=method, max_steps=2), tiny_model_dir,
                  reward=flat_reward)
    logs = train_logs(trainer)
    assert len(logs) == 2 and trainer.args.weight_decay == 0.0
    for log in logs:
        assert log["d3s/kept_rollouts"] == 0 and log["d3s/kept_tokens"] == 0 and log["d3s/forwarded_tokens"] == 0
        assert log["d3s/sample_usefulness_rate"] == 0.0 and log["reward_std"] == 0.0
        assert log["loss"] == 0.0 and log["grad_norm"] == 0.0
    initial, _ = load(tiny_model_dir)
    assert max_param_diff(trainer.model, initial) == 0.0
    states = list(trainer.optimizer.state.values())
    assert states and all(int(st["step"]) == 2 for st in states)  # the optimizer did step, twice ...
    assert all(not st["exp_avg"].any() and not st["exp_avg_sq"].any() for st in states)  # ... on zero moments


@needs_trl
def test_an_empty_dapo_filter_step_after_a_step_with_signal_still_moves_the_weights_by_adams_momentum(tiny_model_dir,
                                                                                                         tmp_path):
    """What integrations/trl.py does NOT do (train_full.py and train_small.py do): skip the optimizer step
    when nothing is kept. Step 1 has spread (parity), step 2 none (signal_then_flat_reward): step 2's
    gradient is exactly 0, but TRL's loop calls AdamW's step, whose moments from step 1 move each weight
    by lr x m^ / sqrt(v^) = 0.67 lr (beta1 0.9, beta2 0.999; any weight whose step-1 gradient is well above
    eps). So in TRL an empty step is an update on stale momentum (docs/trl.md, "DAPO's filter")."""
    from trl_worker import RecordingTrainer, make_config, signal_then_flat_reward

    trainer = run(RecordingTrainer, make_config(str(tmp_path / "out"), d3s_method="dapo-filter", max_steps=2),
                  tiny_model_dir, reward=signal_then_flat_reward)
    first, second = train_logs(trainer)
    assert first["d3s/kept_rollouts"] > 0 and first["grad_norm"] > 0
    assert second["d3s/kept_rollouts"] == 0 and second["grad_norm"] == 0.0 and second["loss"] == 0.0
    after_step_1 = trainer.batches[1]["weights"]  # what generated step 2's rollouts
    final = trainer.model.state_dict()
    moved = max(float((final[k] - after_step_1[k]).abs().max()) for k in final)
    beta1, beta2 = trainer.args.adam_beta1, trainer.args.adam_beta2  # Adam's step 2 on g = 0 after g_1 on step 1:
    adam = beta1 * (1 - beta1) / (1 - beta1**2) / math.sqrt(beta2 * (1 - beta2) / (1 - beta2**2))  # m^ / sqrt(v^)
    assert moved == pytest.approx(trainer.args.learning_rate * adam, rel=1e-3)  # 0.67 lr where |g_1| >> eps


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
