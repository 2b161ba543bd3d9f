"""scripts/export_checkpoint.py: any checkpoint of train_full.py as an HF model folder, on CPU (no GPU, no torchrun).

    python scripts/export_checkpoint.py runs/full/checkpoints/step_000100            # -> runs/full/hf_step_000100
    python scripts/export_checkpoint.py runs/full/checkpoints/step_000100 --out best --dtype float32

train_full.py checkpoints its policy as fp32 master weights in DCP shards, one file per rank (support/checkpoint.py,
save_shards). This reads them on one process without a process group (DCP reshards them to one), into the base
model's class built from its config (--model, by default the model the run recorded), and writes what train_full's
own exports hold (checkpoint.export_hf): the weights in the base model's dtype, config.json, and the tokenizer and
generation config beside them, so that AutoModelForCausalLM.from_pretrained, vLLM and `train_full.py --eval-only`
load it. Written to OUT.tmp and renamed once complete. Host memory [arithmetic, not measured on the 7B]: the model
once in the export dtype (Qwen2.5-Math-7B's 7.6B parameters in bfloat16: 15 GB), and the one fp32 tensor DCP reads
at a time, as bytes and as a tensor (the largest, the embedding: 2 x 2.2 GB). tests/test_export_checkpoint.py checks
its logits against train_full's own exports.
"""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support import cli  # noqa: E402
from support.checkpoint import CheckpointError, export_pretrained, read_shards  # noqa: E402

PROG = "export_checkpoint.py"
PASS_ONE = "pass a checkpoint folder of train_full.py (OUT/checkpoints/step_NNNNNN)"


def build_parser():
    f = cli.flag
    flags = [
        f("checkpoint", None, None, "a checkpoint folder of train_full.py: OUT/checkpoints/step_NNNNNN", nargs="?"),
        f("--out", None, None, "the HF folder to write; none given: OUT/hf_step_NNNNNN beside the run's checkpoints/"),
        f("--model", None, None, "the base model, for its config and tokenizer; none given: the run's --model"),
        f(
            "--dtype",
            "auto",
            ["auto", "float32", "bfloat16"],
            "the weights' dtype; auto: the base model's, as hf_final",
        ),
    ]
    return cli.parser(PROG, __doc__.split("\n\n")[0], flags)


def check_args(p, args):
    """The checkpoint (read_shards: complete, current format, no pickled object), the base model and --out, before
    any model is built. A bad one: one line, exit 2. Returns (trainer_state, the base model, the output folder)."""
    if args.checkpoint is None:
        p.error(f"no checkpoint named; {PASS_ONE}")
    path = os.path.normpath(args.checkpoint)
    if not os.path.isdir(path):
        p.error(f"{args.checkpoint}: no such folder; {PASS_ONE}")
    try:
        meta = read_shards(path)
    except CheckpointError as e:
        p.error(str(e))
    model = args.model or meta["run"].get("model")
    if model is None:
        p.error(f"{path}: its trainer_state.json records no base model; pass --model (its config and tokenizer)")
    if args.model is None and model.startswith(("/", ".", "~")) and not os.path.isdir(model):
        p.error(
            f"{path}: its run's base model {model} (trainer_state.json) is not here; pass --model with the base "
            "model's folder or hub name (its config and tokenizer)"
        )
    cli.check_model(p, model)
    out = args.out
    if out is None:  # OUT/checkpoints/step_NNNNNN -> OUT/hf_step_NNNNNN, as --export-every names its folders
        parent = os.path.dirname(os.path.abspath(path))
        folder = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
        out = os.path.join(folder, f"hf_step_{meta['step']:06d}")
    if os.path.exists(out):
        p.error(f"--out {out}: already exists (an earlier export?); remove it, or pass another --out")
    return meta, model, out


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    meta, base, out = check_args(p, args)

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from support.mathtask import load_generation_config, load_tokenizer

    logging.disable_progress_bar()  # our own lines only: no "Writing model shards" bar

    # 1. The base model's class and config, its weights left empty: DCP fills them
    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as e:  # a hub name not in the cache offline, an unknown model type, ...
        p.error(f"--model {base}: its config cannot be loaded ({(str(e).strip().splitlines() or [''])[0][:200]})")
    dtype = config.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")

    # 2. The shards of the checkpoint's "model" entry, read into the plain model's state dict: FSDP2's state-dict
    # keys are the plain model's (tied weights: both names, one tensor); the fp32 values are cast to `dtype` as read
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP's note that it runs without a process group: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=args.checkpoint)
        except (Exception, dcp.api.CheckpointException) as e:  # (DCP's own is a BaseException, its cause inside)
            cause = next(iter(getattr(e, "failures", {}).values()), (e,))[0]  # {rank: (exception, traceback)}
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
            p.error(
                f"{args.checkpoint}: its shards do not fit the model of {base} ({first}); pass the run's base model "
                "as --model"
            )

    # 3. save_pretrained with the tokenizer (train_full's: pad = EOS where the model has no pad token) and the base's
    # generation config (its EOS ids), into OUT.tmp, renamed once complete
    model.config.dtype, model.config.use_cache = dtype, True
    generation = load_generation_config(base)
    if generation is not None:
        model.generation_config = generation
    export_pretrained(model, load_tokenizer(base), out)
    recorded = meta["run"]  # the run's flags
    print(
        f"exported step {meta['step']} of {args.checkpoint} ({recorded.get('method')}, {recorded.get('loss')} loss) "
        f"to {out} ({str(dtype).replace('torch.', '')}); evaluate it: python train_full.py --eval-only --model {out} "
        f"--template {recorded.get('template')}"
    )


if __name__ == "__main__":
    main()
