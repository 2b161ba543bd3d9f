"""experiments/stats.py: the statistics every experiment reports, on scipy.

A method against a reference is compared seed by seed (same task, start and data order): the mean of the paired
differences with a 95% Student-t interval, and a verdict that needs the interval, as printed, to exclude 0.
"""

import math


def mean_std(values):
    """(mean, sample std); the std of one value is 0."""
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / max(len(values) - 1, 1))


def paired_interval(diffs, level=0.95):
    """(mean, lower, upper) of paired differences: mean ± t_{(1+level)/2, n-1} * sd / sqrt(n) (scipy's one-sample t
    interval); no bounds for n < 2, and the mean itself when every difference is the same.

    >>> [round(x, 4) for x in paired_interval([0.1, 0.2, -0.05, 0.3])]
    [0.1375, -0.1001, 0.3751]
    """
    from scipy import stats

    m = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return m, None, None
    if max(diffs) == min(diffs):  # sd 0: scipy would return nan bounds
        return m, m, m
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(level)
    return m, float(ci.low), float(ci.high)


def excludes_zero(lower, upper, fmt):
    """Does the interval exclude 0 as printed with `fmt`? [+0.000, +0.053] is read as touching 0, as a reader sees
    it: the verdict never rests on a digit the table does not show."""
    return lower is not None and (float(fmt % lower) > 0 or float(fmt % upper) < 0)


def crossing(xs, ys, target):
    """The first x at which the piecewise-linear curve through (xs, ys) reaches `target`, linearly interpolated
    between the two points around it; None if it never does."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target - 1e-12:
            if i == 0 or y == ys[i - 1]:
                return float(x)
            return xs[i - 1] + (x - xs[i - 1]) * (target - ys[i - 1]) / (y - ys[i - 1])
    return None
