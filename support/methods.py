"""support/methods.py: which rollouts and tokens a method keeps, and its N and K at a step.

d3s.py holds the papers' method. Every rung takes --method from LADDER here: d3s.LADDER's rows and a few more, for
the questions a summary of the paper leaves open (docs/questions.md) and two controls, in d3s.py's terms:

    LADDER        d3s.LADDER + random (a control) + DAPO's filter (dapo-filter, dapo-filter-k); NAMES its names
    TOKEN_RULES   the token score: |A| * H (the abstract's), H alone, |A| alone, random (a control)
    progress      the shape of the schedule: linear (a summary's), cosine, step, constant, adaptive
    switch_to_intra   the switch rule: a cross-group row moves to its intra-group twin at a gradient spike
    budget        N and K of a row at a step, from a rung's flags (d3s.method_budget); check_flags, their checks
    flags         the flags of these knobs (--schedule, --token-rule, ...): a rung adds the ones it runs

A rung calls d3s.select_samples(rewards, N, row.samples), which runs a rule given as a function here;
d3s.token_scores takes TOKEN_RULES' functions the same way.
"""

import itertools
import math
import statistics

import torch

from support import cli
import d3s


# === Sample rules: a uniform N per group (a control), and DAPO's group filter =========================================
def uniform_samples(rewards, n_keep, scale=True, eps=1e-6, generator=None):
    """Per group, n_keep of G drawn uniformly (a control, not in the paper); full-group A on the kept.

    >>> uniform_samples(torch.tensor([[1., 0., 0., 0.]]), 2, generator=torch.Generator().manual_seed(0))[0].sum().item()
    2
    """
    adv = d3s.group_advantages(rewards, scale=scale, eps=eps)
    P, G = rewards.shape
    ok = isinstance(n_keep, int) and 1 <= n_keep <= G
    d3s.require(ok, "n_keep", n_keep, f"must be an int in [1, G={G}] (rollouts kept per prompt); raise G or lower N")
    noise = torch.rand(P, G, generator=generator).to(rewards.device)  # CPU generator, any device
    keep = torch.zeros(P, G, dtype=torch.bool, device=rewards.device).scatter_(1, noise.argsort(-1)[:, :n_keep], True)
    return keep, adv * keep


def dapo_filter(rewards, n_keep=None, scale=True, eps=1e-6, generator=None):
    """DAPO's dynamic-sampling filter without its oversampling: every rollout of each group whose rewards are
    not all equal (0 < #correct < G for 0/1 rewards), with full-group A. n_keep is not used: the kept count
    varies, and a step with no group with spread keeps nothing (it has no token to train on).

    >>> dapo_filter(torch.tensor([[1., 0., 0., 0.], [1., 1., 1., 1.]]))[0]
    tensor([[ True,  True,  True,  True],
            [False, False, False, False]])
    """
    adv = d3s.group_advantages(rewards, scale=scale, eps=eps)
    spread = rewards.amax(-1, keepdim=True) > rewards.amin(-1, keepdim=True)  # [P, 1]
    keep = spread.expand(*rewards.shape).clone()
    return keep, adv * keep


LADDER = {
    **d3s.LADDER,
    "random": d3s.Row(uniform_samples, "schedule", "all"),  # control: a uniform N of G on D3S's schedule
    "dapo-filter": d3s.Row(dapo_filter, "all", "all"),  # DAPO's filter: the groups with spread, every token
    "dapo-filter-k": d3s.Row(dapo_filter, "all", "schedule"),  # ... with D3S's token level on K's schedule
}
NAMES = tuple(LADDER)  # the --method choices
RULE_NAMES = {uniform_samples: "random", dapo_filter: "mixed"}  # the samples rule's name in metrics.jsonl


def rule_name(method):
    """The name of a method's samples rule, as metrics.jsonl logs it (sample_rule): "cross", "intra", ...

    >>> rule_name("d3s"), rule_name("dapo-filter")
    ('cross', 'mixed')
    """
    samples = LADDER[method].samples
    return RULE_NAMES.get(samples, samples)


def selects_tokens(method):
    """Whether the method keeps only the top K of the tokens (its K is not "all")."""
    return LADDER[method].k != "all"


# === Token rules: what select_tokens ranks by, besides the abstract's |A| * H (d3s.token_scores' rule=None) ===========
def entropy_only(abs_adv, entropy, generator=None):
    """H alone: the high-entropy "minority tokens" rule of Wang et al. 2025 (80/20)."""
    return entropy.float().clone()


def advantage_only(abs_adv, entropy, generator=None):
    """|A| alone, ties at random: with outcome rewards A is constant in a response, so this picks responses.
    (1e-6 of the largest |A| of noise never reorders distinct |A|.)"""
    noise = torch.rand(entropy.shape, generator=generator).to(entropy.device)  # CPU generator, any device
    largest = abs_adv.max().clamp(min=1e-30) if abs_adv.numel() else 1.0  # no rollout kept: nothing to rank
    return abs_adv.expand(entropy.shape) + noise * 1e-6 * largest


def random_scores(abs_adv, entropy, generator=None):
    """Uniform noise: a control."""
    return torch.rand(entropy.shape, generator=generator).to(entropy.device)


TOKEN_RULES = {"adv-entropy": None, "entropy": entropy_only, "adv": advantage_only, "random": random_scores}


# === Schedules: the curve N and K follow from init (f = 0) to final (f = 1), p = step / total_steps ===================
SCHEDULES = ("linear", "cosine", "step", "constant", "adaptive")  # "linear" is a summary's (the design card)


def progress(kind, step, total_steps, history=None):
    """f for d3s.dynamic_schedule(progress=f) (open question 2 of a summary of the paper, docs/questions.md):
      "linear"    f = p                        a summary's
      "cosine"    f = (1 - cos(pi * p)) / 2    slow at both ends, fastest at the middle
      "step"      f = 0 for p < 1/2, else 1    the init values for the first half, the final ones after
      "constant"  f = 0                        the init values throughout (the aggressive end)
      "adaptive"  f = min(1, 2 * plateaus / total_steps): hold N and K while the signal rises; each step on
                  which it has plateaued (mean of its last 10 values - mean of the 10 before < 0.02)
                  relaxes them by two linear steps. history: the signal of the steps so far (the rungs pass
                  the train reward of steps 1..s-1); `step` is not read.

    >>> [d3s.dynamic_schedule(25, 100, progress=progress(k, 25, 100))[0] for k in ("linear", "cosine", "step", "constant")]
    [14, 12, 8, 8]
    >>> d3s.dynamic_schedule(0, 100, progress=progress("adaptive", 0, 100, history=[0.5] * 30))  # 11 plateaus: f = 0.22
    (13, 0.083)
    """
    d3s.require(kind in SCHEDULES, "kind", kind, f"choose one of {', '.join(SCHEDULES)}")
    p = min(step / total_steps, 1.0)
    curves = {"linear": p, "cosine": (1 - math.cos(math.pi * p)) / 2, "step": 0.0 if p < 0.5 else 1.0, "constant": 0.0}
    if kind in curves:
        return curves[kind]
    d3s.require(history is not None, "history", history, "kind='adaptive' needs the signal's past values (a list)")
    return min(1.0, 2 * _plateaus(history, 10, 0.02) / total_steps)


def _plateaus(history, window, tol):
    """How many steps of `history` ended on a plateau: the mean of their last `window` values minus the mean
    of the `window` before is below `tol`. Steps with fewer than 2 * window values before them never do.

    >>> _plateaus([0.5] * 12, 5, 0.02), _plateaus([0.1 * i for i in range(12)], 5, 0.02)
    (3, 0)
    """
    values = [float(v) for v in history]
    bad = [v for v in values if not math.isfinite(v)]
    d3s.require(not bad, "history", bad[:4], "must be finite (the signal of each past step)")
    prefix = list(itertools.accumulate(values, initial=0.0))
    mean = lambda a, b: (prefix[b] - prefix[a]) / window  # the mean of values[a:b]
    return sum(mean(j - window, j) - mean(j - 2 * window, j - window) < tol for j in range(2 * window, len(values) + 1))


# === The switch rule (open question 1 of a summary of the paper, docs/questions.md question 5; off by default) ========
# The paper found cross-group D3S unstable from an unaligned start and D3S-I stable. A run that starts
# cross-group can move to its intra-group twin, for good, at the first gradient-norm spike.
INTRA_TWIN = {"d3s": "d3s-i", "d1s-cross": "d1s"}  # cross-group row -> the same row with samples "intra"


def spike_ratios(grad_norms, window=10):
    """Per step: its gradient norm / the median of the norms of the `window` steps before it. None where there
    is no ratio: the first `window` steps, and a step with no signal (norm 0 or None: nothing trained; or not
    finite: a skipped update), which is also left out of the medians of later steps.

    >>> spike_ratios([1.0, 2.0, 0.0, 1.0, 9.0], window=2)
    [None, None, None, 0.5, 9.0]
    """
    d3s.require(isinstance(window, int) and window >= 1, "window", window, "must be an int >= 1")
    signal = lambda x: x is not None and x != 0 and math.isfinite(x)
    ratios = []
    for i, g in enumerate(grad_norms):
        before = [x for x in grad_norms[max(0, i - window) : i] if signal(x)]  # the steps with signal
        ratios.append(g / max(statistics.median(before), 1e-12) if i >= window and signal(g) and before else None)
    return ratios


def switch_to_intra(method, grad_norms, ratio, window=10):
    """The row this step runs under the switch rule: a cross-group row (d3s, d1s-cross) runs as its
    intra-group twin (d3s-i, d1s) from the step after the first spike to the end, a step whose gradient norm
    (before clipping) is over `ratio` x the median of the `window` steps before it (spike_ratios).
    grad_norms: the norms of the steps taken so far. ratio None or 0: off, as the sources describe D3S. Any other
    row, or no spike yet: `method` itself. Pure: the same norms give the same row.

    >>> switch_to_intra("d3s", [1.0] * 10 + [1.2], 3.0), switch_to_intra("d3s", [1.0] * 10 + [4.0], 3.0)
    ('d3s', 'd3s-i')
    """
    if not ratio or method not in INTRA_TWIN:
        return method
    ok = math.isfinite(ratio) and ratio > 1
    d3s.require(
        ok, "ratio", ratio, "must be > 1 (a spike is a norm over ratio x its median); 0 or None turns the rule off"
    )
    spiked = any(r is not None and r > ratio for r in spike_ratios(list(grad_norms), window))
    return INTRA_TWIN[method] if spiked else method


# === N and K at a step, from a rung's flags ===========================================================================
def budget(args, method_row, step, history=None):
    """(N, K) of the LADDER row `method_row` at step `step` (from 1) of a run: d3s.method_budget at step - 1 of --steps,
    with the rung's --group-size, --n-init, --n-final, --k-init, --k-final, --static-n, --static-k and, where
    the rung has one, --schedule (progress; `history`: the train reward of the steps before)."""
    f = progress(getattr(args, "schedule", "linear"), step - 1, args.steps, history=history)
    return d3s.method_budget(
        LADDER[method_row], step=step - 1, total_steps=args.steps, group_size=args.group_size, progress=f, **_nk(args)
    )


def _nk(args):
    """The rung's N and K flags, as d3s.method_budget's keywords."""
    return {name: getattr(args, name) for name in ("n_init", "n_final", "k_init", "k_final", "static_n", "static_k")}


def check_flags(p, args, methods, flag="--method"):
    """The method and budget flags every rung shares, checked together (one line and exit 2 through p.error): each
    method a row of LADDER; N <= G wherever a row uses N; --switch-on-spike only where a row has an intra-group
    twin. Returns (static N, static K): --static-n and --static-k, by default the linear schedule's midpoint (choice).
    """
    for m in methods:
        if m not in LADDER:
            p.error(f"{flag} {m!r}: unknown method; choose from {', '.join(NAMES)}")
    uses_n = any(LADDER[m].n != "all" for m in methods)  # N counts rollouts kept per prompt: N <= G
    for name, value in (
        ("--n-init", args.n_init if uses_n else None),
        ("--n-final", args.n_final if uses_n else None),
        ("--static-n", args.static_n),
    ):  # a --static-n given over G is refused whatever the method
        if value is not None and value > args.group_size:
            p.error(
                f"{name} {value} > --group-size {args.group_size}: N counts rollouts kept per prompt and must be "
                f"<= G; lower {name} or raise --group-size"
            )
    if getattr(args, "switch_on_spike", 0) and not any(m in INTRA_TWIN for m in methods):
        p.error(
            f"--switch-on-spike {args.switch_on_spike:g}: moves a cross-group row to its intra-group twin "
            f"({', '.join(f'{a} -> {b}' for a, b in INTRA_TWIN.items())}); {', '.join(methods)} has none: "
            "use --method d3s or d1s-cross, or drop the flag"
        )
    G = max(args.group_size, args.n_init, args.n_final)
    return d3s.method_budget(d3s.LADDER["d2s"], step=0, total_steps=1, group_size=G, **_nk(args))


# === Their flags: a rung adds the ones it runs with one call, *methods.flags("--schedule", ...) (cli.flag entries) ====
FLAGS = [
    cli.flag(
        "--schedule",
        "linear",
        SCHEDULES,
        "N and K from init to final: linear (a summary's), cosine, step, constant, adaptive (methods.progress)",
    ),
    cli.flag(
        "--token-rule",
        "adv-entropy",
        list(TOKEN_RULES),
        "token score: adv-entropy (|A| * H, the abstract's), entropy, adv, random (methods.TOKEN_RULES)",
    ),
    cli.flag(
        "--token-scope",
        "batch",
        ["batch", "sequence"],
        "top-K tokens over the batch or within each response (sequence) (choice)",
    ),
    cli.flag(
        "--switch-on-spike",
        0.0,
        cli.number(float, 1, low_open=True, what="0 (off) or a number > 1", also=(0,)),
        "the switch rule (methods.switch_to_intra): a cross-group row selects within groups from the step "
        "after the first grad-norm spike over this x the median of the 10 steps before; 0: off, as the sources describe D3S "
        "method",
    ),
    cli.flag("--min-token-per-response", False, bool, "every kept response keeps its best token (off: plain top-K%%)"),
]


def flags(*names):
    """The FLAGS named, in that order: each rung adds the knobs its loop runs.

    >>> [name for name, _ in flags("--token-scope", "--schedule")]
    ['--token-scope', '--schedule']
    """
    declared = dict(FLAGS)
    return [(name, declared[name]) for name in names]
