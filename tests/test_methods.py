"""support/methods.py, the switches of issue 18 (docs/questions.md), with the documented behaviour, and the
defaults stay the paper's method: the schedule kinds, the adaptive rule, the switch rule, DAPO's group
filter as a ladder row, and what each token rule selects under the two scopes."""

import math

import pytest
import torch

import d3s
from support import methods
from d3s import select_samples, select_tokens


def dynamic_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20, kind="linear", history=None):
    """N and K of a schedule kind: d3s.dynamic_schedule at methods.progress."""
    f = methods.progress(kind, step, total_steps, history=history)
    return d3s.dynamic_schedule(step, total_steps, n_init, n_final, k_init, k_final, progress=f)


def method_budget(method, step, total_steps, group_size, kind="linear", history=None):
    """d3s.method_budget of a method by name, on a schedule kind."""
    return d3s.method_budget(
        methods.LADDER[method],
        step=step,
        total_steps=total_steps,
        group_size=group_size,
        progress=methods.progress(kind, step, total_steps, history=history),
    )


def token_scores(adv, entropy, rule, generator=None):
    return d3s.token_scores(adv, entropy, methods.TOKEN_RULES[rule], generator=generator)


def old_linear_schedule(step, total_steps, n_init=8, n_final=32, k_init=0.05, k_final=0.20):
    """dynamic_schedule before it had kinds, copied: the default must still give exactly these numbers."""
    p = min(step / total_steps, 1.0)
    n = int(math.floor(n_init + (n_final - n_init) * p + 0.5))
    k = k_init + (k_final - k_init) * p
    return n, round(k, 12) if k >= 1e-9 else k


# ---------------------------------------------------------------------------------------------
# Question 2: the schedule's shape
# ---------------------------------------------------------------------------------------------
def test_the_default_schedule_is_the_old_linear_one_number_for_number():
    for total in (1, 7, 80, 100, 250):
        for step in range(total + 3):
            for ends in ((8, 32, 0.05, 0.2), (4, 16, 0.05, 0.2), (2, 4, 0.3, 0.5), (32, 8, 0.2, 0.05)):
                assert d3s.dynamic_schedule(step, total, *ends) == old_linear_schedule(step, total, *ends)
                assert dynamic_schedule(step, total, *ends, kind="linear") == old_linear_schedule(step, total, *ends)


@pytest.mark.parametrize(
    "kind, start, middle, end",
    [
        ("linear", (8, 0.05), (20, 0.125), (32, 0.2)),
        ("cosine", (8, 0.05), (20, 0.125), (32, 0.2)),  # the same ends and middle as linear ...
        ("step", (8, 0.05), (32, 0.2), (32, 0.2)),  # the final values from the middle on
        ("constant", (8, 0.05), (8, 0.05), (8, 0.05)),  # the init values throughout
    ],
)
def test_each_schedule_kind_gives_the_stated_n_and_k_at_the_start_the_middle_and_the_end(kind, start, middle, end):
    assert dynamic_schedule(0, 100, kind=kind) == start
    assert dynamic_schedule(50, 100, kind=kind) == middle
    assert dynamic_schedule(100, 100, kind=kind) == end


def test_cosine_is_slower_than_linear_early_and_faster_late():
    assert dynamic_schedule(25, 100, kind="cosine") < dynamic_schedule(25, 100)  # (12, ...) < (14, ...)
    assert dynamic_schedule(75, 100, kind="cosine") > dynamic_schedule(75, 100)
    values = [dynamic_schedule(s, 97, kind="cosine") for s in range(100)]
    assert values == sorted(values)  # monotone


def test_step_switches_at_half_of_training():
    assert dynamic_schedule(49, 100, kind="step") == (8, 0.05)
    assert dynamic_schedule(50, 100, kind="step") == (32, 0.2)


def test_the_adaptive_rule_holds_while_the_signal_rises_and_relaxes_on_a_plateau():
    rising = [0.01 * i for i in range(60)]  # +0.1 per window of 10: never a plateau
    flat = [0.3] * 60  # a plateau from the first full pair of windows (step 20) on: 41 plateau steps
    assert dynamic_schedule(60, 100, kind="adaptive", history=rising) == (8, 0.05)  # the init values
    n, k = dynamic_schedule(60, 100, kind="adaptive", history=flat)  # f = 2 * 41 / 100 = 0.82
    assert n == round(8 + 24 * 0.82) and k == pytest.approx(0.05 + 0.15 * 0.82)
    assert dynamic_schedule(60, 100, kind="adaptive", history=[0.3] * 19) == (8, 0.05)  # too short to tell
    assert dynamic_schedule(0, 10, kind="adaptive", history=flat) == (32, 0.2)  # f is capped at 1
    # rises, then stops: relaxes only after the stop; noise of the same size as the tolerance does not move it much
    rise_then_stop = rising[:30] + [rising[29]] * 30
    assert dynamic_schedule(60, 100, kind="adaptive", history=rise_then_stop)[0] > 8
    assert dynamic_schedule(60, 100, kind="adaptive", history=rise_then_stop) < dynamic_schedule(
        60, 100, kind="adaptive", history=flat
    )


def test_the_adaptive_rule_is_pure_and_reads_only_the_history():
    history = torch.tensor([0.2, 0.4] * 15)  # a tensor works as well as a list
    first = dynamic_schedule(5, 100, kind="adaptive", history=history)
    assert first == dynamic_schedule(90, 100, kind="adaptive", history=history.tolist())  # `step` is not read
    assert first == dynamic_schedule(5, 100, kind="adaptive", history=history)  # no state between calls


def test_schedule_kind_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"^kind='cubic': choose one of linear, cosine, step, constant, adaptive"):
        dynamic_schedule(0, 10, kind="cubic")
    with pytest.raises(ValueError, match=r"^history=None: kind='adaptive' needs"):
        dynamic_schedule(0, 10, kind="adaptive")
    with pytest.raises(ValueError, match=r"^history=\[nan\]"):
        dynamic_schedule(0, 10, kind="adaptive", history=[0.1, float("nan")])


def test_method_budget_passes_the_kind_to_the_scheduled_rows_only():
    for method in ("d3s", "d3s-i"):
        assert method_budget(method, 25, 100, 32, kind="step") == (8, 0.05)
        assert method_budget(method, 25, 100, 32, kind="adaptive", history=[0.5] * 30) == dynamic_schedule(
            25, 100, kind="adaptive", history=[0.5] * 30
        )
    assert method_budget("random", 60, 100, 32, kind="step") == (32, 1.0)
    for static in ("d1s", "d1s-cross", "d2s", "pods"):  # the static rows keep the linear midpoint whatever the kind
        assert method_budget(static, 0, 100, 32, kind="step") == method_budget(static, 0, 100, 32)
    assert method_budget("grpo", 0, 100, 32, kind="constant") == (32, 1.0)


# ---------------------------------------------------------------------------------------------
# Question 5: the switch rule from cross- to intra-group samples
# ---------------------------------------------------------------------------------------------
def noisy_norms(steps, seed, sd=0.2):
    """Gradient norms of a healthy run: 1.5 times a log-normal factor (sd 0.2, about the spread of the tiny rung's
    default start, whose largest norm / median was 1.6-1.8)."""
    gen = torch.Generator().manual_seed(seed)
    return (1.5 * torch.exp(sd * torch.randn(steps, generator=gen))).tolist()


def test_the_switch_rule_fires_on_a_synthetic_spike_from_the_step_after_it():
    norms = noisy_norms(100, seed=0)
    norms[60] = 5 * norms[59]  # a spike
    rows = [methods.switch_to_intra("d3s", norms[:s], 3.0) for s in range(101)]  # the row of step s + 1, after s steps
    assert rows[:61] == ["d3s"] * 61  # up to and including the spiking step itself
    assert rows[61:] == ["d3s-i"] * 40  # for good, though the norms are back to normal
    assert methods.switch_to_intra("d1s-cross", norms, 3.0) == "d1s"


@pytest.mark.parametrize("seed", range(20))
def test_the_switch_rule_does_not_fire_on_noise(seed):
    norms = noisy_norms(100, seed)
    norms[30:40] = [0.0] * 10  # ten steps with no signal (no group with spread) then a normal one: not a spike
    norms[45] = None  # a step with no finite norm
    assert methods.switch_to_intra("d3s", norms, 3.0) == "d3s"


def test_spike_ratios_leave_out_the_steps_with_no_signal():
    norms = [1.0] * 10 + [0.0] * 3 + [2.0, None, 3.5]
    ratios = methods.spike_ratios(norms)
    assert ratios[:13] == [None] * 13 and ratios[14] is None  # too early, or no signal
    assert ratios[13] == 2.0 and ratios[15] == pytest.approx(3.5 / 1.0)  # medians over the steps with signal only
    assert methods.spike_ratios([0.0] * 12) == [None] * 12  # nothing to compare with: never a spike
    assert methods.spike_ratios([1.0] * 10 + [float("nan"), 2.0]) == [None] * 11 + [2.0]  # a skipped update: no signal


def test_the_switch_rule_is_off_by_default_and_only_moves_cross_group_rows():
    spiky = [1.0] * 10 + [10.0]
    for off in (None, 0, 0.0):
        assert methods.switch_to_intra("d3s", spiky, off) == "d3s"  # off: the paper's method
    for row in ("grpo", "d1s", "d2s", "d3s-i", "pods", "dapo-filter-k"):  # no intra-group twin, or intra already
        assert methods.switch_to_intra(row, spiky, 3.0) == row
    assert methods.INTRA_TWIN == {"d3s": "d3s-i", "d1s-cross": "d1s"}
    for cross, intra in methods.INTRA_TWIN.items():  # the twin differs only in its sample rule
        assert d3s.LADDER[cross].samples == "cross" and d3s.LADDER[intra].samples == "intra"
        assert d3s.LADDER[cross][1:] == d3s.LADDER[intra][1:]


def test_switch_rule_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"^ratio=0\.5: must be > 1"):
        methods.switch_to_intra("d3s", [1.0] * 11, 0.5)
    with pytest.raises(ValueError, match=r"^ratio=nan"):
        methods.switch_to_intra("d3s", [1.0] * 11, float("nan"))
    with pytest.raises(ValueError, match=r"^window=0"):
        methods.spike_ratios([1.0], window=0)


# ---------------------------------------------------------------------------------------------
# Question 7: DAPO's filter as a sample-level row
# ---------------------------------------------------------------------------------------------
def test_the_dapo_filter_rows_are_in_the_ladder_with_grpos_and_d3ss_token_levels():
    assert methods.LADDER["dapo-filter"] == (methods.dapo_filter, "all", "all")  # tokens as GRPO: every token
    assert methods.LADDER["dapo-filter-k"] == (
        methods.dapo_filter,
        "all",
        "schedule",
    )  # tokens as D3S: top K on K's schedule
    assert methods.rule_name("dapo-filter") == methods.rule_name("dapo-filter-k") == "mixed"


@pytest.mark.parametrize("method", ["dapo-filter", "dapo-filter-k"])
def test_the_dapo_filter_keeps_exactly_the_groups_whose_rewards_are_not_all_equal(method):
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0], [0.5, 0.5, 0.2, 0.5]])
    keep, adv = select_samples(rewards, 2, methods.LADDER[method].samples)  # n_keep is not used
    assert keep.tolist() == [[True] * 4, [False] * 4, [False] * 4, [True] * 4, [True] * 4]
    torch.testing.assert_close(adv, d3s.group_advantages(rewards) * keep)  # full-group A
    assert d3s.usefulness_rate(adv, keep) == 1.0  # 0/1 rewards: every kept rollout has A != 0
    assert (
        int(select_samples(torch.ones(3, 4), 2, methods.LADDER[method].samples)[0].sum()) == 0
    )  # no group with spread: nothing kept


def test_the_dapo_filter_keeps_the_same_rollouts_as_grpo_minus_the_groups_without_signal():
    gen = torch.Generator().manual_seed(3)
    rewards = (torch.rand(16, 8, generator=gen) < 0.3).float()
    keep, adv = select_samples(rewards, 8, methods.dapo_filter)
    grpo_keep, grpo_adv = select_samples(rewards, 8, "all")
    assert torch.equal(adv, grpo_adv)  # the dropped groups had A = 0 anyway: the same gradient direction
    assert torch.equal(keep, grpo_keep & (grpo_adv != 0).any(-1, keepdim=True))


def test_the_dapo_filter_budget_has_no_n_and_its_k_follows_the_schedule():
    assert method_budget("dapo-filter", 0, 100, 16) == (16, 1.0)
    assert method_budget("dapo-filter-k", 0, 100, 16) == (16, 0.05)  # N_final = 32 > G = 16 is no error: no N
    assert method_budget("dapo-filter-k", 100, 100, 16) == (16, 0.2)
    assert method_budget("dapo-filter-k", 25, 100, 16, kind="step") == (16, 0.05)


def test_an_empty_kept_set_goes_through_the_token_level():
    adv, entropy, mask = torch.zeros(0), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool)
    for rule in methods.TOKEN_RULES:
        scores = token_scores(adv, entropy, rule, generator=torch.Generator().manual_seed(0))
        for scope in ("batch", "sequence"):
            assert select_tokens(scores, mask, 0.05, scope=scope).shape == (0, 5)


# ---------------------------------------------------------------------------------------------
# Question 3: with outcome rewards A is constant within a response, so each rule under each scope
# ---------------------------------------------------------------------------------------------
ADV = torch.tensor([2.0, 0.5, 0.0])  # one advantage per response
ENTROPY = torch.tensor([[0.1, 0.2, 0.3, 0.8], [1.0, 2.0, 3.0, 4.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.ones(3, 4, dtype=torch.bool)


def kept(rule, scope, k=0.25, seed=0):
    return (
        select_tokens(
            token_scores(ADV, ENTROPY, rule, generator=torch.Generator().manual_seed(seed)), MASK, k, scope=scope
        )
        .int()
        .tolist()
    )


def test_batch_scope_adv_entropy_weighs_the_entropy_by_the_responses_advantage():
    # 3 of 12 tokens: the best |A| * H are 2.0 and 1.5 in response 2 and 1.6 in response 1; response 3 (A = 0) scores 0
    assert kept("adv-entropy", "batch") == [[0, 0, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]]


def test_batch_scope_entropy_alone_picks_the_uncertain_tokens_even_of_a_response_with_a_0():
    rows = kept("entropy", "batch")
    assert sum(rows[0]) == sum(rows[1]) == 0 and sum(rows[2]) == 3  # 3 of the 4 tokens of H = 9, where A = 0


def test_batch_scope_adv_alone_picks_whole_responses_by_advantage():
    rows = kept("adv", "batch", k=0.5)  # 6 of 12: all 4 tokens of response 1 (|A| = 2), then 2 of response 2
    assert rows[0] == [1, 1, 1, 1] and sum(rows[1]) == 2 and rows[2] == [0, 0, 0, 0]


def test_sequence_scope_makes_adv_entropy_and_entropy_the_same_ranking():
    """Within one response |A| is a constant factor: the per-response top K is the top K by entropy."""
    for k in (0.25, 0.5, 0.75):
        assert kept("adv-entropy", "sequence", k)[:2] == kept("entropy", "sequence", k)[:2]
    assert kept("adv-entropy", "sequence")[:2] == [[0, 0, 0, 1], [0, 0, 0, 1]]  # each response's top-entropy token
    # In a response with A = 0, |A| * H ties every token at 0: its K tokens are the first ones, and carry no gradient
    assert kept("adv-entropy", "sequence")[2] == [1, 0, 0, 0]


def test_sequence_scope_adv_alone_is_random_within_each_response():
    picks = {tuple(map(tuple, kept("adv", "sequence", seed=s))) for s in range(20)}
    assert len(picks) > 1 and all(sum(map(sum, p)) == 3 for p in picks)  # one token per response, its place at random
