"""The lesson (lesson/lesson.py, paired with lesson/lesson.ipynb by jupytext): the committed notebook is the source's
cells with their outputs, it runs top to bottom, and every exercise's checker fails on a wrong answer and passes the
given one.

Regenerate the notebook after editing the source (about a minute on 2 cores; docs/lesson.md):
    .venv/bin/python lesson/build.py
"""

import itertools
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
import d3s  # noqa: E402

jupytext = pytest.importorskip("jupytext", reason="the notebook tooling: pip install -r requirements/dev.txt")
nbformat = pytest.importorskip("nbformat")


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_the_committed_notebook_is_the_source_with_its_outputs():
    source = jupytext.read(LESSON / "lesson.py")
    notebook = nbformat.read(LESSON / "lesson.ipynb", as_version=4)
    assert cells(notebook) == cells(source), "lesson.ipynb is out of date: run .venv/bin/python lesson/build.py"
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "every code cell ran (the notebook is committed executed)"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", [])), (
        "a committed cell failed"
    )
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # the figures read on a code host without running


def test_the_lesson_runs_top_to_bottom(tmp_path):
    """Executes the source as a notebook (nbclient): any error in a cell fails. Prints the time it took (the target, 5
    minutes on a 2-core laptop CPU, is measured and reported in docs/lesson.md, not asserted here)."""
    import build

    nb, seconds = build.execute()
    print(f"lesson executed in {seconds:.0f} s")
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for n in (1, 2, 3, 4, 5, 6):
        assert f"exercise {n}: passed" in outputs


WRONG = {  # a plausible mistake per exercise
    "group_advantages": lambda r: (r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=False, keepdim=True) + 1e-6),
    "max_variance_subset": lambda values, m: list(range(m)),
    "entropy_scores": lambda adv, entropy: adv.abs().unsqueeze(-1) * entropy,
    "linear_schedule": lambda step, total, n_init=8, n_final=32, k_init=0.05, k_final=0.2: (
        round(n_init + (n_final - n_init) * step / total),
        k_init + (k_final - k_init) * step / total,
    ),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_checker_passes_the_answer_and_fails_a_wrong_one(name, capsys):
    check = getattr(checks, f"check_{name}")
    check(getattr(answers, name))
    assert "passed" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        check(WRONG[name])


def _farthest_from_the_mean(values, m):
    """The m values farthest from the mean: a natural greedy, optimal on symmetric rows, wrong on lopsided ones."""
    mean = sum(values) / len(values)
    return sorted(sorted(range(len(values)), key=lambda i: -abs(values[i] - mean))[:m])


def _half_largest_half_smallest(values, m):
    """The m // 2 largest and the rest smallest: the candidate k fixed at m // 2 instead of the best of the m + 1."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    k = m // 2
    return sorted(order[: m - k] + (order[len(order) - k :] if k else []))


def _per_group(rewards, n):
    """N per group (d3s-i's rule), not a pooled choice of N * P across groups."""
    return d3s.select_samples(rewards, n, "intra")


def _restandardized(rewards, n):
    """The pooled choice, but the advantages recomputed on each group's kept rollouts (PODS's step, not D3S's)."""
    keep, _ = d3s.select_samples(rewards, n, "cross")
    adv = torch.zeros_like(rewards)
    for p in range(rewards.shape[0]):
        if keep[p].any():
            adv[p, keep[p]] = d3s.group_advantages(rewards[p, keep[p]].unsqueeze(0))[0]
    return keep, adv


def _top_abs_advantage(rewards, n):
    """The N * P largest |A| of the batch: drops zero-advantage groups too, but without the variance rule."""
    adv = d3s.group_advantages(rewards)
    keep = torch.zeros(adv.numel(), dtype=torch.bool)
    keep[adv.abs().flatten().argsort(descending=True, stable=True)[: n * adv.shape[0]]] = True
    keep = keep.view(adv.shape)
    return keep, torch.where(keep, adv, torch.zeros_like(adv))


def _pooled_reward_variance(rewards, n):
    """The pooled max-variance choice on the raw rewards instead of the advantages (PODS's criterion, pooled)."""
    adv = d3s.group_advantages(rewards)
    keep = torch.zeros(adv.numel(), dtype=torch.bool)
    keep[d3s.max_variance_subset(rewards.flatten(), n * adv.shape[0])] = True
    keep = keep.view(adv.shape)
    return keep, torch.where(keep, adv, torch.zeros_like(adv))


def _per_sequence_topk(adv, entropy, mask, k):
    """|A| * H, but the top K inside each response (scope="sequence"), not over the batch."""
    return d3s.select_tokens(d3s.token_scores(adv, entropy), mask, k, scope="sequence")


def _entropy_only(adv, entropy, mask, k):
    """The top K over the batch by entropy alone, A ignored."""
    return d3s.select_tokens(entropy, mask, k)


def _topk_over_padding(adv, entropy, mask, k):
    """|A| * H over the batch, but ranking every position of the padded tensor, padding included."""
    scores = adv.abs().unsqueeze(-1) * entropy
    keep = torch.zeros(scores.numel(), dtype=torch.bool)
    keep[scores.flatten().topk(math.ceil(k * int(mask.sum()) - 1e-9)).indices] = True
    return keep.view(scores.shape)


def _floor_count(adv, entropy, mask, k):
    """The right ranking, but int(K * tokens) kept (rounded down) instead of ceil: none at all on small batches."""
    scores = (adv.abs().unsqueeze(-1) * entropy).masked_fill(~mask, -1.0)
    keep = torch.zeros(scores.numel(), dtype=torch.bool)
    keep[scores.flatten().topk(int(k * int(mask.sum()))).indices] = True
    return keep.view(scores.shape)


MORE_WRONG = {  # exercises 2, 5 and 6: plausible mistakes beyond the one of WRONG, each named
    ("max_variance_subset", "farthest from the mean"): _farthest_from_the_mean,
    ("max_variance_subset", "half largest, half smallest"): _half_largest_half_smallest,
    ("cross_group_selection", "per-group selection (d3s-i)"): _per_group,
    ("cross_group_selection", "re-standardized advantages (PODS)"): _restandardized,
    ("cross_group_selection", "top |A| without the variance rule"): _top_abs_advantage,
    ("cross_group_selection", "pooled variance of rewards"): _pooled_reward_variance,
    ("token_topk", "per-sequence top K"): _per_sequence_topk,
    ("token_topk", "entropy only"): _entropy_only,
    ("token_topk", "top K over padded positions"): _topk_over_padding,
    ("token_topk", "K rounded down"): _floor_count,
}


@pytest.mark.parametrize("name", ["cross_group_selection", "token_topk"])
def test_the_new_exercises_pass_their_answer(name, capsys):
    getattr(checks, f"check_{name}")(getattr(answers, name))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("name,mistake", sorted(MORE_WRONG), ids=[f"{n}: {m}" for n, m in sorted(MORE_WRONG)])
def test_each_checker_fails_a_named_plausible_mistake(name, mistake):
    with pytest.raises(AssertionError):
        getattr(checks, f"check_{name}")(MORE_WRONG[name, mistake])


def test_the_wrong_answers_of_exercise_2_are_right_on_some_rows():
    """They are plausible: each one is optimal on a symmetric row, so only the checker's harder rows catch it."""
    values, m = [0.0, 1.0, 0.2, 0.8], 2
    best = max(torch.tensor([values[i] for i in c]).var().item() for c in itertools.combinations(range(4), m))
    for wrong in (_farthest_from_the_mean, _half_largest_half_smallest):
        assert torch.tensor([values[i] for i in wrong(values, m)]).var().item() == pytest.approx(best)


def test_the_brute_force_answer_to_exercise_2_passes_too():
    checks.check_max_variance_subset(answers.brute_force_subset)


def test_the_answers_agree_with_d3s():
    import d3s

    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(answers.group_advantages(rewards), d3s.group_advantages(rewards), atol=1e-6)
    assert answers.linear_schedule(50, 100) == (20, pytest.approx(0.125))
    assert math.isclose(answers.linear_schedule(150, 100)[1], 0.2)
