"""Run under `torchrun --nproc_per_node=R`: one train_full.train_step per method on fixed rollouts.

Writes (rank 0) the full parameters, gradients and kept sets after the step to --out, for
tests/test_full_fsdp.py to compare with a plain single-process step. Also checks that the
global token selection over uneven per-rank rows equals d3s.select_tokens on the whole batch.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import d3s  # noqa: E402
import train_full  # noqa: E402

P, G, STEP, STEPS = 4, 4, 1, 4  # step 1 of 4 with N 2 -> 4: N = 3 per prompt, K = 0.35
REWARDS = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])  # group 2 has no signal


def make_rollouts(vocab_size, seed=0):
    """P x G rollouts of random tokens: prompts of 3-6 tokens, responses of 1-7 (prompt-major)."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for _ in range(P):
        prompt = torch.randint(3, vocab_size, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        group = []
        for _ in range(G):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            group.append({"prompt_ids": prompt, "response_ids": torch.randint(3, vocab_size, (n,), generator=gen).tolist()})
        rollouts.append(group)
    return rollouts


def trainer_args(model_dir, method, loss="grpo"):
    return train_full.parse_args(["--model", model_dir, "--method", method, "--loss", loss, "--device", "cpu",
                                  "--steps", str(STEPS), "--group-size", str(G), "--n-init", "2", "--n-final", "4",
                                  "--k-init", "0.3", "--k-final", "0.5", "--micro-batch-size", "3", "--lr", "1e-4",
                                  "--max-grad-norm", "0.05", "--prompts-per-step", str(P)])


def check_global_token_selection(dist_):
    """Uneven rows per rank (rank r has 3 + r rows): the gathered choice equals the one-shot choice."""
    gen = torch.Generator().manual_seed(1)
    rows = [3 + r for r in range(dist_.world)]
    scores = torch.rand(sum(rows), 9, generator=gen)
    mask = torch.rand(sum(rows), 9, generator=gen) > 0.3
    first = sum(rows[: dist_.rank])
    mine = slice(first, first + rows[dist_.rank])
    ok = True
    for k in (0.1, 0.35, 1.0):
        for scope in ("batch", "sequence"):
            local = train_full.select_tokens_global(scores[mine], mask[mine], k, scope, dist_)
            ok &= bool(torch.equal(local, d3s.select_tokens(scores, mask, k, scope=scope)[mine]))
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default="grpo,d3s")
    cli = parser.parse_args()
    dist_ = train_full.init_distributed("cpu")
    torch.manual_seed(0)
    tokenizer = train_full.load_tokenizer(cli.model)
    rollouts = make_rollouts(len(tokenizer))
    per = P // dist_.world
    mine = slice(dist_.rank * per, (dist_.rank + 1) * per)
    result = {"world": dist_.world, "token_selection_ok": check_global_token_selection(dist_)}
    for method in cli.methods.split(","):
        args = trainer_args(cli.model, method)
        model = train_full.load_policy(args, dist_)
        optimizer = train_full.make_optimizer(model, args)
        stats = train_full.train_step(model, optimizer, rollouts[mine], REWARDS[mine], STEP, args, dist_,
                                      tokenizer.pad_token_id, keep_grads=True)
        params, grads = {}, {}
        for name, p in model.named_parameters():
            params[name] = p.full_tensor().detach().clone()
            grads[name] = p.grad.full_tensor().detach().clone()
        result[method] = {"params": params, "grads": grads, "keep": stats["_keep"], "token_keep": stats["_token_keep"],
                          "grad_norm": stats["grad_norm"], "loss": stats["loss"], "n_keep": stats["n_keep"],
                          "k_frac": stats["k_frac"], "kept_tokens": stats["kept_tokens"]}
    if dist_.is_main:
        torch.save(result, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
