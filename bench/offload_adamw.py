"""bench/offload_adamw.py: the CPU optimizer step of train_full.py --cpu-offload, at 1 thread and at more.

Under --cpu-offload FSDP2 keeps a rank's fp32 master weights, gradients and AdamW moments in host memory, and
AdamW's update runs on the CPU, one tensor at a time (torch's foreach path is for GPU tensors). torchrun sets
OMP_NUM_THREADS=1 and vLLM's worker calls torch.set_num_threads(1), so that update ran on one thread until
engines.offload_threads gave the trainer the host's cores / local ranks back (issue 37). This times
torch.optim.AdamW.step on a rank's shard of a Qwen2.5-Math preset's parameters (bench/memory.py's shapes, every
tensor split --ranks ways), random gradients, for each --threads count, and prints a markdown table.

    python bench/offload_adamw.py                                  # 1.5B shapes, a quarter of each tensor, 1 and 2 threads
    python bench/offload_adamw.py --preset 7b --ranks 16 --threads 1,4,8
"""

import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import cli  # noqa: E402  (support/cli.py: one-line errors)
from memory import PRESETS  # noqa: E402  (bench/memory.py, beside this file: the Qwen2.5-Math shapes)


def threads_list(text):
    """--threads: comma-separated thread counts, each an int in [1, 1024]."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(1 <= t <= 1024 for t in counts):
        raise cli.argparse.ArgumentTypeError(f"{text!r}: must be thread counts like 1,2 (each an int in [1, 1024])")
    return counts


def parse_args(argv=None):
    """The flags, checked before any work: one line `offload_adamw.py: error: --flag VALUE: ...`, exit 2."""
    f, n = cli.flag, cli.number
    flags = [
        f("--preset", "1.5b", sorted(PRESETS), "the model's shapes (bench/memory.py's presets)"),
        f("--ranks", 4, n(int, 1, 4096), "the rank's shard: 1/R of every tensor (1: the whole model on one GPU)"),
        f("--threads", [1, 2], threads_list, "thread counts to time, comma-separated"),
        f("--repeats", 3, n(int, 1, 1000), "timed steps per thread count (the median is reported), after one warm-up"),
    ]
    return cli.parser("offload_adamw.py", __doc__.split("\n\n")[0], flags).parse_args(argv)


def shard_shapes(config, ranks):
    """numel of a rank's shard of each parameter of a Qwen2 model with this config (embedding, layers, norm, head)."""
    H, I, V, L = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    kv = config["num_key_value_heads"] * H // config["num_attention_heads"]
    layer = [H * H, H, kv * H, kv, kv * H, kv, H * H, I * H, I * H, H * I, H, H]  # q, k, v (+ biases), o, MLP, 2 norms
    sizes = [V * H] + layer * L + [H] + ([] if config.get("tie_word_embeddings") else [V * H])
    return [max(1, -(-s // ranks)) for s in sizes]


def main(argv=None):
    args = parse_args(argv)
    sizes = shard_shapes(PRESETS[args.preset], args.ranks)
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
    print(
        f"{args.preset}, 1/{args.ranks} of each tensor: {sum(sizes) / 1e6:.0f}M parameters, {len(sizes)} tensors; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"AdamW foreach={opt.defaults['foreach']} (None: torch's default, per tensor on CPU)\n"
    )
    print("| threads | AdamW step s (median) | s per 1e9 parameters | speed-up |\n|---|---|---|---|")
    first = None
    for count in args.threads:
        torch.set_num_threads(count)
        opt.step()  # warm-up: the moments are allocated here
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        first = first or median
        print(f"| {count} | {median:.3f} | {median / (sum(sizes) / 1e9):.2f} | {first / median:.2f}x |")


if __name__ == "__main__":
    main()
