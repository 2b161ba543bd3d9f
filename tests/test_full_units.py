"""train_full.py's pieces that need neither vLLM nor several processes: CLI, data, layout."""

import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from support import run, checks, fsdp, loss_head, gpu, methods, cli, mathtask
import train_full
from test_full_faults import flags, inputs  # noqa: F401 (inputs: a fixture)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_help_runs_without_vllm_or_gpu_and_labels_paper_and_recipe_defaults():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_full.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--model",
        "--method",
        "--loss",
        "--rollout",
        "--train-data",
        "--eval-data",
        "--eval-only",
        "--out",
        "--resume",
        "[abstract]",
        "[summary]",
        "[notes]",
        "[recipe]",
        "[choice]",
    ):
        assert flag in proc.stdout
    # (the main test venv has no vLLM installed, so this also shows --help does not need it)


def test_defaults_are_the_papers_and_the_recipes():
    args = train_full.parse_args([])
    assert (args.n_init, args.n_final, args.k_init, args.k_final, args.group_size) == (8, 32, 0.05, 0.20, 32)
    assert (args.lr, args.clip_low, args.clip_high, args.temperature, args.max_response_len, args.max_prompt_len) == (
        1e-6,
        0.2,
        0.28,
        1.0,
        3000,
        1024,
    )
    assert args.model == "Qwen/Qwen2.5-Math-7B" and args.method == "d3s" and args.template == "qwen-math"
    gspo = train_full.parse_args(["--loss", "gspo"])
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    with pytest.raises(SystemExit):
        train_full.parse_args(["--group-size", "16"])  # N ends at 32 > G


def test_ladder_methods_mini_batches_and_gspo_aggregation_defaults():
    for method in ("grpo", "d1s", "d1s-cross", "d2s", "d3s", "d3s-i", "pods", "random"):
        assert train_full.parse_args(["--method", method]).method == method
    with pytest.raises(SystemExit):
        train_full.parse_args(["--method", "d3s-static"])  # an old name: refused like any unknown one
    args = train_full.parse_args([])
    assert args.mini_batches == 4 and args.loss_agg == "token-mean" and not args.kl_ref and args.kl_coef == 0.0
    assert train_full.parse_args(["--loss", "gspo"]).loss_agg == "seq-mean-token-mean"
    assert methods.budget(args, "d3s", 1) == (8, 0.05)  # (N, K) of a row at step 1 (steps count from 1)
    assert methods.budget(train_full.parse_args(["--method", "d2s"]), "d2s", 1) == (20, 0.125)
    assert methods.budget(args, "d3s", 250) == (32, pytest.approx(0.2 - 0.15 / 250))  # step S: method_budget at S - 1
    for bad in (["--mini-batches", "0"], ["--kl-coef", "0.1"], ["--static-n", "40"], ["--mlp-chunk-tokens", "-1"]):
        with pytest.raises(SystemExit):
            train_full.parse_args(bad)


def test_the_kl_to_the_reference_is_measured_on_step_1_every_kl_every_steps_and_the_last():
    measured = lambda argv: [s for s in range(1, 26) if run.measures_kl(s, train_full.parse_args(argv))]
    assert train_full.parse_args(["--kl-ref"]).kl_every == 10  # --eval-every 0: 10
    assert measured(["--kl-ref", "--steps", "25"]) == [1, 10, 20, 25]
    assert measured(["--kl-ref", "--steps", "25", "--eval-every", "12"]) == [1, 12, 24, 25]  # default: --eval-every
    assert measured(["--steps", "25", "--kl-every", "0"]) == []  # (with --kl-ref: refused, the reference would idle)
    assert measured(["--kl-ref", "--steps", "25", "--kl-coef", "0.1"]) == list(range(1, 26))  # in the loss: every step


@pytest.mark.parametrize("balance", [False, True])
def test_mini_batches_are_contiguous_parts_of_the_global_kept_list_whatever_the_ranks(balance):
    lengths = [5, 9, 2, 7, 7, 1, 8, 3, 6, 4, 10]
    for ranks, home in ((1, [0] * 11), (2, [0] * 7 + [1] * 4), (3, [0] * 5 + [2] * 6)):  # rank 1 of 3 kept nothing
        owner, parts = fsdp.assign_rollouts(lengths, home, ranks, 3, balance)
        assert parts == [part.tolist() for part in torch.arange(11).tensor_split(3)]
        assert owner == home or balance
        assert all(0 <= r < ranks for r in owner)


def test_load_balance_spreads_each_mini_batch_by_token_count():
    lengths = [100, 90, 80, 70, 10, 10, 10, 10]
    home = [0] * 8  # rank 0 generated every kept rollout (the others' prompts were all solved)
    owner, _ = fsdp.assign_rollouts(lengths, home, 4, 1, balance=True)
    load = [sum(n for n, r in zip(lengths, owner) if r == rank) for rank in range(4)]
    assert owner[:4] == [0, 1, 2, 3] and max(load) - min(load) <= 20  # longest first onto the least loaded
    owner, _ = fsdp.assign_rollouts(lengths, home, 4, 1, balance=False)
    assert owner == home


def test_prompt_order_resumes_exactly_and_crosses_epochs():
    whole = mathtask.PromptOrder(7, seed=3)
    uninterrupted = [whole.take(3) for _ in range(5)]
    first = mathtask.PromptOrder(7, seed=3)
    got = [first.take(3) for _ in range(2)]
    second = mathtask.PromptOrder(7, seed=3)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [second.take(3) for _ in range(3)]
    assert got == uninterrupted
    assert sorted(uninterrupted[0] + uninterrupted[1] + [uninterrupted[2][0]]) == list(range(7))  # one epoch each


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_rank_shares_concatenate_to_the_global_batch_with_rank_independent_seeds(ranks):
    batch = list(range(100, 108))
    shares = [mathtask.rank_share(batch, types.SimpleNamespace(rank=r, size=ranks)) for r in range(ranks)]
    assert [x for share in shares for x in share] == batch
    args = types.SimpleNamespace(seed=0, unseeded_sampling=False)
    seeds = [s for share in shares for s in mathtask.sample_seeds(args, 5, share, 4)]
    assert seeds == mathtask.sample_seeds(args, 5, batch, 4)


def test_sampling_seeds_of_one_call_never_share_a_noise_stream():
    # vLLM seeds sample j of a request with seed + j: the G samples of every prompt need their own seeds
    args = types.SimpleNamespace(seed=0, unseeded_sampling=False)
    G = 32
    streams = [s + j for s in mathtask.sample_seeds(args, 7, list(range(1024)), G) for j in range(G)]
    assert len(set(streams)) == len(streams)


def test_resume_keeps_the_metrics_the_checkpoint_covers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"kind": "eval", "step": 0},
        {"kind": "train", "step": 1},
        {"kind": "train", "step": 2},
        {"kind": "eval", "step": 2},
        {"kind": "train", "step": 3},
        {"kind": "eval", "step": 3},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run.truncate_metrics(str(path), 2)  # checkpoint after 2 steps (steps count from 1; eval 0 before training)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:4]


def test_a_fresh_run_into_a_folder_with_checkpoints_stops_and_overwrites_nothing(inputs, tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 0}\n')
    # a tiny model here: the folder is read after the tokenizer and data (checks.load_inputs), under the run's lock
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_full.py"), *flags(inputs, tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--resume" in proc.stderr and str(tmp_path) in proc.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"kind": "train", "step": 0}\n'
    assert not (tmp_path / "args.json").exists()


def test_pack_aligns_responses_and_numbers_positions_as_without_padding():
    seqs = [{"prompt_ids": [5, 6, 7], "response_ids": [8]}, {"prompt_ids": [9], "response_ids": [10, 11, 12]}]
    inputs, targets, mask = loss_head.pack(seqs, [0, 1], pad_id=0, device=torch.device("cpu"))
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8, 0, 0], [0, 0, 9, 10, 11, 12]]
    assert inputs["position_ids"].tolist()[1][2:] == [0, 1, 2, 3] and inputs["position_ids"].tolist()[0][:4] == [
        0,
        1,
        2,
        3,
    ]
    assert targets.tolist() == [[8, 0, 0], [10, 11, 12]] and mask.tolist() == [[True, False, False], [True, True, True]]
    assert inputs["logits_to_keep"] == 4  # the last prompt position predicts the first response token


def test_micro_batches_cover_every_row_once_and_pad_to_the_common_count():
    chunks = loss_head.micro_batches([3, 9, 1, 7, 5], size=2, n_micro=4)
    assert len(chunks) == 4 and chunks[-1] == [] and sorted(r for c in chunks for r in c) == [0, 1, 2, 3, 4]
    assert chunks[0] == [1, 3]  # longest first


def test_eval_data_takes_lists_commas_globs_and_none(tmp_path):
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_text("")
    specs = checks.expand_specs([f"{tmp_path}/*.jsonl", "x.jsonl,org/hub-set:test", "none"])
    assert specs == [f"{tmp_path}/a.jsonl", f"{tmp_path}/b.jsonl", "x.jsonl", "org/hub-set:test"]
    assert train_full.parse_args(["--eval-data", "none"]).eval_data == []
    assert len(train_full.parse_args([]).eval_data) == 7  # the seven benchmarks of the paper


QWEN25_MATH_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def test_vllm_memory_plan_gives_vllm_what_the_trainer_shards_leave():
    from transformers import Qwen2Config

    config = Qwen2Config(**QWEN25_MATH_7B)
    args = train_full.parse_args([])
    card = 80 * 2**30
    plan = gpu.vllm_memory_plan(config, args, 8, card)
    assert 7.5e9 < plan["params"] < 7.7e9  # Qwen2.5-Math-7B: 7.62B
    assert plan["trainer_resident_gib"] == pytest.approx(12 * plan["params"] / 8 / 2**30)  # fp32 + two Adam moments
    assert plan["gpu_memory_utilization"] * card == pytest.approx(
        card - (plan["trainer_resident_gib"] + 4) * 2**30, rel=1e-3
    )
    assert plan["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    full_length = args.max_prompt_len + args.max_response_len
    assert plan["max_num_seqs"] * plan["kv_bytes_per_token"] * full_length <= plan["kv_cache_gib"] * 2**30
    assert plan["max_num_seqs"] >= args.prompts_per_step * args.group_size // 8  # a rank's 128 rollouts run at once
    with pytest.raises(cli.UsageError, match="does not fit this 80.0 GiB GPU"):  # the 7B's state on one GPU:
        gpu.vllm_memory_plan(config, args, 1, card)  # refused with one line (no silent floor at 0.05)


def test_vllm_sleep_levels_that_cost_memory_need_a_flag():
    for level in ("0", "1"):
        with pytest.raises(SystemExit):
            train_full.parse_args(["--device", "cuda", "--vllm-sleep-level", level])
        assert train_full.parse_args(
            ["--device", "cuda", "--vllm-sleep-level", level, "--vllm-allow-awake"]
        ).vllm_sleep_level == int(level)
    assert (
        train_full.parse_args(["--device", "cpu", "--vllm-sleep-level", "0"]).vllm_sleep_level == 0
    )  # no sleep on CPU anyway


def test_mfu_counts_parameters_without_the_input_embedding():
    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    tied = tiny.build_tiny_model(tokenizer)
    total = sum(p.numel() for p in tied.parameters())
    assert tied.config.tie_word_embeddings and gpu.flop_params(tied) == total  # the head is a matmul: counted
    embed = tied.get_input_embeddings().weight.numel()
    untied_config = type(tied.config)(**{**tied.config.to_dict(), "tie_word_embeddings": False})
    untied = type(tied)(untied_config)
    assert gpu.flop_params(untied) == sum(p.numel() for p in untied.parameters()) - embed
    assert dict(gpu.PEAK_TFLOPS)["H100 PCIe"] == 756 and dict(gpu.PEAK_TFLOPS)["H100"] == 989


@pytest.mark.parametrize("method", ["grpo", "d3s"])
def test_the_blockwise_loss_head_equals_the_full_logits_head(method, monkeypatch):
    """Pass 1 (log-probs, entropy) and pass 2 (loss, gradients) of train_full's loss head (support/loss_head.py), which
    never holds [n, T, vocab] logits, against the plain full-logits computation, on CPU."""
    import d3s
    from support import tiny

    monkeypatch.setattr(loss_head, "HEAD_CHUNK", 7)  # several blocks, a ragged last one
    tokenizer = tiny.build_char_tokenizer()
    for tied in (True, False):
        model = tiny.build_tiny_model(tokenizer, tie_word_embeddings=tied).train()
        gen = torch.Generator().manual_seed(3)
        seqs = [
            {
                "prompt_ids": torch.randint(3, 60, (int(p),), generator=gen).tolist(),
                "response_ids": torch.randint(3, 60, (int(r),), generator=gen).tolist(),
            }
            for p, r in zip(torch.randint(2, 6, (5,), generator=gen), torch.randint(1, 9, (5,), generator=gen))
        ]
        inputs, targets, mask = loss_head.pack(seqs, list(range(5)), 0, torch.device("cpu"))
        temperature = 0.7
        full = model(**inputs).logits[:, :-1].float() / temperature  # [n, T, V], the old head
        full_logp = full.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            logp, entropy = loss_head.response_logp(model, inputs, targets, temperature, with_entropy=True)
        torch.testing.assert_close(logp[mask], full_logp[mask].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[mask], d3s.token_entropy(full)[mask], rtol=1e-5, atol=1e-5)

        adv = torch.randn(5, generator=gen)
        k = 1.0 if method == "grpo" else 0.2
        keep = d3s.select_tokens(adv.abs().unsqueeze(1) * entropy, mask, k)
        old = logp + 0.05 * torch.randn(logp.shape, generator=gen)  # off-policy: ratios and clipping act
        grads = {}
        for head in ("full", "blocks"):
            model.zero_grad()
            new = full_logp if head == "full" else loss_head.response_logp_at(model, inputs, targets, keep, temperature)
            loss, _ = d3s.policy_loss(new, old, adv, keep, kind="grpo", clip_low=0.2, clip_high=0.28)
            loss.backward(retain_graph=head == "full")
            grads[head] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        assert grads["blocks"][0] == pytest.approx(grads["full"][0], abs=1e-6)
        for name, grad in grads["full"][1].items():
            torch.testing.assert_close(
                grads["blocks"][1][name], grad, rtol=1e-4, atol=1e-6
            )  # fp32 sums in another order


def test_the_tiled_mlp_gives_the_whole_mlps_outputs_and_gradients():
    """fsdp.chunk_mlps (MLP over slices of the sequence, each recomputed in backward),
    under activation checkpointing as in training, against the untouched model: same logits
    with and without grad, same gradients."""
    import copy

    from support import tiny

    tokenizer = tiny.build_char_tokenizer()
    whole = tiny.build_tiny_model(tokenizer).train()
    whole.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled = copy.deepcopy(whole)
    fsdp.chunk_mlps(tiled, chunk_tokens=6)  # 3 rows: slices of 2 positions, a ragged last one
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 11), generator=gen)
    weights = torch.randn(3, 11, whole.config.vocab_size, generator=gen)
    outputs = {}
    for name, model in (("whole", whole), ("tiled", tiled)):
        with torch.no_grad():
            no_grad = model(input_ids=ids).logits
        logits = model(input_ids=ids).logits
        (logits * weights).sum().backward()
        outputs[name] = (no_grad, logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(outputs["tiled"][0], outputs["whole"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["tiled"][1], outputs["whole"][1], rtol=1e-5, atol=1e-5)
    for name, grad in outputs["whole"][2].items():
        torch.testing.assert_close(outputs["tiled"][2][name], grad, rtol=1e-4, atol=1e-4)  # fp32 sums in another order
    assert all(layer.mlp.forward.func.__name__ == "tiled" for layer in tiled.model.layers)
