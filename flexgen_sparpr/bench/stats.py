"""Small statistics for the fidelity reports: a mean with its Student-t interval, and a binomial
proportion's Wilson interval (no scipy: the t quantiles are tabulated)."""
from __future__ import annotations

import math

# two-sided 95 % Student-t quantiles t_{0.975, df}, df = 1..30; beyond 30 the normal's 1.96 is within 4 %
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t interval needs at least two values")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its two-sided 95 % Student-t interval (one value: no width
    is known, so low = -inf and high = inf)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    m = sum(values) / n
    if n == 1:
        return m, -math.inf, math.inf
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion hits / n."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)
