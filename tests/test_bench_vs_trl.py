"""Smoke test of bench/vs_trl.py --quick (TRL GRPOTrainer vs train_small.py and TRL + D3S; no timing assertions).

Opt-in: it runs only with D3S_BENCH=1 and the TRL venv (.venv-trl, `pip install -r
requirements/trl.txt`, which .ci/run builds); otherwise it is skipped with the reason. About a
minute and a half on a 2-core CPU (five arms of 2 steps, a 20-step warm start).
(integrations/trl.py's own tests, tests/test_integration_trl.py, run in CI.)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "vs_trl.py")
TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("D3S_BENCH") != "1",
        reason="opt-in benchmark smoke test: set D3S_BENCH=1 (needs .venv-trl with trl)",
    ),
    pytest.mark.skipif(
        not os.path.exists(TRL_PYTHON), reason=f"{TRL_PYTHON} not found: create it as bench/vs_trl.py's docstring says"
    ),
]


def test_quick_run_writes_the_table(tmp_path):
    out = tmp_path / "vs_trl.md"
    work = tmp_path / "work"
    res = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--quick",
            "--work",
            str(work),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--trl-python",
            TRL_PYTHON,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    text = out.read_text()
    assert "| arm | gen s/step | reward s/step | update s/step | total s/step | total vs TRL |" in text
    for row in (
        "| TRL GRPOTrainer",
        "gradient_checkpointing=False |",
        "| train_small.py grpo |",
        "| train_small.py d3s |",
        "+ D3S (integrations/trl.py) |",
    ):
        assert row in text, row
    assert "What differs between the arms beyond the algorithm" in text
    results = json.loads((work / "results.json").read_text())
    summary = results["summary"]
    assert set(summary) == {"trl", "trl-nogc", "grpo", "d3s", "trl-d3s"}
    for arm, s in summary.items():
        assert s["gen_s"] > 0 and s["update_s"] > 0 and s["peak_rss_mb"] > 0, (arm, s)
        assert 0.0 <= s["acc"] <= 1.0
        assert all(len(r["steps"]) == 2 for r in results["runs"][arm])
    # Same weights, prompts and sampling seed, but two samplers: the TRL arms sample with HF generate, the train_small
    # arms with train_small's own loop (each prompt encoded once, its KV cache repeated G times), whose tokens equal
    # generate's only up to rounding, so the two families may draw different step-1 rollouts. Within a family the
    # sampler is the same: its arms draw the same step-1 rollouts (the selection acts after sampling).
    assert summary["trl"]["step1"] == summary["trl-nogc"]["step1"] == summary["trl-d3s"]["step1"]
    assert summary["grpo"]["step1"] == summary["d3s"]["step1"]
    # TRL + D3S generates what TRL generates and trains on fewer tokens (kept rollouts, top-K tokens).
    assert summary["trl-d3s"]["loss_tokens"] < summary["trl-d3s"]["fwd_tokens"] <= summary["trl-d3s"]["gen_tokens"]
    # Same warm start: the held-out accuracy before training agrees exactly.
    assert len({s["acc0"] for s in summary.values()}) == 1
