"""support/page.py: how one step is drawn: explain.py chooses what to show, this draws it.

write_step writes out_dir/step_NNNNNN.html (one self-contained file: inline CSS, no script, font, image or network;
hover shows the numbers) and step_NNNNNN.png (matplotlib, for the README): 1. the sample level, one row per prompt,
one cell per rollout sorted by A, coloured by its sign, kept or dropped, Var(A) of the kept set against the full
batch; 2. the token level, a few rollouts with every token shaded by |A| * H and the selected ones outlined.

Nothing here computes a piece of the method: advantages, variances and the usefulness rate come from d3s.py.
"""

import html
import math
import os

import torch

import d3s
from support import methods

POSITIVE, NEGATIVE, ZERO = (33, 102, 172), (217, 95, 2), (222, 222, 222)  # A > 0 blue, A < 0 orange (colour-blind safe)
SCORE = (118, 42, 131)  # token score |A| * H: purple, a scale of its own
MARK = (230, 171, 2)  # a mark under some positions (the toy's decision positions)
RULES = {  # the samples rule of a LADDER row (methods.rule_name), in words (d3s.select_samples)
    "all": "every rollout is trained on (N = G).",
    "intra": "intra-group: in every row, the N rollouts whose advantages have the largest variance "
    "(the extremes of the row). Every row keeps N, even a row with no spread (A = 0).",
    "cross": "cross-group: one pooled choice of N &times; P rollouts over the whole batch, the set whose "
    "advantages have the largest variance. Rows keep uneven counts; rows with no spread (A = 0) are taken last.",
    "pods": "PODS: in every row, the N rollouts whose rewards have the largest variance; A is recomputed on "
    "the kept N (kept cells show that A, dropped cells their full-group A).",
    "random": "random control: N uniform rollouts per row.",
    "mixed": "DAPO's filter: every rollout of each row whose rewards are not all equal (0 &lt; #correct &lt; G); "
    "rows with no spread (A = 0) keep none. No N: the count follows the batch.",
}


def write_step(
    out_dir,
    *,
    step,
    rung,
    method,
    rewards,
    adv,
    keep,
    n_keep,
    k_frac,
    k_real,
    shown,
    prompts=None,
    extra=None,
    png=True,
):
    """Write out_dir/step_NNNNNN.html (and .png when png=True); return the html path.

    step: the global step as the rung counts it; rung: "toy" | "train_small" | "train_full"; method: the method's
    name (a methods.LADDER row). rewards [P, G]; keep [P, G] bool (from d3s.select_samples); adv [P, G]: the
    advantage each cell shows, torch.where(keep, adv_from_select_samples, d3s.group_advantages(rewards)) (pods:
    the kept cells show A recomputed on the kept N).
    n_keep: N, rollouts per prompt (the cross-group budget is N * P); k_frac: the scheduled K; k_real: the realised
    fraction (kept tokens / forwarded tokens).
    shown: one dict per rollout to draw token by token (pick_rollouts chooses them):
        {"index": p * G + g, "tokens": [str] (one decoded piece per response token),
         "entropy": [float] | None, "score": [float] | None, "selected": [bool] | None}
      None for a rollout that was dropped and never forwarded (its text is shown unshaded). Optional keys: "marked":
      [bool] and "mark_label": str (a mark under some positions, e.g. the toy's decision positions), "notes": [str]
      (per token, appended to the hover).
    prompts: P strings (a row's label; full text on hover); extra: {label: number or str}, printed in the summary
    (the loss, its normalizer, the grad norm...).
    """
    check_grid(rewards=rewards, adv=adv, keep=keep)
    P, G = rewards.shape
    got = f"{len(prompts)} strings" if prompts else prompts
    d3s.require(prompts is None or len(prompts) == P, "prompts", got, f"pass one string per prompt (P={P}) or None")
    for name, value in (("n_keep", n_keep), ("k_frac", k_frac), ("k_real", k_real), ("step", step)):
        d3s.require(isinstance(value, (int, float)) and math.isfinite(value), name, value, "must be a finite number")
    shown = [_check_shown(item, P * G) for item in shown]
    rewards, adv, keep = rewards.detach().float().cpu(), adv.detach().float().cpu(), keep.detach().bool().cpu()
    numbers = {
        "var_kept": d3s.kept_variance(adv, keep),
        # the full batch: every rollout with its group's A, what GRPO trains on
        "var_all": d3s.kept_variance(d3s.group_advantages(rewards), torch.ones_like(keep)),
        "sur": d3s.usefulness_rate(adv, keep),
    }
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "step_%06d" % int(step))
    parts = [
        _HEAD % {"title": html.escape(f"{rung} step {int(step)}: {method}")},
        _summary(step, rung, method, rewards, keep, n_keep, k_frac, k_real, numbers, extra),
        _legend(shown),
        _grid(rewards, adv, keep, prompts, n_keep, method),
        _token_level(shown, rewards, adv, keep, prompts, k_frac, k_real),
        "</body></html>\n",
    ]
    with open(base + ".html", "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    if png:
        plot_step(
            base + ".png",
            step=step,
            rung=rung,
            method=method,
            adv=adv,
            keep=keep,
            shown=shown,
            var_kept=numbers["var_kept"],
            var_all=numbers["var_all"],
            prompts=prompts,
        )
    return base + ".html"


_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>%(title)s</title>
<style>
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 18px 24px; color: #222; max-width: 1400px; }
h1 { font-size: 21px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 22px 0 6px; border-bottom: 1px solid #ccc; }
.sub { color: #555; margin: 0 0 10px; }
.stats { display: flex; flex-wrap: wrap; gap: 10px; margin: 8px 0; }
.stat { flex: 1 1 150px; border: 1px solid #ccc; border-radius: 6px; padding: 5px 10px; background: #fafafa; }
.stat b { display: block; font-size: 19px; } .stat span { color: #555; font-size: 12px; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; font-size: 13px; margin: 8px 0; }
.rule { background: #f4f4f4; border-left: 4px solid #888; padding: 6px 10px; margin: 6px 0 10px; }
table.grid { border-collapse: separate; border-spacing: 2px; }
.grid td.lab { font-size: 12px; color: #333; padding-right: 6px; max-width: 200px; white-space: nowrap;
  overflow: hidden; text-overflow: ellipsis; }
.grid td.cnt { font-size: 12px; padding-left: 6px; white-space: nowrap; line-height: 1.2; }
.cell { width: 26px; height: 30px; text-align: center; font: 10px/1.1 ui-monospace, Menlo, Consolas, monospace;
  border-radius: 3px; padding: 0; }
.cell b { font-size: 12px; display: block; }
.cell.kept { border: 2px solid #111; }
.cell.drop { border: 2px dashed #bbb; color: #999; opacity: 0.55;
  background-image: repeating-linear-gradient(135deg, transparent 0 5px, rgba(255,255,255,.75) 5px 7px); }
.bar { display: inline-block; height: 9px; background: #111; vertical-align: middle; margin-right: 6px; }
.nosig { color: #a00; font-weight: 600; }
.roll { margin: 12px 0 16px; }
.roll .hd { font-size: 13px; margin-bottom: 4px; }
.chip { display: inline-block; min-width: 42px; text-align: center; border-radius: 3px; padding: 0 4px; margin-right: 6px;
  font-family: ui-monospace, Menlo, Consolas, monospace; }
.toks { font: 15px/2 ui-monospace, Menlo, Consolas, monospace; }
.tok, .tokdemo { display: inline-block; min-width: 9px; padding: 0 2px; margin: 0 1px 3px 0; border-radius: 2px;
  white-space: pre; border-bottom: 3px solid transparent; }
.tok.sel, .tokdemo.seldemo { outline: 2px solid #000; outline-offset: 0; }
.tok.mark, .tokdemo.markdemo { border-bottom-color: rgb(230,171,2); }
.ws { color: #999; }
.fwd0 { color: #777; }
.note { color: #555; font-size: 12px; }
</style></head><body>"""


def _summary(step, rung, method, rewards, keep, n_keep, k_frac, k_real, numbers, extra):
    P, G = rewards.shape
    samples = _samples_rule(method)
    stats = [
        (f"{int(keep.sum())} / {P * G}", f"rollouts kept (P = {P} prompts &times; G = {G})"),
        (
            f"N = {int(n_keep)}",
            f"per prompt on average: N &times; P = {int(n_keep) * P} pooled"
            if samples == "cross"
            else f"rollouts kept per prompt, of G = {G}",
        ),
        (
            f"{numbers['var_kept']:.2f} <small>vs</small> {numbers['var_all']:.2f}",
            "Var(A): kept set vs full batch (unbiased)",
        ),
        (f"{100 * k_frac:.1f}% &rarr; {100 * k_real:.1f}%", "tokens: scheduled K &rarr; realised (kept / forwarded)"),
        (f"{numbers['sur']:.2f}", "usefulness: kept rollouts with A &ne; 0"),
    ]
    cards = "".join(f'<div class="stat"><b>{value}</b><span>{label}</span></div>' for value, label in stats)
    notes = " &middot; ".join(f"{html.escape(str(k))}: <b>{html.escape(_fmt(v))}</b>" for k, v in (extra or {}).items())
    rows = f'<p class="note">{notes}</p>' if extra else ""
    return (
        f"<h1>Step {int(step)} &middot; {html.escape(str(method))} &middot; {html.escape(str(rung))}</h1>"
        f'<p class="sub">What this step trains on: first the rollouts (sample level), then their tokens '
        f"(token level). Global step {int(step)} of the run; hover any cell or token for its numbers.</p>"
        f'<div class="stats">{cards}</div>{rows}'
    )


def _legend(shown):
    chip = lambda a, text: f'<span class="chip" style="background:{_adv_css(a)};color:{_ink(a)}">{text}</span>'
    items = [
        chip(1.5, "A &gt; 0") + "better than its group",
        chip(-1.5, "A &lt; 0") + "worse than its group",
        chip(0.0, "A = 0") + "no signal (all rewards equal)",
        '<span class="cell kept chip" style="display:inline-block;height:auto">&nbsp;</span>kept: trained on',
        '<span class="cell drop chip" style="display:inline-block;height:auto;background-color:#ccc">&nbsp;</span>'
        "dropped: never forwarded",
        f'<span class="tokdemo" style="{_score_css(0.9)}">x</span> token shaded by score |A|&times;H',
        '<span class="tokdemo seldemo">x</span> selected token (in the loss)',
    ]
    marks = {item.get("mark_label") for item in shown if item.get("marked")} - {None}
    items += [f'<span class="tokdemo markdemo">x</span> {html.escape(label)}' for label in sorted(marks)]
    return '<div class="legend">' + "".join(f"<span>{item}</span>" for item in items) + "</div>"


def _grid(rewards, adv, keep, prompts, n_keep, method):
    """One row per prompt, one cell per rollout, sorted by A (then reward) within the row."""
    P, G = rewards.shape
    samples = _samples_rule(method)
    rule = RULES.get(samples, "the rung's own rule (see its --help).")
    per_row = keep.sum(1)
    flat = rewards.amax(1) == rewards.amin(1)  # rows with no spread: A = 0
    this_step = f"This step: rows keep {int(per_row.min())} to {int(per_row.max())} of {G}"
    if flat.any():
        this_step += (
            f"; {int(flat.sum())} row{'s' if int(flat.sum()) > 1 else ''} with no spread "
            f"keep {int(per_row[flat].sum())} rollout{'' if int(per_row[flat].sum()) == 1 else 's'} in all"
        )
    out = [
        f'<h2>1. Sample level: which rollouts</h2><div class="rule"><b>{html.escape(str(method))}</b>, '
        f"N = {int(n_keep)}: {rule} <b>{this_step}.</b> Cells are sorted by A within each row; the top number "
        "is the reward R, the bottom one A.</div>",
        '<table class="grid">',
    ]
    for p in range(P):
        order = _row_order(adv[p], keep[p])
        label = prompts[p] if prompts else f"prompt {p}"
        cells = []
        for g in order:
            a, r, k = float(adv[p, g]), float(rewards[p, g]), bool(keep[p, g])
            tip = f"prompt {p}, rollout {g} (index {p * G + g}): reward {_fmt(r)}, A = {a:+.3f}, {'kept' if k else 'dropped'}"
            cells.append(
                f'<td class="cell {"kept" if k else "drop"}" data-p="{p}" data-g="{g}" title="{html.escape(tip)}" '
                f'style="background-color:{_adv_css(a)};color:{_ink(a) if k else "#666"}">'
                f"<b>{html.escape(_fmt(r, short=True))}</b>{_fmt_adv(a)}</td>"
            )
        n_kept, spread = int(keep[p].sum()), float(rewards[p].max() - rewards[p].min()) > 0
        count = f'<span class="bar" style="width:{round(40 * n_kept / G)}px"></span>{n_kept}/{G} kept' + (
            "" if spread else '<br><span class="nosig">no spread</span>'
        )
        out.append(
            f'<tr><td class="lab" title="{html.escape(label)}">{html.escape(_short(label, 48))}</td>{"".join(cells)}'
            f'<td class="cnt">{count}</td></tr>'
        )
    out.append("</table>")
    return "\n".join(out)


def _token_level(shown, rewards, adv, keep, prompts, k_frac, k_real):
    G = rewards.shape[1]
    scores = [s for item in shown if item["score"] is not None for s in item["score"] if math.isfinite(s)]
    top = max(scores, default=0.0) or 1.0  # the darkest shade: the largest score on the page
    out = [
        f'<h2>2. Token level: which tokens</h2><div class="rule">Score s = |A| &times; H (entropy of the policy at '
        f"that token). The top K = {100 * k_frac:.1f}% of scores over all forwarded tokens of the batch are selected "
        f"(realised: {100 * k_real:.1f}%); only they enter the loss. Shade: s relative to the largest s shown "
        f"({top:.3g}). Rollouts shown: the highest- and lowest-advantage kept ones, and a dropped one for contrast.</div>"
    ]
    for item in shown:
        p, g = divmod(item["index"], G)
        a, r, k = float(adv[p, g]), float(rewards[p, g]), bool(keep[p, g])
        label = prompts[p] if prompts else f"prompt {p}"
        if k:
            status = "kept"
        elif keep[p].any():
            status = "dropped"
        elif float(rewards[p].max() - rewards[p].min()) == 0:
            status = "dropped: its group had no spread"
        else:
            status = "dropped, with its whole group"
        if item["selected"] is not None:
            n_sel, n_tok = sum(map(bool, item["selected"])), len(item["tokens"])
            status += f" &middot; <b>{n_sel}</b> of {n_tok} tokens selected" + (
                " (none made the batch's top K)" if k and not n_sel else ""
            )
        else:
            status += " &middot; never forwarded: no entropy, no score, no gradient"
        out.append(
            f'<div class="roll" data-index="{item["index"]}"><div class="hd">'
            f'<span class="chip" style="background:{_adv_css(a)};color:{_ink(a)}">A {f"{a:+.2f}" if a else "0"}</span>'
            f"R = {html.escape(_fmt(r))} &middot; rollout {g} of <i>{html.escape(_short(label, 80))}</i> &middot; {status}</div>"
            f'<div class="toks{"" if item["score"] is not None else " fwd0"}">{_tokens_html(item, top)}</div></div>'
        )
    if not shown:
        out.append('<p class="note">No rollout shown at token level.</p>')
    return "\n".join(out)


def _tokens_html(item, top):
    spans = []
    for t, piece in enumerate(item["tokens"]):
        tip = [f"position {t}", f"token {piece!r}"]
        classes, style = ["tok"], ""
        if item["entropy"] is not None:
            tip.append(f"H = {item['entropy'][t]:.3f}")
        if item["score"] is not None:
            tip.append(f"score |A|*H = {item['score'][t]:.3f}")
            style = f' style="{_score_css(item["score"][t] / top)}"'
        if item["selected"] is not None:
            tip.append("SELECTED" if item["selected"][t] else "not selected")
            if item["selected"][t]:
                classes.append("sel")
        if item.get("marked") and item["marked"][t]:
            classes.append("mark")
            tip.append(item.get("mark_label") or "marked")
        if item.get("notes") and item["notes"][t]:
            tip.append(str(item["notes"][t]))
        spans.append(
            f'<span class="{" ".join(classes)}"{style} title="{html.escape(" | ".join(tip))}">{_visible(piece)}</span>'
        )
        if "\n" in piece:
            spans.append("<br>")
    return "".join(spans)


def plot_step(path, *, step, rung, method, adv, keep, shown, var_kept, var_all, prompts=None, max_tokens=48):
    """PNG: prompts x rollouts in the page's colours (sorted by A per row; dots = kept, faded = dropped), and one
    response strip (the first shown rollout with some but not all of its tokens selected, else the first with any)
    with its tokens shaded by |A| * H and the selected ones outlined (at most max_tokens: the window with the most
    selected tokens). Quantized to 256 colours (no dithering) to stay small."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    P, G = adv.shape
    order = torch.tensor([_row_order(adv[p], keep[p]) for p in range(P)])  # [P, G]
    adv_sorted, keep_sorted = adv.gather(1, order), keep.gather(1, order)
    with_selection = [s for s in shown if s["selected"] is not None and any(s["selected"])]
    partial = [s for s in with_selection if not all(s["selected"])]  # shows a choice better than all-selected
    strip = (partial or with_selection or [None])[0]
    colours = torch.tensor([[_adv_rgb(float(a)) for a in row] for row in adv_sorted]) / 255  # [P, G, 3]
    colours = torch.where(keep_sorted.unsqueeze(-1), colours, 1 - 0.4 * (1 - colours))  # dropped: faded
    grid_h = min(0.3 * P + 1.3, 9.0)
    fig = plt.figure(figsize=(10, grid_h + (1.2 if strip else 0.0)))
    axes = fig.subplots(2 if strip else 1, 1, gridspec_kw={"height_ratios": [grid_h, 0.5]} if strip else None)
    ax = axes[0] if strip else axes
    ax.imshow(colours.numpy(), aspect="auto", interpolation="nearest")
    ax.set_xticks([x - 0.5 for x in range(1, G)], minor=True), ax.set_yticks([y - 0.5 for y in range(1, P)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1 if G <= 64 else 0)
    ax.tick_params(which="minor", length=0)
    rows, cols = keep_sorted.nonzero(as_tuple=True)
    ax.scatter(cols, rows, s=min(30, 700 / max(G, P)), c="black", marker="o")
    for p in range(P):
        ax.text(G - 0.3, p, f" {int(keep[p].sum())}/{G}", va="center", ha="left", fontsize=8)
    ax.set_xticks([])
    if P <= 40:
        ax.set_yticks(range(P), [_short(prompts[p], 24) if prompts else f"prompt {p}" for p in range(P)], fontsize=8)
    ax.set_xlabel("rollouts of a prompt, sorted by advantage (right: kept / G)", fontsize=9)
    ax.set_title(
        f"{rung} step {int(step)}, {method}: kept {int(keep.sum())} of {P * G} rollouts; "
        f"Var(A) kept {var_kept:.2f} vs full batch {var_all:.2f}",
        fontsize=10,
    )
    signs = [(1.5, "A > 0"), (-1.5, "A < 0"), (0.0, "A = 0")]  # _adv_rgb(0.0) is ZERO
    handles = [Patch(color=[c / 255 for c in _adv_rgb(a)], label=label) for a, label in signs]
    handles.append(plt.Line2D([], [], color="black", marker="o", ls="", markersize=4, label="kept (faded: dropped)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.06, 1), fontsize=8, frameon=False)
    if strip:
        _plot_strip(axes[1], strip, G, prompts, max_tokens)
    height = fig.get_figheight()  # fixed margins in inches: tight_layout would draw the figure twice
    fig.subplots_adjust(left=0.18, right=0.77, top=1 - 0.35 / height, bottom=0.1 / height, hspace=1.1 / grid_h)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    from PIL import Image  # comes with matplotlib

    Image.open(path).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)  # ~3x fewer bytes


def _plot_strip(ax, item, G, prompts, max_tokens):
    """One response as a row of boxes: shade = |A| * H, black outline = selected."""
    from matplotlib.patches import Rectangle

    selected, scores, tokens, marked = item["selected"], item["score"], item["tokens"], item.get("marked")
    n = len(tokens)
    width = min(n, max_tokens)
    counts = [sum(selected[i : i + width]) for i in range(n - width + 1)]
    start = counts.index(max(counts))  # the window with the most selected tokens
    top = max((s for s in scores if math.isfinite(s)), default=0.0) or 1.0
    wide = width <= 32  # room for 3 characters per box, else 1 (plus … when cut)
    for x, t in enumerate(range(start, start + width)):
        shade = 0.85 * max(scores[t], 0) / top if math.isfinite(scores[t]) else 0.0
        face = [(255 + (c - 255) * shade) / 255 for c in SCORE]
        edge, line_width = ("black", 2.4) if selected[t] else ("#ccc", 0.5)  # selected: a thick black outline
        ax.add_patch(Rectangle((x + 0.06, 0.12), 0.88, 0.76, facecolor=face, edgecolor=edge, linewidth=line_width))
        text = _visible_plain(tokens[t])
        room = 3 if wide else 1
        text = text if len(text) <= room else text[: max(room - 1, 1)] + "…"
        ink = "white" if shade > 0.5 else "black"
        ax.text(x + 0.5, 0.5, text, ha="center", va="center", fontsize=9 if wide else 6, family="monospace", color=ink)
        if marked and marked[t]:
            ax.plot(
                [x + 0.15, x + 0.85], [0.03, 0.03], color=[c / 255 for c in MARK], linewidth=3, solid_capstyle="butt"
            )
    p, g = divmod(item["index"], G)
    label = _short(prompts[p], 40) if prompts else f"prompt {p}"
    shown_range = "" if width == n else f", tokens {start}-{start + width - 1} of {n}"
    mark = f"; underlined: {item.get('mark_label') or 'marked'}" if marked and any(marked) else ""
    ax.set(xlim=(0, max(width, 20)), ylim=(0, 1), xticks=[], yticks=[])
    ax.set_aspect("equal", anchor="W")  # square boxes, left-aligned
    ax.set_title(
        f"{label}, rollout {g}{shown_range}\nshade = |A| x H, outlined = selected ({sum(selected)} of {n}){mark}",
        fontsize=8.5,
        loc="left",
    )
    for side in ax.spines.values():
        side.set_visible(False)


def check_grid(**tensors):
    """Each a [P, G] tensor, all of one shape."""
    shape = None
    for name, t in tensors.items():
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        ok = isinstance(t, torch.Tensor) and t.dim() == 2
        d3s.require(ok, name, got, "pass a [P, G] tensor (prompts x rollouts per prompt)")
        d3s.require(shape is None or got == shape, f"{name}.shape", got, f"must equal {shape}, as the other grids")
        shape = got


def _check_shown(item, n):
    ok = isinstance(item, dict) and "index" in item and "tokens" in item
    fix = 'pass dicts {"index": p * G + g, "tokens": [...], "entropy", "score", "selected"}'
    d3s.require(ok, "shown[...]", type(item).__name__, fix)
    i = item["index"]
    d3s.require(isinstance(i, int) and 0 <= i < n, "shown index", i, f"must be an int p * G + g in [0, {n})")
    item = {"entropy": None, "score": None, "selected": None, **item, "tokens": [str(t) for t in item["tokens"]]}
    n_tok = len(item["tokens"])
    for key in ("entropy", "score", "selected", "marked", "notes"):
        value = item.get(key)
        if value is not None:
            value = value.tolist() if isinstance(value, torch.Tensor) else list(value)
            fix = f"must have one value per token ({n_tok})"
            d3s.require(len(value) == n_tok, f"shown[index={i}].{key}", f"{len(value)} values", fix)
            item[key] = value
    return item


def _samples_rule(method):
    return methods.rule_name(method) if method in methods.LADDER else None


def _row_order(adv_row, keep_row):
    """Display order of one row: A descending; among equal A the kept ones toward the nearer end (first if A > 0,
    last otherwise), so max-variance picks read as "the extremes"."""
    side = lambda g: -1 if (float(adv_row[g]) > 0) == bool(keep_row[g]) else 1
    return sorted(range(len(adv_row)), key=lambda g: (-round(float(adv_row[g]), 6), side(g), g))


def _mix(rgb, t, base=(255, 255, 255)):
    return tuple(round(b + (c - b) * t) for c, b in zip(rgb, base))


def _adv_rgb(a):
    """Sign of A as hue (blue > 0, orange < 0, grey = 0); |A| as depth, never too pale to read."""
    if a == 0:
        return ZERO
    return _mix(POSITIVE if a > 0 else NEGATIVE, 0.35 + 0.65 * min(abs(a) / 2.0, 1.0))


def _adv_css(a):
    return "rgb(%d,%d,%d)" % _adv_rgb(a)


def _ink(a):
    return "#fff" if abs(a) >= 0.6 else "#111"


def _score_css(fraction):
    """Background of a token: white -> purple with the score; white text on the darker half."""
    if not math.isfinite(fraction):  # a NaN forward: no shade (the hover shows the value)
        return ""
    shade = 0.85 * max(0.0, min(fraction, 1.0))
    return "background:rgb(%d,%d,%d)" % _mix(SCORE, shade) + (";color:#fff" if shade > 0.5 else "")


def _fmt(value, short=False):
    if not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.2g}" if short else f"{value:.4g}"


def _fmt_adv(a):
    return "0" if a == 0 else (f"{a:+.1f}" if abs(a) < 9.95 else f"{a:+.0f}")


def _short(text, n):
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _visible_plain(piece):
    """Whitespace a reader can see: space ·, newline ↵, tab →, empty ∅, other controls \\xNN."""
    if piece == "":
        return "∅"
    return "".join(
        {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}.get(c, c if c.isprintable() else "\\x%02x" % ord(c)) for c in piece
    )


def _visible(piece):
    """HTML of a token: spaces kept as spaces (the shading shows them), other whitespace as a grey sign."""
    if piece == "":
        return '<span class="ws">∅</span>'
    sign = lambda c: f'<span class="ws">{html.escape(_visible_plain(c))}</span>'
    return "".join(sign(c) if c in "\n\t\r" or not c.isprintable() else html.escape(c) for c in piece)
