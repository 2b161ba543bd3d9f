"""fsdp_vllm.py: the plumbing of train_full.py: what runs the method, not the method.

train_full.py keeps what a reader of the method needs (arguments, prompt order and seeds, the
loss head, the step, evaluation, the run). This module holds the rest, in five parts:

  1 process group     Dist, init_distributed (torchrun, or a world of one), collectives that
                      gather rows of different counts per rank, all_reduce of a number
  2 policy            the tokenizer and generation config, the HF model as FSDP2 shards (fp32
                      master weights, bf16 compute, fp32 reductions, activation checkpointing,
                      the tiled MLP), AdamW, full tensors one at a time for the weight sync
  3 rollout engines   VLLMEngine (colocated vLLM, sleep mode, reload_weights) and its memory
                      plan; HFEngine (transformers' generate), the same interface
  4 checkpoints       sharded (torch.distributed.checkpoint) for resume, written atomically;
                      HF export (save_pretrained) for transformers and vLLM
  5 clocks, memory    timers that wait for the GPU, peak memory, MFU's peak FLOP/s
  6 run files         metrics.jsonl (and its truncation on resume), the evaluation report,
                      the few rollouts an explain page shows, gathered on rank 0
"""

import datetime
import functools
import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist

import d3s
import explain


# ---------------------------------------------------------------------------------------------
# 1. Process group: one process per GPU (torchrun); device from LOCAL_RANK, data from RANK
# ---------------------------------------------------------------------------------------------
class Dist:
    """rank, world (all nodes), local_rank, device: where this process trains and generates."""

    def __init__(self, rank, world, local_rank, device):
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device
        self.is_main = rank == 0


def init_distributed(device_type):
    """Join the torchrun process group (or make a world of one): nccl on CUDA, gloo on CPU.

    vLLM's external_launcher reads the same RANK / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, so a
    plain `python train_full.py` sets them for a world of one.
    """
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=60),
                                device_id=device if device_type == "cuda" else None)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def gather_rows(local, dist_):
    """Concatenate a [rows, ...] tensor over all ranks in rank order; rows may differ per rank.

    Returns (global tensor on CPU, rows per rank). Pads to the largest rank for all_gather.
    """
    dtype = local.dtype
    send = local.to(dist_.device, torch.uint8 if dtype == torch.bool else dtype)
    rows = torch.tensor([send.shape[0]], device=dist_.device)
    all_rows = [torch.zeros_like(rows) for _ in range(dist_.world)]
    dist.all_gather(all_rows, rows)
    counts = [int(r) for r in all_rows]
    padded = send.new_zeros((max(counts), *send.shape[1:]))
    padded[: send.shape[0]] = send
    parts = [torch.empty_like(padded) for _ in range(dist_.world)]
    dist.all_gather(parts, padded)
    out = torch.cat([part[:n] for part, n in zip(parts, counts)]).cpu()
    return (out.bool() if dtype == torch.bool else out), counts


def all_reduce(value, dist_, op=dist.ReduceOp.SUM):
    """A Python number summed (or max'ed) over all ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=dist_.device)
    dist.all_reduce(t, op=op)
    return t.item()


def gather_global(local, mine, total, dist_):
    """The [rows, ...] tensors of all ranks as one [total, ...] tensor in GLOBAL order (CPU):
    row r of this rank is global row mine[r]. Every rank gets the same tensor."""
    gathered, _ = gather_rows(local, dist_)
    where, _ = gather_rows(torch.tensor(mine, dtype=torch.long).view(-1, 1), dist_)
    out = torch.empty((total, *gathered.shape[1:]), dtype=gathered.dtype)
    out[where.view(-1)] = gathered
    return out


# ---------------------------------------------------------------------------------------------
# 2. Policy: HF model -> FSDP2 (fully_shard per decoder layer and the untied embedding, then the root)
# ---------------------------------------------------------------------------------------------
def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_generation_config(path):
    """The model's generation_config.json (its EOS ids feed mathtask.stop_token_ids), or None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # the folder (or hub repo) has none
        return None


def load_policy(args, dist_, reference=False):
    """The trainable policy: fp32 master weights sharded with FSDP2, compute in args.dtype.

    reference=True: the same model, frozen, stored in args.dtype (bf16 on GPU: 2 bytes per
    parameter, sharded), for the KL of --kl-ref.
    Memory: rank 0 reads the checkpoint on CPU, every other rank builds the model on the meta
    device; after fully_shard the full weights are broadcast from rank 0 and each rank keeps
    only its shard, so a 7B model never sits 8 times in host memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    storage = getattr(torch, args.dtype) if reference else torch.float32
    config = AutoConfig.from_pretrained(args.model)
    full_state = None
    if dist_.is_main:
        full_state = AutoModelForCausalLM.from_pretrained(args.model, dtype=storage).state_dict()
    checkpoint_dtype = config.dtype  # e.g. bfloat16: what export_hf writes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=storage)
    model.config.dtype, model.config.use_cache = checkpoint_dtype, False
    shard_policy(model, args)
    model.to_empty(device=dist_.device)
    set_model_state_dict(model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _init_rotary_buffers(model, dist_.device)  # non-persistent: not in the checkpoint, garbage after to_empty
    if reference:
        return model.eval().requires_grad_(False)
    model.train()
    return model


def shard_policy(model, args, mesh=None):
    """FSDP2 in place: activation checkpointing, tiled MLPs, fully_shard per decoder layer and the
    untied embedding, then the root.

    fp32 master weights, compute in args.dtype, fp32 gradient reduction; gradients are SUMMED
    over ranks (the loss already divides by the global token count). bench/memory.py calls
    this too, so the memory plan simulates the very wrapping that trains.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mlp_chunk_tokens:
        chunk_mlps(model, args.mlp_chunk_tokens)
    compute = getattr(torch, args.dtype)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)  # fp32 master weights + reductions
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if not model.config.tie_word_embeddings:  # an untied embedding (the 7B) is needed in forward only: 1 GiB freed after it
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
    # root (final norm, lm_head; the tied embedding): stays gathered after forward for the loss head, which calls
    # lm_head block by block; backward starts there
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # an FSDPModule
            module.set_gradient_divide_factor(1.0)  # SUM over ranks: the loss already divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
            # a rank whose micro-batch has no selected token gives an untied lm_head no gradient: reduce-scatter
            # zeros for it, so that every rank runs the same collectives (torch >= 2.13, requirements.txt's pin;
            # older torch lacks the switch, and only an untied model on several ranks needs it)
            if hasattr(module, "set_reduce_scatter_unused_params"):
                module.set_reduce_scatter_unused_params(True)
    return model


def chunk_mlps(model, chunk_tokens):
    """Tiled MLP: each decoder layer's MLP runs over slices of about chunk_tokens tokens along
    the sequence, and with grad each slice is checkpointed (recomputed in backward). The
    [n, L, intermediate] activations of the MLP (gate, up, their product: 5.3x the hidden size
    for Qwen2.5) then exist for one slice at a time, in forward and in backward. Per-token,
    so the output is the same as the whole MLP's.
    """
    from torch.utils.checkpoint import checkpoint

    def tiled(whole, x):  # x [n, L, H]
        width = max(1, chunk_tokens // x.shape[0])  # positions per slice
        if x.shape[1] <= width:
            return whole(x)
        run = (lambda part: checkpoint(whole, part, use_reentrant=False)) if torch.is_grad_enabled() else whole
        return torch.cat([run(part) for part in x.split(width, dim=1)], dim=1)

    for layer in model.model.layers:
        layer.mlp.forward = functools.partial(tiled, layer.mlp.forward)


@torch.no_grad()
def _init_rotary_buffers(model, device):
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf.to(device))


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))


def full_named_tensors(model, dtype):
    """(name, full tensor) one parameter at a time, gathered from the FSDP shards (all ranks call it)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, tensor.detach().to(dtype)


# ---------------------------------------------------------------------------------------------
# 3. Rollout engines: vLLM (colocated, one per rank) or HF generate; same interface
# ---------------------------------------------------------------------------------------------
def context_length(model_path, args):
    """Prompt + response tokens one sequence may hold: the model's context window, capped at
    max(prompt + response budget, 4096) so a long-context model does not reserve a huge sequence."""
    from transformers import AutoConfig

    window = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 10**9
    return min(window, max(args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens), 4096))


def vllm_memory_plan(config, args, ranks, gpu_bytes, kv_ref=False):
    """gpu_memory_utilization and max_num_seqs of the colocated vLLM engine on one GPU.

    While vLLM generates, the trainer keeps its shards on the same GPU: fp32 weights and
    AdamW's two moments, 12 bytes x parameters / ranks (gradients are freed after each step;
    bench/memory.py checks these bytes), plus 2 bytes x parameters / ranks for --kl-ref's bf16
    reference. vLLM may take the rest, less MARGIN_GIB for the CUDA context, NCCL buffers and
    fragmentation. Inside vLLM's share its bf16 weights take 2 bytes x parameters and its
    forward's workspace about VLLM_WORKSPACE_GIB; the KV cache gets the rest, 2 (K and V) x
    layers x KV heads x head dim x 2 bytes per token. max_num_seqs is the number of sequences
    whose KV cache fits at full length (prompt + response), so vLLM need not preempt (clamped
    to 16 .. 1024). Returns a dict with the numbers (printed at start).
    """
    params = sum(p.numel() for p in _meta_model(config).parameters())
    gib = 2**30
    trainer = (12 + (2 if kv_ref else 0)) * params / ranks
    share = max(gpu_bytes - trainer - MARGIN_GIB * gib, 0.0)
    utilization = min(max(share / gpu_bytes, 0.05), 0.95)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    kv_bytes = utilization * gpu_bytes - 2 * params - VLLM_WORKSPACE_GIB * gib
    full_length = args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens)
    max_num_seqs = int(min(1024, max(16, kv_bytes // (kv_per_token * full_length))))
    return {"params": params, "trainer_resident_gib": trainer / gib, "gpu_gib": gpu_bytes / gib,
            "gpu_memory_utilization": round(utilization, 3), "kv_cache_gib": kv_bytes / gib,
            "kv_bytes_per_token": kv_per_token, "max_num_seqs": max_num_seqs}


MARGIN_GIB, VLLM_WORKSPACE_GIB = 4.0, 3.0  # CUDA context + NCCL + fragmentation; vLLM's forward workspace


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


class VLLMEngine:
    """A vLLM engine inside this trainer process, on this rank's GPU (external_launcher, TP=1).

    generate() runs this rank's prompts; sleep() frees its GPU memory for training;
    update_weights() streams the new weights in through vLLM 0.32's reload_weights (in place,
    checkpoint format) and resets the prefix cache, whose KV entries belong to the old weights.
    """

    def __init__(self, model_path, args, dist_):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        from vllm import LLM

        self.cuda = cuda = dist_.device.type == "cuda"
        self.sleep_level = args.vllm_sleep_level if cuda else 0  # vLLM has no sleep mode on CPU
        extra = {} if cuda else {"kv_cache_memory_bytes": int(args.vllm_kv_cache_gb * 2**30)}
        utilization, max_num_seqs = args.vllm_gpu_memory_utilization or 0.5, args.vllm_max_num_seqs or 256
        if cuda:
            from transformers import AutoConfig

            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the free memory
            plan = vllm_memory_plan(AutoConfig.from_pretrained(model_path), args, dist_.world,
                                    torch.cuda.get_device_properties(dist_.device).total_memory, kv_ref=args.kl_ref)
            utilization = args.vllm_gpu_memory_utilization or plan["gpu_memory_utilization"]
            max_num_seqs = args.vllm_max_num_seqs or plan["max_num_seqs"]
            if dist_.is_main:
                print(f"vLLM memory plan: trainer shards {plan['trainer_resident_gib']:.1f} GiB of {plan['gpu_gib']:.0f}, "
                      f"gpu_memory_utilization {utilization}, KV cache ~{plan['kv_cache_gib']:.1f} GiB, "
                      f"max_num_seqs {max_num_seqs}", flush=True)
        # per-request seeds (the default) fix every sample; with --unseeded-sampling the engine's own
        # seed draws them, so each rank gets its own (seed + rank) instead of 8 copies of one stream
        engine_seed = args.seed + (dist_.rank if args.unseeded_sampling else 0)
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=args.dtype, seed=engine_seed, generation_config="vllm",
                       distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                       max_model_len=context_length(model_path, args),
                       gpu_memory_utilization=utilization, enable_sleep_mode=self.sleep_level > 0,
                       enable_prefix_caching=True, enforce_eager=args.vllm_enforce_eager or not cuda,
                       max_num_seqs=max_num_seqs, **extra)
        self.max_model_len = self.llm.llm_engine.vllm_config.model_config.max_model_len
        self.sleeping = False

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
        """prompts: list of token-id lists -> per prompt, n dicts {token_ids, logprobs}."""
        from vllm import SamplingParams

        self.wake_up()
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_ids,
                                 max_tokens=max(1, min(max_tokens, self.max_model_len - len(ids))), detokenize=False,
                                 logprobs=0 if logprobs else None)
                  for ids, seed in zip(prompts, seeds)]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids),
                  "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs] if logprobs else None}
                 for c in out.outputs] for out in outs]

    def sleep(self):
        if self.sleep_level > 0 and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self):
        if self.sleeping:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.sleeping = False

    def update_weights(self, named_tensors):
        if self.sleeping:
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver for vLLM
            self.llm.wake_up(tags=["weights"])  # weights first: the KV cache is not needed to load them
        stream = _Drain(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        stream.drain()  # every rank must gather every tensor, even ones vLLM skipped
        if not self.cuda:
            self.llm.collective_rpc(_repack_tied_lm_head)
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down (it also tears down the process group: call last)."""
        self.llm.llm_engine.engine_core.shutdown()


def _repack_tied_lm_head(worker):
    """vLLM on CPU packs lm_head's weight into its GEMM kernel at load time. With tied embeddings
    reload_weights refreshes only the embedding (lm_head.* is skipped), so the packed copy would
    keep the old weights: pack it again. (On GPU lm_head reads the shared weight directly.)"""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class _Drain:
    """An iterator that can be run to its end afterwards (keeps FSDP all-gathers matched across ranks)."""

    def __init__(self, iterable):
        self.it = iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def drain(self):
        for _ in self.it:
            pass


class HFEngine:
    """HF generate on a plain (unsharded) copy of the policy on this rank: --rollout hf."""

    def __init__(self, model_path, args, dist_):
        from transformers import AutoModelForCausalLM

        self.device, self.batch = dist_.device, args.hf_generate_batch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(self.device).eval()
        self.max_model_len = context_length(model_path, args)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.eos_token_id if isinstance(self.model.config.eos_token_id, int) else 0
        self.offloaded = False

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, stop_ids, logprobs=False):
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
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                      do_sample=not greedy, temperature=None if greedy else temperature,
                                      top_p=None if greedy else top_p, top_k=None if greedy else 0, repetition_penalty=1.0,
                                      num_return_sequences=n, eos_token_id=stop_ids,
                                      max_new_tokens=max(1, min(max_tokens, self.max_model_len - width)),
                                      pad_token_id=self.pad_id, output_scores=logprobs, return_dict_in_generate=True)
            new = out.sequences[:, width:].cpu()  # [len(chunk) * n, new]
            steps = torch.stack(out.scores, 1).float().log_softmax(-1).cpu() if logprobs else None  # [.., new, V]
            for i in range(len(chunk)):
                group = []
                for j in range(n):
                    row = new[i * n + j].tolist()
                    end = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), len(row))
                    lps = steps[i * n + j, torch.arange(end), new[i * n + j, :end]].tolist() if logprobs else None
                    group.append({"token_ids": row[:end], "logprobs": lps})
                results.append(group)
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
    if engine is not None:
        engine.close()  # vLLM's shutdown also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def make_engine(model_path, args, dist_):
    if args.rollout == "vllm":
        try:
            return VLLMEngine(model_path, args, dist_)
        except ImportError as e:
            raise SystemExit(f"--rollout vllm needs vLLM ({e}): pip install -r requirements-full.txt, or use --rollout hf")
    return HFEngine(model_path, args, dist_)


# ---------------------------------------------------------------------------------------------
# 4. Checkpoints: sharded (DCP) for resume, HF export for vLLM / transformers
# ---------------------------------------------------------------------------------------------

CKPT_RE = re.compile(r"^step_(\d+)$")
CHECKPOINT_FORMAT = 2  # 2: tensors (DCP) + RNG as tensors + JSON; 1 (before): pickled RNG state, optimizer param_groups
STALL_ENV = "D3S_TEST_STALL_CHECKPOINT"  # tests: "N" stalls the write of step N's checkpoint halfway (a SIGKILL lands there)


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed: missing, truncated, corrupt, of an older format, or holding
    a pickled object. The message names the file and the fix (train_full prints it as one line, exit 2)."""


def save_checkpoint(model, optimizer, out, step, trainer_state, dist_, keep):
    """OUT/checkpoints/step_NNNNNN (NNNNNN: the number of completed steps): the model and AdamW's
    state as tensors (DCP shards; the optimizer's param_groups are not saved, they follow from the
    run's flags), each rank's RNG as tensors (rng_rankR.pt), and trainer_state.json (the format,
    the step, the world size, and train_full's JSON: data position, the run's flags). Nothing in it
    needs pickle to load beyond DCP's .metadata, which load_checkpoint reads with an allow-list.

    Written to step_NNNNNN.tmp and renamed when complete: a run killed at any moment leaves
    either a complete checkpoint or a .tmp folder that --resume ignores. The newest `keep` stay.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(out, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dist_.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": {"state": optim_sd["state"]}}, checkpoint_id=tmp)
    version, words, gauss = random.getstate()
    rng = {"torch": torch.get_rng_state(), "python_words": torch.tensor(words, dtype=torch.int64),
           "python_version": torch.tensor(version), "python_gauss": torch.tensor([math.nan if gauss is None else gauss])}
    if dist_.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(tmp, f"rng_rank{dist_.rank}.pt"))
    if os.environ.get(STALL_ENV) == str(step):
        print(f"checkpoint of step {step}: shards written, stalled before completion ({STALL_ENV})", file=sys.stderr,
              flush=True)
        time.sleep(600)
    dist.barrier()
    if dist_.is_main:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"format": CHECKPOINT_FORMAT, "step": step, "world": dist_.world, **trainer_state}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)  # resumed from an older checkpoint: this step is redone
        os.replace(tmp, final)  # atomic: the checkpoint exists only once it is complete
        done = sorted(d for d in os.listdir(root) if CKPT_RE.match(d))
        for old in done[: max(len(done) - keep, 0)]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(spec, out):
    """The folder to resume from: spec itself, or the newest complete OUT/checkpoints/step_* (None if none)."""
    if spec != "latest":
        return spec
    root = os.path.join(out, "checkpoints")
    done = sorted(d for d in os.listdir(root) if CKPT_RE.match(d)) if os.path.isdir(root) else []
    done = [d for d in done if os.path.exists(os.path.join(root, d, "trainer_state.json"))]
    return os.path.join(root, done[-1]) if done else None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: allow the classes DCP writes there (its metadata dataclasses, torch
    sizes, dtypes and layouts, paths), refuse anything else before it runs."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module, name):
        obj = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
        if ((module, name) in self.ALLOWED or (module == "torch" and isinstance(obj, torch.dtype))
                or (module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
                    and isinstance(obj, type) and name != "BytesStorageMetadata")):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A global that a train_full checkpoint never holds."""


def read_checkpoint(path, rank=None):
    """Check a checkpoint folder without loading it into a model (cheap: before any model is built) and
    return its trainer_state. Raises CheckpointError for a missing, truncated, corrupt or older
    checkpoint, or one that holds a pickled object (in .metadata or an RNG file)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (the classes .metadata names)

    fix = "resume from an older checkpoint (--resume OUT/checkpoints/step_NNNNNN) or start a new run with a new --out"
    state_file = os.path.join(path, "trainer_state.json")
    try:
        with open(state_file) as f:
            meta = json.load(f)
        assert isinstance(meta, dict) and isinstance(meta.get("step", 0), int)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no trainer_state.json); {fix}") from None
    except (ValueError, AssertionError, UnicodeDecodeError):
        raise CheckpointError(f"{state_file}: truncated or corrupt (not the JSON train_full writes); {fix}") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{state_file}: checkpoint format {meta.get('format', 1)}, written by an older train_full.py "
                              f"(this one reads format {CHECKPOINT_FORMAT} only: no pickled state); finish that run with "
                              "the train_full.py that wrote it, or start a new run with a new --out")
    for key in ("step", "world", "order", "run"):
        if key not in meta:
            raise CheckpointError(f"{state_file}: no '{key}' (truncated or edited); {fix}")
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        for info in metadata.storage_data.values():  # every shard file holds the bytes .metadata points to
            shard = os.path.join(path, info.relative_path)
            if not os.path.isfile(shard) or os.path.getsize(shard) < info.offset + info.length:
                raise CheckpointError(f"{shard}: {'truncated' if os.path.isfile(shard) else 'missing'} (the write did "
                                      f"not complete); {fix}")
    except FileNotFoundError:
        raise CheckpointError(f"{path}/.metadata: missing (the shards were not written completely); {fix}") from None
    except _Refused as e:  # (non-tensor entries, BytesStorageMetadata, would be unpickled by DCP: refused too)
        raise CheckpointError(f"{path}/.metadata: refused: it holds a pickled object ({e}) that train_full never "
                              f"writes there (loading it could run code); {fix}") from None
    except CheckpointError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, ...: a damaged file
        raise CheckpointError(f"{path}/.metadata: truncated or corrupt ({type(e).__name__}); {fix}") from None
    for r in range(meta["world"]) if rank is None else [rank]:
        rng_file = os.path.join(path, f"rng_rank{r}.pt")
        if os.path.exists(rng_file):
            load_rng_file(rng_file, fix)
    return meta


def load_rng_file(rng_file, fix):
    """One rank's RNG state: tensors only (torch.load(weights_only=True))."""
    try:
        rng = torch.load(rng_file, weights_only=True)
        assert isinstance(rng, dict) and all(isinstance(v, torch.Tensor) for v in rng.values())
        return rng
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CheckpointError(f"{rng_file}: refused: it holds a pickled Python object, not tensors (loading it could "
                                  f"run code); {fix}") from None
        raise CheckpointError(f"{rng_file}: truncated or corrupt ({first}); {fix}") from None
    except Exception as e:
        raise CheckpointError(f"{rng_file}: truncated or corrupt ({type(e).__name__}); {fix}") from None


def load_checkpoint(path, model, optimizer, dist_):
    """Restore the model and AdamW's state (any world size: DCP reshards the shards) and, when the
    world size is the one that wrote it, this rank's RNG; returns trainer_state. Every file is
    checked first (read_checkpoint): DCP then reads tensors only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_checkpoint(path, rank=dist_.rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # a fresh optimizer's state is initialised (zeros)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:  # (DCP's own is a BaseException)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: its shards cannot be read ({first}): truncated or corrupt, or from another "
                              "model; resume from an older checkpoint or start a new run with a new --out") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]})
    rng_file = os.path.join(path, f"rng_rank{dist_.rank}.pt")
    if meta["world"] == dist_.world and os.path.exists(rng_file):  # another world size: sampling is seeded per prompt
        rng = load_rng_file(rng_file, "start a new run")
        torch.set_rng_state(rng["torch"])
        gauss = float(rng["python_gauss"][0])
        random.setstate((int(rng["python_version"]), tuple(rng["python_words"].tolist()), None if math.isnan(gauss) else gauss))
        if "cuda" in rng and dist_.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def export_hf(model, tokenizer, path, dist_):
    """save_pretrained of the full weights (rank 0), in the base model's dtype: loadable by
    transformers' from_pretrained and by vLLM."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist_.is_main:
        config = model.config
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
        config.use_cache = True
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)  # a plain class for save_pretrained (not FSDP's)
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shell.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in full.items()})
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        config.use_cache = False
    dist.barrier()
    return path


# ---------------------------------------------------------------------------------------------
# 5. Clocks, memory and MFU
# ---------------------------------------------------------------------------------------------
def clock(device):
    """time.perf_counter() after the device has finished its queued work: CUDA kernels run
    asynchronously, so without the synchronize a timer would stop before the GPU does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def memory_peak_gb(device):
    """Peak of PyTorch's allocator this step on CUDA (max over ranks); peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: peak RSS of this process


def gpu_used_gb(device):
    """Memory in use on the whole GPU (every allocator, vLLM's included); 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


PEAK_TFLOPS = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("H800", 989), ("A100", 312), ("A800", 312))  # dense bf16


def peak_flops(device, peak_tflops):
    """Peak dense bf16 FLOP/s of one GPU (for MFU), or None if unknown. The first name in
    PEAK_TFLOPS that the GPU's name contains wins: H100 PCIe 756 TFLOP/s, NVL 835, SXM 989."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS if key in name), None)


def flop_params(model):
    """Parameters that cost 2 FLOPs per token in a forward: all but the input embedding (a
    lookup). A tied LM head shares the embedding's weight but is a real matmul: counted once."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.get_input_embeddings().weight.numel()
    return n


# ---------------------------------------------------------------------------------------------
# 6. Run files: metrics.jsonl, the evaluation report, the explain page's rollouts
# ---------------------------------------------------------------------------------------------
def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def eval_record(step, results):
    """One metrics.jsonl line per evaluation: {benchmark}_pass@k for every benchmark and the average."""
    return {"kind": "eval", "step": step, **{f"{name}_{k}": v for name, row in results.items()
                                             for k, v in row.items() if k.startswith("pass@")}}


def truncate_metrics(path, step):
    """Keep what the checkpoint after `step` steps covers (a killed run may have logged past it):
    the train lines of steps 1..step and the evaluations after at most `step` steps."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", math.inf) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def write_eval_report(results, keys, args, tag, model_name):
    lines = [f"# Evaluation of {model_name}", "",
             f"{args.eval_samples} samples per problem, temperature {args.eval_temperature}, top-p {args.eval_top_p}, "
             f"max {args.eval_max_tokens} tokens, template {args.template}. Pass@1 = mean accuracy over the samples; "
             "Pass@k unbiased (Chen et al., 2021).", "",
             "| benchmark | problems | " + " | ".join(k.replace("pass", "Pass") for k in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for name, row in results.items():
        cells = [f"{row[k]:.1f}" for k in keys]
        lines.append(f"| {name} | {row.get('problems', '')} | " + " | ".join(cells) + " |")
    skipped = {name: (row["dropped"], row["too_long"]) for name, row in results.items() if row.get("dropped") or row.get("too_long")}
    for name, (dropped, too_long) in skipped.items():
        lines.append(f"\nNot evaluated in {name}: {dropped} rows without an answer, {too_long} prompts longer than the context.")
    stem = os.path.join(args.out, f"eval{'_' + tag if tag else ''}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"model": model_name, "settings": {k: getattr(args, k) for k in (
            "eval_samples", "eval_temperature", "eval_top_p", "eval_max_tokens", "template", "eval_limit")},
            "results": results}, f, indent=1)
    print("\n".join(lines), flush=True)


def explain_rows(rollouts, prompts, keep_all, adv_all, rewards_all, first, local_row, seqs, entropy, token_scores,
                 token_keep, dist_):
    """The few rollouts an explain page shows (explain.pick_rollouts on the global batch: the same
    choice on every rank), gathered on rank 0 with their token ids and, when forwarded, entropy,
    score and selection: a few rollouts, never the batch. local_row: flat index p * G + g -> row
    of this rank's forwarded batch. Every rank calls it (gather_object).
    Returns (shown_adv, items, prompt texts) on rank 0, None elsewhere."""
    G = keep_all.shape[1]
    shown_adv = torch.where(keep_all, adv_all, d3s.group_advantages(rewards_all))  # the loss's A on kept cells
    picked, mine = explain.pick_rollouts(shown_adv, keep_all), []
    for index in picked:
        p, g = divmod(index, G)
        if index in local_row:  # forwarded here: its row of entropy / scores / selection
            r = local_row[index]
            ids = list(seqs[r]["response_ids"])
            n = len(ids)
            mine.append({"index": index, "ids": ids, "entropy": entropy[r, :n].tolist(), "score": token_scores[r, :n].tolist(),
                         "selected": token_keep[r, :n].tolist()})
        elif not keep_all[p, g] and first <= p < first + len(rollouts):  # dropped: only its home rank has it
            mine.append({"index": index, "ids": list(rollouts[p - first][g]["response_ids"])})
    parts = [None] * dist_.world if dist_.is_main else None
    dist.gather_object((mine, prompts), parts, dst=0)
    if not dist_.is_main:
        return None
    items = sorted((item for part, _ in parts for item in part), key=lambda item: picked.index(item["index"]))
    return shown_adv, items, [text for _, texts in parts for text in texts]


def write_explain_page(details, stats, step, args, tokenizer, dist_):
    """Rank 0's page of one step (explain.write_step), from the global selection."""
    shown_adv, items, texts = details["explain"]
    for item in items:
        item["tokens"] = [tokenizer.decode([t]) for t in item.pop("ids")]
    row = details.get("row", args.method)  # the row that selected: args.method, or its twin after --switch-on-spike
    switched = {} if row == args.method else {"--switch-on-spike": f"fired: --method {args.method} runs as {row}"}
    explain.write_step(os.path.join(args.out, "explain"), step=step, rung="train_full", method=row,
                       rewards=details["rewards"], adv=shown_adv, keep=details["keep"], n_keep=stats["n_keep"],
                       k_frac=stats["k_frac"], k_real=stats["k_real"], shown=items, prompts=texts,
                       extra={**switched, "loss (mean over optimizer steps)": stats["loss"], "tokens in the loss": stats["kept_tokens"],
                              "grad norm (before clipping)": stats["grad_norm"], "ranks": dist_.world})
