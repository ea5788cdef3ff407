"""Mann & Whitney (1947)'s exact distribution of U, the number of pairs in which one side's value lies above the
other's, for exchangeable values: what the regression gate's test (harness.derive.gate) and the harness overhead's
interval (harness.derive.harness_overhead) are computed from. Torch-free.
"""

from __future__ import annotations

import functools
from math import comb


@functools.cache
def orderings_by_pairs(n_low: int, n_high: int) -> tuple[int, ...]:
    """counts[u]: how many of the C(n + m, n) orderings of n low-side and m high-side values put a high value
    above a low one in exactly u pairs (Mann & Whitney 1947's recursion, on which of the two sides holds the
    largest value: a high one lies above all n low ones, a low one above no high one)."""
    if n_low == 0 or n_high == 0:
        return (1,)
    counts = [0] * (n_low * n_high + 1)
    for u, c in enumerate(orderings_by_pairs(n_low, n_high - 1)):
        counts[u + n_low] += c
    for u, c in enumerate(orderings_by_pairs(n_low - 1, n_high)):
        counts[u] += c
    return tuple(counts)


def tail_probability(n_low: int, n_high: int, pairs: int) -> float:
    """P(U >= pairs) for exchangeable values: the one-sided exact Mann-Whitney p-value of `pairs` (at
    pairs = n * m, every high value above every low one: 1 / C(n + m, n), `chance_of_firing`)."""
    counts = orderings_by_pairs(n_low, n_high)
    return sum(counts[max(pairs, 0):]) / comb(n_low + n_high, n_low)
