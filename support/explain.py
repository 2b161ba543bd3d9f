"""support/explain.py: one training step on one page: which rollouts and which tokens get the gradient.

D3S is about a choice: which rollouts of a batch are trained on (the sample level), and which of their tokens (the
token level). metrics.jsonl only counts them; a page draws one step so that a reader can point at it. Each rung calls
its page with its step's record (every --explain-every steps and step 1):

    toy_page       toy/bandit.py's: a toy "token" is a position, the decision positions marked
    small_page     train_small.py's (train_small.Selection)
    full_page      train_full.py's, from the global selection (train_full.Selection), rank 0 writing

Each picks a few rollouts to show token by token (pick_rollouts) and hands them to page.write_step, which draws the
P x G grid and their tokens as HTML and PNG (support/page.py). Draws no random number; changes no number of the run.
Left out on purpose: the whole batch at token level (a few rollouts bound the cost at any scale).
"""

import os

import torch

import d3s
from support.page import check_grid, write_step


def pick_rollouts(adv, keep, n_high=2, n_low=2, n_dropped=1):
    """Flat indices p * G + g of the rollouts worth showing token by token, deterministic: the n_high
    highest-advantage kept rollouts (descending), the n_low lowest-advantage kept ones (ascending), then n_dropped
    dropped ones: the first rollout of each group that lost all its rollouts when some did, else the dropped rollouts
    with the largest |A|. Ties go to a prompt not shown yet, then to the lower index, so equal advantages (0/1
    rewards) spread over prompts. Fewer come back when there are fewer to show. adv, keep: [P, G] (the advantages to
    display and the kept mask).

    >>> adv = torch.tensor([[1., -1., 0., 0.], [2., -.5, -.5, -1.], [0., 0., 0., 0.]])
    >>> keep = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]).bool()
    >>> pick_rollouts(adv, keep)  # A = 2 and 1, then A = -1 twice, then row 3 (no spread)
    [4, 0, 1, 7, 8]
    """
    check_grid(adv=adv, keep=keep)
    P, G = adv.shape
    values, kept = adv.double().reshape(-1).tolist(), keep.reshape(-1).tolist()
    chosen, shown_prompts = [], {}

    def take(candidates, key, count):
        candidates = [i for i in candidates if i not in chosen]
        for _ in range(min(count, len(candidates))):  # greedy: best key, then an unseen prompt, then index
            best = min(candidates, key=lambda i: (round(key(i), 9), shown_prompts.get(i // G, 0), i))
            candidates.remove(best)
            chosen.append(best)
            shown_prompts[best // G] = shown_prompts.get(best // G, 0) + 1

    kept_ids = [i for i in range(P * G) if kept[i]]
    take(kept_ids, lambda i: -values[i], n_high)
    take(kept_ids, lambda i: values[i], n_low)
    empty_rows = [p for p in range(P) if not any(kept[p * G : (p + 1) * G])]
    if empty_rows:  # the first rollout of each group that lost everything
        take([p * G for p in empty_rows], lambda i: 0.0, n_dropped)
    else:
        take([i for i in range(P * G) if not kept[i]], lambda i: -abs(values[i]), n_dropped)
    return chosen


def toy_page(args, v):
    """toy/bandit.py's page of a step; v: the step's record (toy/bandit.py's run). A toy token shows its id, and
    a mark on the decision positions (the ones the reward reads)."""
    G, task = args.group_size, v.task
    extra = {
        "loss": v.loss.item(),
        f"loss normalizer ({args.normalizer} tokens)": int(v.normalizer or v.token_keep.sum()),
        "grad norm (before clipping)": float(v.grad_norm),
    }
    shown_adv = torch.where(v.keep, v.adv, d3s.group_advantages(v.rewards))  # the loss's A on kept, group A elsewhere
    row_of = {int(i): r for r, i in enumerate(v.kept.tolist())}  # flat index -> row of the forwarded batch
    shown = []
    for i in pick_rollouts(shown_adv, v.keep):
        prompt, r, ids = int(v.prompts[i // G]), row_of.get(i), v.tokens[i].tolist()
        decisions, answers = task["decisions"][prompt].tolist(), task["answers"][prompt].tolist()
        right = lambda a, t: f"decision: the right token is {a}, this one is {'right' if t == a else 'wrong'}"
        notes = [right(a, t) if d else "filler: the reward ignores it" for d, a, t in zip(decisions, answers, ids)]
        item = {"index": i, "tokens": [str(t) for t in ids], "marked": decisions, "notes": notes}
        item["mark_label"] = "decision position (the reward reads it)"
        if r is not None:  # forwarded: its entropy, score and selection
            item.update(entropy=v.entropy[r].tolist(), score=v.scores[r].tolist(), selected=v.token_keep[r].tolist())
        shown.append(item)
    n = lambda p: int(task["decisions"][p].sum())
    labels = [f"prompt {p}: {n(p)} decision{'' if n(p) == 1 else 's'}" for p in v.prompts.tolist()]
    write_step(
        os.path.join(args.out, "explain", f"{v.method}_seed{v.seed}"),
        step=v.step,
        rung="toy",
        method=v.method,
        rewards=v.rewards,
        adv=shown_adv,
        keep=v.keep,
        n_keep=v.n_keep,
        k_frac=v.k_frac,
        k_real=float(v.token_keep.sum() / v.token_keep.numel()),
        shown=shown,
        prompts=labels,
        extra=extra,
    )


def small_page(step, tokenizer, problems, rollouts, rewards, sel, *, entropy, metrics, args):
    """train_small.py's page of a step (OUT/explain/step_N.html): sel, its train_small.Selection; entropy, pass 1's
    [B, T]; metrics, its train line."""
    shown_adv = torch.where(sel.keep, sel.adv, d3s.group_advantages(rewards))  # the loss's A on kept cells (pods)
    row_of = {int(i): r for r, i in enumerate(sel.kept_rows.tolist())}  # p * G + g -> row of the kept batch
    shown = []
    for i in pick_rollouts(shown_adv, sel.keep):
        n = int(rollouts["response_mask"][i].sum())  # response tokens up to and including the first EOS
        item = {"index": i, "tokens": [tokenizer.decode([t]) for t in rollouts["response_ids"][i, :n].tolist()]}
        if (r := row_of.get(i)) is not None:  # forwarded: its entropy, score and selection
            item.update(entropy=entropy[r, :n].tolist(), score=sel.scores[r, :n].tolist())
            item["selected"] = sel.token_keep[r, :n].tolist()
        shown.append(item)
    return png_of(
        write_step(
            os.path.join(args.out, "explain"),
            step=step,
            rung="train_small",
            method=sel.method_row,
            rewards=rewards,
            adv=shown_adv,
            keep=sel.keep,
            n_keep=sel.n_keep,
            k_frac=sel.k_frac,
            k_real=metrics["k_real"],
            shown=shown,
            prompts=[r["problem"] for r in problems],
            extra={
                **_switched(args.method, sel.method_row),
                "loss (mean over mini-batches)": metrics["loss"],
                "grad norm (before clipping)": metrics["grad_norm"],
                "tokens in the loss": metrics["kept_tokens"],
                "mini-batches": args.mini_batches,
            },
        )
    )


def full_page(step, rollouts, problems, sel, entropy, stats, *, tokenizer, notices, world, args):
    """train_full.py's page of a step, rank 0's, from the global selection (sel: its train_full.Selection;
    rollouts, problems: this rank's share). The few rollouts it shows (pick_rollouts on the global batch: the same
    choice on every rank) are gathered on rank 0 with their token ids and, when forwarded, entropy, score and
    selection: a few rollouts, never the batch. Every rank calls it (gather_object); a full disk is noted in
    `notices` (every rank stops at its agree())."""
    import torch.distributed as dist

    G = sel.keep_all.shape[1]
    local_row = {sel.kept_all[g][0] * G + sel.kept_all[g][1]: r for g, r in sel.row_of.items()}  # p * G + g -> row
    scores = d3s.token_scores(sel.kept_adv, entropy)
    shown_adv = torch.where(sel.keep_all, sel.adv_all, d3s.group_advantages(sel.rewards_all))  # the loss's A on kept
    picked, mine = pick_rollouts(shown_adv, sel.keep_all), []
    for index in picked:
        p, g = divmod(index, G)
        if (r := local_row.get(index)) is not None:  # forwarded here: its row of entropy / scores / selection
            n = len(sel.seqs[r]["response_ids"])
            item = {"index": index, "ids": list(sel.seqs[r]["response_ids"]), "entropy": entropy[r, :n].tolist()}
            mine.append({**item, "score": scores[r, :n].tolist(), "selected": sel.token_keep[r, :n].tolist()})
        elif not sel.keep_all[p, g] and sel.first <= p < sel.first + len(rollouts):  # dropped: only its home rank
            mine.append({"index": index, "ids": list(rollouts[p - sel.first][g]["response_ids"])})
    parts = [None] * world.size if world.is_main else None
    dist.gather_object((mine, [problem["problem"] for _, problem in problems]), parts, dst=0)
    if not world.is_main:
        return
    items = sorted((item for part, _ in parts for item in part), key=lambda item: picked.index(item["index"]))
    for item in items:
        item["tokens"] = [tokenizer.decode([t]) for t in item.pop("ids")]
    with notices.writing(os.path.join(args.out, "explain")):
        return png_of(
            write_step(
                os.path.join(args.out, "explain"),
                step=step,
                rung="train_full",
                method=sel.method_row,
                rewards=sel.rewards_all,
                adv=shown_adv,
                keep=sel.keep_all,
                n_keep=stats["n_keep"],
                k_frac=stats["k_frac"],
                k_real=stats["k_real"],
                shown=items,
                prompts=[text for _, texts in parts for text in texts],
                extra={
                    **_switched(args.method, sel.method_row),
                    "loss (mean over optimizer steps)": stats["loss"],
                    "tokens in the loss": stats["kept_tokens"],
                    "grad norm (before clipping)": stats["grad_norm"],
                    "ranks": world.size,
                },
            )
        )


def png_of(html):
    """The figure beside a page (write_step's .png), for the trackers' image of the step; None if it was not drawn."""
    png = os.path.splitext(html)[0] + ".png" if html else None
    return png if png and os.path.exists(png) else None


def _switched(method, method_row):
    """The summary's line when --switch-on-spike moved --method to its twin (the row that selected)."""
    return {} if method_row == method else {"--switch-on-spike": f"fired: --method {method} runs as {method_row}"}
