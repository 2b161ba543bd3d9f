"""support/fsdp.py: train_full.py's policy as FSDP2 shards over the ranks.

World, init_distributed      this process among the run's ranks (torchrun, or a world of one): nccl or gloo
gather_rows, gather_global, all_reduce   rows of different counts per rank, gathered in global order; a number
assign_rollouts              which rank trains which kept rollout (the load balance) and the step's mini-batches
load_policy, shard_policy    the HF model as FSDP2 shards: fp32 master weights, bf16 compute, fp32 reductions,
                             activation checkpointing, the tiled MLP (chunk_mlps); --cpu-offload
make_optimizer, full_named_tensors   AdamW; bf16 full tensors one at a time (the weight sync, the export)
"""

import datetime
import functools
import os
import socket

import torch
import torch.distributed as dist


class World:
    """This process among the ranks of the run: rank, size (ranks over all nodes), local_rank, device (where it
    trains and generates); is_main: rank 0, which writes the run's files."""

    def __init__(self, rank, size, local_rank, device):
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device
        self.is_main = rank == 0


def init_distributed(device_type, cpu_offload=False):
    """Join the torchrun process group (or make a world of one): nccl on CUDA, gloo on CPU; with --cpu-offload on
    CUDA both (cpu:gloo,cuda:nccl), for the collectives on the host-resident shards (clip_grad_norm_'s norm, the
    initial weights' broadcast). vLLM's external_launcher reads the same RANK / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT, so a plain `python train_full.py` sets them for a world of one."""
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = ("cpu:gloo,cuda:nccl" if cpu_offload else "nccl") if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, timeout=datetime.timedelta(minutes=60), device_id=device if device_type == "cuda" else None
        )
    return World(dist.get_rank(), dist.get_world_size(), local_rank, device)


def gather_rows(local, world):
    """Concatenate a [rows, ...] tensor over all ranks in rank order; rows may differ per rank (padded to the largest
    for all_gather). Returns (global tensor on CPU, rows per rank)."""
    dtype = local.dtype
    send = local.to(world.device, torch.uint8 if dtype == torch.bool else dtype)
    rows = torch.tensor([send.shape[0]], device=world.device)
    all_rows = [torch.zeros_like(rows) for _ in range(world.size)]
    dist.all_gather(all_rows, rows)
    counts = [int(r) for r in all_rows]
    padded = send.new_zeros((max(counts), *send.shape[1:]))
    padded[: send.shape[0]] = send
    parts = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(parts, padded)
    out = torch.cat([part[:n] for part, n in zip(parts, counts)]).cpu()
    return (out.bool() if dtype == torch.bool else out), counts


def all_reduce(value, world, op=dist.ReduceOp.SUM):
    """A Python number summed (or max'ed) over all ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=op)
    return t.item()


def gather_global(local, mine, total, world):
    """The [rows, ...] tensors of all ranks as one [total, ...] tensor in GLOBAL order (CPU):
    row r of this rank is global row mine[r]. Every rank gets the same tensor."""
    gathered, _ = gather_rows(local, world)
    where, _ = gather_rows(torch.tensor(mine, dtype=torch.long).view(-1, 1), world)
    out = torch.empty((total, *gathered.shape[1:]), dtype=gathered.dtype)
    out[where.view(-1)] = gathered
    return out


def assign_rollouts(lengths, home, ranks, m, balance):
    """Which rank trains each kept rollout of the step, and the step's m mini-batches.

    lengths: prompt + response tokens of each kept rollout, in global order (rank order = prompt order); home: the
    rank that generated it. The kept list is split into m contiguous mini-batches (torch.tensor_split, as verl splits
    its batch), whatever the number of ranks. With balance, each mini-batch's rollouts go longest first to the
    least-loaded rank (LPT), so a rank whose prompts were all solved still gets its share; without it each rollout
    stays home. Which rank computes a rollout changes neither the kept set nor any normalizer.
    Returns (owner: rank of each kept rollout, parts: m lists of global indices); the same on every rank."""
    owner = list(home)
    parts = [part.tolist() for part in torch.arange(len(lengths)).tensor_split(m)]
    if balance:
        for part in parts:
            load = [0] * ranks
            for g in sorted(part, key=lambda g: (-lengths[g], g)):
                owner[g] = min(range(ranks), key=lambda r: (load[r], r))
                load[owner[g]] += lengths[g]
    return owner, parts


def load_policy(args, world, reference=False):
    """The trainable policy: fp32 master weights sharded with FSDP2, compute in args.dtype.

    reference=True: the same model, frozen, stored in args.dtype (bf16 on GPU, sharded), for the KL of --kl-ref.
    Memory: rank 0 reads the checkpoint on CPU, the others build the model on the meta device; after fully_shard
    rank 0 broadcasts the full weights and each rank keeps its shard, so a 7B model never sits 8 times in host
    memory. With --cpu-offload the shards stay in host memory (CPUOffloadPolicy), only the buffers go to the GPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    storage = getattr(torch, args.dtype) if reference else torch.float32
    config = AutoConfig.from_pretrained(args.model)
    full_state = AutoModelForCausalLM.from_pretrained(args.model, dtype=storage).state_dict() if world.is_main else None
    checkpoint_dtype = config.dtype  # e.g. bfloat16: what export_hf writes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=storage)
    model.config.dtype, model.config.use_cache = checkpoint_dtype, False
    shard_policy(model, args)
    model.to_empty(device="cpu" if getattr(args, "cpu_offload", False) else world.device)
    set_model_state_dict(
        model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    _init_rotary_buffers(model, world.device)  # non-persistent: not in the checkpoint, garbage after to_empty
    return model.eval().requires_grad_(False) if reference else model.train()


def shard_policy(model, args, mesh=None):
    """FSDP2 in place. --cpu-offload (choice): CPUOffloadPolicy keeps the sharded weights, their gradients and so
    AdamW's state in host memory, each unit's weights copied to the GPU for its forward and backward
    (docs/train_full.md, "One GPU"). bench/memory.py calls this too: the plan simulates the real wrapping."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mlp_chunk_tokens:
        chunk_mlps(model, args.mlp_chunk_tokens)
    compute = getattr(torch, args.dtype)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)  # fp32 master weights + reductions
    offload = OffloadPolicy()
    if getattr(args, "cpu_offload", False):  # pinned host memory where there is a GPU to copy to (pin_memory needs one)
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if not model.config.tie_word_embeddings:  # an untied embedding (the 7B) is needed in forward only: 1 GiB freed
        fully_shard(model.model.embed_tokens, **kw)
    # root (final norm, lm_head; the tied embedding): stays gathered after forward for the loss head, which calls
    # lm_head block by block; backward starts there (a no-grad forward, which has no backward, reshards it: reshard)
    fully_shard(model, reshard_after_forward=False, **kw)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # an FSDPModule
            module.set_gradient_divide_factor(1.0)  # SUM over ranks: the loss already divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    # every rank reduce-scatters every parameter's gradient (loss_head.response_logp_at), so that no torch switch
    # (set_reduce_scatter_unused_params, torch >= 2.13 only) is needed for the ranks' collectives to match
    return model


def reshard(model):
    """Free a root's gathered weights after a no-grad forward: the root is wrapped reshard_after_forward=False
    for the loss head, and only a backward would reshard it. (--kl-ref's reference never runs one: its lm_head,
    1 GiB in bf16 for the 7B, would stay gathered beside vLLM.)"""
    if hasattr(model, "reshard"):
        model.reshard()


def chunk_mlps(model, chunk_tokens):
    """Tiled MLP: each decoder layer's MLP runs over slices of about chunk_tokens tokens along the sequence, each
    checkpointed with grad. Its [n, L, intermediate] activations (gate, up, their product: 5.3x the hidden size for
    Qwen2.5) exist for one slice at a time, in forward and backward. Per-token: the output equals the whole MLP's."""
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
    """The rotary buffers, computed afresh on the compute device (--cpu-offload made the model on the CPU: FSDP2 moves
    weights, never buffers)."""
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
