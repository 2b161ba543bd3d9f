"""bench/memory.py on a tiny Qwen2: the simulated state bytes equal the arithmetic, and a real
CPU run of the same step under the same tracker peaks where the fake run does.

The fake run goes through the script's command line in a fresh process: DTensor caches its
sharding propagation per process, and only a cold cache shows whether the propagation's
global-shape tensors are kept out of the count (they add ~50% to this tiny step's peak).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from support import tiny  # tests/conftest.py puts the repository root on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "memory.py")
RANKS, MICRO_BATCH, RESPONSE, PROMPT = 2, 2, 48, 16
TRAIN_ARGS = ["--mlp-chunk-tokens", "32"]  # the tiled MLP on: 16 positions x 2 rows per slice, 4 slices


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen2 folder (config.json is what the bench reads). vocab 259 rows shard 130 + 129
    over 2 ranks, so FSDP2's padding of the last shard is exercised. Untied, as the 7B: the
    embedding is an FSDP unit of its own."""
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, tie_word_embeddings=False)
    return tiny.save_tiny(model, tokenizer, str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def fake_run(tiny_dir):
    cmd = [
        sys.executable,
        SCRIPT,
        "--preset",
        tiny_dir,
        "--ranks",
        str(RANKS),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--response-len",
        str(RESPONSE),
        "--prompt-len",
        str(PROMPT),
        "--method",
        "d3s",
        "--",
        *TRAIN_ARGS,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def shard_bytes(model_dir, ranks):
    """4 bytes x ceil(rows / ranks) x columns per parameter: rank 0's fp32 shard under FSDP2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    return sum(4 * math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0]) for p in params), len(params)


def test_prints_a_table_and_one_json_line(fake_run):
    stdout, record = fake_run
    assert "| **peak** |" in stdout and "| optimizer state |" in stdout
    for key in (
        "peak_gib",
        "ranks",
        "micro_batch_size",
        "response_len",
        "method",
        "k_frac",
        "breakdown_gib",
        "categories_gib",
        "logits_gib",
    ):
        assert key in record, key
    assert (record["ranks"], record["micro_batch_size"], record["response_len"]) == (RANKS, MICRO_BATCH, RESPONSE)
    assert record["method"] == "d3s" and record["k_frac"] == 0.2  # train_full's --k-final
    assert record["peak_phase"].startswith("step 2 pass 2")  # with Adam state and accumulated gradients


def test_simulated_parameter_gradient_and_optimizer_bytes_equal_the_arithmetic(fake_run, tiny_dir):
    _, record = fake_run
    weights, n_tensors = shard_bytes(tiny_dir, RANKS)
    end, peak = record["end_bytes"], record["breakdown_bytes"]
    assert end["Sharded Param"] == weights  # fp32 master shards
    assert end["OptState"] == 2 * weights + 4 * n_tensors  # exp_avg, exp_avg_sq + one fp32 step count per tensor
    assert peak["Sharded Grad"] == weights  # micro-batch 2's backward: micro-batch 1's gradients are all there
    assert end["Sharded Grad"] == 0  # zero_grad(set_to_none=True) after the step


def test_a_real_cpu_run_of_the_same_step_peaks_within_10_percent_of_the_fake_run(fake_run, tiny_dir):
    _, record = fake_run
    bench = _load_bench()
    config = bench.load_config(tiny_dir)
    targs = bench.trainer_args(MICRO_BATCH, RESPONSE, "d3s", TRAIN_ARGS)
    real = bench.simulate(config, targs, RANKS, MICRO_BATCH, RESPONSE, PROMPT, k_frac=0.2, fake=False)
    assert real["end"]["Sharded Param"] == record["end_bytes"]["Sharded Param"]
    assert real["peak"]["Total"] == pytest.approx(record["peak_bytes"], rel=0.10)
    assert real["peak_phase"] == record["peak_phase"]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--method", "ppo"], "--method"),
        (["--ranks", "0"], "--ranks"),
        (["--k-frac", "1.5"], "--k-frac"),
        (["--preset", "no/such/folder"], "--preset"),
    ],
)
def test_bad_flags_name_the_flag_and_the_fix(argv, flag, capsys):
    bench = _load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def run_bench(tiny_dir, *extra, gpu=None):
    cmd = [
        sys.executable,
        SCRIPT,
        "--preset",
        tiny_dir,
        "--ranks",
        str(RANKS),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--response-len",
        str(RESPONSE),
        "--prompt-len",
        str(PROMPT),
        "--method",
        "d3s",
    ]
    cmd += ["--gpu", str(gpu)] if gpu else []
    proc = subprocess.run(
        cmd + ["--", *TRAIN_ARGS, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_what_the_trainer_holds_while_vllm_generates_is_its_state_and_with_kl_ref_the_references_shards(
    fake_run, tiny_dir
):
    """The plan's trainer_resident (fp32 shards + AdamW's moments, + 2 B x params / ranks with --kl-ref), counted in
    the simulated run: the reference's root (wrapped reshard_after_forward=False, no backward) holds no gathered
    weights after its forward (fsdp.reshard), which would add its lm_head here (issue 30)."""
    weights, n_tensors = shard_bytes(tiny_dir, RANKS)
    buffers = 2 * 16 * 4  # the rotary inv_freq and original_inv_freq of the tiny model (fp32, 16 each)
    assert fake_run[1]["resident_bytes"] == weights + (2 * weights + 4 * n_tensors) + buffers
    _, with_ref = run_bench(tiny_dir, "--kl-ref")
    assert with_ref["resident_bytes"] == weights + (2 * weights + 4 * n_tensors) + weights // 2 + 2 * buffers
    assert any(phase.endswith("pass 1 (reference)") for phase in with_ref["phase_peaks_gib"])


def test_cpu_offload_moves_the_sharded_state_off_the_gpu_and_gpu_adds_vllms_share(fake_run, tiny_dir):
    stdout, offload = run_bench(tiny_dir, "--cpu-offload", gpu=8)
    assert offload["cpu_offload"] and offload["resident_bytes"] == 2 * 16 * 4  # only the buffers stay on the GPU
    assert offload["peak_bytes"] < fake_run[1]["peak_bytes"] - fake_run[1]["breakdown_bytes"]["OptState"]
    assert (
        offload["peak_phase"].endswith("pass 2")
        and "| **peak** |" in stdout
        and "(host memory: --cpu-offload)" in stdout
    )
    assert offload["generating_gib"] == pytest.approx(offload["resident_gib"] + offload["vllm_share_gib"], abs=1e-3)
    assert offload["total_peak_gib"] == pytest.approx(max(offload["generating_gib"], offload["training_gib"]), abs=1e-3)
    # the margin, 4 GiB, leaves vLLM at most 4 of the 8; the plan gives it no more than its weights, workspace (3)
    # and a KV cache for twice the run's rollouts at once (issue 47, S1): here less than the room
    assert offload["plan_accepts"] and 0.5 < offload["vllm_share_gib"] < 8 - 4.0  # workspace by the model (issue 57)
    # weights + workspace by the model (issue 57): the 0.5 GiB of graphs and a tiny model's profile run, not 3.0
    assert 0.5 < offload["vllm_share_gib"] - offload["kv_cache_gib"] < 0.6
    assert "One GPU of 8 GiB: trainer + vLLM" in stdout
    # issue 37, finding 5: the host's share, by part. The simulated host-resident shards are the arithmetic's bytes;
    # the plan's host count pins each shard on its own, rounded up to a power of two (torch's host allocator)
    weights, n_tensors = shard_bytes(tiny_dir, RANKS)
    host, simulated = offload["host_parts_bytes"], offload["host_simulated_bytes"]
    assert simulated["Sharded Param"] == weights and simulated["OptState"] == 2 * weights + 4 * n_tensors
    assert host["moments"] == 2 * weights and host["weights"] == host["gradients"] == pinned_shards(tiny_dir, RANKS)
    assert host["weights"] > weights and host["rounding"] == 2 * (host["weights"] - weights)
    assert host["total"] == host["per_rank"] * RANKS + host["export"] and "Host memory (gpu.host_memory" in stdout


def pinned_shards(model_dir, ranks):
    """Each parameter's fp32 shard (ceil(rows / ranks) rows) as torch's host allocator pins it: a power of two."""
    from transformers import AutoModelForCausalLM

    from support import gpu

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(
        gpu.pinned_block(4 * math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0])) for p in model.parameters()
    )


@pytest.mark.parametrize("gpu", ["12gb", "0", "nan"])
def test_a_bad_gpu_size_names_the_flag(gpu, capsys):
    bench = _load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--gpu", gpu])
    assert exit_info.value.code == 2 and "--gpu" in capsys.readouterr().err
