"""integrations/trl.py: D3SGRPOTrainer inside TRL's GRPOTrainer, on CPU with a tiny model.

These tests need TRL, which lives in its own venv (.venv-trl, `pip install -r requirements/trl.txt`;
.ci/run builds it). Run them there directly:

    .venv-trl/bin/python -m pytest tests/test_integration_trl.py -q

Under the project's .venv (no TRL), `test_trl_suite_in_trl_venv` runs this file under
.venv-trl in a subprocess (so `pytest tests` in CI runs them), and skips when .venv-trl is absent.

What they check:
  - d3s_method="grpo" is TRL's GRPOTrainer: rewards, loss and parameters after 3 steps agree;
  - d3s and d3s-i keep the rollouts d3s.select_samples keeps and the tokens d3s.select_tokens
    keeps, given the same rewards and the logits of a plain forward (d3s.token_entropy);
  - dapo-filter and dapo-filter-k keep the groups with spread, whole (kept_samples = G x their count);
    a step where no process keeps a token makes no optimizer step: after a step with signal the weights
    and AdamW's state stay bit for bit (no update on stale momentum), also with gradient accumulation;
    on 2 processes, both step when one keeps nothing and the other keeps rows, and both skip when none does;
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

needs_trl = pytest.mark.skipif(
    not HAVE_TRL, reason="needs trl: runs under .venv-trl (test_trl_suite_in_trl_venv runs them)"
)


# ---------------------------------------------------------------------------------------------
# Under .venv: run this file under .venv-trl
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_TRL, reason="trl is importable here: the tests below run in this process")
@pytest.mark.skipif(
    not os.path.exists(TRL_PYTHON),
    reason=f"{TRL_PYTHON} not found: python3 -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl.txt",
)
def test_trl_suite_in_trl_venv():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            TRL_PYTHON,
            "-m",
            "pytest",
            os.path.abspath(__file__),
            "-q",
            "-ra",
            "-p",
            "no:cacheprovider",
            "-k",
            "not test_trl_suite_in_trl_venv",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


# ---------------------------------------------------------------------------------------------
# Under .venv-trl
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, hidden_size=64, num_layers=2)
    return tiny.save_tiny(model, tokenizer, str(tmp_path_factory.mktemp("tiny")))


def load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
    )


def dataset():
    from datasets import Dataset
    from trl_worker import PROMPTS

    return Dataset.from_dict({"prompt": PROMPTS})


def run(trainer_cls, config, model_dir, reward=None):
    from trl_worker import parity_reward

    model, tokenizer = load(model_dir)
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward or parity_reward,
        args=config,
        train_dataset=dataset(),
    )
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
        assert lb["kept_samples"] == 16 and lb["k_real"] == 1.0  # every rollout, every token
    initial, _ = load(tiny_model_dir)
    assert max_param_diff(plain.model, initial) > 1e-3  # the 3 steps did move the weights ...
    assert max_param_diff(plain.model, ours.model) < 1e-6  # ... and the two trainers moved them alike


def budget(method, step, total_steps, config):
    """d3s.method_budget of the method's row at TRL's step, with the config's schedule (G = 4)."""
    import d3s
    from support import methods

    return d3s.method_budget(
        methods.LADDER[method],
        step=step,
        total_steps=total_steps,
        group_size=4,
        n_init=config.n_init,
        n_final=config.n_final,
        k_init=config.k_init,
        k_final=config.k_final,
    )


def reference_selection(batch, method, n_keep, model_dir):
    """From d3s.py alone: the kept rollouts and, from a plain forward's logits, the kept tokens."""
    import d3s
    from support import methods

    rewards = batch["rewards"].view(-1, 4)
    keep, adv = d3s.select_samples(rewards, n_keep, methods.LADDER[method].samples, eps=1e-4)
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
    from trl_worker import RecordingTrainer, kept_tokens_by_row, make_config

    config = make_config(str(tmp_path / "out"), d3s_method=method, max_steps=4)
    trainer = run(RecordingTrainer, config, tiny_model_dir)
    assert len(trainer.batches) == 4
    for batch in trainer.batches:
        step = batch["step"]
        n_keep, k_frac = budget(method, step, 4, config)
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
    whole; the logged kept_samples is G x their count, every kept rollout has A != 0, and the loss
    sees the kept rows only, with the tokens d3s.select_tokens keeps."""
    from trl_worker import RecordingTrainer, half_flat_reward, kept_tokens_by_row, make_config

    config = make_config(str(tmp_path / "out"), d3s_method=method, max_steps=3)
    trainer = run(RecordingTrainer, config, tiny_model_dir, reward=half_flat_reward)
    logs = train_logs(trainer)
    assert len(trainer.batches) == len(logs) == 3
    partial = 0
    for batch, log in zip(trainer.batches, logs):
        step, spread = batch["step"], spread_groups(batch["rewards"])
        n_keep, k_frac = budget(method, step, 3, config)
        assert n_keep == 4 and batch["k_frac"] == k_frac and (k_frac == 1.0) == (method == "dapo-filter")
        assert torch.equal(batch["d3s_keep"], spread.repeat_interleave(4))  # whole groups (one process: rows in order)
        partial += 0 < int(spread.sum()) < len(spread)
        assert log["kept_samples"] == 4 * int(spread.sum()) and log["n_keep"] == 4
        assert log["k_frac"] == pytest.approx(k_frac)
        assert log["sur"] == (1.0 if spread.any() else 0.0)
        keep, adv, tokens = reference_selection(batch, method, n_keep, tiny_model_dir)
        assert torch.equal(batch["d3s_keep"], keep) and torch.allclose(batch["advantages"], adv, atol=1e-6)
        got = {r: m for (s, r), m in kept_tokens_by_row(trainer).items() if s == step}
        assert set(got) == set(tokens) == set(keep.nonzero().view(-1).tolist())  # the loss saw the kept rows only
        for r, ref in tokens.items():
            width = got[r].shape[0]
            assert not ref[width:].any() and torch.equal(got[r], ref[:width]), (step, r)
        n_selected = sum(int(t.sum()) for t in tokens.values())
        assert log["kept_tokens"] == n_selected
        if method == "dapo-filter":  # every token of the kept rollouts, as GRPO
            assert log["k_real"] == (1.0 if spread.any() else 0.0)
    assert partial >= 1  # some step dropped some groups and kept others (half the prompts reward 0 throughout)


@needs_trl
@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_without_spread_keeps_nothing_and_makes_no_optimizer_step(tiny_model_dir, tmp_path, method):
    """Every reward 1 (flat_reward): no group has spread, nothing is kept on any step. Each process forwards
    one dummy row with a zero loss (the gradient is exactly 0), and the optimizer's step does nothing, as in
    train_full.py and train_small.py: AdamW never steps (no state), the weights stay bit for bit. The steps
    still count: global_step and the lr schedule advance."""
    from trl_worker import flat_reward, make_config

    from integrations.trl import D3SGRPOTrainer

    trainer = run(
        D3SGRPOTrainer,
        make_config(str(tmp_path / "out"), d3s_method=method, max_steps=2),
        tiny_model_dir,
        reward=flat_reward,
    )
    logs = train_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert log["kept_samples"] == 0 and log["kept_tokens"] == 0 and log["fwd_tokens"] == 0
        assert log["sur"] == 0.0 and log["reward_std"] == 0.0
        assert log["loss"] == 0.0 and log["grad_norm"] == 0.0
    initial, _ = load(tiny_model_dir)
    assert max_param_diff(trainer.model, initial) == 0.0
    assert not trainer.optimizer.state  # AdamW never stepped
    assert trainer.state.global_step == 2 and trainer.lr_scheduler.last_epoch == 2


@needs_trl
@pytest.mark.parametrize("gas", [1, 2])
def test_an_empty_dapo_filter_step_after_a_step_with_signal_leaves_the_weights_and_adamw_as_they_are(
    tiny_model_dir, tmp_path, gas
):
    """Step 1 has spread (parity), step 2 none (signal_then_flat_reward). Step 2's gradient is exactly 0, but
    an AdamW step would still move the weights by step 1's momentum (0.67 lr with beta 0.9 / 0.999).
    D3SGRPOTrainer makes no optimizer step when no process selected a token: after step 2 the weights and
    AdamW's state (step count 1, both moments) are those after step 1, bit for bit, while global_step and the
    lr schedule advance. gas=2 (2 micro-batches of 8): the decision covers the whole optimizer step (pass 1)."""
    from trl_worker import RecordingTrainer, make_config, signal_then_flat_reward

    accumulation = {} if gas == 1 else {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}
    trainer = run(
        RecordingTrainer,
        make_config(str(tmp_path / "out"), d3s_method="dapo-filter", max_steps=2, **accumulation),
        tiny_model_dir,
        reward=signal_then_flat_reward,
    )
    first, second = train_logs(trainer)
    assert first["kept_samples"] > 0 and first["grad_norm"] > 0
    assert second["kept_samples"] == 0 and second["kept_tokens"] == 0
    assert second["grad_norm"] == 0.0 and second["loss"] == 0.0
    assert len(trainer.batches) == 2  # one generation batch per optimizer step
    initial, after_step_1 = trainer.batches[0]["weights"], trainer.batches[1]["weights"]
    final = trainer.model.state_dict()
    assert max(float((after_step_1[k] - initial[k]).abs().max()) for k in final) > 1e-4  # step 1 moved them ...
    assert all(torch.equal(final[k], after_step_1[k]) for k in final)  # ... step 2 did not
    adam_1, adam_2 = trainer.batches[1]["adam"], trainer.optimizer.state_dict()["state"]
    assert adam_1 and set(adam_1) == set(adam_2)
    assert any(bool(st["exp_avg"].any()) for st in adam_1.values())  # momentum an AdamW step would have applied
    for i, st in adam_2.items():
        assert int(st["step"]) == int(adam_1[i]["step"]) == 1
        assert torch.equal(st["exp_avg"], adam_1[i]["exp_avg"]) and torch.equal(
            st["exp_avg_sq"], adam_1[i]["exp_avg_sq"]
        )
    assert trainer.state.global_step == 2 and trainer.lr_scheduler.last_epoch == 2


@needs_trl
def test_gradient_accumulation_gives_the_update_of_one_micro_batch(tiny_model_dir, tmp_path):
    from integrations.trl import D3SGRPOTrainer
    from trl_worker import make_config

    one = run(D3SGRPOTrainer, make_config(str(tmp_path / "one"), max_steps=2), tiny_model_dir)
    two = run(
        D3SGRPOTrainer,
        make_config(str(tmp_path / "two"), max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=2),
        tiny_model_dir,
    )
    for a, b in zip(train_logs(one), train_logs(two)):
        assert a["reward"] == b["reward"]
        assert a["kept_samples"] == b["kept_samples"] and a["kept_tokens"] == b["kept_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-5
        )
    assert max_param_diff(one.model, two.model) < 1e-6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one_and_two_processes(model_dir, tmp_path, *worker_args):
    """tests/trl_worker.py on 1 process (16 rows) and on 2 (torchrun, gloo, 8 rows each), side by side."""
    worker = os.path.join(ROOT, "tests", "trl_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    procs = [
        subprocess.Popen(
            [sys.executable, worker, "--model", model_dir, "--out", str(one), *worker_args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--master_port={free_port()}",
                worker,
                "--model",
                model_dir,
                "--out",
                str(two),
                "--rows-per-process",
                "8",
                *worker_args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-4000:]
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert (a["processes"], b["processes"]) == (1, 2)
    return a, b


@needs_trl
def test_two_processes_keep_the_global_set_of_one(tiny_model_dir, tmp_path):
    a, b = run_one_and_two_processes(tiny_model_dir, tmp_path)
    assert a["completions"] == b["completions"] and len(a["completions"]) == 32  # the same 2 x 16 rollouts
    assert a["keep"] == b["keep"] and 0 < sum(a["keep"].values()) < 32  # the same kept rollouts ...
    assert a["tokens"] == b["tokens"]  # ... and tokens, chosen over both processes' rows
    logs = [[h for h in r["log_history"] if "grad_norm" in h] for r in (a, b)]
    assert len(logs[0]) == len(logs[1]) == 2
    for la, lb in zip(*logs):  # the loss and the gradient of the whole batch (global normalizer), not twice one half
        assert lb["loss"] == pytest.approx(la["loss"], abs=1e-6) and lb["grad_norm"] == pytest.approx(
            la["grad_norm"], rel=1e-5
        )
    assert max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"]) < 1e-6  # same update


@needs_trl
def test_two_processes_step_together_when_one_keeps_nothing_and_skip_together_when_none_does(tiny_model_dir, tmp_path):
    """dapo-filter, 1 process and 2 (8 rows, 2 groups each), the same seeded rollouts. Step 1: rows 8-15
    (process 1's groups) reward 1, so process 1 keeps nothing while process 0 keeps its groups with spread.
    The gradients are all-reduced, so both processes must step (one skipping would leave the two copies
    apart), with the update of the one process. Step 2: every reward 1, nothing kept anywhere: both skip,
    the weights stay those after step 1 and AdamW's step count 1 on every process."""
    a, b = run_one_and_two_processes(
        tiny_model_dir, tmp_path, "--method", "dapo-filter", "--flat-rows", "0:8:16", "1:0:16"
    )
    assert a["completions"] == b["completions"] and a["keep"] == b["keep"]
    kept = {s: sorted(r for (step, r), k in b["keep"].items() if k and step == s) for s in (0, 1)}
    assert kept[0] and max(kept[0]) < 8 and kept[1] == []  # step 1: process 0's rows only; step 2: none
    logs = [[h for h in r["log_history"] if "grad_norm" in h] for r in (a, b)]
    assert len(logs[0]) == len(logs[1]) == 2
    for la, lb in zip(*logs):
        assert lb["loss"] == pytest.approx(la["loss"], abs=1e-6) and lb["grad_norm"] == pytest.approx(
            la["grad_norm"], rel=1e-5
        )
    assert logs[1][0]["grad_norm"] > 0 and logs[1][1]["grad_norm"] == 0.0
    after_step_1 = b["weights_before"][1]
    assert max(float((after_step_1[k] - b["weights_before"][0][k]).abs().max()) for k in after_step_1) > 1e-4  # stepped
    for proc in b["per_process"] + a["per_process"]:
        assert proc["adam_steps"] == [1]  # step 1 stepped on every process, step 2 on none
    for proc in b["per_process"]:  # both copies: the weights after step 1, bit for bit
        assert all(torch.equal(proc["params"][k], after_step_1[k]) for k in after_step_1)
    # the 1-process update, within 1% of lr: Adam's first step is lr g / (|g| + eps), and a few weights whose
    # gradient is near eps (1e-8) turn the processes' float-order differences into up to 2.4e-6 (lr 1e-3)
    assert max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"]) < 1e-5


@needs_trl
@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_final": 5}, "n_final=5"),  # above num_generations = 4
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
    ],
)
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
        D3SGRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=parity_reward,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
            train_dataset=dataset(),
        )
    check_trl_version()  # the installed one is supported
    for version in ("1.15.0", "1.17.0", "2.0.0"):
        with pytest.raises(RuntimeError, match=re.escape(f"supports trl{SUPPORTED_TRL}")):
            check_trl_version(version)


@needs_trl
def test_use_d3s_from_trl_example_runs(tmp_path):
    """integrations/train_trl_d3s.py, the script docs/trl.md shows whole (tests/test_printed_commands.py checks they
    are the same), runs from another folder and prints its d3s/* metrics."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "integrations", "train_trl_d3s.py")
    proc = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'kept_samples'" in proc.stdout and "'k_real'" in proc.stdout, proc.stdout[-2000:]
