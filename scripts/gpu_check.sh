#!/usr/bin/env bash
# scripts/gpu_check.sh: the first thing to run on a GPU node, before a real train_full.py run.
#
#   python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements-full.txt pytest hypothesis
#   PYTHON=.venv-gpu/bin/python bash scripts/gpu_check.sh          # ~5-10 minutes on one H100
#
# The sessions that wrote this repo had a GPU once (one H100, torch 2.11, no vLLM: docs/gpu_check.md);
# the vLLM and multi-GPU paths below have only run on CPU. This script checks them on your hardware:
#   1. the distributed tests on CUDA (FSDP2 step == single-process step, vLLM weight sync with
#      the tied and the untied LM head, end to end with HF rollouts), on min(GPUs, 2) ranks;
#   2. two steps of train_full.py with vLLM on a random-initialised Qwen2.5-Math-1.5B-shaped model
#      (no download: the config is written here), on every GPU of the node;
#   3. what those steps measured (memory, times) next to bench/memory.py's simulated peak;
#   4. the tiled MLP's time and memory on the 7B's own layer shapes (bench/tiled_mlp.py, bf16).
# Without vLLM in $PYTHON (e.g. a stock PyTorch image), the vLLM tests are skipped and step 2 uses
# --rollout hf; the script says so. It prints a summary at the end; keep it with your bug report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: torch sees no CUDA device (torch.cuda.device_count() == 0); install the CUDA build of torch" >&2
    exit 2
fi
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
echo "== gpu_check: $NGPU GPU(s): $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))"); tests on $RANKS rank(s)"
"$PY" -c "import sys, torch, transformers; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, '
                                               f'transformers {transformers.__version__}')"
if "$PY" -c "import vllm" 2>/dev/null; then ROLLOUT=vllm; else
    ROLLOUT=hf
    echo "gpu_check: vLLM is not importable by $PY: the vLLM tests are skipped and step 2 uses --rollout hf"
fi

echo "== 1/4 distributed tests on CUDA"
export D3S_TEST_DEVICE=cuda D3S_TEST_RANKS=$RANKS D3S_VLLM_PYTHON="$PY"
TESTS=(tests/test_full_fsdp.py)
if [ "$ROLLOUT" = vllm ]; then
    TESTS+=("tests/test_full_vllm.py::test_vllm_greedy_tokens_and_logprobs_match_the_trainer_after_a_step_and_weight_sync")
fi
if [ "$RANKS" -ge 2 ]; then  # 2-rank end-to-end runs
    TESTS+=(tests/test_full_hf_rollout.py)
    if [ "$ROLLOUT" = vllm ]; then TESTS+=(tests/test_full_vllm.py); fi
fi
FAILED=()
"$PY" -m pytest "${TESTS[@]}" -q -ra 2>&1 | tee "$OUT/tests.log" || FAILED+=("tests ($OUT/tests.log)")

echo "== 2/4 two steps of train_full.py, $ROLLOUT rollouts, a random 1.5B-shaped model on $NGPU GPU(s)"
"$PY" - "$OUT" <<'EOF'
import json, os, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, ".")
import tiny
from mathtask import arithmetic_problems

out = sys.argv[1]
tokenizer = tiny.build_char_tokenizer()  # a small vocabulary; the model keeps Qwen2.5-Math-1.5B's 151936 rows
config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                     tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
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
rm -rf "$OUT/run"
"$PY" -m torch.distributed.run --nproc_per_node="$NGPU" train_full.py --model "$OUT/model-1.5b" --template plain \
    --train-data "$OUT/train.jsonl" --eval-data none --out "$OUT/run" --steps 2 --prompts-per-step "$NGPU" --rollout "$ROLLOUT" \
    --group-size 32 --n-init 8 --n-final 32 --max-response-len 1024 --micro-batch-size 4 --save-every 2 \
    --explain-every 1 2>&1 | tee "$OUT/train.log" || FAILED+=("train_full ($OUT/train.log)")

echo "== 3/4 measured vs simulated"
"$PY" bench/memory.py --preset "$OUT/model-1.5b/config.json" --ranks "$NGPU" --micro-batch-size 4 --response-len 1024 \
    --method d3s --k-frac 0.2 2>&1 | tee "$OUT/memory.log"
"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
records = [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl")) if '"train"' in line]
plan = json.loads(open(os.path.join(out, "memory.log")).read().strip().splitlines()[-1])
print(f"{'step':>4} {'mem_peak_gb':>11} {'gpu_used_gen_gb':>15} {'gpu_used_train_gb':>17} {'gen_s':>7} {'train_s':>7} "
      f"{'sync_s':>7} {'mfu':>6}")
f = lambda r, key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"  # noqa: E731
for r in records:
    print(f"{r['step']:>4} {f(r, 'mem_peak_gb', '.1f'):>11} {f(r, 'gpu_used_gen_gb', '.1f'):>15} "
          f"{f(r, 'gpu_used_train_gb', '.1f'):>17} {f(r, 'gen_s', '.1f'):>7} {f(r, 'train_s', '.1f'):>7} "
          f"{f(r, 'sync_s', '.1f'):>7} {f(r, 'mfu', '.3f'):>6}")
print(f"bench/memory.py simulated training peak: {plan['peak_gib']:.1f} GiB per GPU "
      f"(micro-batch 4 x {plan['response_len']} response tokens; the measured mem_peak_gb is the same quantity, "
      f"torch.cuda.max_memory_allocated, minus what the simulation leaves out: CUDA context, NCCL, fragmentation)")
EOF
echo "== 4/4 the tiled MLP on the 7B's layer shapes (4 layers, [4, 3512] tokens, bf16)"
"$PY" bench/tiled_mlp.py --device cuda --dtype bfloat16 --hidden 3584 --seq-len 3512 --chunk-tokens 4096 --repeats 5 \
    2>&1 | tee "$OUT/tiled_mlp.log"
echo "== gpu_check done: tests in $OUT/tests.log, the run in $OUT/run, the plan in $OUT/memory.log, $OUT/tiled_mlp.log"
if [ "${#FAILED[@]}" -gt 0 ]; then echo "gpu_check: FAILED: ${FAILED[*]}" >&2; exit 1; fi
