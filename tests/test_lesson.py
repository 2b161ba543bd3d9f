"""The lesson (lesson/lesson.py, paired with lesson/lesson.ipynb by jupytext): the committed notebook is the source's
cells with their outputs, it runs top to bottom, and every exercise's checker fails on a wrong answer and passes the
given one.

Regenerate the notebook after editing the source (about a minute on 2 cores; docs/lesson.md):
    .venv/bin/python lesson/build.py
"""

import math
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSON = ROOT / "lesson"
sys.path.insert(0, str(LESSON))
import answers  # noqa: E402
import checks  # noqa: E402

jupytext = pytest.importorskip("jupytext", reason="the notebook tooling: pip install -r requirements-dev.txt")
nbformat = pytest.importorskip("nbformat")


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_the_committed_notebook_is_the_source_with_its_outputs():
    source = jupytext.read(LESSON / "lesson.py")
    notebook = nbformat.read(LESSON / "lesson.ipynb", as_version=4)
    assert cells(notebook) == cells(source), "lesson.ipynb is out of date: run .venv/bin/python lesson/build.py"
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "every code cell ran (the notebook is committed executed)"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", [])), "a committed cell failed"
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # the figures read on a code host without running


def test_the_lesson_runs_top_to_bottom(tmp_path):
    """Executes the source as a notebook (nbclient): any error in a cell fails. Prints the time it took (the target, 5
    minutes on a 2-core laptop CPU, is measured and reported in docs/lesson.md, not asserted here)."""
    import build

    nb, seconds = build.execute()
    print(f"lesson executed in {seconds:.0f} s")
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for n in (1, 2, 3, 4):
        assert f"exercise {n}: passed" in outputs


WRONG = {  # a plausible mistake per exercise
    "group_advantages": lambda r: (r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=False, keepdim=True) + 1e-6),
    "max_variance_subset": lambda values, m: list(range(m)),
    "entropy_scores": lambda adv, entropy: adv.abs().unsqueeze(-1) * entropy,
    "linear_schedule": lambda step, total, n_init=8, n_final=32, k_init=0.05, k_final=0.2: (
        round(n_init + (n_final - n_init) * step / total), k_init + (k_final - k_init) * step / total),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_checker_passes_the_answer_and_fails_a_wrong_one(name, capsys):
    check = getattr(checks, f"check_{name}")
    check(getattr(answers, name))
    assert "passed" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        check(WRONG[name])


def test_the_brute_force_answer_to_exercise_2_passes_too():
    checks.check_max_variance_subset(answers.brute_force_subset)


def test_the_answers_agree_with_d3s():
    import d3s

    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(answers.group_advantages(rewards), d3s.group_advantages(rewards), atol=1e-6)
    assert answers.linear_schedule(50, 100) == (20, pytest.approx(0.125))
    assert math.isclose(answers.linear_schedule(150, 100)[1], 0.2)
