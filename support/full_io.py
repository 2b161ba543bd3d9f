"""support/full_io.py: the run's files and checks under train_full.py: what a run reads and writes, not the method.

train_full.py holds the flags, the six steps of a D3S step and the loop; support/fsdp.py, loss_head.py, engines.py and
gpu.py the machines. This module holds the rest, in seven parts:

  1 flag checks       the checks that involve several flags or the file system, before any work:
                      one line on stderr (once per job under torchrun: usage_error_line), exit 2
  2 data              the tokenizer and prompts, read before the process group exists; one global
                      prompt order and one sampling seed per prompt, the same on every rank
  3 checkpoints       sharded (torch.distributed.checkpoint) for --resume, written atomically and
                      read without unpickling objects; the resume checks; HF export
  4 evaluation        k samples per problem on every rank -> Pass@1 and Pass@k, the eval report
  5 reports           the step's line of metrics.jsonl (clocks, MFU, memory), the explain page
  6 stops             a preemption notice (SIGTERM, SIGUSR1) or a full disk on any rank stops every rank at
                      the same point: after the step's checkpoint (exit 75), or before it (exit 74)
  7 the loop          Run: what train_full.main does around the six steps of a step, one call each
                      (evaluation cadence, explain pages, metrics line, notices, exports, checkpoints)
"""

import contextlib
import glob
import importlib
import importlib.util
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

from support import cli, common
import d3s
from support import explain, methods
from support.cli import UsageError
from support.engines import export_asleep
from support.fsdp import all_reduce
from support.gpu import flop_params, memory_peak_gb, peak_flops
from support.common import DiskFull, attempt, noting, on_another_rank
from support.grading import default_grader_workers, evaluate, evaluation_due


# ---------------------------------------------------------------------------------------------
# 1. Flag checks: what a flag's declaration cannot say alone
# ---------------------------------------------------------------------------------------------
def usage_error_line(line, wait_s=10.0):
    """Print a bad-input line once per job. Every rank finds the same bad flag, so rank 0 prints at once and
    the others wait: torchrun stops them when rank 0 exits. A rank that alone finds a fault (a file missing
    on its node only) prints it after wait_s, so the line is never lost."""
    from tqdm import tqdm  # tqdm.write: the line starts clear of a progress bar

    if os.environ.get("RANK", "0") != "0":
        time.sleep(wait_s)
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


MAX_ROLLOUTS = 2**20  # rollouts per step (P x G) and samples per problem beyond which a value is a typo [choice]
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "org/name" or "name": not a local path


def check_args(p, args, ranks):
    """The checks of several flags together and of the paths, before any work (no model, data or process group
    yet), each a line through p.error (exit 2); each flag's own range is in its declaration. Fills in the
    defaults that depend on other flags (--static-n/-k, clip range, loss aggregation, --kl-every, dtype, ...)."""
    if args.stop_after is not None and args.stop_after > args.steps:
        p.error(f"--stop-after {args.stop_after}: must be an int in [1, --steps {args.steps}]")
    args.eval_pass_k = sorted(set(cli.int_list(p, "--eval-pass-k", args.eval_pass_k, what="comma-separated ints")))
    if not all(1 <= k <= args.eval_samples for k in args.eval_pass_k):
        p.error(
            f"--eval-pass-k {','.join(map(str, args.eval_pass_k))}: each k must be in [1, --eval-samples "
            f"{args.eval_samples}] (Pass@k from k <= n samples); lower k or raise --eval-samples"
        )
    if args.prompts_per_step * args.group_size > MAX_ROLLOUTS:
        p.error(
            f"--prompts-per-step {args.prompts_per_step}: x --group-size {args.group_size} is more than "
            f"{MAX_ROLLOUTS} rollouts per step; lower one of them"
        )
    if args.prompts_per_step % ranks:
        p.error(
            f"--prompts-per-step {args.prompts_per_step}: must be divisible by the {ranks} ranks; change it or the "
            "number of ranks"
        )
    args.static_n, args.static_k = methods.check_flags(p, args, [args.method])  # the method, N <= G, the switch rule
    if args.mini_batches > args.prompts_per_step * args.group_size:
        p.error(
            f"--mini-batches {args.mini_batches}: more than the {args.prompts_per_step * args.group_size} rollouts "
            "of a step; lower it"
        )
    if args.kl_coef > 0 and not args.kl_ref:
        p.error(f"--kl-coef {args.kl_coef}: a KL penalty needs the reference model; add --kl-ref")
    args.kl_every = (args.eval_every or 10) if args.kl_every is None else args.kl_every
    if args.kl_ref and args.kl_coef == 0 and args.kl_every == 0:
        p.error(
            "--kl-every 0: with --kl-ref and --kl-coef 0 the reference would never be used; drop --kl-ref, or "
            "measure the KL every N > 0 steps"
        )
    args.loss_agg = args.loss_agg or d3s.DEFAULT_AGG[args.loss]
    if args.normalize_by == "all" and args.loss_agg != "token-mean":
        p.error(
            f"--normalize-by all: applies to --loss-agg token-mean ({args.loss_agg} divides by the responses); drop "
            "it or add --loss-agg token-mean"
        )
    clip = d3s.CLIP_DEFAULTS[args.loss]  # grpo 0.2 / 0.28 (DAPO's clip-higher), gspo 3e-4 / 4e-4
    args.clip_low = clip[0] if args.clip_low is None else args.clip_low
    args.clip_high = clip[1] if args.clip_high is None else args.clip_high
    if args.grader_workers is None:
        args.grader_workers = default_grader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and args.rollout == "vllm" and args.vllm_sleep_level < 2 and not args.vllm_allow_awake:
        p.error(
            f"--vllm-sleep-level {args.vllm_sleep_level}: costs memory while the trainer runs (0: vLLM's whole "
            "share of the GPU; 1: its bf16 weights in CPU RAM, 2 bytes x parameters per GPU); level 2, the default, "
            "frees both; add --vllm-allow-awake to go on"
        )
    # paths: what is read must exist, what is written must be writable
    if not args.model:
        p.error("--model '': empty; pass a model folder or a hub name")
    if os.path.exists(args.model):  # a local folder: config.json, weights and a tokenizer, each named if missing
        cli.check_model(p, args.model)
    elif not HUB_NAME.fullmatch(args.model):
        p.error(
            f"--model {args.model}: no such folder; pass a model folder (config.json, weights, tokenizer) or a hub name"
        )
    for flag, spec in [("--train-data", args.train_data)] * (not args.eval_only) + [
        ("--eval-data", s) for s in args.eval_data
    ]:
        check_data_spec(p, flag, spec)
    args.eval_data = expand_specs(args.eval_data)
    cli.check_out_dir(p, "--out", args.out)
    return args


def check_machine(args, ranks):
    """What this machine must have for the run (main only: tests and bench/memory.py parse flags for
    other machines): CUDA for --device cuda (else why not: gpu.cuda_diagnosis), vLLM for --rollout vllm,
    and, with both, a GPU the setting fits (gpu.vllm_memory_plan: trainer and vLLM together) and no
    VLLM_BATCH_INVARIANT on compute capability 8.x (engines.check_batch_invariant)."""
    from support.engines import check_batch_invariant
    from support.gpu import cuda_diagnosis, vllm_memory_plan

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: torch sees no CUDA device ({cuda_diagnosis()}); or use --device cpu")
    if args.device == "cuda":  # VLLM_BATCH_INVARIANT on compute capability 8.x: refused before the model loads
        check_batch_invariant(args, torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    if args.rollout == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "--rollout vllm: vLLM is not installed; pip install -r requirements/full.txt, or use --rollout hf"
        )
    if args.device == "cuda" and args.rollout == "vllm" and not args.eval_only:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError):  # no config to read: load_inputs names the model's fault in its line
            return
        local = int(os.environ.get("LOCAL_RANK", "0"))
        vllm_memory_plan(
            config,
            args,
            ranks,
            torch.cuda.get_device_properties(local).total_memory,
            host_bytes=host_available(),
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )


def host_available():
    """Host memory available to new allocations (MemAvailable of /proc/meminfo), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_data_spec(p, flag, spec):
    """A data file that exists and is a file, a glob that matches, 'none' (eval), or a hub name."""
    for item in (s.strip() for s in spec.split(",")) if flag == "--eval-data" else [spec]:
        if item == "none" and flag == "--eval-data":
            continue
        if not item:
            p.error(
                f"{flag} {spec!r}: empty; pass a JSONL/JSON/Parquet file"
                + (", or none" if flag == "--eval-data" else "")
            )
        if any(c in item for c in "*?["):
            if not glob.glob(item):
                p.error(f"{flag} {item}: no file matches; check the pattern")
        elif os.path.isdir(item):
            p.error(f"{flag} {item}: is a folder; pass a JSONL/JSON/Parquet file with 'problem' and 'answer'")
        elif not os.path.exists(item) and (
            item.endswith((".jsonl", ".json", ".parquet")) or not HUB_NAME.fullmatch(item.split(":")[0])
        ):
            p.error(f"{flag} {item}: no such file; pass an existing JSONL/JSON/Parquet file or a hub dataset")


def expand_specs(items):
    """['a.jsonl,b.jsonl', 'dir/*.jsonl', 'none'] -> the list of files / hub names ('none' drops out)."""
    specs = []
    for item in items:
        for spec in (s.strip() for s in item.split(",")):
            if spec and spec != "none":
                specs += sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
    return specs


# ---------------------------------------------------------------------------------------------
# 2. Data: local files or hub datasets -> tokenized prompts; one global order and seeds for all ranks
# ---------------------------------------------------------------------------------------------


def check_finite(model, args, world, prompt_ids):
    """NaN or inf in the policy's weights (each rank its shards, one tensor at a time: no copy of the model) or in the
    logits of a first forward of one prompt (its last 64 tokens, on every rank together: FSDP's all-gathers): a
    UsageError naming --model on every rank (one all-reduce), before any work."""
    bad = ""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                bad = bad or f"its weights hold NaN or inf ({name})"
        if not all_reduce(bool(bad), world, dist.ReduceOp.MAX):
            ids = torch.tensor([prompt_ids[-64:]], device=world.device)
            if not bool(torch.isfinite(model.eval()(input_ids=ids).logits).all()):
                bad = (
                    f"its first forward gives NaN or inf logits (weights finite: an overflow in --dtype {args.dtype}?)"
                )
            model.train()
            if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters whole after a forward: shards again, so
                model.reshard()  # that the optimizer and the checkpoints meet the sharded parameters they know
    if all_reduce(bool(bad), world, dist.ReduceOp.MAX):
        raise UsageError(
            f"--model {args.model}: {bad or 'its weights hold NaN or inf (on another rank)'}; its weights "
            "are damaged or were saved from a diverged run: pass another model"
        )


# ---------------------------------------------------------------------------------------------
# 3. Checkpoints: sharded (DCP) for --resume, checked before any work; HF export for vLLM / transformers
# ---------------------------------------------------------------------------------------------
RUN_FLAGS = (
    "model",
    "train_data",
    "template",
    "max_prompt_len",
    "method",
    "loss",
    "loss_agg",
    "steps",
    "prompts_per_step",
    "group_size",
    "n_init",
    "n_final",
    "k_init",
    "k_final",
    "static_n",
    "static_k",
    "token_scope",
    "switch_on_spike",
    "min_token_per_response",
    "normalize_by",
    "lr",
    "weight_decay",
    "max_grad_norm",
    "clip_low",
    "clip_high",
    "mini_batches",
    "kl_coef",
    "temperature",
    "top_p",
    "max_response_len",
    "seed",
    "unseeded_sampling",
)
# the flags that define a run's trajectory: a resume must repeat them (--steps too: the schedule runs over it).
# Free to change on a resume: the world size (DCP reshards), memory and systems flags, evaluation, checkpoints.
ADDED_RUN_FLAGS = {"switch_on_spike": 0.0}  # RUN_FLAGS added later: a checkpoint without one ran with this value
MIDPOINT_FLAGS = ("static_n", "static_k")  # null in a checkpoint of a train_full.py before 2026-11: the midpoint


def run_flags(args):
    """RUN_FLAGS of this run, local paths made absolute (a resume may start from another folder)."""
    value = lambda k, v: os.path.abspath(v) if k in ("model", "train_data") and os.path.exists(v) else v
    return {k: value(k, getattr(args, k)) for k in RUN_FLAGS}


def check_resume(args, ranks):
    """The checkpoint folder to continue from (--resume), checked before any work: complete, readable,
    of this format, holding no pickled object, written by a run with these RUN_FLAGS. A fresh run's
    --out must hold no checkpoint (nothing is overwritten). Returns the folder or None."""
    if args.eval_only:
        return None
    if not args.resume:
        if find_checkpoint("latest", args.out):
            raise UsageError(
                f"--out {args.out}: holds the checkpoints of an earlier run; pass --resume to continue it, "
                "or a new --out (nothing was overwritten)"
            )
        return None
    path = find_checkpoint(args.resume, args.out)
    if path is None:
        raise UsageError(
            f"--resume: no complete checkpoint in {os.path.join(args.out, 'checkpoints')}; drop --resume to "
            "start a new run, or pass a checkpoint folder"
        )
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such folder; pass a checkpoint folder (OUT/checkpoints/step_NNNNNN)")
    meta = read_checkpoint(path)  # CheckpointError: the file and the fix
    midpoint = d3s.dynamic_schedule(1, 2, args.n_init, args.n_final, args.k_init, args.k_final)  # what null meant
    for flag, value in run_flags(args).items():
        then = meta["run"].get(flag, ADDED_RUN_FLAGS.get(flag))
        if then is None and flag in MIDPOINT_FLAGS:
            then = midpoint[MIDPOINT_FLAGS.index(flag)]
        if then != value:
            raise UsageError(
                f"--{flag.replace('_', '-')} {value}: the checkpoint {path} is of a run with "
                f"--{flag.replace('_', '-')} {then}"
                + (" (the D3S schedule runs over --steps)" if flag == "steps" else "")
                + "; resume with the run's flags (its trainer_state.json lists them), or start a new run "
                "with a new --out"
            )
    if args.stop_after is not None and args.stop_after <= meta["step"]:
        raise UsageError(
            f"--stop-after {args.stop_after}: the checkpoint {path} is already at step {meta['step']}; "
            "raise --stop-after or drop it"
        )
    return path


def trainer_state(args, order, grad_norms=()):
    """The JSON part of a checkpoint: the data position, the run's flags and the grad_norm of every step so
    far (--switch-on-spike's signal)."""
    return {"order": order.state_dict(), "run": run_flags(args), "grad_norms": list(grad_norms)}


def resume_from(path, model, optimizer, order, args, world):
    """Model and optimizer shards, RNG and data position from a checkpoint; says so (rank 0) and returns its
    completed steps and the grad norms of those steps."""
    meta = load_checkpoint(path, model, optimizer, world)
    order.load_state_dict(meta["order"])
    if world.is_main:
        print(f"resumed from {path} at step {meta['step']}" + other_world_note(path, world.size, args), flush=True)
    return meta["step"], meta.get("grad_norms", [])


def other_world_note(path, ranks, args):
    """'' when the checkpoint was saved on `ranks` ranks; else what a resume on another rank count
    keeps and what it cannot (docs/train_full.md, "Resuming on another number of ranks")."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)["world"]
    if saved == ranks:
        return ""

    def hf_calls(ranks):  # the prompts of each generate() call of --rollout hf: one seed per call
        share, batch = args.prompts_per_step // ranks, args.hf_generate_batch
        return {
            (r * share + k, r * share + min(k + batch, share)) for r in range(ranks) for k in range(0, share, batch)
        }

    if args.unseeded_sampling:
        rollouts = "; with --unseeded-sampling the rollouts differ from an uninterrupted run's"
    elif args.rollout == "hf" and hf_calls(saved) != hf_calls(ranks):
        rollouts = (
            f"; --rollout hf seeds each generate() call of --hf-generate-batch {args.hf_generate_batch} prompts "
            "and the calls now group the prompts differently, so the rollouts differ from an uninterrupted run's"
        )
    else:
        rollouts = " (sampling is seeded per prompt, not drawn from it)"
    return (
        f"; saved on {saved} ranks, resumed on {ranks}: the model and AdamW state are resharded exactly and the data "
        "order continues, but the per-rank RNG is not restored" + rollouts + "; losses and gradient norms equal an "
        "uninterrupted run's to rounding only, not bit for bit (the sums over ranks run in another order)"
    )


CKPT_RE = re.compile(r"^step_(\d+)$")
CHECKPOINT_FORMAT = 2  # 2: tensors (DCP) + RNG as tensors + JSON; 1 (before): pickled RNG state, optimizer param_groups


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed: missing, truncated, corrupt, of an older format, or holding
    a pickled object. The message names the file and the fix (train_full prints it as one line, exit 2)."""


def save_checkpoint(model, optimizer, out, step, trainer_state, world, keep):
    """OUT/checkpoints/step_NNNNNN (NNNNNN: the number of completed steps): the model and AdamW's
    state as tensors (DCP shards; the optimizer's param_groups are not saved, they follow from the
    run's flags), each rank's RNG as tensors (rng_rankR.pt), and trainer_state.json (the format,
    the step, the world size, and train_full's JSON: data position, the run's flags). Nothing in it
    needs pickle to load beyond DCP's .metadata, which load_checkpoint reads with an allow-list.

    Written to step_NNNNNN.tmp and renamed when complete: a run killed at any moment leaves
    either a complete checkpoint or a .tmp folder that --resume ignores. The newest `keep` stay,
    the older ones removed only once the new one is complete. A full disk on any rank raises
    DiskFull on every rank (attempt, where the barriers were), the .tmp folder removed: the last
    checkpoint stays as it was.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = os.path.join(out, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    try:
        with attempt(tmp, out, world):
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with attempt(tmp, out, world):
            dcp.save(
                {"model": model_sd, "optim": {"state": optim_sd["state"]}}, checkpoint_id=tmp
            )  # raises on all ranks
            version, words, gauss = random.getstate()
            rng = {
                "torch": torch.get_rng_state(),
                "python_words": torch.tensor(words, dtype=torch.int64),
                "python_version": torch.tensor(version),
                "python_gauss": torch.tensor([math.nan if gauss is None else gauss]),
            }
            if world.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state()
            torch.save(rng, os.path.join(tmp, f"rng_rank{world.rank}.pt"))
        with attempt(tmp, out, world):
            if world.is_main:
                with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                    json.dump(
                        {"format": CHECKPOINT_FORMAT, "step": step, "world": world.size, **trainer_state}, f, indent=1
                    )
                shutil.rmtree(final, ignore_errors=True)  # resumed from an older checkpoint: this step is redone
                os.replace(tmp, final)  # atomic: the checkpoint exists only once it is complete
                done = sorted(d for d in os.listdir(root) if CKPT_RE.match(d))
                for old in done[: max(len(done) - keep, 0)]:
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    except DiskFull:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # what was written of it: the space back
        raise
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

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module, name):
        obj = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
        if (
            (module, name) in self.ALLOWED
            or (module == "torch" and isinstance(obj, torch.dtype))
            or (
                module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
                and isinstance(obj, type)
                and name != "BytesStorageMetadata"
            )
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A global that a train_full checkpoint never holds."""


def read_checkpoint(path, rank=None):
    """Check a checkpoint folder without loading it into a model (cheap: before any model is built) and
    return its trainer_state. Raises CheckpointError for a missing, truncated, corrupt or older
    checkpoint, or one that holds a pickled object (in .metadata or an RNG file)."""
    importlib.import_module("torch.distributed.checkpoint.filesystem")  # the classes .metadata names

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
        raise CheckpointError(
            f"{state_file}: checkpoint format {meta.get('format', 1)}, written by an older train_full.py "
            f"(this one reads format {CHECKPOINT_FORMAT} only: no pickled state); finish that run with "
            "the train_full.py that wrote it, or start a new run with a new --out"
        )
    for key in ("step", "world", "order", "run"):
        if key not in meta:
            raise CheckpointError(f"{state_file}: no '{key}' (truncated or edited); {fix}")
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        for info in metadata.storage_data.values():  # every shard file holds the bytes .metadata points to
            shard = os.path.join(path, info.relative_path)
            if not os.path.isfile(shard) or os.path.getsize(shard) < info.offset + info.length:
                raise CheckpointError(
                    f"{shard}: {'truncated' if os.path.isfile(shard) else 'missing'} (the write did "
                    f"not complete); {fix}"
                )
    except FileNotFoundError:
        raise CheckpointError(f"{path}/.metadata: missing (the shards were not written completely); {fix}") from None
    except _Refused as e:  # (non-tensor entries, BytesStorageMetadata, would be unpickled by DCP: refused too)
        raise CheckpointError(
            f"{path}/.metadata: refused: it holds a pickled object ({e}) that train_full never "
            f"writes there (loading it could run code); {fix}"
        ) from None
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
            raise CheckpointError(
                f"{rng_file}: refused: it holds a pickled Python object, not tensors (loading it could run code); {fix}"
            ) from None
        raise CheckpointError(f"{rng_file}: truncated or corrupt ({first}); {fix}") from None
    except Exception as e:
        raise CheckpointError(f"{rng_file}: truncated or corrupt ({type(e).__name__}); {fix}") from None


def load_checkpoint(path, model, optimizer, world):
    """Restore the model and AdamW's state (any world size: DCP reshards the shards) and, when the
    world size is the one that wrote it, this rank's RNG; returns trainer_state. Every file is
    checked first (read_checkpoint): DCP then reads tensors only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_checkpoint(path, rank=world.rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # a fresh optimizer's state is initialised (zeros)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:  # (DCP's own is a BaseException)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: its shards cannot be read ({first}): truncated or corrupt, or from another "
            "model; resume from an older checkpoint or start a new run with a new --out"
        ) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]},
    )
    rng_file = os.path.join(path, f"rng_rank{world.rank}.pt")
    if meta["world"] == world.size and os.path.exists(rng_file):  # another world size: sampling is seeded per prompt
        rng = load_rng_file(rng_file, "start a new run")
        torch.set_rng_state(rng["torch"])
        gauss = float(rng["python_gauss"][0])
        random.setstate(
            (int(rng["python_version"]), tuple(rng["python_words"].tolist()), None if math.isnan(gauss) else gauss)
        )
        if "cuda" in rng and world.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def export_hf(model, tokenizer, path, world, out):
    """save_pretrained of the full weights (rank 0), in the base model's dtype: loadable by
    transformers' from_pretrained and by vLLM. Written to PATH.tmp, then renamed; a full disk
    raises DiskFull on every rank (`out`: the run's folder, for its line)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tmp = path.rstrip("/") + ".tmp"
    try:
        with attempt(tmp, out, world):  # a full disk: DiskFull on every rank
            if world.is_main:
                config = model.config
                dtype = (
                    config.dtype
                    if isinstance(config.dtype, torch.dtype)
                    else getattr(torch, str(config.dtype or "float32"))
                )
                config.use_cache = True
                with torch.device("meta"):
                    shell = AutoModelForCausalLM.from_config(config)  # a plain class for save_pretrained (not FSDP's)
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    shell.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in full.items()})
                    tokenizer.save_pretrained(tmp)
                finally:
                    config.use_cache = False
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
    except DiskFull:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# 4. Evaluation: k samples per problem -> Pass@1 (mean over k) and Pass@k (unbiased)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# 5. Reports: the step's line of metrics.jsonl, the explain page
# ---------------------------------------------------------------------------------------------
def write_args(args, world):
    """OUT/args.json (eval_args.json with --eval-only): the flags as parsed and checked, and the world size."""
    with attempt(args.out, args.out, world):
        os.makedirs(args.out, exist_ok=True)
        if world.is_main:
            with open(os.path.join(args.out, "args.json" if not args.eval_only else "eval_args.json"), "w") as f:
                json.dump({**vars(args), "world": world.size}, f, indent=1)


def train_record(step, stats, rollouts, phases, grader, n_params, flops_peak, args, world):
    """The step's line of metrics.jsonl (docs/metrics.md): the step's metrics (train_full.step_metrics), then the
    run's counts, clocks, MFU and memory. phases: this rank's gen_s, reward_s, pass1_s, sync_s, and the GPU memory in
    use during generation (gpu_used_gen) and after the update, before the sync (gpu_used_train). Every rank calls it (all_reduce)."""
    MAX = dist.ReduceOp.MAX
    gen_tokens = all_reduce(sum(len(r["response_ids"]) for group in rollouts for r in group), world)
    gen_s = all_reduce(phases["gen_s"], world, MAX)  # the slowest rank's
    return {
        "kind": "train",
        "step": step,
        **stats,
        "gen_tokens": int(gen_tokens),
        "kept_tokens_frac": stats["kept_tokens"] / max(gen_tokens, 1.0),
        "response_len": gen_tokens / (args.prompts_per_step * args.group_size),
        "grader_timeouts": int(all_reduce(grader.timeouts, world)),
        "gen_s": gen_s,
        "reward_s": all_reduce(phases["reward_s"], world, MAX),
        "pass1_s": all_reduce(phases["pass1_s"], world, MAX),
        "sync_s": phases["sync_s"],
        "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
        # model FLOPs of the update: the no-grad forwards (2 N per token: pass 1 and the
        # reference) + pass 2 forward and backward (6 N per token), N without the embedding;
        # activation recomputation and attention not counted
        "mfu": (
            (2 * stats["pass1_tokens"] + 6 * stats["train_tokens"])
            * n_params
            / (stats["train_s"] * world.size * flops_peak)
            if flops_peak
            else None
        ),
        "mem_peak_gb": all_reduce(memory_peak_gb(world.device), world, MAX),
        "gpu_used_gen_gb": all_reduce(phases["gpu_used_gen"], world, MAX),
        "gpu_used_train_gb": all_reduce(phases["gpu_used_train"], world, MAX),
    }


def write_explain_page(step, rollouts, prompts, sel, entropy, token_keep, stats, args, tokenizer, world, halt=None):
    """Rank 0's page of one step (explain.write_step), from the global selection (a full disk: noted in `halt`, a
    Stops, whose agree() stops every rank; without one, raised). The few rollouts it shows
    (explain.pick_rollouts on the global batch: the same choice on every rank) are gathered on rank 0 with their
    token ids and, when forwarded, entropy, score and selection: a few rollouts, never the batch. sel: the
    step's train_full.select_samples_global; prompts: this rank's problem texts. Every rank calls it (gather_object)."""
    G = sel.keep_all.shape[1]
    local_row = {sel.kept_all[g][0] * G + sel.kept_all[g][1]: r for g, r in sel.row_of.items()}  # p * G + g -> row here
    token_scores = d3s.token_scores(sel.kept_adv, entropy)
    shown_adv = torch.where(
        sel.keep_all, sel.adv_all, d3s.group_advantages(sel.rewards_all)
    )  # the loss's A on kept cells
    picked, mine = explain.pick_rollouts(shown_adv, sel.keep_all), []
    for index in picked:
        p, g = divmod(index, G)
        if index in local_row:  # forwarded here: its row of entropy / scores / selection
            r = local_row[index]
            ids = list(sel.seqs[r]["response_ids"])
            n = len(ids)
            mine.append(
                {
                    "index": index,
                    "ids": ids,
                    "entropy": entropy[r, :n].tolist(),
                    "score": token_scores[r, :n].tolist(),
                    "selected": token_keep[r, :n].tolist(),
                }
            )
        elif not sel.keep_all[p, g] and sel.first <= p < sel.first + len(
            rollouts
        ):  # dropped: only its home rank has it
            mine.append({"index": index, "ids": list(rollouts[p - sel.first][g]["response_ids"])})
    parts = [None] * world.size if world.is_main else None
    dist.gather_object((mine, prompts), parts, dst=0)
    if not world.is_main:
        return
    items = sorted((item for part, _ in parts for item in part), key=lambda item: picked.index(item["index"]))
    for item in items:
        item["tokens"] = [tokenizer.decode([t]) for t in item.pop("ids")]
    # the row that selected: args.method, or its twin after --switch-on-spike
    switched = (
        {} if sel.row == args.method else {"--switch-on-spike": f"fired: --method {args.method} runs as {sel.row}"}
    )
    with halt.writing(os.path.join(args.out, "explain")) if halt else contextlib.nullcontext():
        explain.write_step(
            os.path.join(args.out, "explain"),
            step=step,
            rung="train_full",
            method=sel.row,
            rewards=sel.rewards_all,
            adv=shown_adv,
            keep=sel.keep_all,
            n_keep=stats["n_keep"],
            k_frac=stats["k_frac"],
            k_real=stats["k_real"],
            shown=items,
            prompts=[text for _, texts in parts for text in texts],
            extra={
                **switched,
                "loss (mean over optimizer steps)": stats["loss"],
                "tokens in the loss": stats["kept_tokens"],
                "grad norm (before clipping)": stats["grad_norm"],
                "ranks": world.size,
            },
        )


# ---------------------------------------------------------------------------------------------
# 6. Stops: a preemption notice or a full disk, agreed by every rank
# ---------------------------------------------------------------------------------------------


class Stops(common.Preemption):
    """common.Preemption (SIGTERM, SIGUSR1 and a first SIGINT set a flag while the run is in the block; torchrun
    forwards a Ctrl-C as one SIGINT to every rank, its workers being in their own session) for every rank of a run, and
    the full disks of the writes that only rank 0 makes (the metrics line, the explain page): noted by
    writing(), and at the step's end agree() tells every rank what any rank met."""

    def __init__(self, out, world):
        super().__init__("train_full.py", quiet=not world.is_main)  # a second Ctrl-C: rank 0's line, exit 130
        self.out, self.world, self.faults = out, world, []

    def writing(self, path):
        """A write of this rank alone: a full disk is noted (agree() raises DiskFull on every rank), not raised."""
        return noting(self.faults, path)

    def append_metrics(self, path, record):
        """common.append_metrics, its full disk noted."""
        with self.writing(path):
            common.append_metrics(path, record)

    def agree(self):
        """One all-reduce at the step's end: DiskFull on every rank if a write failed on any; else the name of the
        notice any rank received (the same on every rank), or None."""
        number = signal.Signals[self.signal].value if self.signal else 0
        code = int(all_reduce(1000 if self.faults else number, self.world, dist.ReduceOp.MAX))
        if code >= 1000:
            raise DiskFull(self.faults[0] if self.faults else on_another_rank(self.out), self.out)
        return signal.Signals(code).name if code else None


def stopped(notice, step, out, world):
    """After the step's checkpoint, on a notice: rank 0's one line (common.stopped), exit common.STOPPED (75) on
    every rank."""
    if world.is_main:
        common.stopped("train_full.py", notice, step, os.path.join(out, "checkpoints", f"step_{step:06d}"))
    sys.exit(common.STOPPED)


def crashed(error):
    """train_full.entry's end of any other error: a Ctrl-C outside the loop (KeyboardInterrupt) is rank 0's one line
    and exit common.INTERRUPTED (130) on every rank; anything else prints its traceback and exits 1 at once."""
    import traceback

    if isinstance(error, KeyboardInterrupt):
        common.interrupted(
            "train_full.py",
            "stopped by Ctrl-C (SIGINT); the last checkpoint in --out, if any, is intact; continue with --resume",
            quiet=os.environ.get("RANK", "0") != "0",
            at_once=True,
        )
    print(
        f"train_full.py: rank {os.environ.get('RANK', '0')} failed; ending the job (the other ranks are stopped "
        "by torchrun)",
        file=sys.stderr,
    )
    traceback.print_exception(error)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1)


def fail_disk(e):
    """train_full.entry's line for DiskFull (rank 0 at once, any other rank after a wait: usage_error_line), then
    exit common.DISK_FULL on this rank."""
    usage_error_line(common.disk_full_line("train_full.py", e.error, e.out))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(common.DISK_FULL)


# ---------------------------------------------------------------------------------------------
# 7. The loop's plumbing: what main() does around the six steps, one call each
# ---------------------------------------------------------------------------------------------
class Run:
    """train_full.main's loop less its six steps: the evaluations on their cadence (evaluate_if_due, at the end of
    each step and of the run), the explain pages, the step's line of metrics.jsonl and the progress bar, the notices
    and full disks that every rank agrees on, the HF exports and the checkpoints. Every rank makes every call (they
    hold collectives). `step`: the steps completed (a resume's); `resumed`: whether a checkpoint was loaded."""

    def __init__(
        self, args, world, step, resumed, model, optimizer, order, engine, tokenizer, stops, eval_sets, grader, halt
    ):
        from tqdm import tqdm

        self.args, self.world, self.halt, self.stop_at = args, world, halt, args.stop_after or args.steps
        self.model, self.optimizer, self.order, self.engine, self.grader = model, optimizer, order, engine, grader
        self.tokenizer, self.stops, self.eval_sets = tokenizer, stops, eval_sets
        self.metrics = os.path.join(args.out, "metrics.jsonl")
        if world.is_main:  # what the checkpoint covers (a new run: nothing)
            common.truncate_metrics(self.metrics, step if resumed else -1)
        self.n_params, self.flops_peak = flop_params(model), peak_flops(world.device, args.peak_tflops)  # MFU
        self.bar = tqdm(total=args.steps, initial=step, disable=not world.is_main, desc="steps", dynamic_ncols=True)

    def evaluate(self, step, tag=None, name=None):
        """evaluate() of the policy after `step` steps, whose weights the engine holds; metrics.jsonl's eval line."""
        a = self.args
        if tag is None:
            tag, name = f"step_{step:06d}", f"{a.model} after {step} steps of {a.method}, {a.loss} loss"
            name = name if step else f"{a.model} before training"
        return evaluate(
            self.engine, self.tokenizer, self.stops, self.eval_sets, a, self.world, self.grader, tag, name, step=step
        )

    def evaluate_if_due(self, step):
        """Before the first step: the evaluation of step 0, or of the step a stop cut off after its checkpoint."""
        if evaluation_due(self.metrics, step, self.args, self.world):
            self.evaluate(step)

    def explain(self, step, rollouts, batch, sel, upd, token_keep, stats):
        """Step 1 and every --explain-every-th: rank 0's page of what the step trained on (write_explain_page, from
        the global selection; a full disk: noted in halt)."""
        every = self.args.explain_every
        if every and (step == 1 or step % every == 0):
            problems = [p["problem"] for _, p in batch]
            write_explain_page(
                step,
                rollouts,
                problems,
                sel,
                upd.entropy,
                token_keep,
                stats,
                self.args,
                self.tokenizer,
                self.world,
                self.halt,
            )

    def end_step(self, step, stats, rollouts, phases, grad_norms):
        """After the step's update and weight sync: its line of metrics.jsonl (train_record) and the bar on rank 0;
        the notices every rank agrees on (a full disk anywhere: DiskFull on every rank, exit 74); the HF export and
        the checkpoint that are due; on a notice, the stop after that checkpoint (exit 75); the evaluation due."""
        args, world, halt = self.args, self.world, self.halt
        record = train_record(step, stats, rollouts, phases, self.grader, self.n_params, self.flops_peak, args, world)
        if world.is_main:
            halt.append_metrics(self.metrics, record)  # a full disk: noted, every rank stops at agree() below
            self.bar.set_postfix(reward=f"{record['reward_mean']:.3f}", N=record["n_keep"], K=f"{record['k_frac']:.2f}")
            self.bar.update(1)
        notice = halt.agree()  # any rank's full disk (DiskFull on every rank: exit 74) or notice (SIGTERM, SIGUSR1)
        if args.export_every and step % args.export_every == 0:  # before the checkpoint: a resume redoes both
            path = os.path.join(args.out, f"hf_step_{step:06d}")  # with vLLM asleep: its fp32 gathers fit beside it
            export_asleep(
                self.engine, self.model, args, lambda: export_hf(self.model, self.tokenizer, path, world, args.out)
            )
        if step % args.save_every == 0 or step == self.stop_at or notice:
            state = trainer_state(args, self.order, grad_norms)
            save_checkpoint(self.model, self.optimizer, args.out, step, state, world, args.keep_checkpoints)
        if notice and step < self.stop_at:
            stopped(notice, step, args.out, world)  # rank 0's line; exit 75 on every rank
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            self.evaluate(step)

    def finish(self, step):
        """After the loop: --stop-after's line, or the export to OUT/hf_final and the final evaluation."""
        args, say = self.args, print if self.world.is_main else (lambda *m, **kw: None)
        self.bar.close()
        if args.stop_after:
            say(f"stopped after step {step} (--stop-after): continue with --resume", flush=True)
        elif step >= args.steps:
            final = os.path.join(args.out, "hf_final")  # with vLLM asleep (engines.export_asleep)
            export = lambda: export_hf(self.model, self.tokenizer, final, self.world, args.out)
            path = export_asleep(self.engine, self.model, args, export)
            say(f"exported {path}", flush=True)
            self.evaluate(step, "final", f"{path} ({args.model} after {step} steps of {args.method}, {args.loss} loss)")
