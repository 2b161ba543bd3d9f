"""train_full.py on bad input: one line on stderr, `train_full.py: error: --flag VALUE: ...`, exit 2,
never a traceback, before any work; and a fuzz of every flag (hypothesis): each run either trains
(tiny settings: --steps 1, a tiny model, --rollout hf, --device cpu) and exits 0, or exits 2 with
one line.

The runs go through tests/full_cli_worker.py, a fork server: it imports train_full once and runs
each argv in a forked child through train_full.entry, what `python train_full.py ARGV` runs, so
exit codes and stderr are the real ones without an interpreter start per run. One run under
torchrun checks that rank 0 alone prints the line.
"""

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model, data files good and bad, a folder, a plain file; the worker runs in `work`."""
    root = tmp_path_factory.mktemp("cli")
    tokenizer = tiny.build_char_tokenizer()
    paths = {
        "model": tiny.save_tiny(tiny.build_tiny_model(tokenizer), tokenizer, str(root / "tiny")),
        "train": root / "train.jsonl",
        "bad": root / "bad.jsonl",
        "empty": root / "empty.jsonl",
        "dir": root / "a_folder",
        "file": root / "a_file.txt",
        "work": root / "work",
        "root": root,
    }
    paths["train"].write_text(
        "".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    paths["bad"].write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n')
    paths["empty"].write_text("")
    paths["file"].write_text("not a model\n")
    paths["dir"].mkdir()
    paths["work"].mkdir()
    # incomplete model folders (issue 30): without weights, without a tokenizer, a tokenizer that encodes to nothing
    import shutil

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    for name, drop in (
        ("noweights", ("model.safetensors",)),
        ("notokenizer", ("tokenizer.json", "vocab.json")),
        ("emptytok", ()),
    ):
        paths[name] = root / name
        shutil.copytree(paths["model"], paths[name])
        for file in drop:
            (paths[name] / file).unlink(missing_ok=True)
    for file in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (paths["emptytok"] / file).unlink(missing_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab={"<|endoftext|>": 0}, merges=[])), eos_token="<|endoftext|>"
    ).save_pretrained(paths["emptytok"])
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def cli(files):
    """run(argv) -> {"code", "stderr", "stdout"} of train_full.py ARGV (tests/full_cli_worker.py)."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "full_cli_worker.py")],
        cwd=files["work"],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(argv):
        proc.stdin.write(json.dumps([str(a) for a in argv]) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


def base(files, out):
    """A valid tiny run: 1 step of 2 prompts x 4 rollouts, no evaluation (unless a flag adds one, then a tiny one)."""
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
        out,
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--n-init",
        "2",
        "--n-final",
        "4",
        "--max-response-len",
        "8",
        "--max-prompt-len",
        "64",
        "--micro-batch-size",
        "4",
        "--eval-samples",
        "2",
        "--eval-pass-k",
        "1",
        "--eval-max-tokens",
        "4",
        "--eval-limit",
        "1",
        "--grader-workers",
        "1",
        "--hf-generate-batch",
        "2",
    ]


def one_line_exit_2(result):
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["code"] == 2, result
    assert "Traceback" not in result["stderr"] and len(lines) == 1, result["stderr"]
    assert lines[0].startswith("train_full.py: error: "), lines[0]
    return lines[0]


CASES = [  # (flags added to a valid tiny run, a fragment the one line must hold)
    (["--lr", "nan"], "--lr nan: must be in (0, 1]"),
    (["--lr", "-1"], "--lr -1: must be"),
    (["--lr", "inf"], "--lr inf: must be"),
    (["--max-grad-norm", "-1"], "--max-grad-norm -1: must be a finite number > 0"),
    (["--max-grad-norm", "nan"], "--max-grad-norm nan"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be an int >= 1"),
    (["--clip-low", "-0.5"], "--clip-low -0.5: must be in [0, 1)"),
    (["--clip-high", "inf"], "--clip-high inf"),
    (["--steps", "0"], "--steps 0: must be an int >= 1"),
    (["--steps", "x"], "--steps 'x': must be an int >= 1"),
    (["--steps", ""], "--steps '': must be an int >= 1"),
    (["--group-size", "1"], "--group-size 1: must be an int in [2, 1024]"),
    (["--group-size", "1000000000"], "--group-size 1000000000"),
    (["--n-final", "5"], "--n-final 5 > --group-size 4: N counts rollouts kept per prompt"),
    (["--n-init", "0"], "--n-init 0"),
    (["--k-init", "0"], "--k-init 0: must be a fraction of tokens in (0, 1]"),
    (["--k-final", "1.5"], "--k-final 1.5"),
    (["--static-k", "nan"], "--static-k nan"),
    (["--mini-batches", "0"], "--mini-batches 0"),
    (["--mini-batches", "9"], "--mini-batches 9: more than the 8 rollouts"),
    (["--prompts-per-step", "1000000"], "rollouts per step"),
    (["--kl-coef", "0.1"], "--kl-coef 0.1: a KL penalty needs the reference model; add --kl-ref"),
    (["--kl-coef", "-1", "--kl-ref"], "--kl-coef -1: must be"),
    (["--kl-ref", "--kl-every", "0"], "--kl-every 0: with --kl-ref and --kl-coef 0 the reference would never be used"),
    (["--temperature", "0"], "--temperature 0: must be in [0.01, 100]"),
    (["--top-p", "0"], "--top-p 0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--weight-decay", "-1"], "--weight-decay -1: must be in [0, 1]"),
    (["--eval-samples", "0"], "--eval-samples 0"),
    (["--eval-pass-k", "1,x"], "--eval-pass-k '1,x': must be comma-separated ints"),
    (["--eval-pass-k", "4"], "--eval-pass-k 4: each k must be in [1, --eval-samples 2]"),
    (["--eval-temperature", "-1"], "--eval-temperature -1: must be 0 (greedy)"),
    (["--stop-after", "2"], "--stop-after 2: must be an int in [1, --steps 1]"),
    (["--seed", "-1"], "--seed -1"),
    (["--grader-workers", "0"], "--grader-workers 0"),
    (["--grader-timeout", "0"], "--grader-timeout 0: must be"),
    (["--save-every", "0"], "--save-every 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0"),
    (["--mlp-chunk-tokens", "-1"], "--mlp-chunk-tokens -1: must be an int >= 0"),
    (["--max-response-len", "0"], "--max-response-len 0"),
    (["--max-prompt-len", "2"], "--max-prompt-len 2: no prompt of"),
    (["--hf-generate-batch", "0"], "--hf-generate-batch 0"),
    (["--peak-tflops", "-1"], "--peak-tflops -1: must be"),
    (["--vllm-gpu-memory-utilization", "0"], "--vllm-gpu-memory-utilization 0: must be"),
    (["--vllm-kv-cache-gb", "nan"], "--vllm-kv-cache-gb nan"),
    (["--loss", "gspo", "--normalize-by", "all"], "--normalize-by all: applies to --loss-agg token-mean"),
    (["--switch-on-spike", "1"], "--switch-on-spike 1: must be 0 (off) or a number > 1"),
    (["--switch-on-spike", "inf"], "--switch-on-spike inf"),
    (
        ["--method", "d3s-i", "--switch-on-spike", "3"],
        "--switch-on-spike 3: moves a cross-group row to its intra-group "
        "twin (d3s -> d3s-i, d1s-cross -> d1s); d3s-i has none",
    ),
    (["--method", "d4s"], "--method 'd4s': unknown method; choose from grpo, d1s"),
    (["--method", "grpo", "--static-n", "40"], "--static-n 40 > --group-size 4"),
    (["--model", ""], "--model '': empty"),
    (["--model", "{root}/missing/model"], "missing/model: no such folder"),
    (["--model", "{dir}"], "a_folder: has no config.json"),
    (["--model", "{file}"], "a_file.txt: is a file"),
    (["--model", "no-such-org/no-such-model"], "--model no-such-org/no-such-model: cannot load its tokenizer"),
    (["--model", "{noweights}"], "--model {noweights}: has no weights"),  # issue 30: each named before any work
    (["--model", "{notokenizer}"], "--model {notokenizer}: has no tokenizer"),
    (["--model", "{emptytok}"], "--model {emptytok}: its tokenizer encodes a prompt to no tokens"),
    (["--train-data", ""], "--train-data '': empty"),
    (["--train-data", "{root}/missing.jsonl"], "missing.jsonl: no such file"),
    (["--train-data", "{dir}"], "a_folder: is a folder"),
    (["--train-data", "{bad}"], "bad.jsonl:2: not valid JSON"),
    (["--train-data", "{empty}"], "empty.jsonl: no usable rows"),
    (["--eval-data", "{dir}"], "--eval-data"),
    (["--eval-data", "{root}/*.nothing"], "no file matches"),
    (["--eval-data", ""], "--eval-data '': empty"),
    (["--eval-data", "{bad}", "--eval-limit", "0"], "bad.jsonl:2: not valid JSON"),
    (["--out", "{file}"], "--out"),
    (["--out", ""], "--out '': empty"),
    (["--resume"], "--resume: no complete checkpoint in"),
    (["--resume", "{root}/missing"], "missing: no such folder"),
    (["--resume", "{dir}"], "a_folder: not a complete checkpoint (no trainer_state.json)"),
]
if not torch.cuda.is_available():
    CASES.append((["--device", "cuda"], "--device cuda: torch sees no CUDA device"))
if importlib.util.find_spec("vllm") is None:  # the main venv (vLLM lives in .venv-vllm)
    CASES.append((["--rollout", "vllm"], "--rollout vllm: vLLM is not installed"))


@pytest.mark.parametrize("extra, fragment", CASES, ids=[" ".join(c[0]) or "''" for c in CASES])
def test_bad_input_is_one_line_and_exit_2_before_any_work(cli, files, extra, fragment, tmp_path):
    out = tmp_path / "run"
    result = cli(base(files, str(out)) + [e.format(**files) for e in extra])
    line = one_line_exit_2(result)
    assert fragment.format(**files) in line, line
    assert result["stdout"] == "" and not (out / "args.json").exists()  # nothing ran


class NotATensor:
    """A Python object, pickled by reference to this module: torch.load(weights_only=True) must refuse it."""


def test_bad_checkpoints_are_one_line_naming_the_file_and_the_fix(cli, files, tmp_path):
    """A real checkpoint (a 1-step run of 2, stopped), then each damage to a copy of it."""
    import pickle
    import shutil

    run = tmp_path / "run"
    first = cli(base(files, str(run)) + ["--steps", "2", "--stop-after", "1"])
    assert first["code"] == 0, first
    ckpt = run / "checkpoints" / "step_000001"
    assert {"trainer_state.json", ".metadata"} <= set(os.listdir(ckpt)) and not any(
        "rng" in f for f in os.listdir(ckpt)
    )

    damages = {
        "truncated shards": (lambda c: open(c / "__0_0.distcp", "r+b").truncate(100), "__0_0.distcp: truncated"),
        "corrupt shards": (
            lambda c: (c / "__0_0.distcp").write_bytes(b"x" * (c / "__0_0.distcp").stat().st_size),
            "its shards cannot be read",
        ),  # found when DCP reads them: after the model is built
        "truncated metadata": (lambda c: open(c / ".metadata", "r+b").truncate(40), ".metadata: truncated or corrupt"),
        "no metadata": (lambda c: (c / ".metadata").unlink(), ".metadata: missing"),
        "truncated state": (
            lambda c: open(c / "trainer_state.json", "r+b").truncate(20),
            "trainer_state.json: truncated or corrupt",
        ),
        "pickled metadata": (
            lambda c: (c / ".metadata").write_bytes(pickle.dumps({"x": os.system})),
            ".metadata: refused: it holds a pickled object (posix.system)",
        ),
        "older format": (  # format 2 (before 2026-11-28) held each rank's RNG state: refused, not read in part
            lambda c: (c / "trainer_state.json").write_text(
                json.dumps({**json.loads((c / "trainer_state.json").read_text()), "format": 2})
            ),
            "checkpoint format 2 (this train_full.py reads format 3 only)",
        ),
    }
    for name, (damage, fragment) in damages.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(run, copy)
        damage(copy / "checkpoints" / "step_000001")
        result = cli(base(files, str(copy)) + ["--steps", "2", "--resume"])
        line = one_line_exit_2(result)
        assert (
            fragment in line
            and "step_000001" in line
            and ("resume from an older checkpoint" in line or "start a new run" in line)
        ), (name, line)
    for flags, fragment in (
        (["--steps", "3", "--resume"], "--steps 3: the checkpoint"),  # the schedule runs over --steps
        (["--steps", "2", "--resume", "--lr", "1e-3"], "--lr 0.001: the checkpoint"),
        (["--steps", "2"], "holds an earlier run (metrics.jsonl, checkpoints); continue it with --resume"),
        (["--steps", "2", "--resume", "--stop-after", "1"], "already at step 1"),
    ):
        line = one_line_exit_2(cli(base(files, str(run)) + flags))
        assert fragment in line, line
    resumed = cli(base(files, str(run)) + ["--steps", "2", "--resume"])  # the undamaged original still resumes
    assert resumed["code"] == 0, resumed
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_under_torchrun_rank_0_alone_prints_the_line_and_every_rank_exits_2(files, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(ROOT / "train_full.py"),
        *base(files, str(tmp_path / "run")),
        "--lr",
        "nan",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("train_full.py: error: --lr nan: must be in (0, 1]") == 1, proc.stderr
    assert "exitcode  : 2" in proc.stderr or "exit code 2" in proc.stderr or "exitcode: 2" in proc.stderr, proc.stderr[
        -2000:
    ]


WIDE = st.one_of(  # wider than any flag's valid range
    st.sampled_from(["-1", "0", "1", "2", "3", "7"]),
    st.integers(10**6, 10**12).map(str),
    st.integers(-(10**12), -(10**6)).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(0, 1).map(repr),
    st.sampled_from(["", "abc", "1e999", "-inf", "nan", "0x10", "1,2", "DIR", "FILE", "MISSING"]),
)
CHOICES = {
    "--method": ["grpo", "d3s", "pods", "d2s"],
    "--loss": ["grpo", "gspo"],
    "--rollout": ["hf", "vllm"],
    "--template": ["plain", "qwen-math"],
    "--token-scope": ["batch", "sequence"],
    "--loss-agg": ["token-mean", "seq-mean-token-mean"],
    "--normalize-by": ["selected", "all"],
    "--device": ["cpu", "auto", "cuda"],
    "--dtype": ["float32", "bfloat16"],
    "--vllm-sleep-level": ["0", "1", "2"],
    "--model": ["MODEL"],
    "--train-data": ["TRAIN"],
    "--eval-data": ["none", "EVAL"],
    "--out": ["FRESH", "DIR"],
    "--eval-pass-k": ["1", "1,2"],
}
VALUED = [
    "--prompts-per-step",
    "--group-size",
    "--n-init",
    "--n-final",
    "--k-init",
    "--k-final",
    "--static-n",
    "--static-k",
    "--lr",
    "--weight-decay",
    "--max-grad-norm",
    "--clip-low",
    "--clip-high",
    "--mini-batches",
    "--micro-batch-size",
    "--kl-coef",
    "--kl-every",
    "--mlp-chunk-tokens",
    "--temperature",
    "--top-p",
    "--max-prompt-len",
    "--max-response-len",
    "--eval-every",
    "--eval-samples",
    "--eval-temperature",
    "--eval-top-p",
    "--eval-max-tokens",
    "--eval-limit",
    "--save-every",
    "--keep-checkpoints",
    "--export-every",
    "--explain-every",
    "--stop-after",
    "--seed",
    "--vllm-gpu-memory-utilization",
    "--vllm-kv-cache-gb",
    "--vllm-max-num-seqs",
    "--hf-generate-batch",
    "--grader-timeout",
    "--grader-workers",
    "--peak-tflops",
    "--resume",
    *CHOICES,
]
SWITCHES = [
    "--eval-only",
    "--min-token-per-response",
    "--no-load-balance",
    "--kl-ref",
    "--no-activation-checkpointing",
    "--unseeded-sampling",
    "--vllm-allow-awake",
    "--vllm-enforce-eager",
    "--resume",
]
# --steps stays 1 (the brief's tiny settings): a wide value would be a long run, not a bad input


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_flags_train_or_fail_with_one_line(cli, files, tmp_path_factory, data):
    flags = data.draw(st.lists(st.sampled_from(VALUED + SWITCHES), min_size=1, max_size=3, unique=True), label="flags")
    fresh = str(tmp_path_factory.mktemp("fuzz") / "out")
    argv = base(files, fresh)
    for flag in flags:
        if flag in SWITCHES and (flag not in VALUED or data.draw(st.booleans(), label=f"{flag} alone")):
            argv.append(flag)
            continue
        value = data.draw(st.one_of(WIDE, st.sampled_from(CHOICES[flag])) if flag in CHOICES else WIDE, label=flag)
        value = {
            "DIR": files["dir"],
            "FILE": files["file"],
            "MISSING": files["root"] + "/missing",
            "MODEL": files["model"],
            "TRAIN": files["train"],
            "EVAL": str(ROOT / "data" / "gsm8k.jsonl"),
            "FRESH": fresh,
        }.get(value, value)
        argv += [flag, value]
    result = cli(argv)
    assert "Traceback" not in result["stderr"], (argv, result["stderr"][-3000:])
    assert result["code"] in (0, 2), (argv, result)
    if result["code"] == 2:
        one_line_exit_2(result)


def test_a_sigkill_while_a_checkpoint_is_written_then_resume_continues_as_the_uninterrupted_run(cli, files, tmp_path):
    """train_full.py killed (SIGKILL) while step 2's checkpoint is half written: step_000002.tmp is
    ignored, --resume continues from step_000001, and the resumed run's metrics equal those of an
    uninterrupted run (wall-clock and memory fields aside)."""
    import signal

    flags = ["--steps", "3", "--save-every", "1", "--keep-checkpoints", "3"]
    whole = tmp_path / "whole"
    assert cli(base(files, str(whole)) + flags)["code"] == 0
    killed = tmp_path / "killed"  # tests/full_stall_worker.py: train_full.py, its checkpoint of step 2 stalled halfway
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "full_stall_worker.py"), "2", *base(files, str(killed)), *flags],
        cwd=files["work"],
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for line in proc.stderr:
        if "stalled before completion" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(os.listdir(killed / "checkpoints")) == ["step_000001", "step_000002.tmp"]
    resumed = cli(base(files, str(killed)) + flags + ["--resume"])
    assert resumed["code"] == 0, resumed

    def lines(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [
            {
                k: v
                for k, v in r.items()
                if not (k.endswith("_s") or "per_s" in k or k.startswith(("mem_", "gpu_", "mfu")))
            }
            for r in rows
        ]

    assert [r["step"] for r in lines(killed)] == [1, 2, 3]
    assert lines(killed) == lines(whole)
    assert sorted(os.listdir(killed / "checkpoints")) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_on_rewards_without_spread_keeps_nothing_and_leaves_the_weights(cli, files, tmp_path, method):
    """train_full.py --method dapo-filter(-k) through main(): the tiny untrained model's 8-token answers
    hold no \\boxed{} (reward 0 for every rollout), so no group has spread on either step. Each metrics
    line says nothing was kept and no optimizer step was made; the run still syncs, checkpoints, writes
    its explain pages and exports hf_final/, with the initial weights: an AdamW step would have moved
    them even on a zero gradient, by its decoupled weight decay (lr x 0.1 of each weight). (Steps that
    keep rollouts, and 2 FSDP ranks: tests/test_full_fsdp.py.)"""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    result = cli(
        base(files, str(out))
        + [
            "--method",
            method,
            "--steps",
            "2",
            "--mini-batches",
            "2",
            "--explain-every",
            "1",
            "--weight-decay",
            "0.1",
            "--lr",
            "1e-2",
        ]
    )
    assert result["code"] == 0, result
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    k_frac = [1.0, 1.0] if method == "dapo-filter" else [0.05, 0.125]  # K 0.05 -> 0.20 over 2 steps: p = 0, 1/2
    for r, k in zip(records, k_frac):
        assert r["reward_mean"] == 0.0 and r["groups_mixed"] == 0.0  # the premise: no group with spread
        assert r["kept_samples"] == 0 and r["sur"] == 0.0 and r["kept_tokens"] == r["fwd_tokens"] == 0
        assert r["updates"] == 0 and r["skipped"] is False and r["loss"] is None and r["grad_norm"] is None
        assert r["train_tokens"] == r["pass1_tokens"] == 0 and r["gen_tokens"] > 0  # generated, nothing trained
        assert r["n_keep"] == 4 and r["k_frac"] == pytest.approx(k)
    assert (out / "checkpoints" / "step_000002").is_dir()
    assert [p.name for p in sorted((out / "explain").glob("*.html"))] == ["step_000001.html", "step_000002.html"]
    start = load_file(os.path.join(files["model"], "model.safetensors"))
    final = load_file(str(out / "hf_final" / "model.safetensors"))
    assert set(final) <= set(start) and len(final) > 0
    for name, tensor in final.items():
        assert torch.equal(tensor, start[name].to(tensor.dtype)), name


def test_the_switch_rule_reads_the_grad_norms_of_the_earlier_steps_from_the_checkpoint(cli, files, tmp_path):
    """--switch-on-spike through main() and a resume: step 1 of d3s runs cross-group and is checkpointed with
    its grad norm (0: this tiny model's rewards have no spread). Resumed as it is, step 2 stays cross-group;
    resumed from a copy whose history holds a spike (written into trainer_state.json), step 2 runs intra-group."""
    import shutil

    flags = ["--method", "d3s", "--steps", "2", "--switch-on-spike", "3"]
    run = tmp_path / "run"
    assert cli(base(files, str(run)) + flags + ["--stop-after", "1"])["code"] == 0
    state_file = pathlib.Path("checkpoints") / "step_000001" / "trainer_state.json"
    state = json.loads((run / state_file).read_text())
    assert state["run"]["switch_on_spike"] == 3.0 and state["grad_norms"] == [0.0]

    def resumed(folder, extra=()):
        result = cli(base(files, str(folder)) + flags[:-2] + list(extra) + ["--resume"])
        return result, [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]

    spiked = tmp_path / "spiked"
    shutil.copytree(run, spiked)
    (spiked / state_file).write_text(json.dumps({**state, "grad_norms": [1.0] * 10 + [10.0]}))
    for folder, rules in ((run, ["cross", "cross"]), (spiked, ["cross", "intra"])):
        result, lines = resumed(folder, ["--switch-on-spike", "3"])
        assert result["code"] == 0, result
        assert [r["sample_rule"] for r in lines if r["kind"] == "train"] == rules, folder.name


def test_resume_auto_starts_continues_and_finishes_with_one_command_line(cli, files, tmp_path):
    """--resume auto, the one command line a requeue script runs: into an empty folder it starts; after a stop it
    continues from the newest checkpoint to the numbers of a run never stopped; on a finished run it prints one line
    and exits 0, writing nothing."""
    same = ("kind", "step", "reward_mean", "loss", "grad_norm", "kept_tokens", "n_keep", "k_frac", "entropy_mean")
    lines = lambda out: [tuple(m.get(k) for k in same) for m in map(json.loads, (out / "metrics.jsonl").open())]
    whole = tmp_path / "whole"
    assert cli(base(files, str(whole)) + ["--steps", "2"])["code"] == 0
    out = tmp_path / "auto"
    command = base(files, str(out)) + ["--steps", "2", "--resume", "auto"]
    first = cli(command + ["--stop-after", "1"])  # a fresh start (nothing in --out), stopped after step 1
    assert first["code"] == 0 and "resumed" not in first["stdout"], first
    second = cli(command)
    assert second["code"] == 0 and "resumed from" in second["stdout"], second
    assert lines(out) == lines(whole) and len(lines(out)) == 2
    before = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    third = cli(command)
    assert third["code"] == 0 and f"the run in {out} already finished its 2 steps" in third["stdout"], third
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_keep_exports_rotates_the_step_exports(cli, files, tmp_path):
    """--export-every 1 --keep-exports 2: after 3 steps the two newest hf_step_NNNNNN folders are left, as
    --keep-checkpoints leaves checkpoints; hf_final is not one of them."""
    out = tmp_path / "exports"
    result = cli(base(files, str(out)) + ["--steps", "3", "--export-every", "1", "--keep-exports", "2"])
    assert result["code"] == 0, result
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("hf_")) == [
        "hf_final",
        "hf_step_000002",
        "hf_step_000003",
    ]
