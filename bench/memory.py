"""bench/memory.py: the per-GPU memory of train_full.py's training step, simulated on a CPU.

    python bench/memory.py --preset 7b --ranks 8 --micro-batch-size 4 --response-len 3000 --method d3s
    python bench/memory.py --preset 1.5b --ranks 1 --method grpo
    python bench/memory.py --preset llama3-8b --ranks 8 --micro-batch-size 16 --gpu 80gb --method d3s-i
    python bench/memory.py --preset MODEL        # MODEL (a placeholder): a model folder with config.json, or the file itself
    python bench/memory.py --preset 7b -- --no-activation-checkpointing   # after "--": train_full.py flags
    python bench/memory.py --preset 1.5b --ranks 1 --gpu 24gb -- --cpu-offload   # one GPU: trainer + vLLM

It runs train_full.py's own code (its flags, and its plumbing's in support/) for the trainer's
part of a step: the model built from the config in fp32, fsdp.shard_policy (FSDP2 per decoder
layer, the untied embedding and the root, bf16 compute, fp32 reductions, activation
checkpointing, tiled MLP), fsdp.make_optimizer (AdamW), loss_head.pack,
loss_head.response_logp (log-probs, and d3s.token_entropy in pass 1), d3s.select_tokens,
d3s.policy_loss, backward, gradient clipping and the optimizer step. As steps 4-6 of train_full's loop:

    pass 1  no grad, per micro-batch: old log-probs + entropy of the kept rollouts (the
            methods without token selection: old log-probs only, as for mini-batches 2..M)
    tokens  the kept-token mask (d3s.select_tokens keeps K of the tokens; every token for the
            methods without token selection)
    pass 2  per micro-batch: forward, d3s.policy_loss over the kept tokens, backward
            (micro-batch 2 onwards accumulates into the gradients of micro-batch 1); the
            methods without token selection also take their entropy metric from its logits
    update  clip_grad_norm_, AdamW step, zero_grad(set_to_none=True)
    sync    fsdp.full_named_tensors: each parameter gathered whole, cast to bf16, for vLLM
            (the trainer's side only)

for --steps steps (default 2: step 1 has no optimizer state yet, step 2 does). With --kl-ref (after
"--") the frozen bf16 reference is built and sharded as fsdp.load_policy does and forwarded in
pass 1, then resharded (fsdp.reshard). With --cpu-offload the sharded state lives in host memory:
the figures are the GPU's, the host's state is reported apart (below).

--gpu SIZE adds vLLM's share (gpu.vllm_memory_plan on a GPU of that size: bf16 weights,
workspace, KV cache) and reports the peak of trainer plus vLLM over a step's two phases:
generating (the trainer's resident bytes, counted at the end of the simulated step, beside vLLM's
share) and training (the trainer's simulated peak; vLLM asleep holds no GPU memory that torch or the
plan sees: weights and KV cache freed, runtime buffers and CUDA-graph pools copied to host memory, the
graphs because engines.vllm_engine_args turns on sleep_mode_offload_cudagraph, off by default in 0.32).
The plan's margin (CUDA context, NCCL, fragmentation) is left for what the simulation leaves out.

How it allocates nothing: every tensor is a FakeTensor (shape, dtype and device `cpu`, no
data), under torch's FakeTensorMode. The process is rank 0 of a fake process group of --ranks
ranks (FakeStore, backend "fake": collectives return at once), on a CPU DeviceMesh, so FSDP2
holds the 1/R shard a GPU would hold and all-gathers whole layers into buffers of their real
size. torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker counts the bytes of every
tensor alive, by category, and keeps the peak. The micro-batch is per rank, as in train_full.

What makes the fake run read like a GPU (each a context manager or a line below):
- sharding_propagation_apart: DTensor works out each op's global output shape by running the
  op on global-shape fake tensors under the fake mode it finds active, i.e. ours; the tracker
  would count those (AdamW's foreach step on global shapes: the 7B at micro-batch 4 reads
  103.0 GiB instead of 46.4). A fake mode of their own keeps them out: the tracker counts only
  ops of the fake mode it was entered under.
- foreach=True: on CUDA, AdamW's default (foreach=None) picks the foreach implementation, whose
  temporaries span all parameters at once; on CPU tensors it would pick the per-tensor loop.
- cuda_entropy_chunks: d3s.token_entropy sizes its chunks by device; it gets the CUDA size.
- zero_reads: d3s.policy_loss logs `stats` with float(...), which needs values that fake
  tensors do not have. Inside that call only, such reads return 0; the loss is computed as usual.
- no_hooks_without_grad: keeps the tracker itself from leaking pass 1's embedding outputs.

Why not fake `cuda` tensors: on a CPU-only build, autograd on fake cuda tensors aborts the
process. CPU and CUDA differ in the attention kernel (here SDPA's CPU flash kernel, on the GPU
flash / memory-efficient attention; both keep O(L) per head, not the O(L^2) scores).

- offload_copies (--cpu-offload): FSDP2 copies each unit's fp32 shards to the GPU before its
  all-gather and its reduced gradients back to the host; on the simulated `cpu` device those copies
  would be the tensors themselves, so they are made real copies here, and counted while they live.

Left out, so add them when you budget a GPU: the CUDA context, NCCL's buffers,
the caching allocator's fragmentation (reserved above allocated), and what vLLM keeps while
it sleeps (level 2 frees weights and KV cache; its runtime buffers and CUDA-graph pools go to host
memory, the graphs with sleep_mode_offload_cudagraph, which engines.vllm_engine_args turns on; its NCCL buffers
stay). The plan's MARGIN_GIB stands for them.

Output: a table of the peak by category, then one JSON line (peak_gib, ranks, micro_batch_size,
response_len, method, k_frac, breakdown_gib, ...). Figures are GiB (2^30 bytes).
"""

import contextlib
import io
import json
import math
import os
import resource
import sys
import time
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
import d3s  # noqa: E402
from support import methods, fsdp, loss_head, gpu  # noqa: E402
import train_full  # noqa: E402

GIB = 2**30
# GPU sizes of --gpu, GiB as torch reports them (total_memory): the smallest card of each class.
GPUS = {"24gb": 22.0, "48gb": 44.4, "80gb": 79.1}  # L4 / A10G (RTX 4090: 23.6), L40S (A6000: 47.5), H100 / A100 80GB
# Qwen2.5-Math's and Llama-3.1-8B's shapes (the fields that set the memory; the hub configs' other fields do not).
PRESETS = {
    "1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",  # the hub checkpoints' (what export_hf writes); the simulation builds fp32 weights
    },
    "7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",  # the hub checkpoints' (what export_hf writes); the simulation builds fp32 weights
    },
    # Llama-3.1-8B(-Instruct)'s shapes, the paper's second model (its hub config.json; rope_scaling, which sets no
    # memory, left out). An untied 128,256-token head, 8 KV heads of 128 over 32 layers.
    "llama3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "dtype": "bfloat16",
    },
}
# The tracker's categories, grouped for the table.
GROUPS = {
    "parameters": ("Sharded Param", "Unsharded Param", "All Gather", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer state": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
}
HOST = ("Sharded Param", "Sharded Grad", "OptState")  # with --cpu-offload: in host memory (--kl-ref's shards too)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    f, n, length = cli.flag, cli.number, cli.number(int, 1, 2**20, what="an int in [1, 2^20]")
    flags = [
        f(
            "--preset",
            "7b",
            None,
            "1.5b or 7b (Qwen2.5-Math shapes), llama3-8b (Llama-3.1-8B's), or a model folder / its config.json",
        ),
        f("--ranks", 8, n(int, 1, 65536), "FSDP ranks (GPUs); each holds 1/ranks of the sharded state"),
        f("--micro-batch-size", 4, n(int, 1, 65536), "rollouts per forward/backward on one rank"),
        f("--response-len", 3000, length, "response tokens per rollout (train_full --max-response-len)"),
        f(
            "--prompt-len",
            512,
            length,
            "prompt tokens per rollout (MATH levels 3-5: 99%% of the problems are under 1,060 characters, plus 161 "
            "for the Qwen template; train_full drops prompts over --max-prompt-len 1024)",
        ),
        f("--method", "d3s", methods.NAMES, "those with token selection keep K of the tokens"),
        f(
            "--k-frac",
            None,
            n(float, 0, 1, low_open=True, what="a fraction of the tokens in (0, 1]"),
            "fraction of tokens kept by the token-selecting methods (default: train_full's --k-final, 0.20, the "
            "largest K of the schedule)",
        ),
        f(
            "--steps",
            2,
            n(int, 1, 100, what="an int in [1, 100] (2: the second step has the optimizer state)"),
            "optimizer steps to simulate (>= 2: step 1 has no optimizer state)",
        ),
        f(
            "--micro-batches",
            2,
            n(int, 1, 1024),
            "micro-batches per step on a rank (>= 2: the second accumulates into the first one's gradients)",
        ),
        f(
            "--gpu",
            None,
            None,
            f"a GPU size ({', '.join(f'{k}: {v} GiB' for k, v in GPUS.items())}, or GiB as a number): adds vLLM's "
            "share by the plan (gpu.vllm_memory_plan) and the peak of trainer plus vLLM",
        ),
    ]
    epilog = "Arguments after '--' go to train_full.parse_args (e.g. -- --no-activation-checkpointing)."
    p = cli.parser("memory.py", __doc__.split("\n\n")[0], flags, epilog=epilog)
    args = p.parse_args(argv)
    if args.gpu is not None:
        size = GPUS.get(args.gpu.lower())
        try:
            size = size or float(args.gpu)
        except ValueError:
            p.error(f"--gpu {args.gpu!r}: not a GPU size; pass {', '.join(GPUS)} or GiB as a number")
        if not 1 <= size <= 4096:
            p.error(f"--gpu {args.gpu}: must be in [1, 4096] GiB")
        args.gpu_gib = size
    check_preset(p, args.preset)
    # train_full's own flags (after "--"), checked by train_full.parse_args now rather than after the model is built;
    # its one-line error is given this script's name and says where the flag came from
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            trainer_args(args.micro_batch_size, args.response_len, args.method, train_argv)
    except SystemExit as e:
        if not e.code:  # -- --help: train_full.py's help is printed; stop there
            raise
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else str(e.code)
        message = message.split(": error: ", 1)[-1]
        if message.startswith("unrecognized arguments: "):
            p.error(
                f"unrecognized arguments after '--': {message.split(': ', 1)[1].split('; ')[0]}; they go to "
                "train_full.py, see python train_full.py --help for its flags"
            )
        p.error(f"{message} (a train_full.py flag, given after '--')")
    args.train_argv = train_argv
    return args


def check_preset(p, preset):
    """--preset: a preset's name, or a model folder holding config.json, or that file: readable JSON with a
    model_type that transformers knows."""
    if preset in PRESETS:
        return
    fix = f"choose {' or '.join(PRESETS)}, or give a model folder holding config.json (or the file itself)"
    if not preset.strip() or not os.path.exists(preset):
        p.error(f"--preset {preset!r}: no such preset, folder or file; {fix}")
    path = os.path.join(preset, "config.json") if os.path.isdir(preset) else preset
    if not os.path.isfile(path):
        p.error(f"--preset {preset}: the folder holds no config.json; {fix}")
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        p.error(f"--preset {path}: not a readable JSON config ({type(e).__name__}: {' '.join(str(e).split())}); {fix}")
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        p.error(f"--preset {path}: no 'model_type' field; is this a transformers config.json? {fix}")
    from transformers import CONFIG_MAPPING

    if fields["model_type"] not in CONFIG_MAPPING:
        p.error(f"--preset {path}: model_type {fields['model_type']!r} is not one transformers knows; {fix}")
    try:
        load_config(path)
    except Exception as e:  # a field transformers refuses: the same config is built again in main
        p.error(
            f"--preset {path}: transformers cannot build a config from it ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); {fix}"
        )


def load_config(preset):
    """A transformers config: a preset's shapes, or a model folder's / file's config.json."""
    from transformers import AutoConfig

    if preset in PRESETS:
        fields = dict(PRESETS[preset])
    else:
        path = os.path.join(preset, "config.json") if os.path.isdir(preset) else preset
        if not os.path.isfile(path):
            raise SystemExit(f"--preset {preset}: no config.json there; give a model folder or its config.json")
        with open(path) as f:
            fields = json.load(f)
        if "model_type" not in fields:
            raise SystemExit(f"--preset {path}: no 'model_type' field; is this a transformers config.json?")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.use_cache = False  # as fsdp.load_policy
    return config


def trainer_args(micro_batch_size, response_len, method, extra=(), prompt_len=None):
    """train_full's own arguments and defaults, with the compute dtype it uses on a GPU (bf16). prompt_len: also
    --max-prompt-len, and --eval-max-tokens = response_len, so that the plan's sequences are the simulated ones."""
    argv = [
        "--model",
        "simulated",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--eval-data",
        "none",
        "--micro-batch-size",
        str(micro_batch_size),
        "--max-response-len",
        str(response_len),
    ]
    if prompt_len is not None:
        argv += ["--max-prompt-len", str(prompt_len), "--eval-max-tokens", str(response_len)]
    return train_full.parse_args(argv + ["--method", method] + list(extra))


# ---------------------------------------------------------------------------------------------
# The simulated world: a fake process group, DTensor's propagation apart, fake reads in the loss
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(ranks):
    """This process as rank 0 of `ranks` ranks whose collectives move no data; yields a CPU DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("bench/memory.py needs its own process group; torch.distributed is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield init_device_mesh("cpu", (ranks,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def sharding_propagation_apart():
    """Run DTensor's output-shape propagation under a fake mode of its own.

    DTensor computes each op's global output metadata by running the op on global-shape fake
    tensors, under `detect_fake_mode()`, i.e. our fake mode when one is active; FSDPMemTracker
    would then count those global tensors as if they were allocated. It skips ops that run under
    any fake mode other than the one it was entered under, so a private mode keeps them out.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    private = FakeTensorMode()
    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: private
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def cuda_entropy_chunks():
    """d3s.token_entropy picks its chunk by device: 2^21 fp32 elements on CPU, 2^26 on CUDA (see
    its code). The simulated tensors are on `cpu`, so it is given the chunk a GPU would use:
    larger temporaries (V = 152k: 441 rows, 256 MiB each) and far fewer ops to simulate."""
    original = d3s.token_entropy

    def token_entropy(logits, chunk_size=None):
        return original(logits, chunk_size=chunk_size or max(1, 2**26 // logits.shape[-1]))

    d3s.token_entropy = token_entropy
    try:
        yield
    finally:
        d3s.token_entropy = original


@contextlib.contextmanager
def offload_copies(on):
    """--cpu-offload: FSDP2 copies a unit's fp32 shards host -> GPU before its all-gather (FSDPParam.
    all_gather_inputs) and its reduced gradients GPU -> host after (foreach_reduce). On the simulated
    `cpu` device `.to("cpu")` is the tensor itself; here both are real copies, so that the GPU side
    (the staged weights before their bf16 cast, the reduce-scatter output before its copy) is
    counted while it lives and the host side is a tensor of its own."""
    if not on:
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed

    gather_inputs, reduce = _fsdp_param.FSDPParam.all_gather_inputs, _fsdp_param_group.foreach_reduce

    def all_gather_inputs(self):
        if self.offload_to_cpu and self.sharded_state == _fsdp_param.ShardedState.SHARDED:
            return [
                _to_dtype_if_needed(self._sharded_param_data.clone(), self.param_dtype)
            ]  # the H2D copy, then the cast
        return gather_inputs.fget(self)

    def foreach_reduce(*args, **kwargs):
        to = torch.Tensor.to

        def copying_to(tensor, *a, **kw):  # the D2H copy of the reduced gradients: a host tensor of its own
            return tensor.clone() if a and a[0] == torch.device("cpu") else to(tensor, *a, **kw)

        torch.Tensor.to = copying_to
        try:
            return reduce(*args, **kwargs)
        finally:
            torch.Tensor.to = to

    _fsdp_param.FSDPParam.all_gather_inputs = property(all_gather_inputs)
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        _fsdp_param.FSDPParam.all_gather_inputs, _fsdp_param_group.foreach_reduce = gather_inputs, reduce


@contextlib.contextmanager
def no_hooks_without_grad():
    """Keep the tracker from holding pass 1's embedding outputs for the rest of the run.

    The tracker's ModTracker puts a multi-grad hook on the inputs of every module call that
    require grad, also in a no-grad forward, where the hook can never fire. HF's gradient
    checkpointing makes the embedding output require grad even under no_grad (a leaf), and the
    hook then keeps it alive in a reference cycle: one [micro-batch, L, hidden] tensor per pass-1
    micro-batch, never freed. Without grad mode no such hook is registered.
    """
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook

    def register_multi_grad_hook(tensors, fn, **kwargs):
        return original(tensors, fn, **kwargs) if torch.is_grad_enabled() else None

    mod_tracker.register_multi_grad_hook = register_multi_grad_hook
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


class zero_reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Reading the value of a fake tensor (float(t), bool(t), t.item()) returns 0 / False.

    Used around d3s.policy_loss only, whose `stats` are floats for logging; values that fake
    tensors do hold (constants such as AdamW's step count) are returned as they are.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            return False if args[0].dtype == torch.bool else 0


def step_mem_tracker(model, optimizer, vocab_size, host=()):
    """An FSDPMemTracker that also notes the phase of the step at the peak, each phase's own
    peak, and the bytes of logits-shaped tensors ([..., V]: logits, their fp32 copies, softmax
    and their gradients) alive at the peak. The peak is the GPU's: the categories in `host`
    (--cpu-offload: the sharded state) are left out of it."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class StepMemTracker(FSDPMemTracker):
        def __init__(self):
            super().__init__(model, optimizer)
            self.phase, self.peak_phase, self.phase_peaks = "setup", None, {}
            self.logits_now, self.logits_at_peak, self._logits = 0, 0, {}
            self.device_peak, self.device_peak_snap = 0, {}

        def on_device(self, snap):
            return snap["Total"] - sum(v for k, v in snap.items() if k != "Total" and getattr(k, "value", k) in host)

        def _track(self, reftype, t):
            if t.dim() > 0 and t.shape[-1] == vocab_size:
                for st in get_untyped_storages(t):
                    if st not in self._WINFO and id(st) not in self._logits:
                        self._note_logits(st)
            super()._track(reftype, t)

        def _note_logits(self, st):
            key, nbytes = id(st), st.nbytes()

            def freed(_ref):
                self.logits_now -= nbytes
                self._logits.pop(key, None)

            self._logits[key] = weakref.ref(st, freed)
            self.logits_now += nbytes

        def _update_peak_stats(self, peak_state):
            # The global peak only: the per-module peaks of the base class walk every module's
            # stats after every op (most of the run time), and this report does not use them.
            for dev, snap in self._curr_mem_snap.items():
                now = self.on_device(snap)
                if now > self.device_peak:
                    self.device_peak, self.device_peak_snap = now, {dev: dict(snap)}
                    self.peak_phase, self.logits_at_peak = self.phase, self.logits_now
                self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)

    return StepMemTracker()


# ---------------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------------
def rollouts(n, prompt_len, response_len):
    """n rollouts at full length (the widest micro-batch train_full can pack)."""
    return [{"prompt_ids": [1] * prompt_len, "response_ids": [2] * response_len} for _ in range(n)]


def simulate(
    config,
    targs,
    ranks,
    micro_batch_size,
    response_len,
    prompt_len=512,
    k_frac=1.0,
    steps=2,
    micro_batches=2,
    fake=True,
):
    """Build, shard and train the policy for `steps` steps; returns the tracker's figures (bytes).

    fake=False runs the very same code on real CPU tensors (what the test compares against).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from transformers import AutoModelForCausalLM

    B, T = micro_batch_size * micro_batches, response_len  # rollouts on this rank, response width
    seqs = rollouts(B, prompt_len, T)
    chunks = [list(range(i, i + micro_batch_size)) for i in range(0, B, micro_batch_size)]
    packed = [loss_head.pack(seqs, rows, 0, torch.device("cpu")) for rows in chunks]  # real tensors, KiB
    # the kept tokens: K of them by d3s.select_tokens on random scores (the values do not matter here)
    scores = torch.rand(B, T, generator=torch.Generator().manual_seed(0))
    token_keep = d3s.select_tokens(scores, torch.ones(B, T, dtype=torch.bool), k_frac)
    normalizer = float(token_keep.sum()) * ranks  # the global count of kept tokens (train_full sums over ranks)
    kept_index = [token_keep[rows].nonzero(as_tuple=True) for rows in chunks]  # per micro-batch, real tensors
    offload = getattr(targs, "cpu_offload", False)

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    as_used = (lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t) if fake else (lambda t: t)
    with fake_world(ranks) as mesh, sharding_propagation_apart(), cuda_entropy_chunks(), offload_copies(offload), mode:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 master weights
        fsdp.shard_policy(model, targs, mesh=mesh)
        model.train()
        optimizer = fsdp.make_optimizer(model, targs)
        for group in optimizer.param_groups:
            group["foreach"] = True  # what AdamW(foreach=None) picks on CUDA
        reference = None
        if targs.kl_ref:  # as fsdp.load_policy(reference=True): stored in the compute dtype, frozen
            reference = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, targs.dtype))
            fsdp.shard_policy(reference, targs, mesh=mesh)
            reference.eval().requires_grad_(False)
        batches = [
            ({k: as_used(v) for k, v in inputs.items()}, as_used(targets), as_used(mask))
            for inputs, targets, mask in packed
        ]
        keep = as_used(token_keep)
        # pass 2 computes the LM head at the kept tokens only: their positions, counted on the real
        # mask (a fake tensor cannot count a mask: nonzero has a data-dependent shape)
        positions = [tuple(as_used(i) for i in index) for index in kept_index]
        tracker = step_mem_tracker(model, optimizer, config.vocab_size, host=HOST if offload else ())
        with no_hooks_without_grad(), tracker:
            for param in reference.parameters() if reference is not None else []:  # its shards count as sharded
                tracker._update_and_maybe_create_winfos(
                    param, _FSDPRefType.SHARDED_PARAM
                )  # weights (no track_external)
            for step in range(steps):
                _train_step(
                    model, optimizer, targs, batches, chunks, keep, positions, normalizer, tracker, step, reference
                )
                tracker.phase = f"step {step + 1} sync"  # the trainer's side of the weight sync to vLLM
                for _, tensor in fsdp.full_named_tensors(model, getattr(torch, targs.dtype)):
                    del tensor  # vLLM copies it into its own weights (not simulated) and lets it go
            tracker.phase = "end"
            end = tracker.get_tracker_snapshot("current")
            resident = held_bytes([model] + ([reference] if reference is not None else []), optimizer, offload)
        peak = tracker.device_peak_snap
    return {
        "peak": _by_name(peak),
        "end": _by_name(end),
        "peak_phase": tracker.peak_phase,
        "device_peak": tracker.device_peak,
        "phase_peaks": tracker.phase_peaks,
        "logits_at_peak": tracker.logits_at_peak,
        "resident": resident,
        "offload": offload,
    }


def fsdp_param_groups(module):
    """The FSDPParamGroups of a module that fully_shard wrapped ([] for any other): torch 2.13's list
    (FSDPState._fsdp_param_groups), torch 2.11's single group or None (_fsdp_param_group). A torch with neither
    raises AttributeError rather than reading as a module that holds nothing."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    if state is None:
        return []
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [group] if (group := state._fsdp_param_group) is not None else []


def held_bytes(models, optimizer, offload):
    """What the trainer holds on the GPU between steps, while vLLM generates: every storage reachable from
    the models (sharded weights, gathered weights an FSDP unit still holds, gradients, buffers) and the
    optimizer's state, counted once each by their size now (a freed FSDP buffer has size 0); with
    --cpu-offload the sharded weights, gradients and AdamW's state are the host's, not counted."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0

    def count(tensor):
        nonlocal total
        if tensor is None:
            return
        tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself (each call of untyped_storage() makes a new Python object)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()

    for model in models:
        for module in model.modules():
            for group in fsdp_param_groups(module):
                for fsdp_param in group.fsdp_params:  # what a unit keeps gathered (nothing, once resharded)
                    for tensor in getattr(fsdp_param, "all_gather_outputs", []):
                        count(tensor)
        for param in model.parameters():
            if not offload:
                count(param)
                count(param.grad)
        for buffer in model.buffers():
            count(buffer)
    if not offload:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    count(value)
    return total


def _train_step(model, optimizer, targs, batches, chunks, keep, positions, normalizer, tracker, step, reference=None):
    """Steps 4-6 of train_full's loop (forward_kept, update_policy): passes 1 and 2 and the update, on fixed
    micro-batches; with a reference (--kl-ref), its forward of every micro-batch in pass 1, then its reshard."""
    B, T = keep.shape
    old_logp = torch.zeros(B, T)
    entropy = torch.zeros(B, T)
    kept_adv = torch.ones(B)
    selects = methods.selects_tokens(targs.method)
    # pass 1, no grad: old log-probs and entropy (token selection); without token selection, the old
    # log-probs only, as for mini-batches 2..M (at M = 1 train_full skips pass 1 for those methods)
    with torch.no_grad():
        for (inputs, targets, _), rows in zip(batches, chunks if selects or targs.mini_batches > 1 else []):
            tracker.phase = f"step {step + 1} pass 1"
            tracker.reset_mod_stats()  # the tracker's per-module stats allow one root forward each
            logp, ent = loss_head.response_logp(model, inputs, targets, targs.temperature, with_entropy=selects)
            old_logp[rows] = logp
            if selects:
                entropy[rows] = ent
            del logp, ent
        fsdp.reshard(model)  # as loss_head.forward_no_grad ends
        for inputs, targets, _ in batches if reference is not None else []:
            tracker.phase = f"step {step + 1} pass 1 (reference)"
            ref_logp, _ = loss_head.response_logp(reference, inputs, targets, targs.temperature, with_entropy=False)
            del ref_logp
        if reference is not None:
            fsdp.reshard(reference)
    # pass 2: loss and backward per micro-batch, gradients accumulate; the methods without token
    # selection take their entropy metric from this forward's logits
    optimizer.zero_grad(set_to_none=True)
    for (inputs, targets, _), rows, index in zip(batches, chunks, positions):
        tracker.phase = f"step {step + 1} pass 2"
        tracker.reset_mod_stats()
        logp = loss_head.response_logp_at(model, inputs, targets, index, targs.temperature, with_entropy=not selects)
        if not selects:
            logp, ent = logp
            del ent
        with zero_reads():
            loss, _ = d3s.policy_loss(
                logp,
                old_logp[rows],
                kept_adv[rows],
                keep[rows],
                kind=targs.loss,
                clip_low=targs.clip_low,
                clip_high=targs.clip_high,
                normalizer=normalizer,
                agg=targs.loss_agg,
            )
        del logp
        loss.backward()
        del loss
    tracker.phase = f"step {step + 1} update"
    torch.nn.utils.clip_grad_norm_(model.parameters(), targs.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _by_name(snapshot):
    """{device: {RefType: bytes}} -> {category name: bytes} (one device here)."""
    out = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            out[name] = out.get(name, 0) + value
    return out


def sharded_state_bytes(config, ranks):
    """Arithmetic: fp32 bytes of one rank's parameter shards (FSDP2 gives rank 0 ceil(d0 / R) rows)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return sum(math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0]) * 4 for p in model.parameters()), sum(
        p.numel() for p in model.parameters()
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def report(args, result, state_bytes, n_params, k_frac, wall_s, plan=None, estimate=None):
    peak, end = result["peak"], result["end"]
    gib = lambda b: round(b / GIB, 3)
    groups = {name: sum(peak.get(k, 0) for k in keys) for name, keys in GROUPS.items()}
    offload = result["offload"]
    lines = [
        f"# Simulated peak memory per GPU: {args.preset}, {n_params / 1e9:.2f}B params, {args.ranks} ranks, "
        f"micro-batch {args.micro_batch_size} x ({args.prompt_len} prompt + {args.response_len} response) tokens, "
        f"{args.method} (K = {k_frac:g}), {args.steps} steps x {args.micro_batches} micro-batches"
        + (f", train_full flags {' '.join(args.train_argv)}" if args.train_argv else ""),
        "",
        "| category (at the peak) | GiB | tracker categories |",
        "|---|---|---|",
    ]
    for name, keys in GROUPS.items():
        parts = ", ".join(f"{k} {gib(peak.get(k, 0))}" for k in keys if peak.get(k, 0))
        where = " (host memory: --cpu-offload)" if offload and any(k in HOST for k in keys) and groups[name] else ""
        lines.append(f"| {name}{where} | {gib(groups[name]):.2f} | {parts} |")
    lines.append(
        f"| of which logits-shaped [..., V] | {gib(result['logits_at_peak']):.2f} | activations + temporaries |"
    )
    lines.append(
        f"| **peak** | **{gib(result['device_peak']):.2f}** | on the GPU, in {result['peak_phase']}"
        + (" (the host categories left out)" if offload else "")
        + " |"
    )
    lines += ["", "| phase | peak GiB on the GPU |", "|---|---|"]
    lines += [f"| {phase} | {gib(b):.2f} |" for phase, b in result["phase_peaks"].items()]
    lines += [
        "",
        f"Sharded state at the end (arithmetic: 4 B x ceil(rows / ranks) x columns = {gib(state_bytes):.3f} GiB "
        f"per copy): weights {gib(end.get('Sharded Param', 0)):.3f} GiB, AdamW moments "
        f"{gib(end.get('OptState', 0)):.3f} GiB (2 copies + step counts)"
        + (", in host memory (--cpu-offload)." if offload else "."),
        f"Held on the GPU between steps (while vLLM generates): {gib(result['resident']):.3f} GiB.",
        f"The plan's estimate of this step's peak (gpu.trainer_peak_bytes, --max-prompt-len {args.prompt_len}):"
        f" {gib(estimate or 0):.2f} GiB.",
        "Not included: CUDA context, NCCL buffers, allocator fragmentation, vLLM's sleeping remainder.",
        f"Simulated in {wall_s:.1f} s, max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB.",
    ]
    record = {
        "peak_gib": gib(result["device_peak"]),
        "preset": args.preset,
        "params": n_params,
        "ranks": args.ranks,
        "micro_batch_size": args.micro_batch_size,
        "response_len": args.response_len,
        "prompt_len": args.prompt_len,
        "method": args.method,
        "k_frac": k_frac,
        "steps": args.steps,
        "micro_batches": args.micro_batches,
        "train_args": args.train_argv,
        "peak_phase": result["peak_phase"],
        "cpu_offload": offload,
        "categories_gib": {name: gib(b) for name, b in groups.items()},
        "breakdown_gib": {k: gib(v) for k, v in peak.items() if k != "Total"},
        "logits_gib": gib(result["logits_at_peak"]),
        "phase_peaks_gib": {k: gib(v) for k, v in result["phase_peaks"].items()},
        "sharded_params_gib": gib(end.get("Sharded Param", 0)),
        "optimizer_state_gib": gib(end.get("OptState", 0)),
        "arithmetic_sharded_params_gib": gib(state_bytes),
        "peak_bytes": result["device_peak"],
        "resident_gib": gib(result["resident"]),
        "resident_bytes": result["resident"],
        "estimate_gib": gib(estimate or 0),
        "breakdown_bytes": {k: v for k, v in peak.items() if k != "Total"},
        "end_bytes": {k: v for k, v in end.items() if k != "Total"},
        "wall_s": round(wall_s, 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if plan is not None:
        generating = result["resident"] / GIB + plan["vllm_share_gib"]
        training = result["device_peak"] / GIB
        total = max(generating, training)
        lines += [
            "",
            f"## One GPU of {plan['gpu_gib']:g} GiB: trainer + vLLM (gpu.vllm_memory_plan)",
            "",
            "| phase | trainer GiB | vLLM GiB | together |",
            "|---|---|---|---|",
            f"| generating | {result['resident'] / GIB:.2f} (held) | {plan['vllm_share_gib']:.2f} (weights "
            f"{plan['vllm_weights_gib']:.2f} + workspace {plan['vllm_workspace_gib']:.2f} + KV cache "
            f"{plan['kv_cache_gib']:.2f}) | {generating:.2f} |",
            f"| training | {training:.2f} (peak) | 0 (asleep) | {training:.2f} |",
            f"| **peak** | | | **{total:.2f}** of {plan['gpu_gib']:g}, {plan['margin_gib']:g} left to the margin |",
            "",
            f"gpu_memory_utilization {plan['gpu_memory_utilization']}, max_num_seqs {plan['max_num_seqs']} "
            f"(sequences of {plan['full_length']} tokens whose KV cache fits at once); "
            + ("the plan accepts it." if not plan["short"] else "the plan refuses it: " + "; ".join(plan["short"])),
            "",
            host_line(plan, args.ranks, offload, getattr(args, "train_argv", ())),
        ]
        record.update(
            {
                "gpu_gib": plan["gpu_gib"],
                "vllm_share_gib": round(plan["vllm_share_gib"], 3),
                "kv_cache_gib": round(plan["kv_cache_gib"], 3),
                "max_num_seqs": plan["max_num_seqs"],
                "generating_gib": round(generating, 3),
                "training_gib": round(training, 3),
                "total_peak_gib": round(total, 3),
                "plan_accepts": not plan["short"],
                "plan_short": plan["short"],
                "host_gib": round(plan["host_gib"], 3),
                "host_parts_gib": {k: round(v, 3) for k, v in plan["host_parts_gib"].items()},
                "host_parts_bytes": {k: round(v * GIB) for k, v in plan["host_parts_gib"].items()},
                "host_simulated_bytes": {k: v for k, v in end.items() if k in HOST} if offload else {},
            }
        )
    return "\n".join(lines), record


def host_line(plan, ranks, offload, train_argv=()):
    """The node's host memory by part (gpu.host_memory: arithmetic, not simulated), one line."""
    h = plan["host_parts_gib"]
    state = (
        f"per rank {h['per_rank']:.1f} (fp32 weights {h['weights']:.1f} and gradients {h['gradients']:.1f}, pinned: "
        f"{h['rounding']:.1f} of it is the allocator's rounding to powers of two; AdamW's moments {h['moments']:.1f}; "
        f"its temporaries {h['temporaries']:.2f}"
        + (f"; the reference's bf16 shards {h['reference']:.1f}" if "--kl-ref" in train_argv else "")
        + f") x {ranks} rank(s) + "
        if offload
        else ""
    )
    return (
        f"Host memory (gpu.host_memory, arithmetic): {plan['host_gib']:.1f} GiB on the node = {state}rank 0's "
        f"full copy of the model at the export {h['export']:.1f} (fp32 and the checkpoint's dtype; at load: "
        f"{h['load']:.1f}, before the gradients and moments exist)."
    )


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    config = load_config(args.preset)
    targs = trainer_args(args.micro_batch_size, args.response_len, args.method, args.train_argv, args.prompt_len)
    selects_tokens = methods.selects_tokens(args.method)
    k_frac = (args.k_frac if args.k_frac is not None else targs.k_final) if selects_tokens else 1.0
    result = simulate(
        config,
        targs,
        args.ranks,
        args.micro_batch_size,
        args.response_len,
        args.prompt_len,
        k_frac,
        args.steps,
        args.micro_batches,
    )
    state_bytes, n_params = sharded_state_bytes(config, args.ranks)
    plan = None
    if args.gpu is not None:
        # a fresh config: the simulation's from_config(dtype=float32) set this one's dtype, and the export's copy
        # is in the checkpoint's (gpu.host_memory)
        plan = gpu._plan(load_config(args.preset), targs, args.ranks, args.gpu_gib * GIB, local_ranks=args.ranks)
    table, record = report(
        args,
        result,
        state_bytes,
        n_params,
        k_frac,
        time.perf_counter() - t0,
        plan,
        gpu.trainer_peak_bytes(config, targs, args.ranks),
    )
    print(table)
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
