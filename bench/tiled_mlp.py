"""bench/tiled_mlp.py: what train_full's tiled MLP (--mlp-chunk-tokens) costs in time, on a CPU or a GPU.

    python bench/tiled_mlp.py                                  # 7B-shaped layer ratios, scaled down
    python bench/tiled_mlp.py --rows 4 --seq-len 2048 --chunk-tokens 2048 --repeats 3
    python bench/tiled_mlp.py --device cuda --dtype bfloat16 --hidden 3584 --seq-len 3512 --chunk-tokens 4096   # the 7B's layers

fsdp.chunk_mlps runs each decoder MLP over slices of the sequence and checkpoints each
slice, so under activation checkpointing the MLP's forward runs three times per training
micro-batch instead of two (forward; the layer's recompute in backward; the slice's recompute
just before its backward). Memory is bench/memory.py's job (the 7B at [4, 3000]: 24.95 ->
23.20 GiB per GPU); this script times a forward + backward of a Qwen2 model with Qwen2.5-Math-7B's
proportions (intermediate = 5.29 x hidden, 7 query heads per KV head), whole MLP against tiled,
and prints the FLOP arithmetic for the 7B itself. Prints a markdown table.
"""

import copy
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
from support import fsdp  # noqa: E402
from memory import PRESETS  # noqa: E402  (bench/memory.py, beside this file: the Qwen2.5-Math shapes)

SEVEN_B = PRESETS["7b"]


def seven_b_extra_flops(seq_len=3512):
    """Share of pass 2's FLOPs (forward, recompute, backward = 4 forwards) that one more MLP forward adds, 7B."""
    H, I = SEVEN_B["hidden_size"], SEVEN_B["intermediate_size"]
    kv = SEVEN_B["num_key_value_heads"] * H // SEVEN_B["num_attention_heads"]  # K/V width: 4 heads x 128
    mlp = 2 * 3 * H * I  # per token: gate, up, down
    attn = 2 * (2 * H * H + 2 * H * kv) + 2 * 2 * seq_len * H  # q, o, k, v projections + scores and values (full L)
    return mlp / (4 * (mlp + attn))


def time_pass2(model, ids, repeats):
    """Median seconds of forward + backward (a sum of the logits as the loss) over `repeats` runs, after a warm-up,
    and the peak memory of the device (bytes; CUDA only, else None)."""
    runs, cuda = [], ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1).logits.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        if i:
            runs.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)  # the other arm's peak must not hold these gradients
    return sorted(runs)[len(runs) // 2], (torch.cuda.max_memory_allocated() if cuda else None)


def device_name(device):
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads"


def heads_of(hidden):
    """Query heads of the scaled-down model: 7 per KV head, as the 7B (28 / 4), about 64 wide."""
    return max(7, hidden // 64 // 7 * 7)


def parse_args(argv=None):
    """The flags, every one checked before any work: one line `tiled_mlp.py: error: --flag VALUE: ...`, exit 2."""
    f, n = cli.flag, cli.number
    flags = [
        f("--hidden", 448, n(int, 14, 65536), "hidden size (7B: 3584); intermediate = 5.29 x hidden"),
        f("--layers", 4, n(int, 1, 1024), "decoder layers"),
        f("--rows", 4, n(int, 1, 65536), "rollouts in the micro-batch"),
        f("--seq-len", 1024, n(int, 1, 2**20, what="an int in [1, 2^20]"), "tokens per rollout"),
        f(
            "--chunk-tokens",
            1024,
            n(int, 1, 2**30, what="an int >= 1 (tokens per slice of the tiled arm; the whole arm is the other row)"),
            "--mlp-chunk-tokens of the tiled arm (rows x seq-len / chunk-tokens slices; 4 as the 7B's default at "
            "[4, 3512])",
        ),
        f("--repeats", 3, n(int, 1), "timed runs per arm (the median is reported)"),
        f(
            "--device",
            "cpu",
            ["cpu", "cuda"],
            "on a GPU: --hidden 3584 --seq-len 3512 --chunk-tokens 4096 times the 7B's own layers",
        ),
        f("--dtype", "float32", ["float32", "bfloat16"], "parameter and compute dtype (train_full: bfloat16 on a GPU)"),
    ]
    p = cli.parser("tiled_mlp.py", __doc__.split("\n\n")[0], flags)
    args = p.parse_args(argv)
    heads = heads_of(args.hidden)
    if (args.hidden // heads) % 2:  # rotary embeddings rotate pairs of a head's dimensions
        fits = [h for h in range(args.hidden - 64, args.hidden + 65) if h >= 14 and (h // heads_of(h)) % 2 == 0]
        p.error(
            f"--hidden {args.hidden}: gives {heads} heads of {args.hidden // heads} dimensions, and rotary "
            f"embeddings need an even head size; pass e.g. {min(fits, key=lambda h: abs(h - args.hidden))}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; use --device cpu, or install torch's CUDA build")
    return args


def main(argv=None):
    args = parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = heads_of(args.hidden)
    ratio = SEVEN_B["intermediate_size"] / SEVEN_B["hidden_size"]  # 5.29
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=round(args.hidden * ratio),
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 7,
        tie_word_embeddings=False,
    )
    whole = Qwen2ForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).train()
    whole.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as train_full
    tiled = copy.deepcopy(whole)
    fsdp.chunk_mlps(tiled, args.chunk_tokens)
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    (t_whole, m_whole), (t_tiled, m_tiled) = time_pass2(whole, ids, args.repeats), time_pass2(tiled, ids, args.repeats)
    share = seven_b_extra_flops()
    slices = -(-args.seq_len // max(1, args.chunk_tokens // args.rows))
    print(
        f"# bench/tiled_mlp.py: hidden {args.hidden}, intermediate {config.intermediate_size}, {args.layers} layers, "
        f"[{args.rows}, {args.seq_len}] tokens, activation checkpointing on, {args.dtype}; "
        f"{device_name(args.device)}, torch {torch.__version__}; median of {args.repeats}\n"
    )
    mem = lambda m: f" {m / 2**30:.2f} |" if m is not None else ""
    print("| MLP | forward + backward s | vs whole |" + (" peak GiB |" if m_whole is not None else ""))
    print("|---|---|---|" + ("---|" if m_whole is not None else ""))
    print(f"| whole (--mlp-chunk-tokens 0) | {t_whole:.3f} | 1.00 |" + mem(m_whole))
    print(
        f"| tiled, {slices} slices (--mlp-chunk-tokens {args.chunk_tokens}) | {t_tiled:.3f} | {t_tiled / t_whole:.2f} |"
        + mem(m_tiled)
    )
    print(
        f"\nArithmetic for Qwen2.5-Math-7B at 3512 tokens: one more MLP forward adds {share:.0%} to pass 2's FLOPs "
        "(forward + recompute + backward = 4 forwards; the MLP is most of a layer's FLOPs)."
    )


if __name__ == "__main__":
    main()
