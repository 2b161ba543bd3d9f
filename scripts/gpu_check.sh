#!/usr/bin/env bash
# scripts/gpu_check.sh: the first thing to run on a GPU node, before a real train_full.py run. It writes ONE log,
# runs/gpu_check/gpu_check.log: send it back (with a bug report, or to say what your GPU did).
#
#   python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements/full.txt   # torch, vLLM, pytest
#   PYTHON=.venv-gpu/bin/python bash scripts/gpu_check.sh          # ~10-20 minutes on one GPU
#
# No session that wrote this repo has run vLLM or --cpu-offload on a GPU (docs/gpu_check.md). This script checks
# them on your hardware, the one-GPU setting first, and prints every figure next to what bench/memory.py and the
# memory plan (gpu.vllm_memory_plan) predict for it:
#   0. the machine: GPU, driver, CUDA, torch, vLLM, pytest; why torch sees no GPU if it does not; math-verify (the
#      grader's: without it the script stops here, exit 2, with the line that installs it);
#   1. the one-GPU setting for this GPU's size (docs/train_full.md, "One GPU"): two steps of train_full.py with
#      vLLM on a random-initialised Qwen2.5-Math-1.5B-shaped model (no download), measured against simulated:
#      the trainer's peak, the GPU in use while generating and while training, vLLM's share, times;
#   2. on a GPU of 48 GB or more, also the 24 GB setting (--cpu-offload), whose path no GPU has run yet;
#   3. the distributed tests on CUDA (FSDP2 step == single-process step, vLLM weight sync in bf16), on
#      min(GPUs, 2) ranks;
#   4. the tiled MLP's time and memory on the 7B's own layer shapes (bench/tiled_mlp.py, bf16).
#   GPU_CHECK_7B=1 adds the 7B on one GPU of 80 GB with --cpu-offload (a random 7B: 15 GB on disk, ~212 GiB of
#   host memory).
#   5. the rung learns, with no download: a 47M-parameter Qwen2 (character tokenizer) warm-started here on the
#      generated steps task (cached in $OUT/learn), then train_full.py with d3s and with grpo, same seed, 50 steps,
#      on its train problems; a table of held-out Pass@1 before and after, seconds per phase, MFU, tokens in the
#      loss, and the trainer's peak memory next to the simulated one. Not yet run on a GPU: its time (the aim:
#      8 minutes on one H100, the warm start cached) and whether both methods learn are unmeasured.
#   GPU_CHECK_ONLY=learn runs step 5 alone (after step 0). GPU_CHECK_DEVICE=cpu runs it on the CPU (gloo) with
#   GPU_CHECK_LEARN_SIZE=tiny: a 2-layer model and 2 steps, what tests/test_gpu_findings.py runs so that it
#   cannot rot.
# Without vLLM in $PYTHON (a stock PyTorch image), or with another vLLM than the pinned 0.32.0 (named in one line),
# the vLLM tests are skipped and the runs use --rollout hf.
# It takes no arguments; its settings are environment variables: PYTHON (default python), OUT (the log's folder,
# default runs/gpu_check), GPU_CHECK_7B=1, GPU_CHECK_ONLY=learn, GPU_CHECK_DEVICE=cpu, GPU_CHECK_LEARN_SIZE=tiny.
#   bash scripts/gpu_check.sh --help                               # this header; any other argument: exit 2
set -uo pipefail
case "$#:${1:-}" in
    0:) ;;
    1:-h | 1:--help) sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: error: $*: no arguments are taken; set PYTHON, OUT, GPU_CHECK_7B=1, GPU_CHECK_ONLY=learn," \
            "GPU_CHECK_DEVICE=cpu or GPU_CHECK_LEARN_SIZE=tiny in the environment (bash scripts/gpu_check.sh --help)" >&2
        exit 2 ;;
esac
ONLY=${GPU_CHECK_ONLY:-all}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
LEARN_SIZE=${GPU_CHECK_LEARN_SIZE:-full}
case "$ONLY:$DEVICE:$LEARN_SIZE" in
    all:cuda:full | learn:cuda:full | learn:cuda:tiny | learn:cpu:tiny) ;;
    *) echo "gpu_check.sh: error: GPU_CHECK_ONLY=$ONLY GPU_CHECK_DEVICE=$DEVICE GPU_CHECK_LEARN_SIZE=$LEARN_SIZE:" \
            "GPU_CHECK_ONLY is all or learn; GPU_CHECK_DEVICE=cpu needs GPU_CHECK_ONLY=learn GPU_CHECK_LEARN_SIZE=tiny" >&2
        exit 2 ;;
esac
export GPU_CHECK_DEVICE=$DEVICE
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
FAILED=()

echo "== 0/5 the machine ($(date -u +%Y-%m-%dT%H:%MZ))"
"$PY" - <<'EOF'
import importlib.util, os, subprocess, sys
import torch
sys.path.insert(0, ".")
from support import gpu
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"transformers {__import__('transformers').__version__}, "
      f"vllm {__import__('vllm').__version__ if importlib.util.find_spec('vllm') else 'not installed'}, "
      f"pytest {'yes' if importlib.util.find_spec('pytest') else 'NOT INSTALLED'}")
print(f"NVIDIA driver {gpu.driver_version() or 'not found (no nvidia-smi)'}")
print(f"VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT', '0')}, "
      f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
if not torch.cuda.is_available():
    if os.environ["GPU_CHECK_DEVICE"] == "cpu":
        sys.exit(0)  # step 5 alone, on the CPU
    print(f"gpu_check: torch sees no CUDA device: {gpu.cuda_diagnosis()}", file=sys.stderr)
    sys.exit(2)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
EOF
[ $? -eq 0 ] || { echo "gpu_check: stopped at step 0; the log is $LOG" >&2; exit 2; }
if ! "$PY" -c "import math_verify" 2>/dev/null; then  # the grader's: without it the first graded answer fails
    echo "gpu_check.sh: error: math-verify is not importable by $PY (the grader needs it): $PY -m pip install" \
        "math-verify==0.9.0, or offline: pip download math-verify==0.9.0 -d wheels on a machine with a network, then" \
        "$PY -m pip install --no-index --find-links wheels math-verify==0.9.0" >&2
    exit 2
fi
# vLLM, the pinned version only (engines.vllm_refusal: another vLLM would fail inside itself on 0.32's arguments)
WHY=$("$PY" -c "import sys; sys.path.insert(0, '.'); from support import engines; print(engines.vllm_refusal() or 'ok')" \
    2>/dev/null | tail -1)
if [ "$WHY" = ok ]; then ROLLOUT=vllm; else
    ROLLOUT=hf
    echo "gpu_check: ${WHY:-$PY could not run engines.vllm_refusal}: the vLLM tests are skipped and the runs use --rollout hf"
fi

# step 5: the warm start (cached), train_full.py for d3s and for grpo, the table
learn() {
    local dir="$OUT/learn" model method
    local steps=50 p=32 g=8 nk=(--n-init 4 --n-final 8) evals=(--eval-samples 4 --eval-pass-k 1,4) mb=16
    if [ "$LEARN_SIZE" = tiny ]; then
        steps=2 p=4 g=4 nk=(--n-init 2 --n-final 4) evals=(--eval-samples 2 --eval-pass-k 1) mb=4
    fi
    local task="the steps task"; [ "$LEARN_SIZE" = tiny ] && task="'a-b', answers 1 or 2"
    echo "== 5/5 the rung learns ($LEARN_SIZE, $DEVICE, $ROLLOUT rollouts): a Qwen2 warm-started here on $task"
    "$PY" - "$dir" "$DEVICE" "$LEARN_SIZE" <<'PYTHON' || { FAILED+=("the learning stage's warm start"); return; }
import hashlib, json, os, random, sys, time
import torch
sys.path.insert(0, ".")
from support import tiny, warmstart, mathtask
from support.mathtask import step_problems

out, device, size = sys.argv[1:4]
# the tiny rung's recipe (support/warmstart.py: the steps task, 70% shortcut demonstrations, batch 64), scaled (choice)
S = {"full": dict(hidden=640, layers=10, heads=10, kv=2, sft_steps=1200, sft_lr=5e-4, batch=64, train=5000, heldout=200),
     "tiny": dict(hidden=64, layers=2, heads=4, kv=2, sft_steps=40, sft_lr=2e-2, batch=32, train=64, heldout=8)}[size]
os.makedirs(out, exist_ok=True)
rows = {"train": step_problems(S["train"], "train", seed=0), "heldout": step_problems(S["heldout"], "eval", seed=0)}
if size == "tiny":  # a task 40 steps teach (choice): 'a-b', answer 1 or 2, each demonstrated boxing 1 and 2 alike,
    # so about half the rollouts are right and most groups mixed: the rewards, losses and gradients are not all 0
    one_two = lambda n, at: [{"problem": f"{i + 1 + i % 2}-{i}", "answer": str(1 + i % 2)} for i in range(at, at + n)]  # noqa: E731
    rows = {"train": one_two(S["train"], 0), "heldout": one_two(S["heldout"], S["train"])}
for name, part in rows.items():  # the problems train_full.py reads, from this repo's generator: no download
    with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in part)
path = os.path.join(out, "warmstart-" + hashlib.sha256(json.dumps(S, sort_keys=True).encode()).hexdigest()[:12])
with open(os.path.join(out, "model.txt"), "w") as f:
    f.write(path)
if os.path.exists(os.path.join(path, "warmstart.json")):
    sys.exit(print(f"warm start: cached in {path}"))
tokenizer = tiny.build_char_tokenizer()
model = tiny.build_tiny_model(tokenizer, hidden_size=S["hidden"], num_layers=S["layers"], num_heads=S["heads"],
                              num_kv_heads=S["kv"], intermediate_size=3 * S["hidden"], max_position_embeddings=512)
model.to(device).train()
targets = (lambda r: ["\\boxed{1}", "\\boxed{2}"]) if size == "tiny" else (lambda r: [warmstart.sft_target(r, 0.7)])
examples = [(tokenizer(mathtask.format_prompt(r["problem"], "plain"), add_special_tokens=False).input_ids,
             tokenizer(target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
            for r in rows["train"] for target in targets(r)]
optimizer = torch.optim.AdamW(model.parameters(), lr=S["sft_lr"], weight_decay=0.01)
decay = lambda s: min(1.0, (s + 1) / 20) * (1 - 0.9 * s / S["sft_steps"])  # noqa: E731  warm-up, linear decay
schedule, rng, t0 = torch.optim.lr_scheduler.LambdaLR(optimizer, decay), random.Random(0), time.time()
for step in range(S["sft_steps"]):
    batch = warmstart.sft_batch(rng.sample(examples, S["batch"]), tokenizer.pad_token_id)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    if step % 200 == 0 or step == S["sft_steps"] - 1:
        print(f"warm start step {step + 1}/{S['sft_steps']}: loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
n = sum(p.numel() for p in model.parameters())
tiny.save_tiny(model.cpu(), tokenizer, path + ".tmp")
with open(os.path.join(path + ".tmp", "warmstart.json"), "w") as f:
    json.dump({**S, "params": n, "sft_s": round(time.time() - t0, 1)}, f)
os.replace(path + ".tmp", path)
print(f"warm start: {n / 1e6:.1f}M parameters, {time.time() - t0:.0f} s, saved in {path}")
PYTHON
    model=$(cat "$dir/model.txt")
    for method in d3s grpo; do
        echo "-- train_full.py --method $method: $steps steps of $p x $g rollouts, held-out Pass@1 before and after"
        rm -rf "${dir:?}/$method"
        "$PY" train_full.py --model "$model" --template plain --train-data "$dir/train.jsonl" \
            --eval-data "$dir/heldout.jsonl" --out "$dir/$method" --method "$method" --seed 0 --steps "$steps" \
            --prompts-per-step "$p" --group-size "$g" "${nk[@]}" --lr 2e-5 --max-prompt-len 96 \
            --max-response-len 64 --eval-max-tokens 64 --eval-every "$steps" "${evals[@]}" \
            --micro-batch-size "$mb" --save-every "$steps" --device "$DEVICE" --rollout "$ROLLOUT" \
            > "$dir/$method.log" 2>&1 || { FAILED+=("learn $method ($dir/$method.log)"); tail -5 "$dir/$method.log"; }
        grep -E "vLLM memory plan|Available KV cache memory" "$dir/$method.log" | tail -2  # the plan's KV, vLLM's
    done
    for method in d3s grpo; do  # each method's row against its own simulated step
        "$PY" bench/memory.py --preset "$model/config.json" --ranks 1 --micro-batch-size "$mb" --response-len 64 \
            --prompt-len 96 --method "$method" > "$dir/memory-$method.log" 2>&1 \
            || FAILED+=("bench of the learning stage, $method ($dir/memory-$method.log)")
    done
    "$PY" - "$dir" <<'PYTHON' || FAILED+=("the learning table")
import json, os, sys
out = sys.argv[1]
print(f"{'method':<6} {'Pass@1 before':>13} {'after':>6} {'gen s':>6} {'reward s':>8} {'pass 1 s':>8} {'update s':>8} "
      f"{'sync s':>6} {'MFU':>6} {'loss tokens':>11} {'peak GiB':>8} {'simulated':>9}")
for method in ("d3s", "grpo"):
    sim = json.loads(open(os.path.join(out, f"memory-{method}.log")).read().strip().splitlines()[-1])
    lines = [json.loads(x) for x in open(os.path.join(out, method, "metrics.jsonl"))]
    train, evals = [m for m in lines if m["kind"] == "train"], [m for m in lines if m["kind"] == "eval"]
    p1 = [next(v for k, v in e.items() if k.startswith("heldout") and k.endswith("_pass@1")) for e in evals]
    mean = lambda key: sum(m[key] or 0 for m in train) / len(train)  # noqa: E731
    mfu = [m["mfu"] for m in train if m["mfu"] is not None]
    print(f"{method:<6} {p1[0]:>13.3f} {p1[-1]:>6.3f} {mean('gen_s'):>6.2f} {mean('reward_s'):>8.2f} "
          f"{mean('pass1_s'):>8.2f} {mean('train_s') - mean('pass1_s'):>8.2f} {mean('sync_s'):>6.2f} {(sum(mfu) / len(mfu) if mfu else float('nan')):>6.3f} "
          f"{sum(m['kept_tokens'] for m in train):>11} {max(m['mem_peak_gb'] for m in train):>8.2f} "
          f"{sim['peak_gib']:>9.2f}")
print("seconds: the mean per step (update: train_s less pass1_s, token selection included); MFU: of the "
      "update (nan where the GPU's peak is unknown: --peak-tflops; the LM head counted where it runs); loss tokens: "
      "summed over the steps; peak: torch's max allocated after vLLM's sleep, less vLLM's pools (on CPU the "
      "process's RSS) against bench/memory.py's simulated step of the same method; sync: the slowest rank's")
PYTHON
}
finish() {
    echo "== gpu_check done: the log is $LOG (send it back); the runs are in $OUT"
    if [ "${#FAILED[@]}" -gt 0 ]; then echo "gpu_check: FAILED: ${FAILED[*]}" >&2; exit 1; fi
    exit 0
}
if [ "$ONLY" = learn ]; then learn; finish; fi

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
GIB=$("$PY" -c "import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))")
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
HAVE_PYTEST=1
"$PY" -c "import pytest" 2>/dev/null || { HAVE_PYTEST=0; echo "gpu_check: pytest is missing: step 3 is skipped; \
$PY -m pip install pytest installs it"; }

# what NCCL's communicator takes on this node's GPUs (best effort: the plan's 4 GiB margin holds it, gpu.MARGIN_GIB;
# never fails the check): free memory before and after a first all_reduce on all GPUs, less what torch reserved
cat > "$OUT/nccl_probe.py" <<'EOF'
import os, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
free = torch.cuda.mem_get_info()[0]  # after the CUDA context
dist.init_process_group("nccl")
dist.all_reduce(torch.ones(1, device="cuda"))
torch.cuda.synchronize()
took = torch.tensor([free - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()], device="cuda")
dist.all_reduce(took, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print(f"NCCL took {took.item() / 2**30:.2f} GiB per GPU on {dist.get_world_size()} rank(s) (the plan's margin: 4 GiB)")
dist.destroy_process_group()
EOF
"$PY" -m torch.distributed.run --nproc_per_node "$NGPU" "$OUT/nccl_probe.py" 2>/dev/null | grep "^NCCL took" \
    || echo "gpu_check: what NCCL took could not be read here (not a failure)"

# the one-GPU settings of docs/train_full.md (the 1.5B, micro-batch 16), by this GPU's size; responses of 1024 here
if awk "BEGIN{exit !($GIB < 40)}"; then SIZE=24; SETTING=(--cpu-offload);
elif awk "BEGIN{exit !($GIB < 70)}"; then SIZE=48; SETTING=();
else SIZE=80; SETTING=(); fi

echo "== making a random Qwen2.5-Math-1.5B-shaped model (no download) and 64 arithmetic problems"
"$PY" - "$OUT" <<'EOF' || FAILED+=("the random model")
import json, os, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from support import tiny
from support.mathtask import arithmetic_problems
from memory import PRESETS  # bench/memory.py's Qwen2.5-Math shapes, the ones its simulation uses

out = sys.argv[1]
tokenizer = tiny.build_char_tokenizer()  # a small vocabulary; the model keeps Qwen2.5-Math-1.5B's 151936 rows
shape = {k: v for k, v in PRESETS["1.5b"].items() if k != "model_type"}  # tied embedding, as the real 1.5B
config = Qwen2Config(**shape, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
tiny.save_tiny(model.cpu(), tokenizer, os.path.join(out, "model-1.5b"))
with open(os.path.join(out, "train.jsonl"), "w") as f:
    for row in arithmetic_problems(64, "train", seed=0):
        f.write(json.dumps(row) + "\n")
print(f"wrote {out}/model-1.5b ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters) and {out}/train.jsonl")
EOF

# one_gpu NAME MODEL MICRO_BATCH [FLAGS...]: two steps of train_full.py on one GPU, then bench/memory.py and the
# plan for the same setting on this GPU, and the table of measured against simulated
one_gpu() {
    local name=$1 model=$2 mb=$3; shift 3
    local run="$OUT/$name"
    rm -rf "$run"
    echo "-- train_full.py, 1 GPU, $ROLLOUT rollouts, --micro-batch-size $mb $*"
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$PY" train_full.py --model "$model" --template plain \
        --train-data "$OUT/train.jsonl" --eval-data none --out "$run" --steps 2 --prompts-per-step 1 --group-size 32 \
        --n-init 8 --n-final 32 --max-prompt-len 64 --max-response-len 1024 --eval-max-tokens 1024 --save-every 2 \
        --micro-batch-size "$mb" --rollout "$ROLLOUT" "$@" > "$run.log" 2>&1 || FAILED+=("$name ($run.log)")
    grep -E "vLLM memory plan|Model loading took|KV cache memory|CUDA graph|[Ss]leep mode freed|train_full.py:|Error|error" \
        "$run.log" | tail -20
    echo "-- bench/memory.py, the same setting on a GPU of $GIB GiB"
    "$PY" bench/memory.py --preset "$model/config.json" --ranks 1 --response-len 1024 --prompt-len 64 --method d3s \
        --k-frac 0.2 --gpu "$GIB" --micro-batch-size "$mb" -- "$@" > "$run.memory.log" 2>&1 \
        || FAILED+=("bench $name ($run.memory.log)")
    "$PY" - "$run" <<'EOF' || FAILED+=("the table of $name")
import json, os, sys
run = sys.argv[1]
records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"train"' in line]
sim = json.loads(open(run + ".memory.log").read().strip().splitlines()[-1])
last = records[-1]
rows = [("trainer peak, GiB (torch max allocated less vLLM's pools / simulated)", last.get("mem_peak_gb"), sim["peak_gib"]),
        ("trainer between steps, GiB (- / simulated)", None, sim["resident_gib"]),
        ("GPU in use while generating, GiB (nvidia / plan: trainer + vLLM)", last.get("gpu_used_gen_gb"), sim.get("generating_gib")),
        ("GPU in use while training, GiB (nvidia / simulated trainer)", last.get("gpu_used_train_gb"), sim.get("training_gib")),
        ("vLLM's share, GiB (- / plan)", None, sim.get("vllm_share_gib")),
        ("KV cache, GiB (- / plan)", None, sim.get("kv_cache_gib")),
        ("peak trainer + vLLM, GiB (max of the two nvidia readings / simulated)",
         max(last.get("gpu_used_gen_gb") or 0, last.get("gpu_used_train_gb") or 0), sim.get("total_peak_gib"))]
print(f"{'figure':<72} {'measured':>9} {'simulated':>9}")
fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
for name, measured, simulated in rows:
    print(f"{name:<72} {fmt(measured):>9} {fmt(simulated):>9}")
print("per step: " + "; ".join(f"step {r['step']}: gen {r['gen_s']:.1f} s, train {r['train_s']:.1f} s, sync {r['sync_s']:.1f} s, "
                              f"{r['gen_tokens']} tokens generated, mfu {r['mfu'] if r['mfu'] is None else round(r['mfu'], 3)}"
                              for r in records))
print("(the nvidia readings add the CUDA context and the allocator's cache, which the simulation leaves out and the "
      "plan's margin of 4 GiB stands for)")
EOF
}

echo "== 1/5 the one-GPU setting of a ${SIZE} GB GPU ($GIB GiB here): --micro-batch-size 16 ${SETTING[*]}"
one_gpu "one_gpu_${SIZE}gb" "$OUT/model-1.5b" 16 "${SETTING[@]}"

echo "== 2/5 the 24 GB setting (--cpu-offload) on this GPU"
if [ "$SIZE" != 24 ]; then one_gpu one_gpu_24gb_setting "$OUT/model-1.5b" 16 --cpu-offload;
else echo "(step 1 was it)"; fi
if [ "${GPU_CHECK_7B:-0}" = 1 ] && [ "$SIZE" = 80 ]; then
    echo "-- GPU_CHECK_7B=1: a random 7B-shaped model on one GPU with --cpu-offload"
    "$PY" - "$OUT" <<'EOF' || FAILED+=("the random 7B")
import os, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from support import tiny
from memory import PRESETS  # bench/memory.py's Qwen2.5-Math shapes, the ones its simulation uses
tokenizer = tiny.build_char_tokenizer()
shape = {k: v for k, v in PRESETS["7b"].items() if k != "model_type"}  # untied embedding, as the real 7B
config = Qwen2Config(**shape, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
tiny.save_tiny(model.cpu(), tokenizer, os.path.join(sys.argv[1], "model-7b"))
EOF
    one_gpu one_gpu_7b "$OUT/model-7b" 16 --cpu-offload
fi

echo "== 3/5 the distributed tests on CUDA, $RANKS rank(s)"
if [ "$HAVE_PYTEST" = 1 ]; then
    export D3S_TEST_DEVICE=cuda D3S_TEST_RANKS=$RANKS D3S_VLLM_PYTHON="$PY"
    TESTS=(tests/test_full_fsdp.py)
    if [ "$ROLLOUT" = vllm ]; then
        TESTS+=("tests/test_full_vllm.py::test_vllm_greedy_tokens_and_logprobs_match_the_trainer_after_a_step_and_weight_sync")
    fi
    if [ "$RANKS" -ge 2 ]; then  # 2-rank end-to-end runs
        TESTS+=(tests/test_full_hf_rollout.py)
        if [ "$ROLLOUT" = vllm ]; then TESTS+=(tests/test_full_vllm.py); fi
    fi
    "$PY" -m pytest "${TESTS[@]}" -q -ra 2>&1 | tail -40 || FAILED+=("tests")
else
    echo "(skipped: no pytest)"; FAILED+=("tests (no pytest)")
fi

echo "== 4/5 the tiled MLP on the 7B's layer shapes (4 layers, [4, 3512] tokens, bf16)"
"$PY" bench/tiled_mlp.py --device cuda --dtype bfloat16 --hidden 3584 --seq-len 3512 --chunk-tokens 4096 --repeats 5 \
    2>&1 | tail -12 || FAILED+=("tiled MLP")

learn
finish
