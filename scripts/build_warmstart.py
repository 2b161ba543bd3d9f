"""scripts/build_warmstart.py [FOLDER]: build train_small.py's default warm start afresh into FOLDER/warmstart-<hash>/
(default weights/, the one the repository ships and every default run loads), with its build.json; support/warmstart.py says
why and tests/test_warmstart_shipped.py checks it."""

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train_small  # noqa: E402
from support import mathtask, warmstart  # noqa: E402


def build_shipped(args):
    """The warm start of `args` (train_small.py's defaults) built afresh on 1 thread (one
    float path on any core count) into args.cache_dir/warmstart-<hash>/, with build.json: the command, the machine,
    every supervised loss and the sha256 of model.safetensors (tests/test_warmstart_shipped.py)."""
    torch.set_num_threads(1)
    train_rows, _ = mathtask.load_data(args)
    path = warmstart.warm_start_path(args, train_rows)
    _, _, info, losses = warmstart.build_warm_start(
        args, train_rows, path, os.path.relpath(os.path.abspath(path), warmstart.ROOT)
    )
    digest = hashlib.sha256(Path(path, "model.safetensors").read_bytes()).hexdigest()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()  # the CPU's name, as lscpu's "Model name"
    cpu = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")][:1]
    build = {
        "command": "python scripts/build_warmstart.py",
        "machine": (cpu or [platform.machine()])[0],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "threads": 1,
        "sft_losses": losses,
        "model_sha256": digest,
    }
    Path(path, "build.json").write_text(json.dumps(build, indent=1))
    print(f"{path}: sha256 {digest}, supervised loss {info['sft_loss_first']:.3f} -> {info['sft_loss_last']:.4f}")
    return path


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    build_shipped(train_small.parse_args(["--cache-dir", (sys.argv[1:] or [warmstart.SHIPPED_DIR])[0]]))
