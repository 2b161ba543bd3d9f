"""integrations/train_trl_d3s.py: D3S from TRL, the example of docs/trl.md. Run it with the TRL venv.

    .venv-trl/bin/python integrations/train_trl_d3s.py                   # d3s, 8 steps on CPU, then its D3S metrics
    .venv-trl/bin/python integrations/train_trl_d3s.py --method grpo     # TRL's GRPO, through the same trainer

A tiny Qwen2 (support/tiny.py: a transformers Qwen2Config and a byte-level tokenizer built with `tokenizers`,
both offline, random weights) answers "a+b=" prompts; a reward counts the digits of the answer. TRL's
GRPOTrainer generates, rewards and logs; D3SGRPOTrainer keeps the rollouts and tokens D3S keeps.
With your own model, pass model="Qwen/Qwen2.5-0.5B-Instruct" (its tokenizer is loaded for you) and
drop use_cpu/bf16 on a GPU.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the repository root, not integrations/: its trl.py would hide the trl package

from support import cli  # noqa: E402  (one-line errors, standard library only: --help works without TRL)

METHODS = ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random", "dapo-filter", "dapo-filter-k")


def reward_digits(completions, **kwargs):  # any TRL reward function works unchanged
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def main(argv=None):
    p = cli.Parser(prog="train_trl_d3s.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="d3s", choices=METHODS, help="d3s_method: a row of methods.LADDER")
    p.add_argument("--steps", type=cli.number(int, 1, 1000), default=8, help="max_steps: TRL optimizer steps")
    p.add_argument("--out", default="runs/trl-d3s", help="output_dir of TRL's trainer")
    args = p.parse_args(argv)
    cli.check_out_dir(p, "--out", args.out)

    from datasets import Dataset

    from support import tiny  # a tiny Qwen2 built offline; use your own model
    from integrations.trl import METRICS, D3SGRPOConfig, D3SGRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer)  # or model="Qwen/Qwen2.5-0.5B-Instruct"
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})
    config = D3SGRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=16,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # this example runs on a CPU; drop both on a GPU
        # D3S: N rollouts kept per prompt and K of their tokens, on the linear schedule of a summary of the
        # paper (8 -> 32 of G = 32 there, G inferred; scaled here to G = 8)
        d3s_method=args.method,
        n_init=2,
        n_final=8,
        k_init=0.05,
        k_final=0.20,
    )
    trainer = D3SGRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward_digits, args=config, train_dataset=dataset
    )
    trainer.train()
    last = [h for h in trainer.state.log_history if "kept_samples" in h][-1]
    print({k: round(last[k], 4) for k in METRICS})  # the rungs' names: a TRL run and train_full's lie in one view


if __name__ == "__main__":
    main()
