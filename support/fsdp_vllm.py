"""support/fsdp_vllm.py: the machines under train_full.py: what runs the method, not the method.

train_full.py holds the flags, the six steps of a D3S step and the loop; support/full_io.py the run's files (flag checks,
data, checkpoints, evaluation, reports). This module holds the rest, in five parts:

  1 process group     Dist, init_distributed (torchrun, or a world of one), collectives that
                      gather rows of different counts per rank, all_reduce of a number, which
                      rank trains which kept rollout (assign_rollouts: the load balance)
  2 policy            the tokenizer and generation config, the HF model as FSDP2 shards (fp32
                      master weights, bf16 compute, fp32 reductions, activation checkpointing,
                      the tiled MLP; --cpu-offload), AdamW, bf16 full tensors one at a time for
                      the weight sync
  3 loss head         forward passes on the kept rollouts in micro-batches, never the
                      [n, T, vocab] logits: log-probs and entropy in blocks, pass 2 only at
                      the tokens in the loss
  4 rollout engines   VLLMEngine (colocated vLLM, sleep mode, reload_weights, the check before a
                      wake) and the memory plan of trainer and vLLM on one GPU, host memory too (and
                      its refusal); HFEngine (transformers' generate), the same interface; the GPU
                      checks before vLLM is built (VLLM_BATCH_INVARIANT), the trainer's CPU threads
                      under --cpu-offload, an export with the engine asleep (export_asleep)
  5 clocks, memory    timers that wait for the GPU, peak memory, MFU's peak FLOP/s, why torch
                      sees no GPU (cuda_diagnosis)
"""

import datetime
import functools
import math
import os
import random
import socket
import time

import torch
import torch.distributed as dist

import d3s
from support.cli import UsageError


# ---------------------------------------------------------------------------------------------
# 1. Process group: one process per GPU (torchrun); device from LOCAL_RANK, data from RANK
# ---------------------------------------------------------------------------------------------
class Dist:
    """rank, world (all nodes), local_rank, device: where this process trains and generates."""

    def __init__(self, rank, world, local_rank, device):
        self.rank, self.world, self.local_rank, self.device = rank, world, local_rank, device
        self.is_main = rank == 0


def init_distributed(device_type, cpu_offload=False):
    """Join the torchrun process group (or make a world of one): nccl on CUDA, gloo on CPU; with
    --cpu-offload on CUDA both (cpu:gloo,cuda:nccl), for the collectives on the host-resident shards
    (the gradient norm of clip_grad_norm_, the broadcast of the initial weights).

    vLLM's external_launcher reads the same RANK / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, so a
    plain `python train_full.py` sets them for a world of one.
    """
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = ("cpu:gloo,cuda:nccl" if cpu_offload else "nccl") if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, timeout=datetime.timedelta(minutes=60), device_id=device if device_type == "cuda" else None
        )
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


def assign_rollouts(lengths, home, world, m, balance):
    """Which rank trains each kept rollout of the step, and the step's m mini-batches.

    lengths: prompt + response tokens of each kept rollout, in global order (rank order =
    prompt order); home: the rank that generated it. The kept list is split into m contiguous
    mini-batches (torch.tensor_split, as verl splits its batch), the same whatever the number of
    ranks. With balance, each mini-batch's rollouts go longest first to the least-loaded rank
    (LPT), so a rank whose prompts were all solved (cross-group selection kept none of them)
    still gets its share of the work; without it each rollout stays on its home rank. Which
    rank computes a rollout changes neither the kept set nor any normalizer.
    Returns (owner: rank of each kept rollout, parts: m lists of global indices). Pure: the same
    on every rank.
    """
    owner = list(home)
    parts = [part.tolist() for part in torch.arange(len(lengths)).tensor_split(m)]
    if balance:
        for part in parts:
            load = [0] * world
            for g in sorted(part, key=lambda g: (-lengths[g], g)):
                owner[g] = min(range(world), key=lambda r: (load[r], r))
                load[owner[g]] += lengths[g]
    return owner, parts


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
    only its shard, so a 7B model never sits 8 times in host memory. With --cpu-offload the
    shards stay in host memory (FSDP2's CPUOffloadPolicy) and only the buffers go to the GPU.
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
    model.to_empty(device="cpu" if getattr(args, "cpu_offload", False) else dist_.device)
    set_model_state_dict(
        model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    _init_rotary_buffers(model, dist_.device)  # non-persistent: not in the checkpoint, garbage after to_empty
    if reference:
        return model.eval().requires_grad_(False)
    model.train()
    return model


def shard_policy(model, args, mesh=None):
    """FSDP2 in place: activation checkpointing, tiled MLPs, fully_shard per decoder layer and the
    untied embedding, then the root.

    fp32 master weights, compute in args.dtype, fp32 gradient reduction; gradients are SUMMED
    over ranks (the loss already divides by the global token count). --cpu-offload (choice):
    FSDP2's CPUOffloadPolicy keeps the sharded fp32 weights, their gradients and so AdamW's
    moments and step in host memory; each unit's weights are copied to the GPU for its forward
    and backward, and its gradients back (docs/train_full.md, "One GPU"). bench/memory.py calls
    this too, so the memory plan simulates the very wrapping that trains.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mlp_chunk_tokens:
        chunk_mlps(model, args.mlp_chunk_tokens)
    compute = getattr(torch, args.dtype)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)  # fp32 master weights + reductions
    # pinned host memory where there is a GPU to copy to (pin_memory needs one)
    kw = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if getattr(args, "cpu_offload", False)
        else OffloadPolicy(),
    }
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if (
        not model.config.tie_word_embeddings
    ):  # an untied embedding (the 7B) is needed in forward only: 1 GiB freed after it
        fully_shard(model.model.embed_tokens, **kw)
    # root (final norm, lm_head; the tied embedding): stays gathered after forward for the loss head, which calls
    # lm_head block by block; backward starts there (a no-grad forward, which has no backward, reshards it: reshard)
    fully_shard(model, reshard_after_forward=False, **kw)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # an FSDPModule
            module.set_gradient_divide_factor(1.0)  # SUM over ranks: the loss already divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    # Every rank reduce-scatters the gradients of every parameter, whatever its micro-batch: a micro-batch without a
    # selected token still uses an untied lm_head, at weight 0 (response_logp_at), so that no torch switch
    # (set_reduce_scatter_unused_params, torch >= 2.13 only) is needed for the ranks' collectives to match.
    return model


def reshard(model):
    """Free a root's gathered weights after a no-grad forward: the root is wrapped reshard_after_forward=False
    for the loss head, and only a backward would reshard it. (--kl-ref's reference never runs one: its lm_head,
    1 GiB in bf16 for the 7B, would stay gathered beside vLLM.)"""
    if hasattr(model, "reshard"):
        model.reshard()


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
    """The rotary buffers, computed afresh on the compute device (with --cpu-offload the model was
    made on the CPU: FSDP2 moves weights, never buffers)."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                module.register_buffer(name, buf.to(device), persistent=name not in module._non_persistent_buffers_set)


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))


def full_named_tensors(model, dtype):
    """(name, full tensor) one parameter at a time, gathered from the FSDP shards (all ranks call it). Each shard is
    cast to `dtype` first, then moved to the device its mesh is on (--cpu-offload: from host memory), then
    gathered: the gather moves and holds bf16, never the fp32 full tensor (2 GiB for the 7B's embedding)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            yield name, param.detach().to(dtype).to(param.device_mesh.device_type).full_tensor()
        else:
            yield name, param.detach().to(dtype)


# ---------------------------------------------------------------------------------------------
# 3. The loss head: forward passes on the kept rollouts, never the [n, T, vocab] logits
# ---------------------------------------------------------------------------------------------
def pack(seqs, rows, pad_id, device):
    """[pad.. prompt | response ..pad]: left-padded prompts, right-padded responses, so every
    response starts at the same column and logits_to_keep keeps only the response positions.
    Returns (model inputs, response targets [n, T], response mask [n, T])."""
    width_p = max(len(seqs[r]["prompt_ids"]) for r in rows)
    width_r = max(len(seqs[r]["response_ids"]) for r in rows)
    ids = torch.full((len(rows), width_p + width_r), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        prompt, response = seqs[r]["prompt_ids"], seqs[r]["response_ids"]
        ids[i, width_p - len(prompt) : width_p + len(response)] = torch.tensor(prompt + response)
        attn[i, width_p - len(prompt) : width_p + len(response)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # real tokens at 0, 1, 2, ... as without padding
    inputs = {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "position_ids": position_ids.to(device),
        "logits_to_keep": width_r + 1,
        "use_cache": False,
    }
    return inputs, ids[:, width_p:].to(device), attn[:, width_p:].bool().to(device)


HEAD_CHUNK = 1024  # response positions per LM-head block: [1024, vocab] fp32 logits, 0.6 GB at Qwen's 152k vocabulary


def response_hidden(model, inputs):
    """The final (normed) hidden states of the positions that predict the response tokens, [n, T, H].

    The policy runs as usual (through the FSDP root, which gathers its parameters), but with
    logits_to_keep=1 its LM head sees one position only; a forward hook on the decoder keeps
    its output. So the [n, T, vocab] logits are never made: the loss head below makes them in
    blocks, or only at the selected tokens.
    """
    T = inputs["logits_to_keep"] - 1
    captured = []
    hook = model.model.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(**{**inputs, "logits_to_keep": 1})
    finally:
        hook.remove()
    return captured[0][:, -(T + 1) : -1]  # position width_p - 1 + t predicts response token t


def _head_logp(head, hidden, targets, temperature):
    """log pi(target) for [m, H] hidden states: fp32 logits of one block, divided by the sampling
    temperature (the distribution the rollouts came from); returns ([m] log-probs, [m, V] logits)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1), logits


def response_logp(model, inputs, targets, temperature, with_entropy):
    """Pass 1 (no grad): log pi(o_t | ...) [n, T] of every response token, and the entropy H_t.

    The LM head runs over blocks of HEAD_CHUNK positions of the hidden states, so at most one
    [HEAD_CHUNK, vocab] fp32 block of logits exists at a time (never [n, T, vocab]).
    """
    hidden = response_hidden(model, inputs)  # [n, T, H]
    n, T, H = hidden.shape
    flat, flat_targets = hidden.reshape(n * T, H), targets.reshape(n * T)
    logp = torch.zeros(n * T, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    for start in range(0, n * T, HEAD_CHUNK):
        block = slice(start, start + HEAD_CHUNK)
        logp[block], logits = _head_logp(model.lm_head, flat[block], flat_targets[block], temperature)
        if with_entropy:
            entropy[block] = d3s.token_entropy(logits)
        del logits
    return logp.view(n, T), (entropy.view(n, T) if with_entropy else None)


def response_logp_at(model, inputs, targets, positions, temperature, with_entropy=False):
    """Pass 2 (with grad): log pi of the response tokens at `positions` only, [n, T] (0 elsewhere).

    positions: the tokens in the loss, a bool [n, T] mask or its (rows, cols) index. For a
    token-selecting method (d2s, d3s, d3s-i) that is the top K (5-20%), so the LM head costs 1/K
    less memory and FLOPs: D3S's own saving, which a full-logits loss throws away. Every other
    method passes all valid tokens. Either way the head runs in blocks of HEAD_CHUNK positions
    whose logits are recomputed in backward (torch.utils.checkpoint): one [HEAD_CHUNK, vocab]
    fp32 block at a time. The loss and its gradients equal those of the full-logits head:
    tokens outside `positions` have weight 0 in d3s.policy_loss.

    with_entropy: also return d3s.token_entropy of the same logits at `positions` ([n, T], no
    grad, 0 elsewhere), computed once in the forward (not again when backward recomputes a block):
    the entropy metric of the methods without token selection, which need no pass 1 for it.
    """
    from torch.utils.checkpoint import checkpoint

    hidden = response_hidden(model, inputs)  # [n, T, H]
    index = positions.nonzero(as_tuple=True) if isinstance(positions, torch.Tensor) else positions
    picked, picked_targets = hidden[index], targets[index]  # [m, H], [m]
    logp = torch.zeros(hidden.shape[:2], dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    if picked.shape[0] == 0:  # nothing selected here: a zero that keeps the graph (FSDP's backward hooks) and uses
        # every parameter, an untied lm_head too (one position, weight 0), so every rank reduce-scatters the same
        zero = 0.0 * (hidden.sum() + model.lm_head(hidden[:1, :1]).float().sum())
        return (logp + zero, entropy) if with_entropy else logp + zero
    starts = range(0, picked.shape[0], HEAD_CHUNK)
    block_entropy = [None] * len(starts)

    def block_logp(i, h, y):
        lp, logits = _head_logp(model.lm_head, h, y, temperature)
        if with_entropy and block_entropy[i] is None:  # the forward, not backward's recomputation
            block_entropy[i] = d3s.token_entropy(logits.detach())
        return lp

    blocks = [
        checkpoint(
            functools.partial(block_logp, i),
            picked[s : s + HEAD_CHUNK],
            picked_targets[s : s + HEAD_CHUNK],
            use_reentrant=False,
        )
        for i, s in enumerate(starts)
    ]
    logp = logp.index_put(index, torch.cat(blocks))
    if not with_entropy:
        return logp
    return logp, entropy.index_put(index, torch.cat(block_entropy))


def micro_batches(lengths, size, n_micro):
    """n_micro lists of row indices (longest first, to pad little); trailing lists may be empty."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    return chunks + [[] for _ in range(n_micro - len(chunks))]


def micro_batch_rows(seqs, rows, size, dist_, at_least=0):
    """`rows` of seqs in micro-batches of `size` rows (longest first), as many on every rank (at least
    `at_least`): a rank with fewer rows gets empty ones, on which it forwards DUMMY, so that FSDP's
    all-gathers and reduce-scatters match over the ranks."""
    n_micro = max(int(all_reduce(math.ceil(len(rows) / size), dist_, dist.ReduceOp.MAX)), at_least)
    return [
        [rows[i] for i in chunk]
        for chunk in micro_batches(
            [len(seqs[r]["prompt_ids"]) + len(seqs[r]["response_ids"]) for r in rows], size, n_micro
        )
    ]


DUMMY = {"prompt_ids": [0], "response_ids": [0]}  # a rank with no rows left still runs FSDP's collectives


def idle_loss(model, pad_id, device, temperature):
    """A zero loss through the whole model (on DUMMY, no token selected): the backward of a rank with fewer
    micro-batches than the others, which keeps FSDP's collectives matched."""
    inputs, targets, _ = pack([DUMMY], [0], pad_id, device)
    return (
        response_logp_at(model, inputs, targets, torch.zeros_like(targets, dtype=torch.bool), temperature).sum() * 0.0
    )


def forward_no_grad(model, seqs, rows, T, args, dist_, pad_id, with_entropy):
    """log pi [B, T] (and d3s.token_entropy) of `rows` of seqs, no grad, in micro-batches. Every rank
    runs the same number of forwards (FSDP's all-gathers): a rank with fewer rows forwards DUMMY;
    no rank forwards when no rank has a row. Returns (log-probs, entropy or None, tokens forwarded
    over all ranks)."""
    device = dist_.device
    logp_out = torch.zeros(len(seqs), T, device=device)
    entropy_out = torch.zeros(len(seqs), T, device=device) if with_entropy else None
    with torch.no_grad():
        for chunk in micro_batch_rows(seqs, rows, args.micro_batch_size, dist_):
            inputs, targets, _ = pack(seqs, chunk, pad_id, device) if chunk else pack([DUMMY], [0], pad_id, device)
            logp, entropy = response_logp(model, inputs, targets, args.temperature, with_entropy=with_entropy)
            if chunk:
                logp_out[chunk, : targets.shape[1]] = logp
                if with_entropy:
                    entropy_out[chunk, : targets.shape[1]] = entropy
    reshard(model)  # the root's weights, gathered for the loss head: no backward follows to free them
    return (
        logp_out,
        entropy_out,
        all_reduce(sum(len(seqs[r]["prompt_ids"]) + len(seqs[r]["response_ids"]) for r in rows), dist_),
    )


# ---------------------------------------------------------------------------------------------
# 4. Rollout engines: vLLM (colocated, one per rank) or HF generate; same interface
# ---------------------------------------------------------------------------------------------
def context_length(model_path, args):
    """Prompt + response tokens one sequence may hold: the model's context window, capped at
    max(prompt + response budget, 4096) so a long-context model does not reserve a huge sequence."""
    from transformers import AutoConfig

    window = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 10**9
    return min(window, max(args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens), 4096))


def vllm_memory_plan(config, args, ranks, gpu_bytes, host_bytes=None, local_ranks=1):
    """gpu_memory_utilization and max_num_seqs of the colocated vLLM engine on one GPU, and the check that the
    setting fits at all (train_full calls it before any work, full_io.check_machine).

    While vLLM generates, the trainer keeps its shards on the same GPU: fp32 weights and
    AdamW's two moments, 12 bytes x parameters / ranks (gradients are freed after each step;
    bench/memory.py checks these bytes), plus 2 bytes x parameters / ranks for --kl-ref's bf16
    reference; none of it with --cpu-offload (host memory). vLLM may take the rest, less MARGIN_GIB
    for the CUDA context, NCCL's buffers and fragmentation. Inside vLLM's share its bf16 weights take
    2 bytes x parameters and its forward's workspace about VLLM_WORKSPACE_GIB; the KV cache gets the
    rest, 2 (K and V) x layers x KV heads x head dim x 2 bytes per token. max_num_seqs is the number
    of sequences whose KV cache fits at full length (prompt + response), so vLLM need not preempt
    (clamped to 16 .. 1024). While the trainer runs, vLLM sleeps (level 2: weights and KV cache
    freed, runtime buffers and CUDA-graph pools copied to host memory: vllm_engine_args) and the trainer's peak is
    trainer_peak_bytes (an estimate; bench/memory.py simulates it); --cpu-offload keeps the sharded
    state in host memory instead: host_memory counts it, with the pinned blocks' rounding, for each rank of
    the node, and rank 0's full copy of the model at the export.

    --vllm-sleep-level 0 keeps vLLM awake through the step: its share then sits beside the step's peak instead
    of the resident shards (levels 1 and 2 free vLLM's GPU memory alike; 1 keeps its weights in host memory).

    Refuses (cli.UsageError, one line naming the memory needed and the flags that would fit) a
    setting that leaves vLLM less than its weights, workspace and one full-length sequence of KV
    cache, a --vllm-gpu-memory-utilization whose share with what the trainer holds beside it and the
    margin exceeds the GPU, whose training step does not fit the GPU, or (host_bytes given) the host.
    Returns a dict with the numbers (printed at start, and by bench/memory.py).
    """
    plan = _plan(config, args, ranks, gpu_bytes, host_bytes, local_ranks)
    if plan["short"]:
        raise UsageError(_refusal(plan, config, args, ranks, gpu_bytes, host_bytes, local_ranks))
    return plan


MARGIN_GIB, VLLM_WORKSPACE_GIB = 4.0, 3.0  # CUDA context + NCCL + fragmentation; vLLM's forward workspace (+ graphs)


@functools.lru_cache(maxsize=16)
def _shapes(config_json):
    from transformers import AutoConfig
    import json

    fields = json.loads(config_json)
    return model_shapes(AutoConfig.for_model(fields.pop("model_type"), **fields), cached=False)


def model_shapes(config, cached=True):
    """(parameters, parameters of one decoder layer, of the FSDP root: final norm and lm_head, or the tied embedding)."""
    if cached:
        return _shapes(config.to_json_string())
    model = _meta_model(config)
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    embed = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()  # its own unit: not the root's
    return params, layer, params - layer * len(model.model.layers) - embed


@functools.lru_cache(maxsize=16)
def _rows(config_json):
    from transformers import AutoConfig
    import json

    fields = json.loads(config_json)
    model = _meta_model(AutoConfig.for_model(fields.pop("model_type"), **fields))
    return tuple((p.shape[0], p.numel() // p.shape[0]) for p in model.parameters())


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
    """This node's host memory for a training run, bytes, by part (the plan's host check, bench/memory.py).

    --cpu-offload, per rank (FSDP2 pins each parameter's shard of ceil(rows / ranks) rows on its own, and the
    gradient's too: its copy to the host is non_blocking, so pinned; the allocator rounds each block up to a power
    of two unless PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold_mb below it, see pinned_block()):
      weights       fp32 shards, pinned            gradients  fp32 shards, pinned (kept between steps: the
      moments       AdamW's two, 8 B x shard rows              allocator caches freed pinned blocks)
      temporaries   AdamW per tensor on the CPU: two fp32 copies of the largest shard
      reference     --kl-ref's bf16 shards, pinned
    Rank 0, once a run (every run): export_hf's full state on the host, 4 B x parameters in fp32 and its copy in
    the checkpoint's dtype (2 B x parameters for bf16), beside the rest (the final export; each --export-every
    too). Loading is smaller: rank 0's fp32 full state, 4 B x parameters, beside the pinned weights alone.
    Not counted: vLLM's host copies while it sleeps (runtime buffers, CUDA graphs; level 1: its bf16 weights),
    the page cache of the checkpoint files."""
    rows, threshold = _rows(config.to_json_string()), pinned_round_threshold(environ)
    block = lambda nbytes: pinned_block(nbytes, threshold)
    params = sum(d0 * rest for d0, rest in rows)
    shard = [-(-d0 // ranks) * rest for d0, rest in rows]  # elements of rank 0's shard of each parameter
    offload = getattr(args, "cpu_offload", False)
    parts = dict.fromkeys(("weights", "gradients", "moments", "temporaries", "reference", "rounding"), 0)
    if offload:
        parts["weights"] = parts["gradients"] = sum(block(4 * n) for n in shard)
        parts["moments"], parts["temporaries"] = 8 * sum(shard), 2 * 4 * max(shard)
        parts["reference"] = sum(block(2 * n) for n in shard) if args.kl_ref else 0
        parts["rounding"] = 2 * sum(block(4 * n) - 4 * n for n in shard) + (
            sum(block(2 * n) - 2 * n for n in shard) if args.kl_ref else 0
        )
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
    """The trainer's peak GPU memory in a step, bytes: an estimate from the model's shapes, calibrated on
    bench/memory.py's simulations (Qwen2.5-Math-1.5B and 7B, docs/memory.md: 0-11% above them).

    The larger of the optimizer step (20 B x parameters / ranks: fp32 weights, gradients, AdamW's two moments,
    the foreach update's temporaries) and pass 2: 16 B x parameters / ranks of sharded state and the larger of
    its two moments, for T tokens in the widest micro-batch (--micro-batch-size x (--max-prompt-len +
    --max-response-len)):
      decoder backward   the gathered root and one layer with their gradients and buffers (4 B x root + 10 B x
                         layer parameters), one fp32 block of the loss head, and per token the checkpointed
                         input of every layer (2 B x hidden) and the layer being recomputed (about 50 B x hidden;
                         + 7 B x intermediate size without the tiled MLP; every layer's activations without
                         activation checkpointing);
      loss head          the gathered root (bf16), the checkpointed inputs and the final hidden states, and
                         five fp32 [HEAD_CHUNK, vocab] blocks (logits, softmax, their gradients).
    With --cpu-offload the sharded state is in host memory (a unit's fp32 weights and gradients on their way,
    simulated too, are not alive at the peak). --kl-ref adds its bf16 shards, 2 B x parameters / ranks (in host
    memory with --cpu-offload)."""
    params, layer, root = model_shapes(config)
    offload, H, L = getattr(args, "cpu_offload", False), config.hidden_size, config.num_hidden_layers
    tokens, block = (
        args.micro_batch_size * (args.max_prompt_len + args.max_response_len),
        HEAD_CHUNK * config.vocab_size * 4,
    )
    per_token = (2 * L * H + 50 * H) if args.activation_checkpointing else L * 52 * H
    if not args.mlp_chunk_tokens:
        per_token += 7 * config.intermediate_size
    decoder = 4 * root + 10 * layer + block + per_token * tokens
    head = 2 * root + (2 * L * H + 8 * H) * tokens + 5 * block
    pass2 = (0 if offload else 16 * params / ranks) + max(decoder, head)
    reference = 2 * params / ranks if args.kl_ref and not offload else 0.0
    return max(pass2, 0 if offload else 20 * params / ranks) + reference


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
    # What vLLM's share sits beside on the GPU. Levels 1 and 2 free vLLM's GPU memory while the trainer runs (1 keeps
    # its weights in host memory, 2 drops them; both drop the KV cache), so vLLM only meets the trainer's resident
    # state. --vllm-sleep-level 0 keeps vLLM's whole share through the training step: the plan sizes that share to
    # fit beside the step's peak rather than refusing the level outright (the user asked for it with
    # --vllm-allow-awake, and a share that fits is as honest as a refusal; one that does not is refused below,
    # naming --vllm-sleep-level 2).
    awake = on_gpu and getattr(args, "vllm_sleep_level", 2) == 0
    beside = max(peak, trainer) if awake else trainer
    margin, weights, workspace = MARGIN_GIB * gib, 2 * params, VLLM_WORKSPACE_GIB * gib
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    full_length = args.max_prompt_len + max(args.max_response_len, args.eval_max_tokens)
    least = weights + workspace + kv_per_token * full_length  # vLLM's least: one full-length sequence at a time
    given = args.vllm_gpu_memory_utilization
    utilization = given or min(max(gpu_bytes - beside - margin, 0.0) / gpu_bytes, 0.95)
    share = utilization * gpu_bytes
    kv_bytes = share - weights - workspace
    what = (
        "its step, fsdp_vllm.trainer_peak_bytes: --vllm-sleep-level 0 keeps vLLM awake through it"
        if awake
        else f"{'12' if not offload else '0'} B x {params / 1e9:.2f}B params / {ranks} rank(s)"
        f"{' + the --kl-ref reference' if reference and not offload else ''}"
    )
    short = []
    if share < least:
        short.append(
            f"vLLM would get {share / gib:.1f} GiB beside the trainer's {beside / gib:.1f} GiB "
            f"({what}) and the {MARGIN_GIB:g} GiB "
            f"margin, less than the {least / gib:.1f} GiB it needs (bf16 weights {weights / gib:.1f}, workspace "
            f"{workspace / gib:.1f}, one sequence of {full_length} tokens {kv_per_token * full_length / gib:.2f})"
        )
    if given and share + beside + margin > gpu_bytes:  # the plan's own share always leaves the room
        short.append(
            f"--vllm-gpu-memory-utilization {given:g} gives vLLM {share / gib:.1f} GiB, which beside the "
            f"trainer's {beside / gib:.1f} GiB ({what}) and the {MARGIN_GIB:g} GiB margin needs "
            f"{(share + beside + margin) / gib:.1f} GiB, more than the GPU's {gpu_bytes / gib:.1f}"
        )
    if peak + margin > gpu_bytes:
        short.append(
            f"the trainer's step needs about {peak / gib:.1f} GiB (fsdp_vllm.trainer_peak_bytes: "
            f"{params / 1e9:.2f}B params / {ranks} rank(s), micro-batch {args.micro_batch_size} x "
            f"{args.max_prompt_len + args.max_response_len} tokens) + the {MARGIN_GIB:g} GiB margin"
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
        "gpu_memory_utilization": round(utilization, 3),
        "vllm_share_gib": share / gib,
        "vllm_weights_gib": weights / gib,
        "vllm_workspace_gib": workspace / gib,
        "kv_cache_gib": kv_bytes / gib,
        "kv_bytes_per_token": kv_per_token,
        "full_length": full_length,
        "vllm_least_gib": least / gib,
        "margin_gib": MARGIN_GIB,
        "vllm_beside_gib": beside / gib,
        "vllm_awake_in_step": awake,
        "max_num_seqs": int(min(1024, max(16, kv_bytes // (kv_per_token * full_length)))),
        "short": short,
    }


def _refusal(plan, config, args, ranks, gpu_bytes, host_bytes, local_ranks):
    """The one line of a setting that does not fit: what is short, then the flags that would fit, if any."""
    import copy

    def fits_with(change):
        other = copy.copy(args)
        vars(other).update(change)
        return not _plan(config, other, ranks, gpu_bytes, host_bytes, local_ranks)["short"]

    fits = []
    if not getattr(args, "cpu_offload", False) and fits_with({"cpu_offload": True}):
        fits.append("--cpu-offload")
    for mb in range(args.micro_batch_size - 1, 0, -1):  # the largest --micro-batch-size that fits
        if fits_with({"micro_batch_size": mb}):
            fits.append(f"--micro-batch-size {mb}")
            break
    if args.kl_ref and not args.kl_coef and fits_with({"kl_ref": False}):
        fits.append("no --kl-ref")
    if plan["vllm_awake_in_step"] and fits_with({"vllm_sleep_level": 2}):
        fits.append("--vllm-sleep-level 2 (vLLM asleep during the step)")
    given = args.vllm_gpu_memory_utilization
    if given:
        room = math.floor((gpu_bytes - plan["vllm_beside_gib"] * 2**30 - MARGIN_GIB * 2**30) / gpu_bytes * 1000) / 1000
        if 0 < room < given and fits_with({"vllm_gpu_memory_utilization": room}):  # the largest that fits
            fits.append(f"--vllm-gpu-memory-utilization {room:g}")
        if fits_with({"vllm_gpu_memory_utilization": None}):
            fits.append("no --vllm-gpu-memory-utilization (the plan's)")
    more = None  # the fewest GPUs that fit: on this node (its host memory shared by more ranks), or over more nodes
    for r in (r for r in (2, 4, 8, 16, 32, 64, 128) if ranks < r <= 8 * ranks):
        if not _plan(config, args, r, gpu_bytes, host_bytes, local_ranks * r // ranks)["short"]:
            more = f"{r} GPUs (torchrun --nproc_per_node {r})" if ranks == local_ranks else f"{r} GPUs"
        elif not _plan(config, args, r, gpu_bytes, host_bytes, local_ranks)["short"]:
            more = f"{r} GPUs over {-(-r // local_ranks)} nodes of {local_ranks}"
        if more:
            break
    if more:
        fits.append(more)
    gib = 2**30
    left = (plan["vllm_share_gib"] - plan["vllm_weights_gib"] - plan["vllm_workspace_gib"]) * gib
    tokens = int(left // plan["kv_bytes_per_token"]) - args.max_prompt_len
    if plan["short"] and plan["short"][0].startswith("vLLM") and len(plan["short"]) == 1 and tokens >= 1:
        fits.append(f"--max-response-len {tokens} --eval-max-tokens {tokens} (one sequence's KV cache)")
    fix = (
        ("fits with " + "; or ".join(fits))
        if fits
        else ("no flag of train_full.py fits it on this GPU: use a GPU with more memory")
    )
    return (
        f"--model {args.model}: does not fit this {gpu_bytes / gib:.1f} GiB GPU: "
        + "; ".join(plan["short"])
        + f"; {fix}"
    )


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


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

    capability: the GPU's (major, minor). On compute capability 8.x (A100, A10G, L4, L40S, RTX 3090/4090) and on
    ROCm, vLLM's batch-invariant mode registers its own kernels for aten::linear, matmul, mm and addmm for the whole
    process and never removes them (model_executor/determinism/batch_invariant.py:1318-1329, the family test in
    platforms/interface.py:577-588, switched on as the worker starts, v1/worker/gpu_worker.py:1649-1651). Under
    external_launcher vLLM runs in the trainer's process, and the replaced linear and matmul have no backward: the
    trainer's loss.backward() fails (aten::linear_backward; tests/test_gpu_findings.py shows it on CPU). On 9.x
    and above only mean, softmax, log-softmax and bmm are replaced, whose backward formulas stay torch's: allowed.
    training=False (--eval-only): no backward, allowed everywhere."""
    if not training or not batch_invariant_on(environ):
        return None
    major, minor = capability
    if major != 8 and not hip:
        return None
    gpu = (f"{name}, " if name else "") + ("ROCm" if hip else f"compute capability {major}.{minor}")
    return (
        f"VLLM_BATCH_INVARIANT=1 on this GPU ({gpu}): vLLM 0.32 then replaces torch's linear, matmul, mm and addmm "
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


def vllm_engine_args(model_path, args, cuda, utilization, max_num_seqs, seed):
    """The keyword arguments of the colocated engine's vllm.LLM (which hands them to EngineArgs).

    Sleep mode on a GPU (--vllm-sleep-level 1 or 2) comes with sleep_mode_offload_cudagraph (vLLM 0.32's default
    is off: config/model.py:380): the CUDA graphs are then captured into vLLM's sleep-mode pool (the "cudagraph"
    tag: config/vllm.py:687-700, compilation/cudagraph_pool.py:33-45), which sleep copies to host memory and unmaps
    at every level, beside the "runtime" tag (device_allocator/sleep_mode_backend.py:127-137), and every wake maps
    back in place. Without it the graph pools stayed on the GPU beside the trainer's step, counted nowhere. With
    it vLLM sets NCCL_GRAPH_REGISTER=0 for the process (config/vllm.py:2243-2250): graph capture only, which the
    trainer never does. On CPU vLLM has no sleep mode and no graphs (enforce_eager), and takes its KV cache size
    in bytes (--vllm-kv-cache-gb)."""
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

    generate() runs this rank's prompts; sleep() frees its GPU memory for training;
    update_weights() streams the new weights in through vLLM 0.32's reload_weights (in place,
    checkpoint format) and resets the prefix cache, whose KV entries belong to the old weights.
    Asleep (level 2), vLLM 0.32 keeps no weights and no KV cache on the GPU, and its runtime buffers
    and CUDA-graph pools wait in host memory (the graphs because vllm_engine_args turns on
    sleep_mode_offload_cudagraph); a wake maps them back, after a check that the GPU
    has the memory for them (wake_shortfall): one line instead of an out-of-memory error inside vLLM.
    """

    def __init__(self, model_path, args, dist_):
        check_batch_invariant(args, dist_.device)  # before vLLM is built: its worker replaces the kernels as it starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        from vllm import LLM

        self.cuda = cuda = dist_.device.type == "cuda"
        self.sleep_level = args.vllm_sleep_level if cuda else 0  # vLLM has no sleep mode on CPU
        utilization, max_num_seqs = args.vllm_gpu_memory_utilization or 0.5, args.vllm_max_num_seqs or 256
        if cuda:
            from transformers import AutoConfig

            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the free memory
            plan = vllm_memory_plan(
                AutoConfig.from_pretrained(model_path),
                args,
                dist_.world,
                torch.cuda.get_device_properties(dist_.device).total_memory,
            )
            utilization = plan["gpu_memory_utilization"]
            max_num_seqs = args.vllm_max_num_seqs or plan["max_num_seqs"]
            if dist_.is_main:
                print(
                    f"vLLM memory plan: trainer shards {plan['trainer_resident_gib']:.1f} GiB of {plan['gpu_gib']:.1f} "
                    f"while vLLM generates{' (--cpu-offload: in host memory)' if args.cpu_offload else ''}, its step "
                    f"~{plan['trainer_peak_gib']:.1f} GiB "
                    f"{'beside vLLM awake' if plan['vllm_awake_in_step'] else 'while vLLM sleeps'}, gpu_memory_utilization "
                    f"{utilization}: vLLM's bf16 weights {plan['vllm_weights_gib']:.1f} GiB + workspace "
                    f"{plan['vllm_workspace_gib']:.1f} + KV cache ~{plan['kv_cache_gib']:.1f}, max_num_seqs "
                    f"{max_num_seqs}; generation {'is' if batch_invariant_on() else 'is not'} "
                    "batch-invariant (VLLM_BATCH_INVARIANT, docs/train_full.md)",
                    flush=True,
                )
        # per-request seeds (the default) fix every sample; with --unseeded-sampling the engine's own
        # seed draws them, so each rank gets its own (seed + rank) instead of 8 copies of one stream
        engine_seed = args.seed + (dist_.rank if args.unseeded_sampling else 0)
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
            torch.cuda.memory_allocated(),
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
        stream = _Drain(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        stream.drain()  # every rank must gather every tensor, even ones vLLM skipped
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


class HFEngine(_Engine):
    """HF generate on a plain (unsharded) copy of the policy on this rank: --rollout hf."""

    def __init__(self, model_path, args, dist_):
        from transformers import AutoModelForCausalLM

        self.device, self.batch = dist_.device, args.hf_generate_batch
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
    """The rollout engine of --rollout, and the trainer's CPU threads (offload_threads: --cpu-offload on a GPU).
    vLLM's workers seed torch, Python and NumPy as they start (set_random_seed): the rank's RNG (seeded with seed +
    rank, or restored by --resume) is put back afterwards."""
    engine = _make_engine(model_path, args, dist_)
    trainer = offload_threads(args, dist_.device)
    if trainer:
        engine.threads = (torch.get_num_threads(), trainer)
        torch.set_num_threads(trainer)
    return engine


def _make_engine(model_path, args, dist_):
    if args.rollout == "vllm":
        import numpy as np

        rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
        cuda_rng = torch.cuda.get_rng_state(dist_.device) if dist_.device.type == "cuda" else None
        try:
            engine = VLLMEngine(model_path, args, dist_)
        except ImportError as e:
            raise SystemExit(
                f"--rollout vllm needs vLLM ({e}): pip install -r requirements/full.txt, or use --rollout hf"
            )
        torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dist_.device)
        return engine
    return HFEngine(model_path, args, dist_)


def export_asleep(engine, model, args, export):
    """export() (full_io.export_hf) with the rollout engine asleep; the engine is left as ready as it was found.

    export_hf gathers each parameter whole, in fp32, on the GPU: torch moves the shard to its mesh's device, gathers
    it, and only then copies it to CPU (torch/distributed/_state_dict_utils.py:267-283); 2.03 GiB for the 7B's
    embedding and lm_head each. After a weight sync vLLM is awake, its weights and KV cache filling all of the GPU
    but the 4 GiB margin, so that gather could run out of memory after the last checkpoint, and every --resume would
    retry it the same way. So the engine sleeps first (vLLM: weights and KV cache off the GPU, as in the trainer's
    step, whose peak the gather stays under; HFEngine: its copy goes to host memory). A level-2 sleep drops vLLM's
    weights: when the engine was awake, they are synced again after the export (one more weight sync per export),
    so a generate that follows uses the policy; when it was already asleep, the caller's next sync does it, as
    before the call. Every rank calls it (the gathers and the sync are collectives). Returns export()'s value."""
    awake = not (getattr(engine, "sleeping", False) or getattr(engine, "offloaded", False))
    engine.sleep()
    result = export()
    if awake and getattr(engine, "sleep_level", 0) == 2:
        engine.update_weights(full_named_tensors(model, getattr(torch, args.dtype)))
    return result


# ---------------------------------------------------------------------------------------------
# 5. Clocks, memory and MFU
# ---------------------------------------------------------------------------------------------
def clock(device, reset_peak=False):
    """time.perf_counter() after the device has finished its queued work: CUDA kernels run
    asynchronously, so without the synchronize a timer would stop before the GPU does.
    reset_peak: also start a new peak of memory_peak_gb (a step's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
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


MIN_DRIVER = {13: 580, 12: 525, 11: 450}  # the oldest NVIDIA driver (major) that runs a CUDA major version's builds


def cuda_diagnosis(torch_version=None, build_cuda="", driver=None, driver_cuda=None, gpus=None):
    """Why torch sees no CUDA device, in words (train_full's --device cuda line, scripts/gpu_check.sh): torch's
    build (CPU-only, or for CUDA X.Y) against this node's NVIDIA driver (its version and the newest CUDA it
    runs). Without arguments it reads them here: torch.version.cuda, nvidia-smi and libcuda."""
    if torch_version is None:
        torch_version, build_cuda = torch.__version__, torch.version.cuda
        driver, driver_cuda, gpus = _driver_facts()
    if not build_cuda:
        return (
            f"torch {torch_version} is a CPU-only build; install torch's CUDA build (pip install -r "
            "requirements/full.txt: the PyPI wheel of torch on Linux is the CUDA build)"
        )
    facts = f"torch {torch_version} is built for CUDA {build_cuda}"
    if driver is None:
        return f"{facts}, and no NVIDIA driver answers here (nvidia-smi and libcuda.so.1 not found): install the driver"
    needed, major = MIN_DRIVER.get(int(build_cuda.split(".")[0])), driver.split(".")[0]
    facts += f"; the NVIDIA driver is {driver} (it runs CUDA up to {driver_cuda or '?'})"
    if needed and major.isdigit() and int(major) < needed:
        return (
            f"{facts}, older than the R{needed}+ that CUDA {build_cuda.split('.')[0]} needs: update the driver, or "
            f"install a torch built for CUDA {driver_cuda or 'your driver'} or older (https://download.pytorch.org/whl/)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"{facts}; nvidia-smi lists {len(gpus or [])} GPU(s)"
        + (f" and CUDA_VISIBLE_DEVICES={visible!r} hides them" if visible is not None and gpus else "")
        + ": check the GPU, the driver and the container's access"
    )


def _driver_facts():
    """(driver version, the newest CUDA the driver runs as 'X.Y', [GPU names]) from nvidia-smi and libcuda; Nones
    where neither answers."""
    import ctypes
    import subprocess

    driver, driver_cuda, gpus = None, None, []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        rows = [line.split(", ", 1) for line in out.strip().splitlines() if ", " in line]
        driver, gpus = (rows[0][0], [name for _, name in rows]) if rows else (None, [])
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            driver_cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"
            driver = driver or "present (version unknown: no nvidia-smi)"
    except OSError:
        pass
    return driver, driver_cuda, gpus


PEAK_TFLOPS = (
    ("H100 PCIe", 756),
    ("H100 NVL", 835),
    ("H100", 989),
    ("H200", 989),
    ("H800", 989),
    ("A100", 312),
    ("A800", 312),
)  # dense bf16


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
