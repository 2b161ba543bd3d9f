"""Run with the vLLM venv's python: train_full's vLLM engine, before and after a weight sync.

    torchrun --nproc_per_node=2 tests/full_vllm_worker.py --model TINY_DIR --out result.json

Builds the FSDP policy (sharded over the ranks) and a colocated vLLM engine per rank (engines.make_engine),
generates greedily, takes one optimizer step with a large learning rate, sends the new weights to vLLM
(engines.VLLMEngine.update_weights) and generates again. For both, it records vLLM's tokens
and log-probs and the trainer's own log-probs and greedy choices on those tokens, and, per token, how far
the trainer's best logit is above vLLM's token's (0 where they agree): in bf16 (a GPU) two near-equal logits
may swap. Also whether the rank's RNG came through the engine's start (vLLM seeds torch as it starts).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import full_fsdp_worker  # noqa: E402
from support import fsdp, loss_head, engines, mathtask  # noqa: E402
import train_full  # noqa: E402

PROMPTS = ["1+1=", "The answer is", "abc"]


def trainer_view(model, tokenizer, prompt_ids, completions):
    """The trainer's log-probs of vLLM's tokens, whether its argmax picks them (greedy), and by how much its best
    log-prob is above vLLM's token's at each position."""
    seqs = [{"prompt_ids": p, "response_ids": c["token_ids"]} for p, c in zip(prompt_ids, completions)]
    device = next(model.parameters()).device
    inputs, targets, mask = loss_head.pack(seqs, list(range(len(seqs))), tokenizer.pad_token_id, device)
    with torch.no_grad():
        logits = model(**inputs).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    argmax = logits.argmax(-1)
    margin = logits.log_softmax(-1).amax(-1) - logp  # 0 where vLLM's token is the trainer's argmax
    return (
        [logp[i, mask[i]].tolist() for i in range(len(seqs))],
        [bool((argmax[i, mask[i]] == targets[i, mask[i]]).all()) for i in range(len(seqs))],
        [margin[i, mask[i]].tolist() for i in range(len(seqs))],
    )


def snapshot(engine, model, tokenizer, prompt_ids, stops):
    outs = engine.generate(prompt_ids, 1, 0.0, 1.0, 10, [0] * len(prompt_ids), stops, logprobs=True)
    completions = [group[0] for group in outs]
    trainer_logp, trainer_greedy, margin = trainer_view(model, tokenizer, prompt_ids, completions)
    return {
        "tokens": [c["token_ids"] for c in completions],
        "vllm_logp": [c["logprobs"] for c in completions],
        "trainer_logp": trainer_logp,
        "trainer_greedy_agrees": trainer_greedy,
        "greedy_margin": margin,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    device = os.environ.get("D3S_TEST_DEVICE", "cpu")  # cuda on a GPU node (scripts/gpu_check.sh)
    args = train_full.parse_args(
        [
            "--model",
            cli.model,
            "--device",
            device,
            "--template",
            "plain",
            "--method",
            "grpo",
            "--group-size",
            "4",
            "--prompts-per-step",
            "4",
            "--lr",
            "3e-2",
            "--max-grad-norm",
            "100",
            "--max-prompt-len",
            "32",
            "--max-response-len",
            "16",
            "--eval-max-tokens",
            "16",
            "--vllm-kv-cache-gb",
            "0.25",
            "--micro-batch-size",
            "8",
        ]
    )
    world = fsdp.init_distributed(device)
    tokenizer = mathtask.load_tokenizer(cli.model)
    stops = mathtask.stop_token_ids(tokenizer, mathtask.load_generation_config(cli.model))
    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    torch.manual_seed(1234 + world.rank)  # what train_full's main seeds (seed + rank)
    engine = engines.make_engine(cli.model, args, world)  # vLLM's workers call set_random_seed; make_engine leaves it
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]

    before = snapshot(engine, model, tokenizer, prompt_ids, stops)
    per = full_fsdp_worker.P // world.size
    mine = slice(world.rank * per, (world.rank + 1) * per)
    rollouts = full_fsdp_worker.make_rollouts(len(tokenizer))[mine]
    stats, _ = full_fsdp_worker.train_step(
        model, optimizer, rollouts, full_fsdp_worker.REWARDS[mine], 1, args, world, tokenizer.pad_token_id
    )  # steps 3-6 of train_full's loop
    engine.sleep()  # no-op on CPU (vLLM has no sleep mode there); on CUDA this frees vLLM's memory
    engine.update_weights(fsdp.full_named_tensors(model, getattr(torch, args.dtype)))
    after = snapshot(engine, model, tokenizer, prompt_ids, stops)
    with open(f"{cli.out}.rank{world.rank}", "w") as f:
        json.dump(
            {
                "before": before,
                "after": after,
                "skipped": stats["skipped"],
                "grad_norm": stats["grad_norm"],
                "world": world.size,
                "dtype": args.dtype,
            },
            f,
        )
    engines.shutdown(engine)


if __name__ == "__main__":
    main()
