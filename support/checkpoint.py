"""support/checkpoint.py: a run's start (fresh or resume, decided once for both trainers) and what --resume restores.

What a checkpoint holds, and so what --resume restores; nothing else is saved, the RNG included: every step reseeds
from (seed, step) and train_full's rollouts carry a seed per prompt, so a resumed run equals an uninterrupted one.
    train_small.py  OUT/checkpoint.pt, one file of tensors and plain values: the model, AdamW's state, the completed
                    steps, the run's totals (summary.json's), its flags (RUN_FLAGS) and the history its rules read;
                    no data position: a step's prompts are drawn from (seed, step)
    train_full.py   OUT/checkpoints/step_NNNNNN/: the model and AdamW's state as DCP shards (resharded at another rank
                    count; AdamW's param_groups follow from the flags) and trainer_state.json: the completed steps, the
                    world size, the flags, the history and the data position (mathtask.PromptOrder)
The history is {"grad_norms": [...], "rewards": [...]}, one value per step: --switch-on-spike reads the norms,
--schedule adaptive the rewards.

    start                       fresh or resume, both trainers: the folder, the checkpoint, its format, the flags
                                against the checkpoint's, the steps left; a fresh run never writes over an earlier one
    save_file, load_file        train_small's storage: one file (written to .tmp, fsync, renamed)
    save_shards, load_shards    train_full's: a step_NNNNNN.tmp folder renamed; read_shards checks one before any model
    export_pretrained, export_hf   a model folder that transformers' from_pretrained (and vLLM) loads

A checkpoint of an older format is refused in one line naming its format. Every checkpoint and export is written to a
temporary name and renamed when complete: a kill leaves the old one or the new one, never half of one.
"""

import dataclasses
import importlib
import json
import os
import pickle
import re
import shutil
import sys

import torch

from support.cli import UsageError
from support.run import read_metrics
from support.stops import DiskFull, attempt

FILE_FORMAT = 4  # train_small's OUT/checkpoint.pt; 4: no RNG state (2026-11-28)
SHARDS_FORMAT = 3  # train_full's trainer_state.json; 3: no per-rank RNG files (2026-11-28)
STEP_DIR, EXPORT_DIR = re.compile(r"^step_(\d+)$"), re.compile(r"^hf_step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and the fix (one line, exit 2)."""


@dataclasses.dataclass
class Resume:
    """The checkpoint a run continues from: its path and what it holds besides train_full's shards (train_small: the
    whole file, read_file; train_full: trainer_state.json, read_shards); saved["step"]: its completed steps."""

    path: str
    saved: dict


def start(args, flags, prog, shards=False):
    """Fresh or resume, decided before any work, the same way in both trainers (shards: train_full's storage).
    Returns None for a fresh run, else the Resume to continue from; a refusal is a UsageError (one line, exit 2).

    A fresh run never writes over an earlier one: a folder holding metrics.jsonl or a checkpoint is refused, naming
    --resume and another --out. --resume needs a checkpoint of this format made with these `flags` (the rung's
    RUN_FLAGS) with steps left; a finished run is refused. --resume auto (one command for the first start and every
    requeue): the newest checkpoint, else a fresh start (also where OUT/args.json holds these flags: killed before
    its first checkpoint); a finished run prints one line and exits 0."""
    if args.resume == "auto":
        saved = find_shards("latest", args.out) if shards else os.path.join(args.out, "checkpoint.pt")
        if saved and os.path.exists(saved):
            args.resume = "latest"
            step = (read_shards(saved) if shards else read_file(saved, prog))["step"]
            if step >= args.steps and finished(args, shards):
                print(f"{prog}: the run in {args.out} already finished its {args.steps} steps (--resume auto)")
                raise SystemExit(0)
        else:
            args.resume = None
            if _same_run(args.out, flags):  # killed before its first checkpoint: start it again
                return None
    if not args.resume:
        held = [
            name
            for name in ("metrics.jsonl", "checkpoint.pt", "checkpoints")
            if os.path.exists(os.path.join(args.out, name))
        ]
        if held:
            raise UsageError(
                f"--out {args.out}: holds an earlier run ({', '.join(held)}); continue it with --resume, or pass "
                "another --out (nothing was overwritten)"
            )
        return None
    if shards:
        path = find_shards(args.resume, args.out)
        if path is None:
            raise UsageError(
                f"--resume: no complete checkpoint in {os.path.join(args.out, 'checkpoints')}; drop --resume to start "
                "a new run, or pass a checkpoint folder"
            )
        if not os.path.isdir(path):
            raise UsageError(f"--resume {path}: no such folder; pass a checkpoint folder (OUT/checkpoints/step_NNNNNN)")
        saved = read_shards(path)  # CheckpointError: the file and the fix
    else:
        path = os.path.join(args.out, "checkpoint.pt") if args.resume == "latest" else args.resume
        saved = read_file(path, prog)
    check_run_flags(path, saved["run"], flags)
    if args.stop_after is not None and args.stop_after <= saved["step"]:
        raise UsageError(
            f"--stop-after {args.stop_after}: the checkpoint {path} is already at step {saved['step']}; raise "
            "--stop-after or drop it"
        )
    if saved["step"] >= args.steps and finished(args, shards):  # killed before its end's files: --resume writes them
        end = "OUT/hf_final and its final evaluation" if shards else "OUT/final and summary.json"
        raise UsageError(
            f"--resume {path}: the run already finished its {args.steps} steps ({end} are written); start a new "
            "run with another --out"
        )
    return Resume(path, saved)


def _same_run(out, flags):
    """Whether OUT/args.json (a run's flags as it started) holds `flags`: the same run, started again."""
    try:
        with open(os.path.join(out, "args.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return saved.get("run") == flags


def finished(args, shards=False):
    """Whether the run in --out wrote its end: train_small's summary.json; train_full's OUT/hf_final (renamed into
    place once complete) and, with --eval-data, the final evaluation's line of metrics.jsonl."""
    if not shards:
        return os.path.exists(os.path.join(args.out, "summary.json"))
    lines = read_metrics(os.path.join(args.out, "metrics.jsonl"))
    evaluated = not args.eval_data or any(m["kind"] == "eval" and m["step"] == args.steps for m in lines)
    return os.path.isdir(os.path.join(args.out, "hf_final")) and evaluated


def check_run_flags(path, saved, now):
    """A resume repeats the flags that define the run's trajectory (the rung's RUN_FLAGS; --steps too: the schedule
    runs over it). UsageError naming the first that differs from the checkpoint's (`saved`: {flag: value})."""
    for flag, value in now.items():
        if saved.get(flag) != value:
            name = "--" + flag.replace("_", "-")
            raise UsageError(
                f"{name} {value}: the checkpoint {path} was made with {name} {saved.get(flag)}"
                + (" (the D3S schedule runs over --steps)" if flag == "steps" else "")
                + "; resume with the run's flags, or start a new run with another --out"
            )


def _older(path, found, wanted, prog):
    """The refusal of a checkpoint in another format (one line naming it)."""
    return (
        f"{path}: checkpoint format {found} (this {prog} reads format {wanted} only); finish that run with the "
        f"{prog} that wrote it, or start a new run with another --out"
    )


# === train_small.py: one file =========================================================================================
def save_file(path, model, optimizer, step, flags, totals, history):
    """The model, AdamW's state, the completed steps, the run's totals and flags, and its history in one file of
    tensors and plain values (torch.load(weights_only=True) reads it)."""
    state = {
        "format": FILE_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "totals": totals,
        "run": flags,
        "history": history,
    }
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_file(path, prog):
    """The checkpoint --resume continues from, checked before any work: it exists, is complete, holds no pickled
    object, and is of FILE_FORMAT. Raises UsageError naming the fix."""
    fix = "run without --resume and another --out to start again"
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
        raise UsageError("--resume " + _older(path, state.get("format", 1), FILE_FORMAT, prog))
    if not {"step", "model", "optimizer", "totals", "run", "history"} <= set(state):
        raise UsageError(corrupt)
    return state


def _pickled(error):
    """Whether torch.load(weights_only=True) refused a pickled object (not a damaged file)."""
    return isinstance(error, pickle.UnpicklingError) and (
        "weights_only" in str(error) or "Unsupported global" in str(error)
    )


_REFUSED = "refused: it holds a pickled Python object, not tensors (loading it could run code)"


def load_file(state, model, optimizer):
    """Restore what read_file read; returns (step, totals, history)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["totals"], state["history"]


def export_pretrained(model, tokenizer, path):
    """model.save_pretrained and tokenizer.save_pretrained into `path` (PATH.tmp renamed), for from_pretrained."""
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    model.save_pretrained(path + ".tmp")
    tokenizer.save_pretrained(path + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)


# === train_full.py: DCP shards, one folder per checkpoint =============================================================
def shards_state(run_flags, order, history):
    """trainer_state.json's part from the run: the data position, the flags and the history of the steps so far."""
    return {"order": order.state_dict(), "run": run_flags, **{k: list(history[k]) for k in ("grad_norms", "rewards")}}


def restore_shards(path, model, optimizer, order, args, world):
    """The model's and AdamW's shards and the data position from the checkpoint folder `path` (start's); says so
    (rank 0); returns the completed steps and their history."""
    meta = load_shards(path, model, optimizer, world)
    order.load_state_dict(meta["order"])
    if world.is_main:
        note = other_ranks_note(meta["world"], world.size, args)
        print(f"resumed from {path} at step {meta['step']}" + note, flush=True)
    return meta["step"], {"grad_norms": meta["grad_norms"], "rewards": meta["rewards"]}


def other_ranks_note(saved, ranks, args):
    """'' when the checkpoint was saved on `ranks` ranks (`saved`: its world size); else what a resume on another
    rank count keeps and what it cannot (docs/train_full.md, "Resuming on another number of ranks")."""
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
        "order continues" + rollouts + "; losses and gradient norms equal an "
        "uninterrupted run's to rounding only, not bit for bit (the sums over ranks run in another order)"
    )


def save_shards(model, optimizer, out, step, trainer_state, world, keep):
    """OUT/checkpoints/step_NNNNNN (NNNNNN: the completed steps): the model and AdamW's state as DCP shards (no
    param_groups: they follow from the flags) and trainer_state.json (format, step, world size, `trainer_state`).
    Only DCP's .metadata needs pickle: read_shards allow-lists it.

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
        with attempt(tmp, out, world):
            if world.is_main:
                with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                    state = {"format": SHARDS_FORMAT, "step": step, "world": world.size, **trainer_state}
                    json.dump(state, f, indent=1)
                shutil.rmtree(final, ignore_errors=True)  # resumed from an older checkpoint: this step is redone
                os.replace(tmp, final)  # atomic: the checkpoint exists only once it is complete
                keep_newest(root, STEP_DIR, keep)
    except DiskFull:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # what was written of it: the space back
        raise
    return final


def keep_newest(root, pattern, keep):
    """Remove the folders of `root` whose name matches `pattern` (a step number in its group 1) beyond the newest
    `keep`: --keep-checkpoints' rotation, and --keep-exports' of OUT/hf_step_NNNNNN (rank 0)."""
    done = sorted(d for d in os.listdir(root) if pattern.match(d)) if os.path.isdir(root) else []
    for old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


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


def read_shards(path):
    """Check a checkpoint folder before any model is built and return its trainer_state. CheckpointError: missing,
    truncated, corrupt, of another format, or holding a pickled object in .metadata."""
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
        raise CheckpointError(_older(state_file, meta.get("format", 1), SHARDS_FORMAT, "train_full.py"))
    for key in ("step", "world", "order", "run", "grad_norms", "rewards"):
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
    return meta


def load_shards(path, model, optimizer, world):
    """Restore the model and AdamW's state (DCP reshards them to any world size); returns trainer_state. Checked
    first (read_shards): DCP then reads tensors only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_shards(path)
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
