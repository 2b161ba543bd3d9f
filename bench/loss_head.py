"""bench/loss_head.py: CPU time of train_full's two passes, full-logits head against the blockwise head.

    python bench/loss_head.py                       # train_small's model, then a 32k-vocabulary one
    python bench/loss_head.py --rollouts 64 --response-len 16 --repeats 5

train_full.py used to compute a micro-batch's loss from the whole [n, T, vocab] fp32 logits.
Its head now works on the hidden states: pass 1 (no grad: log-probs + entropy) in blocks of
loss_head.HEAD_CHUNK positions, pass 2 (loss + backward) only at the tokens in the loss, in
checkpointed blocks (see loss_head.response_logp / response_logp_at). This script times both
heads on the same model and batch, pass by pass, for K = 1 (grpo: every token in the loss) and
K = 0.2 (d3s at the end of its schedule). Memory is bench/memory.py's job; this is time.
Prints a markdown table; the figures in docs/benchmarks.md come from it.
"""

import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
import d3s  # noqa: E402
from support import tiny, loss_head  # noqa: E402


def full_logits_passes(model, inputs, targets, mask, keep, adv, temperature=1.0):
    """The old head: [n, T, V] fp32 logits in both passes."""
    with torch.no_grad():
        logits = model(**inputs).logits[:, :-1].float() / temperature
        old = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        d3s.token_entropy(logits)
    t1 = time.perf_counter()
    logits = model(**inputs).logits[:, :-1].float() / temperature
    logp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss, _ = d3s.policy_loss(logp, old, adv, keep)
    loss.backward()
    return t1


def blockwise_passes(model, inputs, targets, mask, keep, adv, temperature=1.0):
    """The new head: loss_head.response_logp (pass 1) and response_logp_at (pass 2)."""
    with torch.no_grad():
        old, _ = loss_head.response_logp(model, inputs, targets, temperature, with_entropy=True)
    t1 = time.perf_counter()
    logp = loss_head.response_logp_at(model, inputs, targets, keep, temperature)
    loss, _ = d3s.policy_loss(logp, old, adv, keep)
    loss.backward()
    return t1


def time_passes(fn, model, batch, repeats):
    """Median (pass 1, pass 2) seconds over `repeats` runs, after one warm-up."""
    runs = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        t1 = fn(model, *batch)
        t2 = time.perf_counter()
        if i:
            runs.append((t1 - t0, t2 - t1))
    runs.sort(key=lambda r: r[0] + r[1])
    return runs[len(runs) // 2]


def parse_args(argv=None):
    """The flags, every one checked before any work: one line `loss_head.py: error: --flag VALUE: ...`, exit 2."""
    f, n, length = cli.flag, cli.number, cli.number(int, 1, 2**20, what="an int in [1, 2^20]")
    flags = [
        f("--rollouts", 64, n(int, 1, 65536), "rollouts in the micro-batch"),
        f("--prompt-len", 24, length, "prompt tokens per rollout"),
        f("--response-len", 16, length, "response tokens per rollout"),
        f("--repeats", 5, n(int, 1), "timed runs per cell (the median is reported)"),
        f("--threads", 0, n(int, 0, 1024), "torch threads (0: torch's default)"),
    ]
    return cli.parser("loss_head.py", __doc__.split("\n\n")[0], flags).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = tiny.build_char_tokenizer()
    models = {
        "train_small's model (hidden 128, 4 layers, vocab %d)" % len(tokenizer): (
            tiny.build_tiny_model(tokenizer, hidden_size=128, num_layers=4),
            len(tokenizer),
        ),
        "hidden 128, 4 layers, vocab 32768": (None, 32768),
    }
    print(
        f"# bench/loss_head.py: {args.rollouts} rollouts x ({args.prompt_len} prompt + {args.response_len} response) "
        f"tokens; {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; median of {args.repeats}\n"
    )
    print("| model | K | head | pass 1 s (no grad: log-probs + entropy) | pass 2 s (loss + backward) |")
    print("|---|---|---|---|---|")
    for name, (model, vocab) in models.items():
        if model is None:
            from transformers import Qwen2Config, Qwen2ForCausalLM

            torch.manual_seed(0)
            model = Qwen2ForCausalLM(
                Qwen2Config(
                    vocab_size=vocab,
                    hidden_size=128,
                    intermediate_size=256,
                    num_hidden_layers=4,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    tie_word_embeddings=True,
                )
            )
        model.train()
        gen = torch.Generator().manual_seed(0)
        seqs = [
            {
                "prompt_ids": torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
                "response_ids": torch.randint(3, vocab, (args.response_len,), generator=gen).tolist(),
            }
            for _ in range(args.rollouts)
        ]
        inputs, targets, mask = loss_head.pack(seqs, list(range(args.rollouts)), 0, torch.device("cpu"))
        adv = torch.randn(args.rollouts, generator=gen)
        for k in (1.0, 0.2):
            keep = d3s.select_tokens(torch.rand(mask.shape, generator=gen), mask, k)
            batch = (inputs, targets, mask, keep, adv)
            for head, fn in (("full logits", full_logits_passes), ("blockwise", blockwise_passes)):
                pass1, pass2 = time_passes(fn, model, batch, args.repeats)
                print(f"| {name} | {k:g} | {head} | {pass1:.4f} | {pass2:.4f} |")


if __name__ == "__main__":
    main()
