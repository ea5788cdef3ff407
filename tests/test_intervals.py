"""Intervals around a median across launches: what each number of launches supports, and its label."""

import pytest

from harness.derive.intervals import IntervalKind, median_interval


def test_one_launch_has_no_interval():
    assert median_interval([350.0]) is None


def test_two_to_four_launches_show_their_range_never_a_ci():
    interval = median_interval([352.0, 340.0, 361.0])
    assert (interval.low, interval.high, interval.kind) == (340.0, 361.0, IntervalKind.RANGE)
    assert interval.label == "range of 3 launches" and "CI" not in interval.label
    assert median_interval([2.0, 1.0, 4.0, 3.0]).label == "range of 4 launches"


def test_five_launches_bootstrap_to_their_range():
    # A bootstrap median of 5 values is the smallest value when 3 or more of the 5 draws are it:
    # P(Binomial(5, 1/5) >= 3) = 10 * 0.2^3 * 0.8^2 + 5 * 0.2^4 * 0.8 + 0.2^5 = 0.0579 > 0.025, so the 2.5%
    # quantile is the smallest value; by symmetry the 97.5% quantile is the largest.
    interval = median_interval([10.0, 12.0, 11.0, 14.0, 13.0])
    assert (interval.low, interval.high, interval.kind) == (10.0, 14.0, IntervalKind.BOOTSTRAP)
    assert interval.label == "95% CI (bootstrap, 5 launches)"


def test_seven_launches_bootstrap_inside_their_range():
    # For 7 values x(1) < ... < x(7), the bootstrap median is <= x(k) when 4 or more draws are <= x(k):
    # k = 1: P(Binomial(7, 1/7) >= 4) = 35 (1/7)^4 (6/7)^3 + 21 (1/7)^5 (6/7)^2 + 7 (1/7)^6 (6/7) + (1/7)^7
    #        = 0.00918 + 0.00092 + 0.00005 + 0.000001 = 0.0102 < 0.025;
    # k = 2: P(Binomial(7, 2/7) >= 4) = 0.0850 + 0.0204 + 0.0027 + 0.0002 = 0.108 > 0.025,
    # so the 95% interval runs from x(2) to x(6).
    interval = median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert (interval.low, interval.high) == (2.0, 6.0)


def test_no_values_is_an_error():
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])
