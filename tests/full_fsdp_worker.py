"""Run under `torchrun --nproc_per_node=R`: steps 3-6 of train_full's loop (train_step below) per method on
fixed rollouts and rewards.

The device comes from the environment: D3S_TEST_DEVICE=cuda (nccl, one GPU per rank) or cpu
(gloo, the default), so the same test runs on a GPU node (scripts/gpu_check.sh).

Writes (rank 0) the full parameters, gradients and kept sets after the step to --out, for
tests/test_full_fsdp.py to compare with a plain single-process step. Also checks that the
global token selection over uneven per-rank rows equals d3s.select_tokens on the whole batch.
"""

import argparse
import os
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import run, checkpoint  # noqa: E402
import d3s  # noqa: E402
from support import fsdp, run, checkpoint, mathtask  # noqa: E402
import train_full  # noqa: E402
from support import methods  # noqa: E402

DEVICE = os.environ.get("D3S_TEST_DEVICE", "cpu")
P, G, STEP, STEPS = 4, 4, 2, 4  # step 2 of 4 (method_budget at 1 of 4) with N 2 -> 4: N = 3 per prompt, K = 0.35
REWARDS = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])  # group 2 has no signal


def train_step(
    model,
    optimizer,
    rollouts,
    rewards,
    step,
    args,
    world,
    pad_id,
    ref_model=None,
    row=None,
    keep_grads=False,
    full_pass1=False,
):
    """Steps 3-6 of train_full.main's loop, its calls in its order, on this rank's fixed rollouts [P_rank][G] and
    rewards [P_rank, G]. row: the row that selects (default args.method; the twin once --switch-on-spike fired).
    Test-side hooks: keep_grads also returns the gradients of the last optimizer step (taken as it steps, all
    ranks gathering them: update_policy frees them after); full_pass1 forwards every kept rollout with entropy in
    pass 1 whatever the method, as a token-selecting method does (step 5 stays the method's).
    Returns (metrics, details[, grads]): details holds the global selection (keep [P, G], token_keep [kept, T])."""
    grads = {}
    if keep_grads:
        real_step = optimizer.step

        def step_keeping_grads(*a, **kw):
            grads.update({name: p.grad.full_tensor().detach().cpu().clone() for name, p in model.named_parameters()})
            return real_step(*a, **kw)

        optimizer.step = step_keeping_grads
    sel = train_full.select_samples(rewards, rollouts, row or args.method, step, args, world)
    selects_tokens = methods.selects_tokens
    if full_pass1:
        methods.selects_tokens = lambda method: True  # what forward_kept reads: the rows and the entropy it needs
    try:
        pass1 = train_full.forward_kept(model, ref_model, sel, args, world, pad_id)
    finally:
        methods.selects_tokens = selects_tokens
    sel.token_keep = train_full.select_tokens(sel, pass1.entropy, args, world)
    update = train_full.update_policy(model, optimizer, sel, pass1, args, world, pad_id)
    if keep_grads:
        del optimizer.step
    metrics = train_full.step_metrics(sel, pass1, update, 1.0, ref_model is not None, world)
    token_keep = fsdp.gather_global(sel.token_keep, sel.mine, len(sel.kept_all), world)
    details = {"keep": sel.keep_all, "token_keep": token_keep}
    return (metrics, details, grads) if keep_grads else (metrics, details)


def make_rollouts(vocab_size, seed=0):
    """P x G rollouts of random tokens: prompts of 3-6 tokens, responses of 1-7 (prompt-major)."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for _ in range(P):
        prompt = torch.randint(3, vocab_size, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        group = []
        for _ in range(G):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            group.append(
                {"prompt_ids": prompt, "response_ids": torch.randint(3, vocab_size, (n,), generator=gen).tolist()}
            )
        rollouts.append(group)
    return rollouts


# name -> (method, loss, mini-batches, lr): on-policy GRPO, and M = 2 (the second optimizer step off-policy;
# GSPO with a larger lr, so that the policy moves past its 3e-4/4e-4 clip range in one step)
CONFIGS = {
    "grpo": ("grpo", "grpo", 1, 1e-4),
    "grpo-m2": ("grpo", "grpo", 2, 1e-4),
    "d3s-m2": ("d3s", "grpo", 2, 1e-4),
    "d3s-m2-unbalanced": ("d3s", "grpo", 2, 1e-4),
    "gspo-d3s-i-m2": ("d3s-i", "gspo", 2, 1e-1),
    "dapo-filter-m2": ("dapo-filter", "grpo", 2, 1e-4),
    "dapo-filter-k-m2": ("dapo-filter-k", "grpo", 2, 1e-4),
    "d3s-m2-offload": ("d3s", "grpo", 2, 1e-4),
}  # --cpu-offload: FSDP2's CPUOffloadPolicy (issue 30)

# check_dapo_filter's three steps on the same rollouts, (name, rewards [P, G], load balance). Rank r holds groups
# 2r, 2r + 1 (2 ranks). "one-rank": only rank 0's groups have spread and the kept rollouts stay home, so rank 1
# trains no row (its FSDP collectives run on dummy rows); "empty": no group has spread on any rank, nothing is
# kept (no forward, no optimizer step); "mixed": REWARDS (groups 0, 1, 3), spread over both ranks.
DAPO_STEPS = (
    ("one-rank", torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]), False),
    ("empty", torch.ones(P, G), True),
    ("mixed", REWARDS, True),
)


def trainer_args(model_dir, method, loss="grpo", mini_batches=1, lr=1e-4):
    return train_full.parse_args(
        [
            "--model",
            model_dir,
            "--method",
            method,
            "--loss",
            loss,
            "--device",
            DEVICE,
            "--steps",
            str(STEPS),
            "--group-size",
            str(G),
            "--n-init",
            "2",
            "--n-final",
            "4",
            "--k-init",
            "0.3",
            "--k-final",
            "0.5",
            "--micro-batch-size",
            "3",
            "--lr",
            str(lr),
            "--max-grad-norm",
            "0.05",
            "--prompts-per-step",
            str(P),
            "--mini-batches",
            str(mini_batches),
            "--dtype",
            "float32",  # the reference is fp32 (on CUDA auto would compute in bf16)
            "--mlp-chunk-tokens",
            "6",
        ]
    )  # 3 rows: the tiled MLP runs 2 positions at a time


def check_global_token_selection(world):
    """Uneven rows per rank (rank r has 3 + r rows): the gathered choice equals the one-shot choice."""
    gen = torch.Generator().manual_seed(1)
    rows = [3 + r for r in range(world.size)]
    scores = torch.rand(sum(rows), 9, generator=gen)
    mask = torch.rand(sum(rows), 9, generator=gen) > 0.3
    first = sum(rows[: world.rank])
    mine = slice(first, first + rows[world.rank])
    ok = True
    for k in (0.1, 0.35, 1.0):
        for scope in ("batch", "sequence"):
            sel = types.SimpleNamespace(
                kept_adv=torch.ones(rows[world.rank]),
                mask=mask[mine],
                k_frac=k,
                kept_all=[None] * sum(rows),
                mine=list(range(mine.start, mine.stop)),
            )  # |A| = 1: the scores are H
            args = types.SimpleNamespace(method="d3s", token_scope=scope, min_token_per_response=False)
            local = train_full.select_tokens(sel, scores[mine], args, world)
            ok &= bool(torch.equal(local, d3s.select_tokens(scores, mask, k, scope=scope)[mine]))
    return ok


def full_params(model):
    return {name: p.full_tensor().detach().cpu().clone() for name, p in model.named_parameters()}


def check_resume(cli, world, tokenizer, rollouts, mine, workdir, offload=False):
    """Two steps straight == one step, save_shards, a fresh model + optimizer, restore_shards, one step."""
    args = trainer_args(cli.model, "d3s", mini_batches=2)
    args.out, args.cpu_offload = os.path.join(workdir, "offload" if offload else "plain"), offload
    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    for step in (1, 2):
        train_step(model, optimizer, rollouts[mine], REWARDS[mine], step, args, world, tokenizer.pad_token_id)
    straight = full_params(model)

    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    order = mathtask.PromptOrder(10, seed=0)
    order.take(3)
    train_step(model, optimizer, rollouts[mine], REWARDS[mine], 1, args, world, tokenizer.pad_token_id)
    path = checkpoint.save_shards(
        model,
        optimizer,
        args.out,
        1,
        checkpoint.shards_state(train_full.run_flags(args), order, {"grad_norms": [], "rewards": []}),
        world,
        2,
    )
    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    order = mathtask.PromptOrder(10, seed=0)
    step, _ = checkpoint.restore_shards(path, model, optimizer, order, args, world)
    train_step(model, optimizer, rollouts[mine], REWARDS[mine], step + 1, args, world, tokenizer.pad_token_id)
    resumed = full_params(model)
    return {
        "step": step,
        "order": order.state_dict(),
        "max_diff": max(float((straight[n] - resumed[n]).abs().max()) for n in straight),
    }


def check_sync_gathers_in_the_sync_dtype(cli, world):
    """fsdp.full_named_tensors(model, bf16): every gather (DTensor.full_tensor) moves bf16 shards, and the full
    tensors are the fp32 weights cast to bf16 (issue 30: the fp32 full tensor of the 7B's embedding is 2 GiB)."""
    from torch.distributed.tensor import DTensor

    args = trainer_args(cli.model, "d3s")
    model = fsdp.load_policy(args, world)
    fp32 = full_params(model)
    gathered, full_tensor = [], DTensor.full_tensor

    def spy(self, *a, **kw):
        gathered.append(self.dtype)
        return full_tensor(self, *a, **kw)

    DTensor.full_tensor = spy
    try:
        synced = {name: t.cpu() for name, t in fsdp.full_named_tensors(model, torch.bfloat16)}
    finally:
        DTensor.full_tensor = full_tensor
    return {
        "dtypes": sorted({str(d) for d in gathered}),
        "count": len(gathered),
        "equal": all(torch.equal(synced[n], fp32[n].to(torch.bfloat16)) for n in fp32),
    }


def check_nonfinite_skip(cli, world, tokenizer, rollouts, mine):
    """NaN logits on rank 1 only: every rank skips the step, and no weight changes."""
    args = trainer_args(cli.model, "d3s")
    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    before = full_params(model)
    if world.rank == 1:
        model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    stats, _ = train_step(model, optimizer, rollouts[mine], REWARDS[mine], STEP, args, world, tokenizer.pad_token_id)
    after = full_params(model)
    skipped = [None] * world.size
    dist.all_gather_object(skipped, stats["skipped"])
    return {"skipped_on_ranks": skipped, "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


def check_pass1_skip(cli, world, tokenizer, rollouts, mine):
    """The update without the skipped parts of pass 1 against the update with a full pass 1, for the
    methods without token selection: M = 1 (no pass 1 at all) and M = 2 (pass 1 over mini-batch 2
    only). SGD, so that a rounding-level difference of a near-zero gradient stays that small (Adam
    would scale it to a step of about lr)."""
    out = {}
    for name, method, M in (("grpo-m1", "grpo", 1), ("grpo-m2", "grpo", 2), ("pods-m2", "pods", 2)):
        args = trainer_args(cli.model, method, mini_batches=M)
        runs = {}
        for full in (False, True):
            model = fsdp.load_policy(args, world)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            stats, _, grads = train_step(
                model,
                optimizer,
                rollouts[mine],
                REWARDS[mine],
                STEP,
                args,
                world,
                tokenizer.pad_token_id,
                keep_grads=True,
                full_pass1=full,
            )
            runs[full] = {
                "params": full_params(model),
                "grads": grads,
                **{
                    k: stats[k]
                    for k in (
                        "loss",
                        "grad_norm",
                        "pass1_tokens",
                        "train_tokens",
                        "entropy_mean",
                        "entropy_kept",
                        "updates",
                        "clip_frac_by_minibatch",
                    )
                },
            }
        out[name] = {"skipped": runs[False], "full": runs[True]}
    return out


def check_kl_schedule(cli, world, tokenizer, rollouts, mine):
    """Four steps with the reference forwarded every step, and on train_full's schedule only
    (--kl-every 3 of --steps 4: steps 1, 3 and 4): the same updates, the same KL where both measure."""
    args = trainer_args(cli.model, "d3s-i", loss="gspo", mini_batches=2, lr=1e-1)
    args.kl_ref, args.kl_every = True, 3
    result = {}
    for schedule in ("every", "scheduled"):
        model = fsdp.load_policy(args, world)
        optimizer = fsdp.make_optimizer(model, args)
        ref_model = fsdp.load_policy(args, world, reference=True)
        kls = []
        for step in range(1, STEPS + 1):
            measure = schedule == "every" or run.measures_kl(step, args)
            stats, _ = train_step(
                model,
                optimizer,
                rollouts[mine],
                REWARDS[mine],
                step,
                args,
                world,
                tokenizer.pad_token_id,
                ref_model=ref_model if measure else None,
            )
            kls.append(stats["kl_ref"])
        result[schedule] = {"kl": kls, "params": full_params(model)}
    return result


def check_dapo_filter(cli, world, tokenizer, rollouts, mine):
    """dapo-filter and dapo-filter-k, M = 2, over DAPO_STEPS (steps 1-3 of one run, AdamW): each step's
    metrics and whether the weights moved (after step 1, AdamW's moments are non-zero: an optimizer step
    on a zero gradient would still move them)."""
    out = {}
    for method in ("dapo-filter", "dapo-filter-k"):
        args = trainer_args(cli.model, method, mini_batches=2)
        model = fsdp.load_policy(args, world)
        optimizer = fsdp.make_optimizer(model, args)
        steps = []
        for step, (name, rewards, balance) in enumerate(DAPO_STEPS, start=1):
            args.load_balance = balance
            before = full_params(model)
            stats, details = train_step(
                model, optimizer, rollouts[mine], rewards[mine], step, args, world, tokenizer.pad_token_id
            )
            after = full_params(model)
            steps.append(
                {
                    "name": name,
                    "keep": details["keep"],
                    "moved": max(float((after[n] - before[n]).abs().max()) for n in before),
                    **{
                        k: stats[k]
                        for k in (
                            "kept_samples",
                            "sur",
                            "groups_mixed",
                            "n_keep",
                            "k_frac",
                            "k_real",
                            "kept_tokens",
                            "fwd_tokens",
                            "updates",
                            "skipped",
                            "loss",
                            "grad_norm",
                            "clip_frac_by_minibatch",
                            "rank_tokens_min",
                            "rank_tokens_max",
                        )
                    },
                }
            )
        out[method] = steps
    return out


def check_switch(cli, world, tokenizer, rollouts, mine):
    """--method d3s on a step the switch rule moved to its twin (row="d3s-i"), and --method d3s-i: one step each,
    M = 2, from the same weights. The twin's samples rule is what selects (the keep mask says which)."""
    out = {}
    for name, method, row in (("d3s as d3s-i", "d3s", "d3s-i"), ("d3s-i", "d3s-i", None), ("d3s", "d3s", None)):
        args = trainer_args(cli.model, method, mini_batches=2)
        model = fsdp.load_policy(args, world)
        optimizer = fsdp.make_optimizer(model, args)
        stats, details = train_step(
            model, optimizer, rollouts[mine], REWARDS[mine], STEP, args, world, tokenizer.pad_token_id, row=row
        )
        out[name] = {
            "params": full_params(model),
            "keep": details["keep"],
            "sample_rule": stats["sample_rule"],
            "loss": stats["loss"],
        }
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workdir", required=True, help="checkpoints of the resume check")
    cli = parser.parse_args()
    world = fsdp.init_distributed(DEVICE)
    torch.manual_seed(0)
    tokenizer = mathtask.load_tokenizer(cli.model)
    rollouts = make_rollouts(len(tokenizer))
    per = P // world.size
    mine = slice(world.rank * per, (world.rank + 1) * per)
    result = {"world": world.size, "token_selection_ok": check_global_token_selection(world)}
    for config in cli.configs.split(","):
        args = trainer_args(cli.model, *CONFIGS[config])
        args.load_balance = not config.endswith("unbalanced")
        args.cpu_offload = config.endswith("offload")
        model = fsdp.load_policy(args, world)
        optimizer = fsdp.make_optimizer(model, args)
        ref_model = fsdp.load_policy(args, world, reference=True) if config.startswith("gspo") else None  # --kl-ref
        stats, details, grads = train_step(
            model,
            optimizer,
            rollouts[mine],
            REWARDS[mine],
            STEP,
            args,
            world,
            tokenizer.pad_token_id,
            keep_grads=True,
            ref_model=ref_model,
        )
        # after pass 1, the reference's root (never run backward) holds no gathered weight: its params are shards
        resharded = ref_model is None or all(isinstance(p, DTensor) for p in ref_model.parameters())
        params = full_params(model)
        result[config] = {
            "params": params,
            "grads": grads,
            "keep": details["keep"],
            "token_keep": details["token_keep"],
            "grad_norm": stats["grad_norm"],
            "loss": stats["loss"],
            "n_keep": stats["n_keep"],
            "k_frac": stats["k_frac"],
            "kept_tokens": stats["kept_tokens"],
            "updates": stats["updates"],
            "clip_frac_by_minibatch": stats["clip_frac_by_minibatch"],
            "k_real": stats["k_real"],
            "sur": stats["sur"],
            "kept_samples": stats["kept_samples"],
            "kl_ref": stats["kl_ref"],
            "rank_tokens_max": stats["rank_tokens_max"],
            "rank_tokens_min": stats["rank_tokens_min"],
            "reference_resharded": resharded,
            "offloaded": [
                fp.offload_to_cpu
                for m in model.modules()
                for g in _bench_memory().fsdp_param_groups(m)
                for fp in g.fsdp_params
            ],
        }
    result["resume"] = check_resume(cli, world, tokenizer, rollouts, mine, cli.workdir)
    result["resume_offload"] = check_resume(cli, world, tokenizer, rollouts, mine, cli.workdir, offload=True)
    result["sync"] = check_sync_gathers_in_the_sync_dtype(cli, world)
    result["nonfinite"] = check_nonfinite_skip(cli, world, tokenizer, rollouts, mine)
    result["pass1_skip"] = check_pass1_skip(cli, world, tokenizer, rollouts, mine)
    result["kl_schedule"] = check_kl_schedule(cli, world, tokenizer, rollouts, mine)
    result["dapo_filter"] = check_dapo_filter(cli, world, tokenizer, rollouts, mine)
    result["switch"] = check_switch(cli, world, tokenizer, rollouts, mine)
    if world.is_main:
        torch.save(result, cli.out)
    dist.barrier()
    dist.destroy_process_group()


def _bench_memory():
    """bench/memory.py (a script) as a module: its fsdp_param_groups."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(root, "bench", "memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
