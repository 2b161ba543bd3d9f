"""train_full.py's FSDP2 step on 2 gloo ranks equals a plain single-process step.

tests/full_fsdp_worker.py runs steps 3-6 of train_full's loop once (its train_step: select_samples,
forward_kept, select_tokens, update_policy; micro-batch size 3, so micro-batching and uneven per-rank
micro-batch counts are on) under `torchrun --nproc_per_node=2`; the reference
here is written from d3s.py alone: one unsharded model, the whole batch in one forward
(right-padded, full logits), d3s.select_samples / select_tokens / policy_loss, clip, AdamW.
Same kept rollouts, same kept tokens, same gradients and parameters: the kept set and the
update do not depend on the number of ranks.
"""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import d3s
from support import tiny, methods

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import full_fsdp_worker as worker  # noqa: E402

CONFIGS = worker.CONFIGS  # name -> (method, loss, mini-batches, lr)
RANKS = int(os.environ.get("D3S_TEST_RANKS", "2"))  # scripts/gpu_check.sh: 1 on a single-GPU node


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_model_dir(request, tmp_path_factory):
    """Both LM-head layouts: tied (Qwen2.5-Math-1.5B; the embedding lives in the FSDP root) and
    untied (the 7B; the embedding is an FSDP unit of its own, freed after forward)."""
    tokenizer = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(tokenizer, tie_word_embeddings=request.param == "tied")
    return tiny.save_tiny(model, tokenizer, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def fsdp_result(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "result.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS}",
        f"--master_port={free_port()}",
        str(ROOT / "tests" / "full_fsdp_worker.py"),
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
        "--configs",
        ",".join(CONFIGS),
        "--workdir",
        str(out.parent / "work"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def reference_step(model_dir, name):
    """One step on one process, from d3s.py only (no train_full code): select, one no-grad
    forward for the old log-probs and entropy, select tokens, then M mini-batches of the kept
    rollouts (contiguous, in order), one AdamW step each with its own selected-token count."""
    from transformers import AutoModelForCausalLM

    method, loss_kind, M, lr = CONFIGS[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rollouts = [r for group in worker.make_rollouts(model.config.vocab_size) for r in group]  # [P*G], prompt-major
    n_keep, k_frac = d3s.method_budget(
        methods.LADDER[method],
        step=worker.STEP - 1,
        total_steps=worker.STEPS,
        group_size=worker.G,
        n_init=2,
        n_final=4,
        k_init=0.3,
        k_final=0.5,
    )  # steps count from 1
    keep, adv = d3s.select_samples(worker.REWARDS, n_keep, methods.LADDER[method].samples)
    kept = keep.view(-1).nonzero().squeeze(1).tolist()
    seqs = [rollouts[i] for i in kept]
    kept_adv = adv.view(-1)[kept]
    # whole batch, right-padded [prompt | response | pad]; response token t is predicted at len(prompt) - 1 + t
    length = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs)
    T = max(len(s["response_ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    attn = torch.zeros_like(ids)
    targets = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        full = s["prompt_ids"] + s["response_ids"]
        ids[i, : len(full)], attn[i, : len(full)] = torch.tensor(full), 1
        targets[i, : len(s["response_ids"])], mask[i, : len(s["response_ids"])] = torch.tensor(s["response_ids"]), True

    def response_logp(rows):
        logits = model(input_ids=ids[rows], attention_mask=attn[rows]).logits.float()  # [b, L, V]
        out = torch.zeros(len(rows), T, logits.shape[-1])
        for j, i in enumerate(rows):
            p, n = len(seqs[i]["prompt_ids"]), len(seqs[i]["response_ids"])
            out[j, :n] = logits[j, p - 1 : p - 1 + n]
        return out.log_softmax(-1).gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1), out

    everything = list(range(len(seqs)))
    with torch.no_grad():
        old_logp, resp_logits = response_logp(everything)
    entropy = d3s.token_entropy(resp_logits)
    token_keep = d3s.select_tokens(kept_adv.abs().unsqueeze(1) * entropy, mask, k_frac)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    clip = (0.2, 0.28) if loss_kind == "grpo" else d3s.CLIP_DEFAULTS["gspo"]
    losses, norms, clip_fracs, kls = [], [], [], []
    for part in torch.arange(len(seqs)).tensor_split(M):
        rows = part.tolist()
        optimizer.zero_grad()
        logp, _ = response_logp(rows)
        loss, stats = d3s.policy_loss(
            logp,
            old_logp[rows],
            kept_adv[rows],
            token_keep[rows],
            kind=loss_kind,
            clip_low=clip[0],
            clip_high=clip[1],
            ref_logp=old_logp[rows],
        )  # ref = the start
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(float(loss.detach()))
        clip_fracs.append(stats["clip_frac"])
        kls.append((stats["kl"], stats["tokens"]))
    return {
        "keep": keep,
        "token_keep": token_keep,
        "grads": grads,
        "grad_norm": sum(norms) / len(norms),
        "loss": sum(losses) / len(losses),
        "clip_fracs": clip_fracs,
        "kl": sum(k * n for k, n in kls) / sum(n for _, n in kls),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def test_global_token_selection_over_uneven_ranks_equals_one_shot_selection(fsdp_result):
    assert fsdp_result["world"] == RANKS
    assert fsdp_result["token_selection_ok"]


@pytest.mark.parametrize("name", CONFIGS)
def test_fsdp_two_ranks_keeps_the_same_rollouts_and_tokens_as_one_process(fsdp_result, tiny_model_dir, name):
    ref, got = reference_step(tiny_model_dir, name), fsdp_result[name]
    assert torch.equal(got["keep"], ref["keep"])
    assert torch.equal(got["token_keep"], ref["token_keep"])
    if name.startswith("d3s-m2"):  # cross-group: rank 0 (groups 0, 1) keeps 8 rollouts, rank 1 (groups 2, 3) only 4
        assert got["keep"][:2].sum() == 8 and got["keep"][2:].sum() == 4
        assert 0 < got["kept_tokens"] < ref["token_keep"].numel()
        assert abs(got["k_real"] - got["k_frac"]) * ref["token_keep"].sum() / got["k_real"] < 1.0  # within one token
    if name.startswith("dapo-filter"):  # groups 0, 1 and 3 have spread: 3 x G rollouts, each with A != 0
        assert got["kept_samples"] == 3 * worker.G == int(got["keep"].sum()) and got["sur"] == 1.0


@pytest.mark.parametrize("name", CONFIGS)
def test_fsdp_two_ranks_step_equals_single_process_step(fsdp_result, tiny_model_dir, name):
    ref, got = reference_step(tiny_model_dir, name), fsdp_result[name]
    assert got["updates"] == CONFIGS[name][2]
    assert got["clip_frac_by_minibatch"] == pytest.approx(ref["clip_fracs"], abs=1e-6)
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)  # the mean over the optimizer steps
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert ref["grad_norm"] > 0.05  # clipping binds, so it is compared too
    assert set(got["params"]) == set(ref["params"])
    lr = CONFIGS[name][3]
    for param in ref["params"]:
        torch.testing.assert_close(got["grads"][param], ref["grads"][param], rtol=1e-4, atol=1e-8, msg=param)
        # Adam moves every weight by about lr, whatever the gradient's size: compare relative to lr. Its step
        # lr * g / (|g| + eps) is ill-conditioned where |g| is near eps (1e-8): there a rounding-level difference
        # of g (3.2e-9 against 3.7e-9 seen on CPU) moves the weight by 0.02 lr, so those weights are left to the
        # gradient check above
        sure = ref["grads"][param].abs() > 1e-7
        torch.testing.assert_close(
            got["params"][param][sure], ref["params"][param][sure], rtol=0, atol=0.02 * lr, msg=param
        )
    base = dict(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    moved = max(float((got["params"][n] - base[n].detach()).abs().max()) for n in base)
    assert moved > 5e-5  # the step did change the weights (lr >= 1e-4)


def test_load_balance_moves_work_between_ranks_and_leaves_the_update_unchanged(fsdp_result):
    if RANKS < 2:
        pytest.skip("one rank: nothing to balance")
    balanced, unbalanced = fsdp_result["d3s-m2"], fsdp_result["d3s-m2-unbalanced"]
    spread = lambda r: r["rank_tokens_max"] - r["rank_tokens_min"]
    assert spread(balanced) < spread(unbalanced)  # rank 0 generated 8 kept rollouts, rank 1 only 4
    assert balanced["loss"] == pytest.approx(unbalanced["loss"], abs=1e-6)
    for param in balanced["params"]:
        torch.testing.assert_close(
            balanced["grads"][param], unbalanced["grads"][param], rtol=1e-4, atol=1e-8, msg=param
        )
        torch.testing.assert_close(balanced["params"][param], unbalanced["params"][param], rtol=0, atol=2e-6, msg=param)


def test_the_second_mini_batch_is_off_policy_so_gspo_clips_there(fsdp_result):
    gspo = fsdp_result["gspo-d3s-i-m2"]["clip_frac_by_minibatch"]
    assert gspo[0] == 0.0 and gspo[1] > 0.0  # on-policy first, then GSPO's 3e-4/4e-4 range binds


def test_kl_to_the_reference_is_measured_on_the_selected_tokens(fsdp_result, tiny_model_dir):
    """--kl-ref: the frozen initial policy. Mini-batch 1 sees KL 0, mini-batch 2 the moved policy."""
    got, ref = fsdp_result["gspo-d3s-i-m2"]["kl_ref"], reference_step(tiny_model_dir, "gspo-d3s-i-m2")["kl"]
    assert got > 0 and got == pytest.approx(ref, rel=1e-3)
    assert fsdp_result["d3s-m2"]["kl_ref"] is None  # without --kl-ref nothing is measured


def test_resume_from_a_sharded_checkpoint_continues_exactly(fsdp_result):
    """Model and optimizer shards (DCP) and the data order come back: step 2 after a resume equals
    step 2 of an uninterrupted run."""
    resume = fsdp_result["resume"]
    assert resume["step"] == 1 and resume["order"]["pos"] == 3  # 1 step completed
    assert resume["max_diff"] <= 1e-7


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(fsdp_result):
    if RANKS < 2:
        pytest.skip("the NaN is injected on rank 1")
    assert fsdp_result["nonfinite"]["skipped_on_ranks"] == [True, True]
    assert fsdp_result["nonfinite"]["unchanged"]


@pytest.mark.parametrize("name", ["grpo-m1", "grpo-m2", "pods-m2"])
def test_skipping_pass_1_where_the_step_needs_none_leaves_the_update_unchanged(fsdp_result, name):
    """Methods without token selection: at M = 1 no pass 1 (the old log-probs are pass 2's own,
    detached); at M = 2 pass 1 covers mini-batch 2 only, without entropy. Against a full pass 1:
    the same loss, gradients and (SGD) weights, to fp32 rounding."""
    skipped, full = fsdp_result["pass1_skip"][name]["skipped"], fsdp_result["pass1_skip"][name]["full"]
    if name == "grpo-m1":
        assert skipped["pass1_tokens"] == 0 < full["pass1_tokens"]
        assert skipped["entropy_mean"] == pytest.approx(full["entropy_mean"], rel=1e-5)  # pass 2's logits, pre-update
    else:  # mini-batch 2's rows only: fewer tokens than all kept rollouts
        assert 0 < skipped["pass1_tokens"] < full["pass1_tokens"] == full["train_tokens"]
    assert skipped["entropy_kept"] == skipped["entropy_mean"]  # every token is in the loss
    assert skipped["updates"] == full["updates"] == int(name[-1])
    assert skipped["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert skipped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert skipped["clip_frac_by_minibatch"] == pytest.approx(full["clip_frac_by_minibatch"], abs=1e-6)
    for param, grad in full["grads"].items():
        torch.testing.assert_close(skipped["grads"][param], grad, rtol=1e-5, atol=1e-8, msg=param)
        torch.testing.assert_close(skipped["params"][param], full["params"][param], rtol=0, atol=1e-8, msg=param)


def test_the_kl_measured_on_its_schedule_equals_the_kl_measured_every_step(fsdp_result):
    """--kl-every 3 over 4 steps: the reference is forwarded on steps 1, 3 and 4 only; there its KL
    equals the every-step run's, and the updates are the same (the KL is only a metric)."""
    every, scheduled = fsdp_result["kl_schedule"]["every"], fsdp_result["kl_schedule"]["scheduled"]
    assert all(kl is not None for kl in every["kl"]) and every["kl"][-1] > 0
    assert [kl is None for kl in scheduled["kl"]] == [False, True, False, False]
    for a, b in zip(every["kl"], scheduled["kl"]):
        if b is not None:
            assert a == b
    for param in every["params"]:
        assert torch.equal(every["params"][param], scheduled["params"][param]), param


@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_keeps_the_groups_with_spread_and_a_step_with_none_makes_no_optimizer_step(fsdp_result, method):
    """DAPO's filter (--method dapo-filter, dapo-filter-k; M = 2, AdamW) over three steps of one run
    (worker.DAPO_STEPS): the metrics line counts G x the groups with spread, all with A != 0 (sur 1);
    on the step whose groups all have equal rewards nothing is kept and no optimizer step is made,
    although AdamW's moments from step 1 would move the weights on any step; no rank hangs on a step
    where it trains no row (one-rank) or no rank does (empty)."""
    steps = {s["name"]: s for s in fsdp_result["dapo_filter"][method]}
    assert list(steps) == [name for name, _, _ in worker.DAPO_STEPS]
    for name, rewards, _ in worker.DAPO_STEPS:
        got = steps[name]
        spread = rewards.amax(-1) > rewards.amin(-1)  # [P]: the groups whose rewards are not all equal
        assert torch.equal(got["keep"], spread.unsqueeze(1).expand(worker.P, worker.G)), name  # whole groups
        assert got["kept_samples"] == worker.G * int(spread.sum()), name
        assert got["groups_mixed"] == pytest.approx(float(spread.float().mean()))
        assert got["n_keep"] == worker.G and got["skipped"] is False
        if spread.any():
            assert got["sur"] == 1.0 and got["kept_tokens"] > 0
            assert got["updates"] == 2 and len(got["clip_frac_by_minibatch"]) == 2  # one optimizer step per mini-batch
            assert got["loss"] is not None and got["grad_norm"] > 0 and got["moved"] > 5e-5
        else:  # nothing kept: no forward, no optimizer step, the weights exactly as before
            assert got["sur"] == 0.0 and got["kept_tokens"] == got["fwd_tokens"] == 0
            assert got["updates"] == 0 and got["clip_frac_by_minibatch"] == []
            assert got["loss"] is None and got["grad_norm"] is None
            assert got["moved"] == 0.0 and got["rank_tokens_max"] == 0
        if method == "dapo-filter":
            assert got["k_frac"] == 1.0 and got["kept_tokens"] == got["fwd_tokens"]  # every token, as GRPO
        else:  # D3S's token level on K's schedule (K 0.3 -> 0.5 over 4 steps), within one token of K
            step = list(steps).index(name) + 1
            assert got["k_frac"] == pytest.approx(
                d3s.method_budget(
                    methods.LADDER[method],
                    step=step - 1,
                    total_steps=worker.STEPS,
                    group_size=worker.G,
                    n_init=2,
                    n_final=4,
                    k_init=0.3,
                    k_final=0.5,
                )[1]
            )
            if got["fwd_tokens"]:
                assert 0 < got["kept_tokens"] < got["fwd_tokens"]
                assert abs(got["kept_tokens"] - got["k_frac"] * got["fwd_tokens"]) < 1.0
    if RANKS == 2:  # one-rank: rank 1's groups have no spread and --no-load-balance keeps the rows home
        assert steps["one-rank"]["rank_tokens_min"] == 0 < steps["one-rank"]["rank_tokens_max"]
        assert steps["mixed"]["rank_tokens_min"] > 0  # balanced: both ranks train


def test_a_step_the_switch_rule_moved_selects_as_the_intra_group_twin(fsdp_result):
    """A step with row="d3s-i" under --method d3s, what main() passes once --switch-on-spike fired
    (methods.switch_to_intra), is the d3s-i step bit for bit on 2 ranks; on these rewards (group 2 has no
    spread) the cross-group d3s step keeps another set, so the row really reached the selection."""
    got = fsdp_result["switch"]
    moved, twin, cross = got["d3s as d3s-i"], got["d3s-i"], got["d3s"]
    assert moved["sample_rule"] == twin["sample_rule"] == "intra" and cross["sample_rule"] == "cross"
    assert torch.equal(moved["keep"], twin["keep"]) and not torch.equal(moved["keep"], cross["keep"])
    assert moved["keep"].sum(-1).tolist() == [3, 3, 3, 3]  # N = 3 in every group, the one without spread too
    assert moved["loss"] == twin["loss"]
    for name in twin["params"]:
        assert torch.equal(moved["params"][name], twin["params"][name]), name


def test_cpu_offload_gives_the_plain_paths_update(fsdp_result):
    """--cpu-offload (FSDP2's CPUOffloadPolicy: fp32 shards, gradients and AdamW state in host memory, the update
    on the CPU) against the same step without it: the same kept sets, loss, gradients and weights, to fp32
    rounding (the parametrized tests above also hold it to the single-process reference)."""
    plain, offload = fsdp_result["d3s-m2"], fsdp_result["d3s-m2-offload"]
    assert offload["offloaded"] and all(offload["offloaded"]) and not any(plain["offloaded"])
    assert torch.equal(offload["keep"], plain["keep"]) and torch.equal(offload["token_keep"], plain["token_keep"])
    assert offload["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert offload["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    for param in plain["params"]:
        torch.testing.assert_close(offload["grads"][param], plain["grads"][param], rtol=1e-5, atol=1e-8, msg=param)
        torch.testing.assert_close(offload["params"][param], plain["params"][param], rtol=0, atol=1e-7, msg=param)
    assert fsdp_result["resume_offload"]["step"] == 1 and fsdp_result["resume_offload"]["max_diff"] <= 1e-7


def test_the_references_root_holds_no_gathered_weights_after_its_forward(fsdp_result):
    """--kl-ref: the reference's root is wrapped reshard_after_forward=False and never runs a backward; without
    fsdp.reshard its lm_head (1 GiB in bf16 for the 7B) would stay gathered beside vLLM (issue 30)."""
    assert fsdp_result["gspo-d3s-i-m2"]["reference_resharded"]


def test_the_weight_sync_gathers_bf16_shards_into_the_bf16_weights(fsdp_result):
    sync = fsdp_result["sync"]
    assert sync["dtypes"] == ["torch.bfloat16"] and sync["count"] > 0 and sync["equal"]
