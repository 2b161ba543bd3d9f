"""train_full.py's FSDP2 step on 2 gloo ranks equals a plain single-process step.

tests/full_fsdp_worker.py runs one train_full.train_step (micro-batch size 3, so micro-batching
and uneven per-rank micro-batch counts are on) under `torchrun --nproc_per_node=2`; the reference
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
import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import full_fsdp_worker as worker  # noqa: E402

METHODS = ("grpo", "d3s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    tokenizer = tiny.build_char_tokenizer()
    return tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def fsdp_result(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "result.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "full_fsdp_worker.py"), "--model", tiny_model_dir, "--out", str(out),
           "--methods", ",".join(METHODS), "--workdir", str(out.parent / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def reference_step(model_dir, method):
    """One step on one process, from d3s.py only (no train_full code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rollouts = [r for group in worker.make_rollouts(model.config.vocab_size) for r in group]  # [P*G], prompt-major
    n_sched, k_sched = d3s.dynamic_schedule(worker.STEP, worker.STEPS, 2, 4, 0.3, 0.5)
    n_keep, k_frac = (worker.G, 1.0) if method == "grpo" else (n_sched, k_sched)
    keep, adv = d3s.select_samples(worker.REWARDS, n_keep, method)
    kept = keep.view(-1).nonzero().squeeze(1).tolist()
    seqs = [rollouts[i] for i in kept]
    kept_adv = adv.view(-1)[kept]
    # whole batch, right-padded [prompt | response | pad]; response token t is predicted at len(prompt) - 1 + t
    length = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs)
    T = max(len(s["response_ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        full = s["prompt_ids"] + s["response_ids"]
        ids[i, : len(full)], attn[i, : len(full)] = torch.tensor(full), 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()  # [B, L, V]
    resp_logits = torch.zeros(len(seqs), T, logits.shape[-1])
    targets = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    rows = []
    for i, s in enumerate(seqs):
        p, n = len(s["prompt_ids"]), len(s["response_ids"])
        rows.append(logits[i, p - 1 : p - 1 + n])
        targets[i, :n], mask[i, :n] = torch.tensor(s["response_ids"]), True
    resp_logits = torch.stack([torch.cat([r, r.new_zeros(T - r.shape[0], r.shape[1])]) for r in rows])
    logp = resp_logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = d3s.token_entropy(resp_logits)
    token_keep = d3s.select_tokens(kept_adv.abs().unsqueeze(1) * entropy, mask, k_frac)
    loss, _ = d3s.policy_loss(logp, logp.detach(), kept_adv, token_keep, kind="grpo", clip_low=0.2, clip_high=0.28)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return {"keep": keep, "token_keep": token_keep, "grads": grads, "grad_norm": float(grad_norm), "loss": float(loss.detach()),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_global_token_selection_over_uneven_ranks_equals_one_shot_selection(fsdp_result):
    assert fsdp_result["world"] == 2
    assert fsdp_result["token_selection_ok"]


@pytest.mark.parametrize("method", METHODS)
def test_fsdp_two_ranks_keeps_the_same_rollouts_and_tokens_as_one_process(fsdp_result, tiny_model_dir, method):
    ref, got = reference_step(tiny_model_dir, method), fsdp_result[method]
    assert torch.equal(got["keep"], ref["keep"])
    assert torch.equal(got["token_keep"], ref["token_keep"])
    if method == "d3s":  # cross-group: rank 0 (groups 0, 1) keeps 8 rollouts, rank 1 (groups 2, 3) only 4
        assert got["keep"][:2].sum() == 8 and got["keep"][2:].sum() == 4
        assert 0 < got["kept_tokens"] < ref["token_keep"].numel()


@pytest.mark.parametrize("method", METHODS)
def test_fsdp_two_ranks_step_equals_single_process_step(fsdp_result, tiny_model_dir, method):
    ref, got = reference_step(tiny_model_dir, method), fsdp_result[method]
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert ref["grad_norm"] > 0.05  # clipping binds, so it is compared too
    assert set(got["params"]) == set(ref["params"])
    for name in ref["params"]:
        torch.testing.assert_close(got["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-8, msg=name)
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=2e-6, msg=name)
    base = dict(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    moved = max(float((got["params"][n] - base[n].detach()).abs().max()) for n in base)
    assert moved > 5e-5  # the step did change the weights (lr 1e-4)


def test_resume_from_a_sharded_checkpoint_continues_exactly(fsdp_result):
    """Model and optimizer shards (DCP) and the data order come back: step 2 after a resume equals
    step 2 of an uninterrupted run."""
    resume = fsdp_result["resume"]
    assert resume["step"] == 1 and resume["order"]["pos"] == 3
    assert resume["max_diff"] <= 1e-7


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(fsdp_result):
    assert fsdp_result["nonfinite"]["skipped_on_ranks"] == [True, True]
    assert fsdp_result["nonfinite"]["unchanged"]
