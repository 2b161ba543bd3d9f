"""support/checkpoint.py: what a checkpoint holds, and what a resume checks and restores, in both trainers.

    save_file, read_file, load_file     train_small.py's: one file of tensors and plain values (model, AdamW, RNG,
                                        step, totals, the run's flags, the history its rules read)
    save_shards, read_shards, load_shards   train_full.py's: OUT/checkpoints/step_NNNNNN: model and AdamW as DCP
                                        shards, each rank's RNG, trainer_state.json; nothing unpickled but DCP's
                                        allow-listed metadata; resharded at another rank count
    check_run_flags                     a resume repeats the flags that define the run's trajectory, in both
    resume_file, resume_shards          the checkpoint a --resume continues from, checked before any work
    export_pretrained, export_hf        a model folder that transformers' from_pretrained (and vLLM) loads

Every checkpoint and export is written to a temporary name and renamed when complete: a kill leaves the old one or
the new one, never half of one. The grad norms of the steps so far (--switch-on-spike's signal) come back from the
checkpoint in both trainers, and train_small's train rewards (--schedule adaptive's) too.
"""

import importlib
import json
import math
import os
import pickle
import random
import re
import shutil
import sys

import torch

from support.cli import UsageError
from support.stops import DiskFull, attempt

ADDED_RUN_FLAGS = {"switch_on_spike": 0.0}  # run flags added later: a checkpoint without one ran with this value


def check_run_flags(path, saved, now, midpoint=None):
    """A resume repeats the flags that define the run's trajectory (the rung's RUN_FLAGS; --steps too: the schedule
    runs over it). UsageError naming the first that differs. saved: the checkpoint's {flag: value}; a flag added
    later (ADDED_RUN_FLAGS) reads as the value the older run had, a null in `midpoint`'s flags as its value there."""
    for flag, value in now.items():
        then = saved.get(flag, ADDED_RUN_FLAGS.get(flag))
        if then is None and flag in (midpoint or {}):
            then = midpoint[flag]
        if then != value:
            name = "--" + flag.replace("_", "-")
            raise UsageError(
                f"{name} {value}: the checkpoint {path} was made with {name} {then}"
                + (" (the D3S schedule runs over --steps)" if flag == "steps" else "")
                + "; resume with the run's flags, or start a new run with a new --out"
            )


def check_steps_left(path, step, args):
    """A checkpoint after `step` steps leaves steps to run before --stop-after (both trainers)."""
    if args.stop_after is not None and args.stop_after <= step:
        raise UsageError(
            f"--stop-after {args.stop_after}: the checkpoint {path} is already at step {step}; raise --stop-after "
            "or drop it"
        )


# === train_small.py: one file =========================================================================================
FILE_FORMAT = 3  # 3: with the history (grad norms, train rewards); 2: without; 1 (before 2026-11): pickled RNG state


def save_file(path, model, optimizer, step, flags, totals, history):
    """Model, optimizer, RNG states, step, the run's totals and flags, and history ({"grad_norms": [...], "rewards":
    [...]}, one value per step so far) in one file of tensors and plain values (torch.load(weights_only=True))."""
    import numpy as np

    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {
        "torch": torch.get_rng_state(),
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    state = {
        "format": FILE_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "totals": totals,
        "args": flags,
        "rng": rng,
        "history": history,
    }
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_file(path, flags, prog):
    """The checkpoint --resume continues from, checked before any work: it exists, is complete, holds no pickled
    object, and was written by a run with these `flags` ({name: value}). Raises UsageError naming the fix."""
    fix = "run without --resume to start again, or use a new --out"
    corrupt = f"--resume {path}: truncated or corrupt (not a checkpoint {prog} wrote); {fix}"
    if not os.path.isfile(path):
        where = "no checkpoint at" if not os.path.isdir(path) else "is a folder, not a checkpoint file:"
        raise UsageError(f"--resume: {where} {path}; {fix} (a run writes OUT/checkpoint.pt every --save-every steps)")
    try:
        state = torch.load(path, weights_only=True)
        assert isinstance(state, dict)
    except Exception as e:  # UnpicklingError, EOFError, RuntimeError (a truncated zip), AssertionError, ...
        if _pickled(e):
            raise UsageError(f"--resume {path}: {_REFUSED}; {fix}") from None
        raise UsageError(corrupt) from None
    if state.get("format") != FILE_FORMAT:
        raise UsageError(
            f"--resume {path}: checkpoint format {state.get('format', 1)} of an older {prog}; "
            f"finish that run with the version that wrote it, or {fix}"
        )
    if not {"step", "model", "optimizer", "totals", "args", "rng", "history"} <= set(state):
        raise UsageError(corrupt)
    check_run_flags(path, state["args"], flags)
    return state


def resume_file(args, run_flags, prog):
    """The checkpoint --resume continues from (OUT/checkpoint.pt, or the one named), read_file's checks; it leaves
    steps to run."""
    path = os.path.join(args.out, "checkpoint.pt") if args.resume == "latest" else args.resume
    state = read_file(path, {k: getattr(args, k) for k in run_flags}, prog)
    check_steps_left(path, state["step"], args)
    if state["step"] >= args.steps:
        raise UsageError(
            f"--resume {path}: the run already finished its {args.steps} steps; run without --resume to "
            "start again, or use a new --out"
        )
    return state


def _pickled(error):
    """Whether torch.load(weights_only=True) refused a pickled object (not a damaged file)."""
    return isinstance(error, pickle.UnpicklingError) and (
        "weights_only" in str(error) or "Unsupported global" in str(error)
    )


_REFUSED = "refused: it holds a pickled Python object, not tensors (loading it could run code)"


def load_file(state, model, optimizer):
    """Restore what read_file read; returns (step, totals, history)."""
    import numpy as np

    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    version, words, gauss = state["rng"]["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    keys, pos, has_gauss, cached = state["rng"]["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return state["step"], state["totals"], state["history"]


def export_pretrained(model, tokenizer, path):
    """model.save_pretrained and tokenizer.save_pretrained into `path` (PATH.tmp renamed), for from_pretrained."""
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    model.save_pretrained(path + ".tmp")
    tokenizer.save_pretrained(path + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)


# === train_full.py: DCP shards, one folder per checkpoint =============================================================
SHARDS_FORMAT = 2  # 2: tensors (DCP) + RNG as tensors + JSON; 1 (before): pickled RNG state, optimizer param_groups
STEP_DIR = re.compile(r"^step_(\d+)$")
MIDPOINT_FLAGS = ("static_n", "static_k")  # null in a checkpoint of a train_full.py before 2026-11: the midpoint


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and the fix (one line, exit 2)."""


def resume_shards(args, run_flags):
    """The checkpoint folder --resume continues from, checked before any work (read_shards, check_run_flags); a
    fresh run's --out must hold no checkpoint (nothing is overwritten). Returns the folder or None."""
    if not args.resume:
        if find_shards("latest", args.out):
            raise UsageError(
                f"--out {args.out}: holds the checkpoints of an earlier run; pass --resume to continue it, "
                "or a new --out (nothing was overwritten)"
            )
        return None
    path = find_shards(args.resume, args.out)
    if path is None:
        raise UsageError(
            f"--resume: no complete checkpoint in {os.path.join(args.out, 'checkpoints')}; drop --resume to "
            "start a new run, or pass a checkpoint folder"
        )
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such folder; pass a checkpoint folder (OUT/checkpoints/step_NNNNNN)")
    meta = read_shards(path)  # CheckpointError: the file and the fix
    import d3s  # the midpoint a null static N or K meant

    midpoint = d3s.dynamic_schedule(1, 2, args.n_init, args.n_final, args.k_init, args.k_final)
    check_run_flags(path, meta["run"], run_flags, midpoint=dict(zip(MIDPOINT_FLAGS, midpoint)))
    check_steps_left(path, meta["step"], args)
    if meta["step"] >= args.steps and _finished(args):  # a run killed before its end's export or evaluation: on
        raise UsageError(  # --resume finishes them, once
            f"--resume {path}: the run already finished its {args.steps} steps (OUT/hf_final and its final "
            "evaluation are written); run without --resume and a new --out to start again"
        )
    return path


def _finished(args):
    """Whether train_full's run in --out wrote its end: OUT/hf_final (renamed into place once complete) and, with
    --eval-data, the final evaluation's line of metrics.jsonl."""
    from support.run import read_metrics

    lines = read_metrics(os.path.join(args.out, "metrics.jsonl"))
    evaluated = not args.eval_data or any(m["kind"] == "eval" and m["step"] == args.steps for m in lines)
    return os.path.isdir(os.path.join(args.out, "hf_final")) and evaluated


def shards_state(run_flags, order, history):
    """The JSON part of a checkpoint: the data position, the run's flags and the history of the steps so far
    (run.Run.history: the grad norms, --switch-on-spike's signal, and the train rewards)."""
    history = {"grad_norms": [], "rewards": [], **history}
    return {"order": order.state_dict(), "run": run_flags, **{k: list(history[k]) for k in ("grad_norms", "rewards")}}


def restore_shards(path, model, optimizer, order, args, world):
    """Model and optimizer shards, RNG and data position from a checkpoint; says so (rank 0); returns its completed
    steps and their history (a checkpoint of before 2026-11-27 has the grad norms only)."""
    meta = load_shards(path, model, optimizer, world)
    order.load_state_dict(meta["order"])
    if world.is_main:
        print(f"resumed from {path} at step {meta['step']}" + other_ranks_note(path, world.size, args), flush=True)
    return meta["step"], {"grad_norms": meta.get("grad_norms", []), "rewards": meta.get("rewards", [])}


def other_ranks_note(path, ranks, args):
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


def save_shards(model, optimizer, out, step, trainer_state, world, keep):
    """OUT/checkpoints/step_NNNNNN (NNNNNN: the completed steps): the model and AdamW's state as DCP shards (no
    param_groups: they follow from the flags), each rank's RNG as tensors (rng_rankR.pt), and trainer_state.json
    (format, step, world size, `trainer_state`). Only DCP's .metadata needs pickle: read_shards allow-lists it.

    Written to step_NNNNNN.tmp (--resume ignores one) and renamed; the older ones beyond the newest `keep` are removed
    after. A full disk on any rank raises DiskFull on every rank (attempt), the .tmp folder removed."""
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
            dcp.save({"model": model_sd, "optim": {"state": optim_sd["state"]}}, checkpoint_id=tmp)  # on all ranks
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
                    state = {"format": SHARDS_FORMAT, "step": step, "world": world.size, **trainer_state}
                    json.dump(state, f, indent=1)
                shutil.rmtree(final, ignore_errors=True)  # resumed from an older checkpoint: this step is redone
                os.replace(tmp, final)  # atomic: the checkpoint exists only once it is complete
                done = sorted(d for d in os.listdir(root) if STEP_DIR.match(d))
                for old in done[: max(len(done) - keep, 0)]:
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    except DiskFull:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # what was written of it: the space back
        raise
    return final


def find_shards(spec, out):
    """The folder to resume from: spec itself, or the newest complete OUT/checkpoints/step_* (None if none)."""
    if spec != "latest":
        return spec
    root = os.path.join(out, "checkpoints")
    done = sorted(d for d in os.listdir(root) if STEP_DIR.match(d)) if os.path.isdir(root) else []
    done = [d for d in done if os.path.exists(os.path.join(root, d, "trainer_state.json"))]
    return os.path.join(root, done[-1]) if done else None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: the classes DCP writes there (its dataclasses, torch sizes, dtypes and layouts,
    paths) allowed, anything else refused before it runs."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout")}
    ALLOWED |= {("pathlib", path) for path in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}

    def find_class(self, module, name):
        obj = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
        dcp = module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
        if (
            (module, name) in self.ALLOWED
            or (module == "torch" and isinstance(obj, torch.dtype))
            or (dcp and isinstance(obj, type) and name != "BytesStorageMetadata")
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """A global that a train_full checkpoint never holds."""


def read_shards(path, rank=None):
    """Check a checkpoint folder before any model is built and return its trainer_state. CheckpointError: missing,
    truncated, corrupt, older, or holding a pickled object (in .metadata or an RNG file)."""
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
    if meta.get("format") != SHARDS_FORMAT:
        raise CheckpointError(
            f"{state_file}: checkpoint format {meta.get('format', 1)}, written by an older train_full.py "
            f"(this one reads format {SHARDS_FORMAT} only: no pickled state); finish that run with "
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
                what = "truncated" if os.path.isfile(shard) else "missing"
                raise CheckpointError(f"{shard}: {what} (the write did not complete); {fix}")
    except FileNotFoundError:
        raise CheckpointError(f"{path}/.metadata: missing (the shards were not written completely); {fix}") from None
    except _Refused as e:  # (non-tensor entries, BytesStorageMetadata, would be unpickled by DCP: refused too)
        why = f"it holds a pickled object ({e}) that train_full never writes there (loading it could run code)"
        raise CheckpointError(f"{path}/.metadata: refused: {why}; {fix}") from None
    except CheckpointError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, ...: a damaged file
        raise CheckpointError(f"{path}/.metadata: truncated or corrupt ({type(e).__name__}); {fix}") from None
    for r in range(meta["world"]) if rank is None else [rank]:
        rng_file = os.path.join(path, f"rng_rank{r}.pt")
        if os.path.exists(rng_file):
            _load_rng_file(rng_file, fix)
    return meta


def _load_rng_file(rng_file, fix):
    """One rank's RNG state: tensors only (torch.load(weights_only=True))."""
    try:
        rng = torch.load(rng_file, weights_only=True)
        assert isinstance(rng, dict) and all(isinstance(v, torch.Tensor) for v in rng.values())
        return rng
    except Exception as e:
        if _pickled(e):
            raise CheckpointError(f"{rng_file}: {_REFUSED}; {fix}") from None
        unpickling = isinstance(e, pickle.UnpicklingError)
        detail = (str(e).strip().splitlines() or [""])[0] if unpickling else type(e).__name__
        raise CheckpointError(f"{rng_file}: truncated or corrupt ({detail}); {fix}") from None


def load_shards(path, model, optimizer, world):
    """Restore the model and AdamW's state (DCP reshards them to any world size) and, at the world size that wrote
    it, this rank's RNG; returns trainer_state. Checked first (read_shards): DCP then reads tensors only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_shards(path, rank=world.rank)
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
    optim_state = {"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)
    rng_file = os.path.join(path, f"rng_rank{world.rank}.pt")
    if meta["world"] == world.size and os.path.exists(rng_file):  # another world size: sampling is seeded per prompt
        rng = _load_rng_file(rng_file, "start a new run")
        torch.set_rng_state(rng["torch"])
        gauss = float(rng["python_gauss"][0])
        words = tuple(rng["python_words"].tolist())
        random.setstate((int(rng["python_version"]), words, None if math.isnan(gauss) else gauss))
        if "cuda" in rng and world.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def export_hf(model, tokenizer, path, world, out):
    """save_pretrained of the full weights (rank 0) in the base model's dtype, for from_pretrained and vLLM; PATH.tmp
    renamed. A full disk raises DiskFull on every rank (`out`: the run's folder, for its line)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tmp = path.rstrip("/") + ".tmp"
    try:
        with attempt(tmp, out, world):  # a full disk: DiskFull on every rank
            if world.is_main:
                dtype = model.config.dtype
                dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"))
                model.config.use_cache = True
                with torch.device("meta"):  # a plain class for save_pretrained (not FSDP's)
                    shell = AutoModelForCausalLM.from_config(model.config)
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    shell.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in full.items()})
                    tokenizer.save_pretrained(tmp)
                finally:
                    model.config.use_cache = False
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
    except DiskFull:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
