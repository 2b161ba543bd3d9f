"""support/explain.py: the page of one step shows what the step trained on, and only that.

The pages here come from real selections (d3s.select_samples, d3s.select_tokens) on rewards
with a zero-spread group, and from the toy's own loop (toy/bandit.py --explain-every)."""

import math
import os
import sys
from html.parser import HTMLParser

import pytest
import torch

import d3s
from support import methods, explain

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy"))
import bandit  # noqa: E402

# P = 4 prompts x G = 6 rollouts: row 2 has no spread (all 0), row 3 one success.
REWARDS = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
    ]
)
TOKENS = ["12", " ", "+", "<b>", "&amp;", "\n", '"q"', "x\ty"]  # text that must be escaped or made visible


class Page(HTMLParser):
    """What a reader's browser would see: grid cells, token spans, links, scripts, the text."""

    def __init__(self, text):
        super().__init__()
        self.cells, self.tokens, self.links, self.scripts, self.text = {}, [], [], 0, []
        self._token, self._depth = None, 0  # the token span being read, spans open inside it
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        for key in ("src", "href"):
            if key in attrs:
                self.links.append(attrs[key])
        if tag == "script":
            self.scripts += 1
        if tag == "td" and "cell" in classes:
            self.cells[int(attrs["data-p"]), int(attrs["data-g"])] = "kept" in classes
        if tag == "span" and self._token is not None:
            self._depth += 1
        elif tag == "span" and "tok" in classes:
            self._token = {
                "selected": "sel" in classes,
                "marked": "mark" in classes,
                "title": attrs.get("title", ""),
                "text": "",
            }
            self.tokens.append(self._token)

    def handle_endtag(self, tag):
        if tag == "span" and self._token is not None:
            if self._depth:
                self._depth -= 1
            else:
                self._token = None

    def handle_data(self, data):
        self.text.append(data)
        if self._token is not None:
            self._token["text"] += data


def make_page(tmp_path, method, n_keep=2, k_frac=0.3, png=True):
    """A step of `method` on REWARDS, with made-up entropies and the real selections; returns
    (html path, keep, shown)."""
    P, G = REWARDS.shape
    keep, adv = d3s.select_samples(REWARDS, n_keep, methods.LADDER[method].samples)
    shown_adv = torch.where(keep, adv, d3s.group_advantages(REWARDS))
    kept = keep.view(-1).nonzero().squeeze(1)  # [B]
    entropy = torch.rand(len(kept), len(TOKENS), generator=torch.Generator().manual_seed(0))  # [B, T]
    scores = adv.view(-1)[kept].abs().unsqueeze(1) * entropy
    mask = torch.ones_like(scores, dtype=torch.bool)
    token_keep = d3s.select_tokens(scores, mask, k_frac)
    row_of = {int(i): r for r, i in enumerate(kept.tolist())}
    shown = []
    for i in explain.pick_rollouts(shown_adv, keep):
        r = row_of.get(i)
        shown.append(
            {
                "index": i,
                "tokens": TOKENS,
                "entropy": None if r is None else entropy[r].tolist(),
                "score": None if r is None else scores[r].tolist(),
                "selected": None if r is None else token_keep[r].tolist(),
            }
        )
    path = explain.write_step(
        tmp_path / method,
        step=7,
        rung="test",
        method=method,
        rewards=REWARDS,
        adv=shown_adv,
        keep=keep,
        n_keep=n_keep,
        k_frac=k_frac,
        k_real=float(token_keep.float().mean()),
        shown=shown,
        prompts=[f"question <{p}> & co" for p in range(P)],
        extra={"grad norm": 1.5},
        png=png,
    )
    return path, keep, shown


@pytest.mark.parametrize("method", ["d3s", "d3s-i"])
def test_kept_and_dropped_cells_match_select_samples(tmp_path, method):
    path, keep, _ = make_page(tmp_path, method, png=False)
    page = Page(open(path, encoding="utf-8").read())
    P, G = REWARDS.shape
    assert len(page.cells) == P * G
    assert page.cells == {(p, g): bool(keep[p, g]) for p in range(P) for g in range(G)}


def test_cross_group_rows_keep_uneven_counts_and_the_flat_row_loses_all(tmp_path):
    path, keep, _ = make_page(tmp_path, "d3s", png=False)
    page = Page(open(path, encoding="utf-8").read())
    per_row = [sum(page.cells[p, g] for g in range(REWARDS.shape[1])) for p in range(REWARDS.shape[0])]
    assert per_row[2] == 0  # no spread: A = 0, taken last by the pooled choice
    assert len(set(per_row)) > 1 and sum(per_row) == 2 * REWARDS.shape[0]  # budget N * P, spread unevenly
    text = "".join(page.text)
    assert "no spread" in text and "0/6 kept" in text


def test_intra_group_rows_keep_n_each_even_without_spread(tmp_path):
    path, _, _ = make_page(tmp_path, "d3s-i", png=False)
    page = Page(open(path, encoding="utf-8").read())
    per_row = [sum(page.cells[p, g] for g in range(REWARDS.shape[1])) for p in range(REWARDS.shape[0])]
    assert per_row == [2, 2, 2, 2]


@pytest.mark.parametrize("method", ["d3s", "d3s-i"])
def test_outlined_tokens_are_exactly_the_selected_ones(tmp_path, method):
    path, _, shown = make_page(tmp_path, method, png=False)
    page = Page(open(path, encoding="utf-8").read())
    selected = [bool(s) for item in shown for s in (item["selected"] or [False] * len(item["tokens"]))]
    assert sum(selected) > 0
    assert [t["selected"] for t in page.tokens] == selected
    assert sum(t["selected"] for t in page.tokens) == sum(selected)


def test_the_page_states_the_numbers_a_reader_needs(tmp_path):
    path, keep, _ = make_page(tmp_path, "d3s", png=False)
    text = " ".join(Page(open(path, encoding="utf-8").read()).text)
    adv = torch.where(keep, d3s.select_samples(REWARDS, 2, "cross")[1], d3s.group_advantages(REWARDS))
    var_kept = d3s.kept_variance(adv, keep)
    var_all = d3s.kept_variance(d3s.group_advantages(REWARDS), torch.ones_like(keep))
    assert var_kept > var_all  # what selection is for
    assert f"{var_kept:.2f}" in text and f"{var_all:.2f}" in text
    assert "Step 7" in text and "N = 2" in text and "30.0%" in text and "grad norm" in text


def test_tokens_are_escaped_and_whitespace_is_visible(tmp_path):
    path, _, shown = make_page(tmp_path, "d3s", png=False)
    page = Page(open(path, encoding="utf-8").read())
    pieces = [t["text"] for t in page.tokens[: len(TOKENS)]]
    assert pieces == ["12", " ", "+", "<b>", "&amp;", "↵", '"q"', "x→y"]  # parsed text = what the reader sees
    assert "token '<b>'" in page.tokens[3]["title"] and "score" in page.tokens[0]["title"]
    dropped = [item for item in shown if item["selected"] is None]
    assert dropped and "never forwarded" in "".join(page.text)


def test_the_page_is_self_contained(tmp_path):
    path, _, _ = make_page(tmp_path, "d3s", png=False)
    text = open(path, encoding="utf-8").read()
    page = Page(text)
    assert page.scripts == 0
    assert not any("http" in link for link in page.links)
    assert "@import" not in text and "url(" not in text  # no fonts or images fetched by CSS


def test_the_figure_is_a_png(tmp_path):
    path, _, _ = make_page(tmp_path, "d3s", png=True)
    png = path[: -len(".html")] + ".png"
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) < 200_000


def test_pick_rollouts_takes_the_extremes_and_a_dropped_group():
    adv = torch.tensor([[1.0, -1.0, 0.2, -0.2], [2.0, -0.5, -0.5, -1.5], [0.0, 0.0, 0.0, 0.0]])
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]).bool()
    picked = explain.pick_rollouts(adv, keep)
    assert picked == [4, 0, 7, 1, 8]  # A = 2, 1 (kept); A = -1.5, -1 (kept); row 2 lost everything
    assert explain.pick_rollouts(adv, keep, n_high=1, n_low=0, n_dropped=0) == [4]


def test_pick_rollouts_without_an_empty_group_takes_the_dropped_one_with_the_largest_a():
    adv = torch.tensor([[1.0, -1.0, 0.9, -0.2], [2.0, -0.5, -0.5, -1.5]])
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]]).bool()
    assert explain.pick_rollouts(adv, keep, n_high=1, n_low=1, n_dropped=1) == [4, 7, 2]
    assert explain.pick_rollouts(adv, torch.ones_like(keep)) == [4, 0, 7, 1]  # GRPO: nothing dropped


def test_bad_input_names_the_field(tmp_path):
    keep, adv = d3s.select_samples(REWARDS, 2, "cross")
    with pytest.raises(ValueError, match="keep.shape"):
        explain.write_step(
            tmp_path,
            step=0,
            rung="t",
            method="d3s",
            rewards=REWARDS,
            adv=adv,
            keep=keep[:2],
            n_keep=2,
            k_frac=0.1,
            k_real=0.1,
            shown=[],
        )
    with pytest.raises(ValueError, match="selected"):
        explain.write_step(
            tmp_path,
            step=0,
            rung="t",
            method="d3s",
            rewards=REWARDS,
            adv=adv,
            keep=keep,
            n_keep=2,
            k_frac=0.1,
            k_real=0.1,
            shown=[{"index": 0, "tokens": ["a", "b"], "selected": [True]}],
        )


# ---------------------------------------------------------------------------------------------
# The toy's wiring: --explain-every writes pages and leaves the run's numbers alone
# ---------------------------------------------------------------------------------------------
def test_toy_pages_are_written_and_do_not_change_the_numbers(tmp_path):
    torch.set_num_threads(1)
    plain = bandit.parse_args(["--steps", "3", "--workers", "1", "--out", str(tmp_path / "plain")])
    explained = bandit.parse_args(
        ["--steps", "3", "--workers", "1", "--out", str(tmp_path / "x"), "--explain-every", "2"]
    )
    for method in ("d3s", "grpo"):
        assert bandit.run(method, 1, plain) == bandit.run(method, 1, explained), method
    assert not (tmp_path / "plain" / "explain").exists()
    for method in ("d3s", "grpo"):
        folder = tmp_path / "x" / "explain" / f"{method}_seed1"
        assert sorted(os.listdir(folder)) == [
            "step_000001.html",
            "step_000001.png",
            "step_000002.html",
            "step_000002.png",
        ]
    page = Page(open(tmp_path / "x" / "explain" / "d3s_seed1" / "step_000001.html", encoding="utf-8").read())
    text = " ".join(page.text)
    assert "Step 1" in text and "d3s" in text and "toy" in text
    tokens, L = page.tokens, plain.length
    assert len(tokens) % L == 0 and len(tokens) >= 2 * L  # whole answers, a few of them
    for start in range(0, len(tokens), L):  # every answer marks its prompt's 1 to 3 decision positions
        assert 1 <= sum(t["marked"] for t in tokens[start : start + L]) <= plain.max_decisions
    assert all(("decision" in t["title"]) == t["marked"] for t in tokens)
    assert sum(t["selected"] for t in tokens) > 0
    assert math.isfinite(float(tokens[0]["title"].split("H = ")[1].split(" ")[0]))


def test_toy_rejects_a_negative_explain_every():
    with pytest.raises(SystemExit):
        bandit.parse_args(["--explain-every", "-1"])


def test_a_page_describes_the_methods_ladder_row(tmp_path):
    keep, adv = d3s.select_samples(REWARDS, 2, "cross")  # d2s selects rollouts as d3s does (cross-group)
    path = explain.write_step(
        tmp_path,
        step=1,
        rung="train_full",
        method="d2s",
        rewards=REWARDS,
        adv=adv,
        keep=keep,
        n_keep=2,
        k_frac=0.1,
        k_real=0.1,
        shown=[],
        png=False,
    )
    text = " ".join(Page(open(path, encoding="utf-8").read()).text)
    assert "cross-group" in text and "d2s" in text and "train_full" in text
