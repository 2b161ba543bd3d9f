"""support/gpu.py: what a run needs of the GPU, and what a step reports of it.

vllm_memory_plan     trainer and vLLM on one GPU (and the host with --cpu-offload): gpu_memory_utilization and
                     max_num_seqs, or one line naming what does not fit and the flags that set it
host_memory, trainer_peak_bytes, model_shapes   its parts (bench/memory.py simulates them)
clock, memory_peak_gb, gpu_used_gb, peak_flops, flop_params, head_params, mfu_counts   a step's clocks, memory, MFU
train_record, update_flops   train_full.py's line of metrics.jsonl for a step: its counts, clocks, MFU and memory
vllm_pool_bytes      what torch counts inside vLLM's sleep-mode pools (left out of the trainer's figures)
cuda_diagnosis, driver_version   why torch sees no GPU, in one line
"""

import functools
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from support.cli import UsageError
from support.fsdp import all_reduce
from support.loss_head import HEAD_CHUNK


def vllm_memory_plan(config, args, ranks, gpu_bytes, host_bytes=None, local_ranks=1, refuse=True):
    """gpu_memory_utilization and max_num_seqs of the colocated vLLM engine on one GPU, and the check that the
    setting fits at all (train_full calls it before any work, engines.check_machine). How it counts: docs/memory.md,
    "How the plan counts".

    vLLM gets the GPU less what the trainer holds while it generates (12 B x parameters / ranks, + 2 B with --kl-ref;
    none with --cpu-offload, or the step's peak with --vllm-sleep-level 0) and MARGIN_GIB, but no more than its bf16
    weights, its workspace (vllm_workspace_bytes) and KV_HEADROOM x a rank's rollouts of KV cache at full length.
    Refuses (UsageError, one line naming what is short and the flags that set it; what fits instead: docs/memory.md,
    "When the plan refuses") a share without room for one full-length sequence's KV cache, a given share that does
    not fit, a step over the GPU, or (host_bytes given) the host. refuse=False returns the numbers alone (a dict, printed at start).
    """
    plan = _plan(config, args, ranks, gpu_bytes, host_bytes, local_ranks)
    if refuse and plan["short"]:  # what is short, with the flags that set it; what else fits: docs/memory.md
        raise UsageError(
            f"--model {args.model}: does not fit this {gpu_bytes / 2**30:.1f} GiB GPU: {'; '.join(plan['short'])} "
            "(what fits instead: docs/memory.md, 'When the plan refuses')"
        )
    return plan


# What the plan leaves free beside the trainer and vLLM [choice; no GPU run has measured its parts]: the CUDA context
# (~0.5 GiB), NCCL's communicators (the trainer's and vLLM's: NCCL_BUFFSIZE, 4 MiB by default, per channel and peer,
# and on NVSwitch nodes the NVLS buffers NCCL_NVLS_ENABLE=0 turns off; NCCL user guide, Environment Variables) and
# the caching allocator's fragmentation. scripts/gpu_check.sh's log prints what NCCL took where it can be read.
MARGIN_GIB = 4.0
VLLM_GRAPHS_GIB = 0.5  # [choice, not measured] vLLM's CUDA graphs and non-torch memory (kernels, cuBLAS) at start
KV_HEADROOM = 2.0  # [choice] KV cache over what a rank's rollouts at once need at full length (evaluation, blocks)


@functools.lru_cache(maxsize=16)
def _meta_model(config_json):
    """The model of a config (its JSON: a hashable cache key) on the meta device: shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))


def model_shapes(config):
    """(parameters, parameters of one decoder layer, of the FSDP root: final norm and lm_head, or the tied embedding)."""
    model = _meta_model(config.to_json_string())
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    embed = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()  # its own unit: not the root's
    return params, layer, params - layer * len(model.model.layers) - embed


def pinned_block(nbytes, threshold=None):
    """What torch 2.13's caching host allocator takes for a pinned block of nbytes: the next power of two, unless
    the block is larger than pinned_max_round_threshold_mb (threshold, bytes; unset by default: every block is
    rounded; ATen/core/CachingHostAllocator.h:302-309, c10/core/AllocatorConfig.h:228-229, 361)."""
    if nbytes <= 0 or (threshold is not None and nbytes > threshold):
        return max(int(nbytes), 0)
    return 1 << (int(nbytes) - 1).bit_length()


def pinned_round_threshold(environ=None):
    """pinned_max_round_threshold_mb, bytes, in the allocator settings torch starts with (PYTORCH_ALLOC_CONF, else
    PYTORCH_CUDA_ALLOC_CONF), or None where it is unset."""
    env = os.environ if environ is None else environ
    for field in (env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or "").split(","):
        key, _, value = field.partition(":")
        if key.strip() == "pinned_max_round_threshold_mb" and value.strip().isdigit():
            return int(value) * 2**20
    return None


def host_memory(config, args, ranks, local_ranks=1, environ=None):
    """This node's host memory for a training run, bytes, by part (the plan's host check, bench/memory.py; the parts:
    docs/memory.md, "Host memory"): with --cpu-offload per rank the pinned fp32 weights and gradients (each block
    rounded up to a power of two: pinned_block), AdamW's moments and temporaries, --kl-ref's bf16 shards; and rank 0's
    full copy at the export (fp32 + the checkpoint's dtype). Not counted: vLLM's host copies, the page cache."""
    threshold = pinned_round_threshold(environ)
    block = lambda nbytes: pinned_block(nbytes, threshold)
    tensors = list(_meta_model(config.to_json_string()).parameters())
    params = sum(p.numel() for p in tensors)
    shard = [-(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) for p in tensors]  # rank 0's shard of each, elements
    offload = getattr(args, "cpu_offload", False)
    parts = dict.fromkeys(("weights", "gradients", "moments", "temporaries", "reference", "rounding"), 0)
    if offload:
        parts["weights"] = parts["gradients"] = sum(block(4 * n) for n in shard)
        parts["moments"], parts["temporaries"] = 8 * sum(shard), 2 * 4 * max(shard)
        parts["reference"] = sum(block(2 * n) for n in shard) if args.kl_ref else 0
        pinned = parts["weights"] + parts["gradients"] + parts["reference"]
        parts["rounding"] = pinned - (4 + 4 + (2 if args.kl_ref else 0)) * sum(shard)  # less their unrounded bytes
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    export = params * (4 + (2 if dtype.endswith(("bfloat16", "float16")) else 0))
    per_rank = sum(v for k, v in parts.items() if k != "rounding")
    return {
        **parts,
        "per_rank": per_rank,
        "export": export,
        "load": 4 * params,
        "total": per_rank * local_ranks + export,
    }


def trainer_peak_bytes(config, args, ranks):
    """The trainer's peak GPU memory in a step, bytes, from the model's shapes, calibrated on bench/memory.py's
    simulations (0-11% above them; the terms: docs/memory.md, "How the plan counts"): the larger of the optimizer
    step (20 B x parameters / ranks) and pass 2 (16 B x parameters / ranks of state beside the larger of the decoder's
    backward and the loss head, for the widest micro-batch's tokens), + --kl-ref's bf16 shards."""
    params, layer, root = model_shapes(config)
    offload, H, L = getattr(args, "cpu_offload", False), config.hidden_size, config.num_hidden_layers
    tokens = args.micro_batch_size * (args.max_prompt_len + args.max_response_len)  # the widest micro-batch
    block = HEAD_CHUNK * config.vocab_size * 4  # one fp32 block of the loss head
    per_token = (2 * L * H + 50 * H) if args.activation_checkpointing else L * 52 * H
    if not args.mlp_chunk_tokens:
        per_token += 7 * config.intermediate_size
    decoder = 4 * root + 10 * layer + block + per_token * tokens
    head = 2 * root + (2 * L * H + 8 * H) * tokens + 5 * block
    pass2 = (0 if offload else 16 * params / ranks) + max(decoder, head)
    reference = 2 * params / ranks if args.kl_ref and not offload else 0.0
    return max(pass2, 0 if offload else 20 * params / ranks) + reference


def vllm_workspace_bytes(config, gpu_bytes, max_num_seqs):
    """What vLLM 0.32 keeps of its share beyond its weights and KV cache, bytes, as it profiles at start (read from its
    source: docs/memory.md, "How the plan counts"): the profile run's forward of 16384 tokens (8192 below 70 GiB),
    2 B x (3 x hidden + 3 x intermediate) a token; the sampler's 3 fp32 [max_num_seqs, vocab] copies; VLLM_GRAPHS_GIB
    for CUDA graphs and non-torch memory. Estimates; the first GPU run compares them (docs/gpu_check.md)."""
    tokens = 16384 if gpu_bytes >= 70 * 2**30 else 8192
    profile = tokens * 2 * 3 * (config.hidden_size + config.intermediate_size)
    sampler = 3 * 4 * max_num_seqs * config.vocab_size
    return profile + sampler + VLLM_GRAPHS_GIB * 2**30


def _plan(config, args, ranks, gpu_bytes, host_bytes=None, local_ranks=1):
    """vllm_memory_plan's numbers (bytes reported in GiB) and what does not fit ("short": a list of phrases)."""
    gib = 2**30
    params = model_shapes(config)[0]
    offload, reference = getattr(args, "cpu_offload", False), 2 * params / ranks if args.kl_ref else 0.0
    on_gpu = not getattr(args, "eval_only", False)  # --eval-only: no trainer at all
    trainer = 12 * params / ranks + reference if on_gpu and not offload else 0.0  # resident while vLLM generates
    peak = trainer_peak_bytes(config, args, ranks) if on_gpu else 0.0  # while vLLM sleeps
    host_parts = host_memory(config, args, ranks, local_ranks) if on_gpu else None  # --eval-only: no trainer
    host = host_parts["total"] if host_parts else 0.0
    # what vLLM's share sits beside on the GPU: the resident shards (levels 1 and 2 free vLLM's GPU memory alike; 1
    # keeps its weights in host memory), or the step's peak (--vllm-sleep-level 0)
    awake = on_gpu and getattr(args, "vllm_sleep_level", 2) == 0
    beside = max(peak, trainer) if awake else trainer
    margin, weights = MARGIN_GIB * gib, 2 * params
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    full_length = args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens)
    # a rank's rollouts at once, at least an evaluation's samples of one problem
    seqs = min(1024, max(16, -(-args.prompts_per_step // ranks) * args.group_size, args.eval_samples))
    # vLLM's max_num_seqs (its sampler's rows at start): --vllm-max-num-seqs, else the KV cache's sequences the plan
    # sizes (fewer where the room is less: the sampler is then counted high)
    max_seqs = getattr(args, "vllm_max_num_seqs", None) or min(1024, int(KV_HEADROOM * seqs))
    workspace = vllm_workspace_bytes(config, gpu_bytes, max_seqs)
    least = weights + workspace + kv_per_token * full_length  # vLLM's least: one full-length sequence at a time
    wanted = weights + workspace + KV_HEADROOM * seqs * kv_per_token * full_length
    given = args.vllm_gpu_memory_utilization
    utilization = given or min(max(min(gpu_bytes - beside - margin, wanted), 0.0) / gpu_bytes, 0.95)
    share = utilization * gpu_bytes
    kv_bytes = share - weights - workspace
    for _ in range(2 if not getattr(args, "vllm_max_num_seqs", None) else 0):  # where the room is less than wanted:
        # the sampler's rows are the sequences the KV cache left holds (max_num_seqs below), so the workspace again
        workspace = vllm_workspace_bytes(
            config, gpu_bytes, min(1024, max(16, kv_bytes // (kv_per_token * full_length)))
        )
        kv_bytes = share - weights - workspace
    what = (
        "its step, gpu.trainer_peak_bytes: --vllm-sleep-level 0 keeps vLLM awake through it"
        if awake
        else "none: --cpu-offload keeps its state in host memory"
        if offload
        else f"12 B x {params / 1e9:.2f}B params / {ranks} rank(s), without --cpu-offload"
        f"{' + the --kl-ref reference' if reference else ''}"
    )
    short = []
    if share < least:
        short.append(
            f"vLLM would get {share / gib:.1f} GiB{f' (--vllm-gpu-memory-utilization {given:g})' if given else ''} "
            f"beside the trainer's {beside / gib:.1f} GiB "
            f"({what}) and the {MARGIN_GIB:g} GiB "
            f"margin, less than the {least / gib:.1f} GiB it needs (bf16 weights {weights / gib:.1f}, workspace "
            f"{workspace / gib:.1f}, one sequence of {full_length} tokens {kv_per_token * full_length / gib:.2f}: "
            "--max-prompt-len + the larger of --max-response-len, --eval-max-tokens)"
        )
    if given and share + beside + margin > gpu_bytes:  # the plan's own share always leaves the room
        short.append(
            f"--vllm-gpu-memory-utilization {given:g} gives vLLM {share / gib:.1f} GiB, which beside the "
            f"trainer's {beside / gib:.1f} GiB ({what}) and the {MARGIN_GIB:g} GiB margin needs "
            f"{(share + beside + margin) / gib:.1f} GiB, more than the GPU's {gpu_bytes / gib:.1f}"
        )
    if peak + margin > gpu_bytes:
        short.append(
            f"the trainer's step needs about {peak / gib:.1f} GiB (gpu.trainer_peak_bytes: "
            f"{params / 1e9:.2f}B params / {ranks} rank(s), --micro-batch-size {args.micro_batch_size} x "
            f"{args.max_prompt_len + args.max_response_len} tokens of --max-prompt-len + --max-response-len"
            f"{', --cpu-offload' if offload else ''}) + the {MARGIN_GIB:g} GiB margin"
        )
    if host_bytes is not None and host > host_bytes:
        state = (
            f"--cpu-offload's state: {host_parts['per_rank'] / gib:.1f} GiB for each of the {local_ranks} rank(s) of "
            f"this node, {host_parts['rounding'] / gib:.1f} GiB of it the pinned blocks' rounding to powers of two; "
            if offload
            else ""
        )
        short.append(
            f"host memory: {host / gib:.1f} GiB needed ({state}rank 0's full copy of the model at the export: "
            f"{host_parts['export'] / gib:.1f}), {host_bytes / gib:.1f} GiB is available"
        )
    return {
        "params": params,
        "gpu_gib": gpu_bytes / gib,
        "trainer_resident_gib": trainer / gib,
        "trainer_peak_gib": peak / gib,
        "host_gib": host / gib,
        "host_parts_gib": {k: v / gib for k, v in (host_parts or {}).items()},
        "gpu_memory_utilization": utilization,  # unrounded: vLLM takes its share from it
        "vllm_share_gib": share / gib,
        "vllm_weights_gib": weights / gib,
        "vllm_workspace_gib": workspace / gib,
        "kv_cache_gib": kv_bytes / gib,
        "kv_bytes_per_token": kv_per_token,
        "full_length": full_length,
        "margin_gib": MARGIN_GIB,
        "vllm_beside_gib": beside / gib,
        "vllm_awake_in_step": awake,
        "max_num_seqs": int(min(1024, max(16, kv_bytes // (kv_per_token * full_length)))),
        "short": short,
    }


def clock(device, reset_peak=False):
    """time.perf_counter() after the device has finished its queued work: CUDA kernels run
    asynchronously, so without the synchronize a timer would stop before the GPU does.
    reset_peak: also start a new peak of memory_peak_gb (a step's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def memory_peak_gb(device, pool_bytes=None):
    """The trainer's peak in PyTorch's allocator since clock(reset_peak=True) on CUDA, less what torch counts inside
    vLLM's sleep-mode pools (vllm_pool_bytes: its weights and KV cache, counted awake or asleep); peak RSS of the
    process on CPU."""
    if device.type == "cuda":
        pool = vllm_pool_bytes() if pool_bytes is None else pool_bytes
        return (torch.cuda.max_memory_allocated(device) - pool) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: peak RSS of this process


def vllm_pool_bytes(allocator=None):
    """Bytes torch counts as allocated inside vLLM's CuMemAllocator pools (MemPools of torch's caching allocator
    backed by cuMem: vLLM's weights and KV cache). Sleep unmaps their pages behind torch's back, so
    memory_allocated and max_memory_allocated count them awake or asleep (vllm/device_allocator/cumem.py); the
    trainer's own bytes are those less these. 0 where vLLM made no such allocator (HF rollouts, no sleep mode)."""
    if allocator is None:
        cumem = sys.modules.get("vllm.device_allocator.cumem")  # never imports vLLM
        allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    pools = [entry[0] for entries in getattr(allocator, "allocator_and_pools", {}).values() for entry in entries]
    return sum(segment["allocated_size"] for pool in pools for segment in pool.snapshot())


def gpu_used_gb(device):
    """Memory in use on the whole GPU (every allocator, vLLM's included); 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def cuda_diagnosis(facts=None):
    """Why torch sees no CUDA device, in one line (train_full's --device cuda line, scripts/gpu_check.sh): facts, the
    CUDA torch was built for (torch.version.cuda; None: a CPU-only build) and this node's NVIDIA driver version
    (nvidia-smi's; None: no driver answers), read here when not given."""
    torch_cuda, driver = facts or (torch.version.cuda, driver_version())
    return f"torch.version.cuda {torch_cuda} (None: a CPU-only torch), NVIDIA driver {driver or 'not found (no nvidia-smi)'}"


def driver_version():
    """The NVIDIA driver's version, as nvidia-smi prints it, or None where nvidia-smi does not answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


# Dense BF16 tensor-core TFLOP/s by a part of torch.cuda.get_device_name(), the first that the name contains: the
# specific forms before the names they contain ("H200 NVL" before "H200", "GB200" before "B200", every H200 before
# "H20"). NVIDIA's datasheets give these with 2:4 sparsity: dense is half.
PEAK_TFLOPS = (
    ("H100 PCIe", 756),  # H100 datasheet: 1,513 sparse
    ("H100 NVL", 835),  # H100 datasheet: 3,341 sparse for the pair of NVL cards, 1,671 each
    ("H200 NVL", 835),  # H200 datasheet: 1,671 sparse (issue 57: read as the SXM's 989 before)
    ("H800 PCIe", 756),  # H800 datasheet: 1,513 sparse, the H100 PCIe's (issue 57: read as 989 before)
    ("GH200", 989),  # GH200 Grace Hopper datasheet: 1,979 sparse, the H100 SXM's
    ("GB200", 2500),  # GB200 NVL72 spec table, per Blackwell GPU: 5 PFLOPS sparse
    ("B200", 2250),  # the same table, HGX B200, per GPU: 4.5 PFLOPS sparse
    ("B100", 1750),  # HGX B100: 3.5 PFLOPS sparse per GPU (not checked against NVIDIA's page; nanochat's table: 1.8 PF)
    ("H100", 989),  # H100 SXM datasheet: 1,979 sparse
    ("H200", 989),  # H200 SXM datasheet: 1,979 sparse
    ("H800", 989),  # H800 SXM datasheet: 1,979 sparse
    ("H20", 148),  # H20: 148 dense FP16/BF16 as reported (no public NVIDIA datasheet; not checked)
    ("A100", 312),  # A100 datasheet: 312 dense (624 sparse)
    ("A800", 312),  # A800: the A100's tensor cores
)  # not here, so MFU is None (--peak-tflops sets it): B300/GB300, RTX PRO 6000 Blackwell (no dense BF16 figure found)


def peak_flops(device, peak_tflops):
    """Peak dense bf16 FLOP/s of one GPU (for MFU): --peak-tflops, else this GPU's by its name (peak_by_name), or None."""
    if peak_tflops:
        return peak_tflops * 1e12
    return peak_by_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_by_name(name):
    """Dense bf16 FLOP/s of the GPU torch names `name`: the first part in PEAK_TFLOPS that it contains, or None."""
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS if key in name), None)


def mfu_counts(model, device, peak_tflops):
    """What train_record's MFU needs: (flop_params, head_params, peak_flops)."""
    return flop_params(model), head_params(model), peak_flops(device, peak_tflops)


def head_params(model):
    """The LM head's parameters (vocabulary x hidden; the embedding's where they are tied): flop_params counts them,
    update_flops charges them only at the tokens where the head runs."""
    return model.get_output_embeddings().weight.numel()


def flop_params(model):
    """Parameters that cost 2 FLOPs per token in a forward: all but the input embedding (a
    lookup). A tied LM head shares the embedding's weight but is a real matmul: counted once."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.get_input_embeddings().weight.numel()
    return n


def update_flops(stats, pass1_head_tokens, n_params, n_head):
    """Model FLOPs of a step's update (MFU's numerator, docs/metrics.md), from its train line's counts and the response
    tokens of its no-grad forwards (pass1_head_tokens, all ranks). The decoder
    (n_params less the LM head's n_head, the input embedding left out: a lookup) at every token forwarded: 2 a
    parameter in the no-grad forwards (pass 1, the reference), 6 in pass 2 (forward and backward). The LM head where
    it runs: the response tokens of the no-grad forwards, and in pass 2 the tokens in the loss only (D3S's saving:
    the K selected, every response token for the methods without token selection). Recomputation and attention are
    not counted."""
    body = (2 * stats["pass1_tokens"] + 6 * stats["train_tokens"]) * (n_params - n_head)
    return body + (2 * pass1_head_tokens + 6 * stats["kept_tokens"]) * n_head


def train_record(step, stats, rollouts, phases, args, world, flops):
    """train_full.py's line of metrics.jsonl for a step (docs/metrics.md): its metrics (train_full.step_metrics), then
    the run's counts, clocks, MFU and memory. phases: this rank's gen_s, reward_s, pass1_s, sync_s, its grader's
    timeouts, the response tokens of the no-grad forwards (pass1_head_tokens, all ranks: MFU's), and the GPU memory in
    use during generation (gpu_used_gen) and after the update, before the sync (gpu_used_train); flops: (parameters
    that cost 2 FLOPs a token, those of them in the LM head, the GPU's peak FLOP/s or None). Every rank calls it
    (all_reduce); sync_s and the phases are the slowest rank's."""
    MAX, (n_params, n_head, flops_peak) = dist.ReduceOp.MAX, flops
    gen_tokens = all_reduce(sum(len(r["response_ids"]) for group in rollouts for r in group), world)
    gen_s = all_reduce(phases["gen_s"], world, MAX)  # the slowest rank's
    return {
        "kind": "train",
        "step": step,
        **stats,
        "gen_tokens": int(gen_tokens),
        "kept_tokens_frac": stats["kept_tokens"] / max(gen_tokens, 1.0),
        "response_len": gen_tokens / (args.prompts_per_step * args.group_size),
        "grader_timeouts": int(all_reduce(phases["grader_timeouts"], world)),
        "gen_s": gen_s,
        "reward_s": all_reduce(phases["reward_s"], world, MAX),
        "pass1_s": all_reduce(phases["pass1_s"], world, MAX),
        "sync_s": all_reduce(phases["sync_s"], world, MAX),
        "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
        "mfu": (
            update_flops(stats, phases["pass1_head_tokens"], n_params, n_head)
            / (stats["train_s"] * world.size * flops_peak)
            if flops_peak
            else None
        ),
        "mem_peak_gb": all_reduce(memory_peak_gb(world.device), world, MAX),
        "gpu_used_gen_gb": all_reduce(phases["gpu_used_gen"], world, MAX),
        "gpu_used_train_gb": all_reduce(phases["gpu_used_train"], world, MAX),
    }
