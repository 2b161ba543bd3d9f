"""Issue 30, the GPU rung, on a CPU: what a review found would break on a GPU node, and one GPU of 24-80 GB.

- the memory plan (gpu.vllm_memory_plan): vLLM's weights, workspace and KV cache beside the trainer,
  --cpu-offload, --kl-ref's shards, --vllm-sleep-level 0 (vLLM awake beside the step), a refusal in one line that
  names the memory and the flags that fit (a given --vllm-gpu-memory-utilization too small or too large too);
- its estimate of the trainer's step (gpu.trainer_peak_bytes) against bench/memory.py's simulations;
- the engine: the first weight sync with vLLM asleep, the free-memory check before a wake (a fake vLLM);
- an untied lm_head on a micro-batch without a selected token still gets a (zero) gradient;
- the diagnosis of a torch that sees no GPU (driver and CUDA versions), the labels of the defaults.
The FSDP2 paths (CPU offload, the reference's reshard, the bf16 gather) run on 2 gloo ranks in
tests/test_full_fsdp.py; preemption and a full disk through the command line in tests/test_full_faults.py.
"""

import math
import types

import pytest
import torch

from support import loss_head, engines, gpu, cli
import train_full

GIB = 2**30
QWEN25_MATH_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    dtype="bfloat16",  # the hub checkpoint's: export_hf writes it (gpu.host_memory counts its copy)
)
QWEN25_MATH_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    dtype="bfloat16",
)
GPUS = {"24gb": 22.0, "48gb": 44.4, "80gb": 79.1}  # bench/memory.py's --gpu sizes (GiB as torch reports them)


def config(shapes):
    from transformers import Qwen2Config

    return Qwen2Config(**shapes)


def plan(shapes, flags=(), ranks=1, card="24gb", **kw):
    model = ["--model", "Qwen/Qwen2.5-Math-1.5B"] if shapes is QWEN25_MATH_1_5B else []  # the name the line gives
    return gpu.vllm_memory_plan(
        config(shapes), train_full.parse_args(model + list(flags)), ranks, GPUS[card] * GIB, **kw
    )


ONE_GPU = ["--micro-batch-size", "4", "--max-prompt-len", "512"]  # the one-GPU settings of docs/train_full.md


def test_the_plan_refuses_the_1_5b_on_a_24_gb_gpu_without_offload_in_one_line_that_names_the_memory_and_the_fix():
    with pytest.raises(cli.UsageError) as refused:
        plan(QWEN25_MATH_1_5B, ONE_GPU)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--model Qwen/Qwen2.5-Math-1.5B: does not fit this 22.0 GiB GPU: ")
    # finding 1: 12 B x 1.54B = 17.25 GiB of fp32 weights and AdamW moments leave vLLM less than its weights
    assert "the trainer's 17.3 GiB (12 B x 1.54B params / 1 rank(s), without --cpu-offload)" in line
    assert "bf16 weights 2.9" in line and line.endswith("(what fits instead: docs/memory.md, 'When the plan refuses')")
    assert "fits with" not in line  # issue 53: the alternatives are docs/memory.md's table, not computed here
    accepted = plan(QWEN25_MATH_1_5B, ONE_GPU + ["--cpu-offload"])
    assert accepted["trainer_resident_gib"] == 0 and not accepted["short"]
    assert accepted["vllm_share_gib"] == pytest.approx(22.0 - gpu.MARGIN_GIB, abs=0.01)
    assert accepted["kv_cache_gib"] > 10 and accepted["max_num_seqs"] >= 64  # 28 KiB a token: ~100 sequences of 3.5k
    parts = accepted["host_parts_gib"]  # the state in host memory (pinned and rounded), + rank 0's export copy
    assert accepted["host_gib"] == pytest.approx(parts["per_rank"] + parts["export"]) and parts["rounding"] > 0


@pytest.mark.parametrize("card", ["48gb", "80gb"])
def test_the_1_5b_fits_48_and_80_gb_without_offload(card):
    fits = plan(QWEN25_MATH_1_5B, ONE_GPU, card=card)
    assert fits["trainer_resident_gib"] == pytest.approx(12 * fits["params"] / GIB)  # 17.25 GiB
    assert fits["trainer_peak_gib"] == pytest.approx(20 * fits["params"] / GIB)  # the AdamW step at micro-batch 4
    assert fits["vllm_share_gib"] + fits["trainer_resident_gib"] + gpu.MARGIN_GIB == pytest.approx(GPUS[card], abs=0.01)


def test_the_7b_on_one_80_gb_gpu_needs_offload_and_the_host_memory_for_it():
    with pytest.raises(cli.UsageError, match=r"12 B x 7.62B params / 1 rank\(s\), without --cpu-offload"):
        plan(QWEN25_MATH_7B, ONE_GPU, card="80gb")
    ok = plan(QWEN25_MATH_7B, ONE_GPU + ["--cpu-offload"], card="80gb", host_bytes=256 * GIB)
    assert ok["vllm_weights_gib"] == pytest.approx(14.2, abs=0.05) and ok["kv_cache_gib"] > 50
    with pytest.raises(cli.UsageError) as refused:  # issue 37, finding 5: 211 GiB, not 20 B x 7.62B = 142
        plan(QWEN25_MATH_7B, ONE_GPU + ["--cpu-offload"], card="80gb", host_bytes=200 * GIB)
    assert (
        "host memory: 211.2 GiB needed (--cpu-offload's state: 168.7 GiB for each of the 1 rank(s) of this node, "
        "51.1 GiB of it the pinned blocks' rounding to powers of two; rank 0's full copy of the model at the "
        "export: 42.6), 200.0 GiB is available (what fits instead: docs/memory.md, 'When the plan refuses')"
    ) in str(refused.value)


def test_the_host_count_rounds_each_pinned_shard_to_a_power_of_two_and_adds_rank_0s_export_copy():
    """Issue 37, finding 5: torch 2.13's caching host allocator rounds every pinned block up to a power of two
    (FSDP2 pins each parameter's shard, and each gradient's), and export_hf holds the full model on rank 0 in fp32
    and in bf16; the plan counted 20 B x params. Arithmetic on the 7B's shapes, one rank."""
    args = train_full.parse_args(["--cpu-offload"])
    h = gpu.host_memory(config(QWEN25_MATH_7B), args, 1, environ={})
    params = gpu.model_shapes(config(QWEN25_MATH_7B))[0]
    mlp, embed = 18944 * 3584 * 4, 152064 * 3584 * 4  # 272 MB -> 512 MiB; 2.18 GB -> 4 GiB (embedding, lm_head)
    assert gpu.pinned_block(mlp) == 2**29 and gpu.pinned_block(embed) == 2**32
    assert h["weights"] == h["gradients"] == sum(gpu.pinned_block(4 * n) for n in shapes(QWEN25_MATH_7B))
    assert h["weights"] / (4 * params) == pytest.approx(1.90, abs=0.01)  # ~1.9x for weights and gradients
    assert h["moments"] == 8 * params and h["rounding"] == 2 * (h["weights"] - 4 * params)
    assert h["export"] == 6 * params and h["load"] == 4 * params  # fp32 + the bf16 checkpoint copy
    assert h["total"] == h["per_rank"] + h["export"] and h["per_rank"] / GIB == pytest.approx(168.7, abs=0.05)
    # pinned_max_round_threshold_mb in the allocator settings: blocks above it are not rounded
    below = gpu.host_memory(
        config(QWEN25_MATH_7B), args, 1, environ={"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}
    )
    assert below["total"] / GIB == pytest.approx(161.85, abs=0.01) and below["rounding"] / GIB < 2
    eight = gpu.host_memory(config(QWEN25_MATH_7B), args, 8, local_ranks=8, environ={})
    assert eight["total"] == 8 * eight["per_rank"] + eight["export"]  # every rank of the node, one export copy
    plain = gpu.host_memory(config(QWEN25_MATH_7B), train_full.parse_args([]), 8, local_ranks=8)
    assert plain["total"] == plain["export"] == 6 * params  # without offload: only the export's copy


def shapes(fields, ranks=1):
    """Elements of rank 0's shard of each parameter (ceil(rows / ranks) rows)."""
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config(fields))
    return [-(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) for p in model.parameters()]


def test_the_plan_counts_the_kl_reference_and_refuses_a_micro_batch_that_does_not_fit():
    base, with_ref = (
        plan(QWEN25_MATH_7B, ranks=8, card="80gb"),
        plan(QWEN25_MATH_7B, ["--kl-ref"], ranks=8, card="80gb"),
    )
    assert with_ref["trainer_resident_gib"] - base["trainer_resident_gib"] == pytest.approx(
        2 * base["params"] / 8 / GIB
    )
    assert with_ref["trainer_peak_gib"] - base["trainer_peak_gib"] == pytest.approx(2 * base["params"] / 8 / GIB)
    with pytest.raises(cli.UsageError) as refused:  # 64 rollouts of 4024 tokens per forward on a 48 GB GPU
        plan(QWEN25_MATH_1_5B, ["--micro-batch-size", "64"], card="48gb")
    line = str(refused.value)
    assert "the trainer's step needs about" in line  # the flags that set it, named
    assert "--micro-batch-size 64 x 4024 tokens of --max-prompt-len + --max-response-len" in line


def test_a_given_gpu_memory_utilization_that_leaves_vllm_too_little_is_refused():
    with pytest.raises(cli.UsageError, match=r"vLLM would get 4.0 GiB \(--vllm-gpu-memory-utilization 0.05\)"):
        plan(QWEN25_MATH_7B, ["--vllm-gpu-memory-utilization", "0.05"], ranks=8, card="80gb")


def test_a_given_gpu_memory_utilization_that_overfills_the_gpu_beside_the_trainer_is_refused():
    """Review: only a too-small share was refused; 0.95 beside the 7B's 10.6 GiB of shards and the margin would run
    vLLM out of memory at its start. The line names the memory; the largest value that fits is the plan's
    arithmetic (docs/memory.md)."""
    with pytest.raises(cli.UsageError) as refused:
        plan(QWEN25_MATH_7B, ["--vllm-gpu-memory-utilization", "0.95"], ranks=8, card="80gb")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--model Qwen/Qwen2.5-Math-7B: does not fit this 79.1 GiB GPU: ")
    assert (
        "--vllm-gpu-memory-utilization 0.95 gives vLLM 75.1 GiB, which beside the trainer's 10.6 GiB (12 B x 7.62B "
        "params / 8 rank(s), without --cpu-offload) and the 4 GiB margin needs 89.8 GiB, more than the GPU's 79.1"
    ) in line
    beside = plan(QWEN25_MATH_7B, ranks=8, card="80gb")["vllm_beside_gib"]  # the GPU less the rest, 3 decimals
    largest = str(math.floor((GPUS["80gb"] - beside - gpu.MARGIN_GIB) / GPUS["80gb"] * 1000) / 1000)
    ok = plan(QWEN25_MATH_7B, ["--vllm-gpu-memory-utilization", largest], ranks=8, card="80gb")
    assert ok["vllm_share_gib"] + ok["trainer_resident_gib"] + gpu.MARGIN_GIB <= GPUS["80gb"]
    with pytest.raises(cli.UsageError, match="more than the GPU's 79.1"):  # the largest: 0.001 more does not fit
        plan(QWEN25_MATH_7B, ["--vllm-gpu-memory-utilization", f"{float(largest) + 0.001:g}"], ranks=8, card="80gb")
    assert not plan(QWEN25_MATH_1_5B, ONE_GPU + ["--vllm-gpu-memory-utilization", "0.5"], card="48gb")["short"]


AWAKE = ["--vllm-sleep-level", "0", "--vllm-allow-awake"]


def test_sleep_level_0_gives_vllm_what_the_trainers_step_leaves_and_level_1_what_level_2_does():
    """Review: --vllm-sleep-level 0 keeps vLLM's whole share on the GPU through the training step, so the share is
    sized beside the step's peak (not the resident shards); levels 1 and 2 both free it while the trainer runs."""
    asleep, awake = plan(QWEN25_MATH_1_5B, ONE_GPU, card="80gb"), plan(QWEN25_MATH_1_5B, ONE_GPU + AWAKE, card="80gb")
    assert awake["vllm_awake_in_step"] and not asleep["vllm_awake_in_step"]
    assert awake["vllm_share_gib"] + awake["trainer_peak_gib"] + gpu.MARGIN_GIB == pytest.approx(79.1, abs=0.01)
    assert awake["vllm_share_gib"] == pytest.approx(asleep["vllm_share_gib"] - (20 - 12) * asleep["params"] / GIB)
    assert awake["max_num_seqs"] < asleep["max_num_seqs"]
    level_1 = plan(QWEN25_MATH_1_5B, ONE_GPU + ["--vllm-sleep-level", "1", "--vllm-allow-awake"], card="80gb")
    assert level_1["gpu_memory_utilization"] == asleep["gpu_memory_utilization"]


def test_sleep_level_0_that_leaves_vllm_too_little_beside_the_step_is_refused_naming_level_2():
    flags = ["--micro-batch-size", "20", "--max-prompt-len", "512"]  # the step: ~35.5 GiB of a 44.4 GiB GPU
    assert not plan(QWEN25_MATH_1_5B, flags, card="48gb")["short"]  # asleep, vLLM gets the room
    with pytest.raises(cli.UsageError) as refused:
        plan(QWEN25_MATH_1_5B, flags + AWAKE, card="48gb")
    line = str(refused.value)
    assert "\n" not in line and "vLLM would get 4.9 GiB beside the trainer's 35.5 GiB (its step" in line
    assert "--vllm-sleep-level 0 keeps vLLM awake through it" in line
    # a given share that fits beside the resident shards but not beside the step's peak
    util = ["--vllm-gpu-memory-utilization", "0.7"]
    assert not plan(QWEN25_MATH_1_5B, ONE_GPU + util, card="80gb")["short"]
    with pytest.raises(
        cli.UsageError,
        match=r"gives vLLM 55.4 GiB, which beside the trainer's 28.8 GiB \(its step"
        r".*--vllm-sleep-level 0 keeps vLLM awake.*needs 88.1 GiB, more than the GPU's 79.1",
    ):
        plan(QWEN25_MATH_1_5B, ONE_GPU + util + AWAKE, card="80gb")


# bench/memory.py's simulated peaks on the GPU (GiB; 2026-11-25, docs/memory.md; response 3000, prompt 512, d3s):
# the plan's estimate is at least the simulated figure and at most 12% above it.
# (preset, ranks, micro-batch, train_full flags) -> simulated peak
SIMULATED = {
    ("7b", 8, 1, ()): 19.80,
    ("7b", 8, 4, ()): 23.20,
    ("7b", 8, 8, ()): 27.63,
    ("7b", 8, 16, ()): 36.92,
    ("7b", 8, 4, ("--kl-ref",)): 24.97,
    ("1.5b", 1, 4, ()): 28.75,
    ("1.5b", 1, 12, ()): 30.44,
    ("1.5b", 1, 16, ()): 32.51,
    ("1.5b", 1, 96, ()): 74.80,
    ("1.5b", 1, 4, ("--cpu-offload",)): 4.50,
    ("1.5b", 1, 16, ("--cpu-offload",)): 9.51,
    ("1.5b", 1, 32, ("--cpu-offload",)): 17.95,
    ("7b", 1, 4, ("--cpu-offload",)): 9.14,
    ("7b", 1, 16, ("--cpu-offload",)): 22.30,
    ("7b", 1, 32, ("--cpu-offload",)): 40.90,
    ("7b", 1, 60, ("--cpu-offload",)): 73.97,
    ("1.5b", 1, 30, ()): 39.90,
}


@pytest.mark.parametrize("key", sorted(SIMULATED))
def test_the_plans_estimate_of_the_trainers_step_is_at_or_a_little_above_the_simulation(key):
    name, ranks, mb, flags = key
    args = train_full.parse_args(["--micro-batch-size", str(mb), "--max-prompt-len", "512", *flags])  # bench: 512
    estimate = gpu.trainer_peak_bytes(config(QWEN25_MATH_7B if name == "7b" else QWEN25_MATH_1_5B), args, ranks)
    assert SIMULATED[key] <= estimate / GIB <= 1.12 * SIMULATED[key]


# ---------------------------------------------------------------------------------------------
# The engine: a fake vLLM that records what VLLMEngine asks of it
# ---------------------------------------------------------------------------------------------
class FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, name, kwargs=None):
        self.calls.append(("rpc", name))
        list(kwargs["weights_iterator"]) if kwargs else None

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def fake_engine(monkeypatch, stub, free_gib, asleep):
    """A VLLMEngine on a 'GPU' with free_gib free, whose vLLM allocator holds `asleep` [(tag, GiB, is_asleep)]."""
    calls = []
    engine = object.__new__(engines.VLLMEngine)
    engine.cuda, engine.sleep_level, engine.sleeping, engine.llm = True, 2, False, FakeLLM(calls)
    allocations = [types.SimpleNamespace(tag=t, handle=(0, int(g * GIB)), is_asleep=a) for t, g, a in asleep]

    def sleep(level):  # vLLM's sleep: every allocation is released
        calls.append(("sleep", level))
        for a in allocations:
            a.is_asleep = True

    engine.llm.sleep = sleep
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_gib * GIB), 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 3 * GIB)
    stub(allocations)
    return engine, calls


@pytest.fixture
def vllm_stub(monkeypatch):
    """vllm.device_allocator.get_mem_allocator_instance over given allocations (vLLM is not in the main venv)."""
    import sys

    def install(allocations):
        allocator = types.ModuleType("vllm.device_allocator")
        allocator.get_mem_allocator_instance = lambda: types.SimpleNamespace(
            pointer_to_data={i: a for i, a in enumerate(allocations)}
        )
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
        monkeypatch.setitem(sys.modules, "vllm.device_allocator", allocator)

    return install


def test_the_first_weight_sync_puts_a_fresh_engine_to_sleep_and_wakes_the_weights_alone(monkeypatch, vllm_stub):
    """Finding 3: on --resume the first sync ran with vLLM fully awake beside AdamW's state. Now every sync
    starts asleep: weights woken alone, loaded, then the KV cache, then the prefix cache is reset."""
    engine, calls = fake_engine(
        monkeypatch, vllm_stub, 40, [("weights", 3, False), ("kv_cache", 20, False), ("runtime", 1, False)]
    )
    engine.update_weights(iter([("w", torch.zeros(1))]))
    assert calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert not engine.sleeping


def test_a_kv_cache_that_the_free_memory_cannot_hold_is_one_line_before_the_wake(monkeypatch, vllm_stub):
    engine, calls = fake_engine(monkeypatch, vllm_stub, 10, [("weights", 3, False), ("kv_cache", 20, False)])
    with pytest.raises(cli.UsageError) as short:
        engine.update_weights(iter([]))
    line = str(short.value)
    assert (
        line.startswith(
            "GPU memory: vLLM's kv cache need 20.00 GiB to wake, 10.00 GiB is free (the trainer holds "
            "3.00 GiB); lower --vllm-gpu-memory-utilization"
        )
        and "\n" not in line
    )
    assert ("wake_up", ["kv_cache"]) not in calls  # refused before vLLM would have run out of memory


def test_the_wake_check_counts_what_vllm_maps_back_whatever_the_tags():
    alloc = lambda tag, gib, asleep=True: types.SimpleNamespace(tag=tag, handle=(0, gib * GIB), is_asleep=asleep)
    pool = [
        alloc("weights", 3),
        alloc("kv_cache", 20),
        alloc("runtime", 1),
        alloc("cudagraph", 1),
        alloc("kv_cache", 5, False),
    ]
    assert engines.wake_shortfall(5 * GIB, pool, ["weights"]) is None  # weights + runtime + CUDA graphs: 5 GiB
    assert "need 5.00 GiB to wake, 4.99 GiB" in engines.wake_shortfall(5 * GIB - 2**23, pool, ["weights"])
    assert engines.wake_shortfall(25 * GIB, pool, None) is None and engines.wake_shortfall(24 * GIB, pool, None)


def test_an_export_runs_with_vllm_asleep_and_the_policy_is_synced_back_after(monkeypatch, vllm_stub):
    """Issue 37, finding 3: export_hf gathers each parameter in fp32 on the GPU; right after a weight sync vLLM was
    awake beside it (weights + KV cache). engines.export_asleep, with the real VLLMEngine's sleep and
    update_weights over a fake vLLM: sleep, then the export, then (level 2 dropped the weights) a sync."""
    engine, calls = fake_engine(monkeypatch, vllm_stub, 40, [("weights", 3, False), ("kv_cache", 20, False)])
    model, args = torch.nn.Linear(2, 2), types.SimpleNamespace(dtype="bfloat16")
    path = engines.export_asleep(engine, model, args, lambda: calls.append(("export",)) or "runs/x/hf_final")
    assert path == "runs/x/hf_final"
    assert calls == [
        ("sleep", 2),
        ("export",),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert not engine.sleeping  # ready to generate the evaluation that follows, with the policy's weights
    calls.clear()  # already asleep (an export between the step and its sync): the caller's sync follows
    engine.sleep()
    engines.export_asleep(engine, model, args, lambda: calls.append(("export",)))
    assert calls == [("sleep", 2), ("export",)] and engine.sleeping


def test_an_export_with_hf_rollouts_moves_the_engines_copy_off_the_gpu_first(monkeypatch):
    """The same call with the real HFEngine's sleep (--rollout hf on a GPU: its plain copy goes to host memory)."""
    engine = object.__new__(engines.HFEngine)
    moved = []
    engine.device, engine.offloaded = torch.device("cuda", 0), False
    engine.model = types.SimpleNamespace(to=lambda device: moved.append(str(device)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []
    engines.export_asleep(engine, None, types.SimpleNamespace(dtype="bfloat16"), lambda: seen.append(moved[:]))
    assert seen == [["cpu"]] and engine.offloaded  # off the GPU before the export; generate() moves it back


# ---------------------------------------------------------------------------------------------
# The untied head on an empty micro-batch; the CUDA diagnosis; the labels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_a_micro_batch_without_a_selected_token_still_gives_every_parameter_a_zero_gradient(tied):
    """Finding 2: an untied lm_head without a gradient on one rank makes its reduce-scatter differ from the
    others' (a hang or wrong gradients) unless torch >= 2.13's switch is on. The zero loss of an empty
    selection (and of a DUMMY micro-batch: loss_head.idle_loss) now uses lm_head at weight 0."""
    from support import tiny

    model = tiny.build_tiny_model(tiny.build_char_tokenizer(), tie_word_embeddings=tied).train()
    inputs, targets, _ = loss_head.pack([{"prompt_ids": [5, 6], "response_ids": [7, 8]}], [0], 0, torch.device("cpu"))
    logp = loss_head.response_logp_at(model, inputs, targets, torch.zeros_like(targets, dtype=torch.bool), 1.0)
    logp.sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and not param.grad.any(), name
    assert model.lm_head.weight.grad is not None


def test_a_torch_that_sees_no_gpu_is_told_its_cuda_build_and_the_drivers_version_in_one_line():
    """Issue 53: the diagnosis is one line with torch.version.cuda and the driver's version (nvidia-smi's)."""
    line = gpu.cuda_diagnosis(("13.0", "550.54.15"))
    assert line == "torch.version.cuda 13.0 (None: a CPU-only torch), NVIDIA driver 550.54.15"
    assert gpu.cuda_diagnosis((None, None)) == (
        "torch.version.cuda None (None: a CPU-only torch), NVIDIA driver not found (no nvidia-smi)"
    )
    here = gpu.cuda_diagnosis()  # this machine's: its torch's build, and nvidia-smi's answer or none
    assert "\n" not in here and here.startswith(f"torch.version.cuda {torch.version.cuda} ")


def test_clip_high_0_28_is_labelled_dapos_clip_higher_not_the_recipes():
    """Finding 7: SimpleRL-Zoo, Dr. GRPO and verl clip at 0.2 / 0.2; 0.28 is DAPO's clip-higher."""
    helps = {a.dest: a.help for a in train_full.build_parser()._actions}
    assert helps["clip_high"].startswith("[choice]") and "DAPO" in helps["clip_high"]
    assert helps["clip_low"].startswith("[recipe]") and helps["cpu_offload"].startswith("[choice]")
    assert train_full.parse_args([]).clip_high == 0.28


def test_gpu_check_on_a_machine_without_a_gpu_says_why_in_its_one_log(tmp_path):
    """scripts/gpu_check.sh stops at its step 0 with the diagnosis (here: a CPU-only torch), exit 2, in the one log
    a user sends back."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "check"), "CUDA_VISIBLE_DEVICES": ""},
    )
    log = (tmp_path / "check" / "gpu_check.log").read_text()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== 0/5 the machine" in log and f"torch {torch.__version__}" in log
    assert f"gpu_check: torch sees no CUDA device: torch.version.cuda {torch.version.cuda} " in log
