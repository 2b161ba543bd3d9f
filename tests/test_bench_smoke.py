"""Smoke test of bench/selection.py (no timing assertions), and its Python reference vs d3s."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import d3s  # tests/conftest.py puts the repository root on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "selection.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_selection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _var(values):
    values = torch.as_tensor(values, dtype=torch.float64)
    return float(values.var()) if values.numel() >= 2 else 0.0


def test_quick_run_prints_tables(tmp_path):
    out = tmp_path / "bench.md"
    res = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for header in (
        "| P x G | operation | median | x sort |",
        "| B x T | operation | median | x sort |",
        "| N tokens x V (logits size) | token_entropy (chunked) |",
        "| variant | measured peak extra |",
        "## Target: selection within 3x of one sort",
    ):
        assert header in res.stdout, header
    assert out.read_text() == res.stdout


@pytest.mark.parametrize("kind", ["uniform", "binary", "few-levels"])
@pytest.mark.parametrize("n,m", [(1, 1), (2, 1), (4, 2), (8, 3), (16, 4), (16, 16), (33, 10)])
def test_python_reference_matches_max_variance_subset(kind, n, m):
    bench = _load_bench()
    gen = torch.Generator().manual_seed(1000 * n + m)
    P = 20
    if kind == "uniform":
        values = torch.rand(P, n, generator=gen, dtype=torch.float64)
    elif kind == "binary":
        values = (torch.rand(P, n, generator=gen) < 0.5).double()
    else:  # many ties
        values = torch.randint(0, 4, (P, n), generator=gen).double() / 3
    rows = values.tolist()
    ref = bench.python_max_variance_subset(rows, m)
    fast = d3s.max_variance_subset(values, m)
    for row, r_idx, f_idx in zip(rows, ref, fast.tolist()):
        assert len(r_idx) == len(set(r_idx)) == m and r_idx == sorted(r_idx)
        assert _var([row[i] for i in r_idx]) == pytest.approx(_var([row[i] for i in f_idx]), rel=1e-9, abs=1e-12)


def test_python_reference_is_the_max_over_all_subsets():
    """Brute force over every m-subset on small rows: the reference (the PODS loop) is optimal."""
    import itertools

    bench = _load_bench()
    gen = torch.Generator().manual_seed(7)
    for n in range(1, 8):
        row = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
        for m in range(1, n + 1):
            best = max(_var([row[i] for i in c]) for c in itertools.combinations(range(n), m))
            (idx,) = bench.python_max_variance_subset([row], m)
            assert _var([row[i] for i in idx]) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_python_reference_deadline():
    bench = _load_bench()
    with pytest.raises(TimeoutError):
        bench.python_max_variance_subset([[0.0, 1.0, 2.0]], 2, deadline=0.0)
