"""Issue 47: figures a GPU run can trust, and the stock GPU image (torch 2.11, no vLLM, no math-verify), tested as far
as a CPU shows them.

- bench_memory().fsdp_param_groups reads FSDP2's state on torch 2.11 (one group or None) and 2.13 (a list), and raises on a
  torch with neither (tests/full_fsdp_worker.py and bench/memory.py read it through this helper).
- scripts/gpu_check.sh without math-verify: one line naming it and how to install it, exit 2, before the warm start.
"""

import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from support import gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# FSDP2's param groups on torch 2.11 and 2.13
# ---------------------------------------------------------------------------------------------
class Module:
    def __init__(self, state):
        self.state = state

    def _get_fsdp_state(self):
        return self.state


def bench_memory():
    """bench/memory.py as a module (a script: loaded from its file), for its fsdp_param_groups."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_memory", pathlib.Path(__file__).parent.parent / "bench/memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdp_param_groups_reads_torch_2_13s_list_and_2_11s_single_group():
    a, b = object(), object()
    assert bench_memory().fsdp_param_groups(Module(types.SimpleNamespace(_fsdp_param_groups=[a, b]))) == [a, b]  # 2.13
    assert bench_memory().fsdp_param_groups(Module(types.SimpleNamespace(_fsdp_param_group=a))) == [a]  # 2.11
    assert (
        bench_memory().fsdp_param_groups(Module(types.SimpleNamespace(_fsdp_param_group=None))) == []
    )  # 2.11, no params
    assert (
        bench_memory().fsdp_param_groups(Module(None)) == []
        and bench_memory().fsdp_param_groups(torch.nn.Linear(2, 2)) == []
    )
    with pytest.raises(AttributeError):  # a torch that moved it again: an error, not a module holding nothing
        bench_memory().fsdp_param_groups(Module(types.SimpleNamespace()))


def test_fsdp_param_groups_on_this_torchs_fully_shard_model():
    """A real fully_shard model on one gloo rank (this torch, 2.13): every parameter is in one of the groups."""
    code = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import importlib.util
spec = importlib.util.spec_from_file_location("bench_memory", "bench/memory.py")
memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(memory)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model[0]); fully_shard(model)
groups = [g for m in model.modules() for g in memory.fsdp_param_groups(m)]
print(len(groups), sum(len(g.fsdp_params) for g in groups))
dist.destroy_process_group()
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PORT": str(port)},
    )
    assert run.stdout.split() == ["2", "4"], run.stdout + run.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# gpu_check.sh on an image without math-verify
# ---------------------------------------------------------------------------------------------
def test_gpu_check_without_math_verify_stops_in_one_line_before_the_warm_start(tmp_path):
    """A python whose `import math_verify` fails (a module of that name on PYTHONPATH that raises ImportError): the
    first step ends with one line naming math-verify and how to install it, exit 2; no warm start, no run."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "math_verify.py").write_text('raise ImportError("no math_verify on this image (a test)")\n')
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(fake),
        "OUT": str(tmp_path / "check"),
        "GPU_CHECK_ONLY": "learn",
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_LEARN_SIZE": "tiny",
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr  # the script tees both into its log
    lines = [line for line in out.splitlines() if "math-verify" in line]
    assert len(lines) == 1 and lines[0].startswith("gpu_check.sh: error: math-verify is not importable"), out
    assert "pip install math-verify==0.9.0" in lines[0] and "--find-links" in lines[0]  # online, and the wheels
    assert out.rstrip().splitlines()[-1] == lines[0]  # the last line: nothing after it
    assert "warm start" not in out and "== 5/5" not in out and not (tmp_path / "check" / "learn").exists()
    assert "math-verify is not importable" in (tmp_path / "check" / "gpu_check.log").read_text()


# ---------------------------------------------------------------------------------------------
# W2: MFU charges the LM head where it runs; W3: sync_s is the slowest rank's
# ---------------------------------------------------------------------------------------------
def test_update_flops_charges_the_decoder_at_every_token_and_the_head_where_the_loss_head_runs_it():

    n, head = 1000, 100  # parameters less the input embedding; of them the LM head's
    stats = {"pass1_tokens": 50, "train_tokens": 40, "kept_tokens": 5}  # 30 response tokens in pass 1
    body = (2 * 50 + 6 * 40) * (n - head)  # decoder: every token forwarded, prompts included
    assert gpu.update_flops(stats, 30, n, head) == body + (2 * 30 + 6 * 5) * head
    old = (2 * 50 + 6 * 40) * n  # the count before issue 47: the head at every token
    assert gpu.update_flops(stats, 30, n, head) < old
    assert gpu.update_flops(stats, 30, n, 0) == old  # no head to spare: the same as before
    # a method without token selection runs the head at every response token in pass 2: only the prompts are spared
    grpo = {**stats, "kept_tokens": 30}
    assert old - gpu.update_flops(grpo, 30, n, head) == 6 * (40 - 30) * head + 2 * (50 - 30) * head


def test_head_params_are_the_vocabulary_times_hidden_tied_or_not():
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    for tied in (True, False):
        model = tiny.build_tiny_model(tokenizer, tie_word_embeddings=tied)
        assert gpu.head_params(model) == model.config.vocab_size * model.config.hidden_size
        assert gpu.head_params(model) < gpu.flop_params(model)


def test_train_record_takes_the_slowest_ranks_sync_and_the_new_mfu(monkeypatch):
    """Two ranks stood in for by all_reduce: the other rank's numbers are 3x this one's (MAX) and the sums double."""

    seen = []

    def fake_all_reduce(value, world, op=None):
        seen.append(op)
        return 3 * float(value) if op == gpu.dist.ReduceOp.MAX else 2 * float(value)

    monkeypatch.setattr(gpu, "all_reduce", fake_all_reduce)
    world = types.SimpleNamespace(size=2, device=torch.device("cpu"))
    args = types.SimpleNamespace(prompts_per_step=2, group_size=2)
    phases = dict(
        gen_s=1.0, reward_s=0.5, pass1_s=0.25, sync_s=0.125, grader_timeouts=0, gpu_used_gen=0, gpu_used_train=0
    )
    phases["pass1_head_tokens"] = 30  # the response tokens of the no-grad forwards, all ranks
    stats = {"pass1_tokens": 50, "train_tokens": 40, "kept_tokens": 5, "train_s": 2.0}
    rollouts = [[{"response_ids": [1, 2, 3]}] * 2] * 2
    line = gpu.train_record(1, stats, rollouts, phases, args, world, flops=(1000, 100, 1e6))
    assert line["sync_s"] == 3 * 0.125 and line["gen_s"] == 3.0 and line["pass1_s"] == 0.75
    assert line["mfu"] == gpu.update_flops(stats, 30, 1000, 100) / (2.0 * 2 * 1e6)
    assert gpu.train_record(1, stats, rollouts, phases, args, world, flops=(1000, 100, None))["mfu"] is None


# ---------------------------------------------------------------------------------------------
# W1: the trainer's peak and bytes leave out what torch counts inside vLLM's sleep-mode pools
# ---------------------------------------------------------------------------------------------
GIB = 2**30


class Pool:
    """A stand-in for torch.cuda.MemPool: snapshot() gives its segments, with the bytes torch counts as allocated."""

    def __init__(self, *allocated):
        self.allocated = allocated

    def snapshot(self):
        return [{"allocated_size": n, "total_size": 2 * n, "blocks": []} for n in self.allocated]


def allocator(pointer_to_data=()):
    """A stand-in for vLLM's CuMemAllocator: its pools by tag (entries (MemPool, allocator)) and its allocations."""
    pools = {"weights": [(Pool(1 * GIB, GIB // 2), None)], "kv_cache": [(Pool(20 * GIB), None), (Pool(GIB), None)]}
    return types.SimpleNamespace(allocator_and_pools=pools, pointer_to_data=dict(enumerate(pointer_to_data)))


def test_vllm_pool_bytes_sums_what_torch_counts_as_allocated_in_every_pool_of_every_tag(monkeypatch):
    assert gpu.vllm_pool_bytes(allocator()) == int(22.5 * GIB)
    assert gpu.vllm_pool_bytes(types.SimpleNamespace(allocator_and_pools={})) == 0
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem", raising=False)
    assert gpu.vllm_pool_bytes() == 0  # vLLM never imported (HF rollouts): nothing to leave out
    cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=None))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    assert gpu.vllm_pool_bytes() == 0  # imported, no sleep mode: no allocator made
    cumem.CuMemAllocator.instance = allocator()
    assert gpu.vllm_pool_bytes() == int(22.5 * GIB)


def test_the_trainers_peak_on_cuda_is_torchs_peak_less_vllms_pools(monkeypatch):
    """vLLM asleep, the peak reset after its sleep (train_full's loop): torch's peak still holds the 22.5 GiB of
    vLLM's pools, and memory_peak_gb gives the trainer's 7.5."""
    cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=allocator()))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 30 * GIB)
    assert gpu.memory_peak_gb(torch.device("cuda", 0)) == 7.5
    assert gpu.memory_peak_gb(torch.device("cuda", 0), pool_bytes=0) == 30.0
    assert gpu.memory_peak_gb(torch.device("cpu")) > 0  # the CPU's RSS, as before


def test_the_peak_is_reset_after_the_engine_sleeps_in_train_fulls_loop():
    source = (ROOT / "train_full.py").read_text()
    sleep = source.index("engine.sleep()  # free vLLM's GPU memory for training")
    assert source.index("clock(device, reset_peak=True)") > sleep and source.count("reset_peak=True") == 1


def test_the_wake_check_names_the_trainers_own_bytes_not_vllms_pools(monkeypatch):
    from support import cli, engines

    asleep = [types.SimpleNamespace(tag="kv_cache", handle=(0, 21 * GIB), is_asleep=True)]
    module = types.ModuleType("vllm.device_allocator")
    module.get_mem_allocator_instance = lambda: allocator(asleep)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", module)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: int(25.5 * GIB))  # 3 of them the trainer's
    engine = object.__new__(engines.VLLMEngine)
    with pytest.raises(cli.UsageError, match=r"need 21\.00 GiB to wake, 10\.00 GiB is free \(the trainer holds 3\.00"):
        engine._wake(["kv_cache"])


# ---------------------------------------------------------------------------------------------
# S1: the plan gives vLLM no more KV cache than the run can use
# ---------------------------------------------------------------------------------------------
def plan_of(shapes, flags, ranks=1, card_gib=79.1):
    import train_full
    from transformers import Qwen2Config

    return gpu.vllm_memory_plan(Qwen2Config(**shapes), train_full.parse_args(flags), ranks, card_gib * GIB)


LEARN = dict(  # scripts/gpu_check.sh's learning stage: the 47M Qwen2 with a character tokenizer
    vocab_size=259, hidden_size=640, intermediate_size=1920, num_hidden_layers=10, num_attention_heads=10,
    num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
)  # fmt: skip
LEARN_FLAGS = ["--prompts-per-step", "32", "--group-size", "8", "--n-init", "4", "--n-final", "8"]
LEARN_FLAGS += ["--max-prompt-len", "96", "--max-response-len", "64", "--eval-max-tokens", "64"]
LEARN_FLAGS += ["--eval-samples", "4", "--eval-pass-k", "1,4", "--micro-batch-size", "16"]
Q15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
Q7B = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=4096,
)  # fmt: skip


@pytest.mark.parametrize("card_gib", [79.1, 139.8])  # H100 80GB, H200
def test_the_learning_stage_gets_the_kv_cache_of_its_256_rollouts_not_the_whole_card(card_gib):
    plan = plan_of(LEARN, LEARN_FLAGS, card_gib=card_gib)
    assert plan["kv_bytes_per_token"] == 2 * 10 * 2 * 64 * 2 == 5120
    need = 32 * 8 * (96 + 64) * 5120  # 256 rollouts at once, 160 tokens each: 0.20 GiB
    assert plan["kv_cache_gib"] * GIB == pytest.approx(gpu.KV_HEADROOM * need, rel=1e-3)
    workspace = plan["vllm_workspace_gib"]  # issue 57: by the model (0.74 GiB on a GPU of 70 GiB or more), not 3.0
    assert plan["vllm_share_gib"] == pytest.approx(plan["vllm_weights_gib"] + workspace + plan["kv_cache_gib"])
    assert plan["gpu_memory_utilization"] < 0.05 and 256 <= plan["max_num_seqs"] <= gpu.KV_HEADROOM * 256  # not 0.943
    raised = plan_of(LEARN, LEARN_FLAGS + ["--vllm-gpu-memory-utilization", "0.5"], card_gib=card_gib)
    assert raised["vllm_share_gib"] == pytest.approx(0.5 * card_gib) and raised["kv_cache_gib"] > 30  # the flag


def test_the_1_5b_and_7b_kv_cache_is_the_runs_where_it_is_less_than_the_room_and_the_room_where_it_is_not():
    one_gpu = ["--micro-batch-size", "4", "--max-prompt-len", "512"]
    full = plan_of(Q15B, one_gpu)  # 1024 rollouts of 3512 tokens a step: 192 GiB wanted, the room is less
    assert full["vllm_share_gib"] == pytest.approx(79.1 - 17.25 - gpu.MARGIN_GIB, abs=0.01)
    check = plan_of(Q15B, ["--prompts-per-step", "1", "--group-size", "32", "--max-prompt-len", "64"]
                    + ["--max-response-len", "1024", "--eval-max-tokens", "1024", "--micro-batch-size", "16"])  # fmt: skip
    per_token = 2 * 28 * 2 * 128 * 2
    assert check["kv_cache_gib"] * GIB == pytest.approx(gpu.KV_HEADROOM * 32 * 1088 * per_token, rel=1e-3)  # 3.7 GiB
    eight = plan_of(Q7B, [], ranks=8)  # 128 rollouts of 4024 tokens a rank: 55 GiB wanted, 47.3 of room
    assert eight["vllm_share_gib"] == pytest.approx(79.1 - eight["vllm_beside_gib"] - gpu.MARGIN_GIB, abs=1e-3)
    assert eight["kv_cache_gib"] == pytest.approx(47.34, abs=0.01)  # its workspace by the model: 2.94 GiB, not 3
    small = plan_of(Q7B, ["--prompts-per-step", "8"], ranks=8)  # 32 rollouts a rank: sized by the run
    assert small["kv_cache_gib"] * GIB == pytest.approx(gpu.KV_HEADROOM * 32 * 4024 * 2 * 28 * 4 * 128 * 2, rel=1e-3)
    for plan in (full, check, eight, small):  # within the card, beside what the trainer holds and the margin
        assert plan["vllm_share_gib"] + plan["vllm_beside_gib"] + gpu.MARGIN_GIB <= 79.1 + 1e-6


# ---------------------------------------------------------------------------------------------
# Issue 57, item 2: the peak table knows every Hopper and Blackwell form by the name torch gives it
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),  # SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),  # SXM
        ("NVIDIA H200 NVL", 835),  # was 989: MFU 16% low
        ("NVIDIA H800", 989),  # SXM
        ("NVIDIA H800 PCIe", 756),  # was 989: MFU 24% low
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA H20", 148),
        ("NVIDIA B200", 2250),
        ("NVIDIA GB200", 2500),
        ("NVIDIA B100", 1750),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA A800-SXM4-80GB", 312),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", None),  # no figure: MFU None, not a wrong one
        ("NVIDIA B300 SXM6 AC", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_peak_of_each_card_is_its_own_forms_not_a_prefixs(name, tflops):
    assert gpu.peak_by_name(name) == (tflops * 1e12 if tflops else None)
    assert gpu.peak_flops(torch.device("cpu"), 500) == 500e12 and gpu.peak_flops(torch.device("cpu"), None) is None


# ---------------------------------------------------------------------------------------------
# Issue 57, item 3: vLLM's workspace by the model, so that the plan's KV line is the one vLLM prints
# ---------------------------------------------------------------------------------------------
def test_vllms_workspace_is_its_profile_run_sampler_and_graphs_by_the_model():
    """gpu.vllm_workspace_bytes, the derivation in its docstring (vLLM 0.32's determine_available_memory): on an
    80 GB card a profile forward of 16384 tokens at 2 B x 3 x (hidden + intermediate) a token, 3 fp32 copies of
    [max_num_seqs, vocab] logits, and VLLM_GRAPHS_GIB. Before issue 57 every model got 3 GiB: the learning stage's
    vLLM kept ~2.3 GiB more KV cache than the plan's line said."""
    from transformers import Qwen2Config

    graphs = gpu.VLLM_GRAPHS_GIB * GIB
    learn = gpu.vllm_workspace_bytes(Qwen2Config(**LEARN), 79.1 * GIB, 512)
    assert learn == 16384 * 2 * 3 * (640 + 1920) + 3 * 4 * 512 * 259 + graphs
    assert learn / GIB == pytest.approx(0.736, abs=1e-3)
    q15 = gpu.vllm_workspace_bytes(Qwen2Config(**Q15B), 79.1 * GIB, 64)
    assert q15 == 16384 * 2 * 3 * (1536 + 8960) + 3 * 4 * 64 * 151936 + graphs
    assert q15 / GIB == pytest.approx(1.570, abs=1e-3)
    assert gpu.vllm_workspace_bytes(Qwen2Config(**Q15B), 44.4 * GIB, 64) < q15  # 8192 tokens under 70 GiB


@pytest.mark.parametrize(
    "shapes, flags, kv_gib",
    [
        (LEARN, LEARN_FLAGS, 0.391),  # the learning stage: docs/gpu_check.md said 0.39 where vLLM kept ~2.5
        (Q15B, CHECK_1_5B := ["--prompts-per-step", "1", "--group-size", "32", "--max-prompt-len", "64"]
         + ["--max-response-len", "1024", "--eval-max-tokens", "1024", "--micro-batch-size", "16"], 1.859),  # step 1
    ],
)  # fmt: skip
def test_the_plans_kv_line_is_what_vllm_computes_from_the_plans_utilization(shapes, flags, kv_gib):
    """vLLM's "Available KV cache memory" is ceil(GPU x gpu_memory_utilization) less its weights and what it keeps
    (v1/worker/gpu_worker.py:740-744): from the plan's unrounded utilization and its workspace, the plan's KV line."""
    plan = plan_of(shapes, flags)
    requested = math.ceil(79.1 * GIB * plan["gpu_memory_utilization"])  # v1/worker/utils.py:724
    vllm_kv = requested - (plan["vllm_weights_gib"] + plan["vllm_workspace_gib"]) * GIB
    assert vllm_kv / GIB == pytest.approx(plan["kv_cache_gib"], rel=1e-6) and plan["kv_cache_gib"] == pytest.approx(
        kv_gib, abs=1e-3
    )
