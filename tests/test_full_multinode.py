"""train_full.py over nodes and rank counts, on CPU (gloo, --rollout hf), 2 steps each:

- two nodes of one process each (two torchrun launches on 127.0.0.1 that meet at a c10d
  rendezvous) give the metrics and the final weights of one node of two processes, exactly;
- a checkpoint saved on 2 ranks resumes on 1, and one saved on 1 resumes on 2. DCP reshards the
  model and AdamW's state exactly (a worker run of this file loads the checkpoint at the other
  rank count and compares with the saving run's own weights and the checkpoint's optimizer state),
  and train_full says what it cannot keep. Step 2 then has the rollouts, rewards and kept samples
  and tokens of an uninterrupted run at either rank count (sampling is seeded per prompt; the
  generate() calls of --hf-generate-batch 2 group the prompts alike on 1 and 2 ranks), and its
  loss, gradient norm and entropy equal theirs to rounding only: the gradient sums over ranks run
  in another order. No RNG state is saved (nothing draws from one here: every draw is seeded by
  (seed, step) or per prompt). A resume at the same rank count is bit-exact (tests/test_full_fsdp.py, test_full_cli.py).

The rendezvous is c10d, as the README's multi-node command has it; the launches pass no
--node-rank (torchrun ignores it under c10d, with a warning: ranks follow the join order) and pass
--local-addr 127.0.0.1, so the process group's address does not depend on the host name resolving.

The model is support/tiny.py's, warm-started here for 100 supervised steps (a few seconds) to answer
'\\boxed{1}' or '\\boxed{2}' at random, and every answer is 1 or 2, so about half the rollouts are
right and nearly every group has a spread: a random tiny model never boxes an answer, every reward
would be 0, no step would change the weights and the comparisons would be empty. The module's
fixture checks that both steps update the weights.

    python -m torch.distributed.run --nproc_per_node=R tests/test_full_multinode.py CKPT OUT.pt -- FLAGS
runs the worker: load CKPT into a fresh FSDP2 policy and AdamW on R ranks (train_full's own
resume path) and save the full weights and optimizer state (rank 0) to OUT.pt.
"""

import json
import os
import pathlib
import random
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as the worker script too

import pytest  # noqa: E402
import torch  # noqa: E402

from support import tiny  # noqa: E402

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
TIMEOUT = 300
CLOSE = (
    "loss",
    "grad_norm",
    "entropy_mean",
    "entropy_kept",
    "clip_frac",
    "clip_frac_by_minibatch",
)  # float sums over ranks
PER_RANK_COUNT = ("rank_tokens_max", "rank_tokens_min")  # the load balance: a function of the rank count


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problem(i):
    """Row i of the training data: answer 1 or 2 (alternating)."""
    return {"problem": f"{i + 1 + i % 2}-{i}", "answer": str(1 + i % 2)}


def warm_start(path, steps=100):
    """support/tiny.py's model after `steps` AdamW steps on 'PROBLEM\\nAnswer: ' -> '\\boxed{1}' or '\\boxed{2}'
    (at random) + EOS: it samples either, so a group's rewards are mixed with probability ~7/8."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = tiny.build_char_tokenizer()
        model = tiny.build_tiny_model(tokenizer)
        rng = random.Random(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            seqs, masks = [], []
            for _ in range(32):
                prompt = tokenizer(problem(rng.randrange(8))["problem"] + "\nAnswer: ")["input_ids"]
                response = tokenizer("\\boxed{" + rng.choice("12") + "}")["input_ids"] + [tokenizer.eos_token_id]
                seqs.append(prompt + response)
                masks.append([0] * len(prompt) + [1] * len(response))
            width = max(map(len, seqs))
            ids = torch.tensor([s + [tokenizer.eos_token_id] * (width - len(s)) for s in seqs])
            mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])[:, 1:].float()
            logits = model(input_ids=ids).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return tiny.save_tiny(model, tokenizer, str(path))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(problem(i)) + "\n" for i in range(8)))
    return {"model": warm_start(root / "boxed"), "train": str(train), "work": str(root)}


def flags(files, out, *extra):
    """2 steps of 4 prompts x 4 rollouts (2 prompts per rank on 2 ranks), up to 4 optimizer steps a
    step (--mini-batches 4, the default), no evaluation."""
    return [
        "--model",
        files["model"],
        "--rollout",
        "hf",
        "--device",
        "cpu",
        "--template",
        "plain",
        "--train-data",
        files["train"],
        "--eval-data",
        "none",
        "--out",
        str(out),
        "--steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-response-len",
        "12",
        "--max-prompt-len",
        "64",
        "--micro-batch-size",
        "4",
        "--lr",
        "1e-3",
        "--grader-workers",
        "1",
        "--hf-generate-batch",
        "2",
        *extra,
    ]


def launch(ranks, argv, cwd):
    """train_full.py ARGV on `ranks` gloo ranks of one node (a plain `python train_full.py` for 1); its stdout."""
    cmd = (
        [sys.executable, str(ROOT / "train_full.py"), *argv]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
            str(ROOT / "train_full.py"),
            *argv,
        ]
    )
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def lines(out):
    """metrics.jsonl, wall-clock and memory fields aside."""
    rows = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.endswith("_s") or "per_s" in k or k.startswith(("mem_", "gpu_", "mfu")))}
        for r in rows
    ]


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(folder) / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    """The uninterrupted 2-step runs on one node: {ranks: out folder} for 1 and 2 ranks."""
    outs = {}
    for ranks in (1, 2):
        outs[ranks] = tmp_path_factory.mktemp(f"whole{ranks}") / "run"
        launch(ranks, flags(files, outs[ranks]), files["work"])
        records = lines(outs[ranks])
        assert [r["step"] for r in records] == [1, 2]
        learn = [r["groups_mixed"] > 0 and r["grad_norm"] > 0 and not r["skipped"] for r in records]
        assert learn == [True, True], records  # both steps update the weights
    return outs


def test_two_nodes_of_one_process_equal_one_node_of_two(files, runs, tmp_path):
    out, port = tmp_path / "two_nodes", free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"d3s-test-{port}",
        "--local-addr",
        "127.0.0.1",
        str(ROOT / "train_full.py"),
        *flags(files, out),
    ]
    paths = [tmp_path / f"node{n}.log" for n in range(2)]  # stdout and stderr of each launch
    with open(paths[0], "w") as log0, open(paths[1], "w") as log1:
        nodes = [
            subprocess.Popen(cmd, cwd=files["work"], env=ENV, stdout=log, stderr=subprocess.STDOUT)
            for log in (log0, log1)
        ]
        try:
            codes = [node.wait(timeout=TIMEOUT) for node in nodes]
        finally:
            for node in nodes:  # on a timeout: SIGTERM, which torchrun passes on to its worker
                if node.poll() is None:
                    node.terminate()
                    node.wait(timeout=60)
    logs = [path.read_text() for path in paths]
    assert codes == [0, 0], [log[-4000:] for log in logs]
    assert "".join(logs).count("; 2 ranks, 2 prompts x 4 rollouts per rank per step") == 1  # rank 0 alone, on one node
    assert json.loads((out / "args.json").read_text())["world"] == 2
    assert lines(out) == lines(runs[2])
    final, reference = weights(out / "hf_final"), weights(runs[2] / "hf_final")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in final)


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)], ids=["saved_on_2_resumed_on_1", "saved_on_1_resumed_on_2"])
def test_resume_on_another_rank_count(files, runs, tmp_path, saved, resumed):
    out = tmp_path / "run"
    launch(saved, flags(files, out, "--stop-after", "1", "--export-every", "1"), files["work"])
    ckpt = out / "checkpoints" / "step_000001"
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world"] == saved

    # the weights and AdamW's state loaded on the other rank count are the saved ones, bit for bit
    loaded = tmp_path / "loaded.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={resumed}",
        f"--master_port={free_port()}",
        __file__,
        str(ckpt),
        str(loaded),
        "--",
        *flags(files, tmp_path / "unused"),
    ]
    proc = subprocess.run(cmd, cwd=files["work"], env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(loaded, weights_only=True)
    assert (int(got["world"]), int(got["saved_world"])) == (resumed, saved)
    exported = weights(out / "hf_step_000001")  # the saving run's own full weights after step 1
    assert exported.keys() <= got["model"].keys()
    for name, tensor in exported.items():
        assert torch.equal(got["model"][name], tensor), name
    assert not torch.equal(
        exported["model.norm.weight"], weights(files["model"])["model.norm.weight"]
    )  # step 1 moved it
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp_path / "saved.pt"))
    saved_optim = torch.load(tmp_path / "saved.pt", weights_only=True)["optim"]["state"]
    assert saved_optim.keys() == got["optim"].keys() and saved_optim
    for name, state in saved_optim.items():
        assert state.keys() == got["optim"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        assert all(torch.equal(got["optim"][name][k], state[k]) for k in state), name
    assert {float(s["step"]) for s in saved_optim.values()} == {
        lines(runs[saved])[0]["updates"]
    }  # step 1's optimizer steps
    assert any(s["exp_avg"].abs().max() > 0 for s in saved_optim.values())

    # the resumed run says what it keeps and what it cannot, and finishes
    stdout = launch(resumed, flags(files, out, "--resume"), files["work"])
    assert (
        f"resumed from {ckpt} at step 1; saved on {saved} ranks, resumed on {resumed}: the model and AdamW state are "
        "resharded exactly and the data order continues (sampling is seeded "
        "per prompt, not drawn from it); losses and gradient norms equal an uninterrupted run's to rounding only, "
        "not bit for bit"
    ) in stdout, stdout[-3000:]
    got = lines(out)
    assert [r["step"] for r in got] == [1, 2]
    assert got[0] == lines(runs[saved])[0]  # step 1 is the saving run's line
    step2 = got[1]
    for ranks in (1, 2):  # the uninterrupted run on either rank count
        whole = lines(runs[ranks])[1]
        assert step2.keys() == whole.keys()
        for key, value in step2.items():
            if key in CLOSE:
                assert value == pytest.approx(whole[key], rel=1e-4, abs=1e-6), (ranks, key)
            elif key in PER_RANK_COUNT:
                if ranks == resumed:
                    assert value == whole[key], (ranks, key)
            else:  # rollouts, rewards, kept samples and tokens, counts
                assert value == whole[key], (ranks, key)
    assert step2["grad_norm"] > 0 and step2["groups_mixed"] > 0
    assert (out / "hf_final" / "model.safetensors").exists()


def test_the_resume_note_says_when_the_rollouts_differ(files, tmp_path):
    """checkpoint.other_ranks_note (what train_full says on a resume at another rank count), for the cases the runs above do not reach: the same rank count
    (nothing to say), --unseeded-sampling, and --rollout hf calls that group the prompts differently
    (4 prompts in one generate() call on 1 rank, in two on 2 ranks: other seeds, other rollouts)."""
    from support import checkpoint
    import train_full

    note = lambda ranks, *extra: checkpoint.other_ranks_note(
        2,  # the checkpoint's world size
        ranks,
        train_full.parse_args(flags(files, tmp_path / "out", *extra)),
    )
    assert note(2) == note(2, "--unseeded-sampling") == note(2, "--hf-generate-batch", "16") == ""
    assert "(sampling is seeded per prompt, not drawn from it)" in note(1)  # calls of 2 prompts on 1 and 2 ranks alike
    assert "; with --unseeded-sampling the rollouts differ from an uninterrupted run's;" in note(
        1, "--unseeded-sampling"
    )
    hf = note(1, "--hf-generate-batch", "16")
    assert hf.startswith("; saved on 2 ranks, resumed on 1: the model and AdamW state are resharded exactly")
    assert (
        "--rollout hf seeds each generate() call of --hf-generate-batch 16 prompts and the calls now group the prompts "
        "differently, so the rollouts differ from an uninterrupted run's"
    ) in hf
    assert hf.endswith(
        "equal an uninterrupted run's to rounding only, not bit for bit (the sums over ranks run in another order)"
    )


def load_resharded(ckpt, out, argv):
    """The worker (under torchrun): train_full's resume path on this rank count; rank 0 saves the full state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from support import fsdp, checkpoint
    import train_full

    args = train_full.parse_args(argv)
    world = fsdp.init_distributed(args.device)
    model = fsdp.load_policy(args, world)
    optimizer = fsdp.make_optimizer(model, args)
    meta = checkpoint.load_shards(ckpt, model, optimizer, world)
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if world.is_main:
        torch.save(
            {
                "model": model_sd,
                "optim": optim_sd["state"],
                "world": torch.tensor(world.size),
                "saved_world": torch.tensor(meta["world"]),
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    split = sys.argv.index("--")
    load_resharded(sys.argv[1], sys.argv[2], sys.argv[split + 1 :])
