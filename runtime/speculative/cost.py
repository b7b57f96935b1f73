"""How many draft tokens pay: measured forward cost against expected kept tokens.

Whether a draft pays depends on the machine and the weight format: on a 2-core AVX2 CPU a float32
forward of 8 rows costs about 1.8x one row (the weights are read once), but with Q4_1 blocks about
3.9x (the kernel unpacks the blocks for every row). So the cost is measured, not assumed:
`RowCost` keeps the time of decode/verify forwards (no prefill in them) by their row count, and
`choose_sizes` adds draft tokens one at a time, each to the request whose next token is likeliest
to be kept (a draft token i deep is kept with probability alpha^i, alpha the request's measured
per-token acceptance), and keeps the number of additions that maximises expected tokens per second
of the next forward. A row count never measured is costed as the nearest smaller one measured, so
it is tried once and then known; a batch size never measured first runs one plain step.
"""

from __future__ import annotations

_WEIGHT = 0.3  # of the latest measurement in a row count's running mean


class RowCost:
    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # rows -> running mean of a forward's wall time

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - _WEIGHT) * old + _WEIGHT * seconds

    def estimate(self, rows: int) -> float | None:
        if rows in self.seconds:
            return self.seconds[rows]
        below = [r for r in self.seconds if r < rows]
        if below:
            return self.seconds[max(below)]
        above = [r for r in self.seconds if r > rows]
        return self.seconds[min(above)] if above else None


def choose_sizes(cost: RowCost, base_rows: int, alphas: list[float], caps: list[int], budget: int,
                 step_seconds: float = 0.0) -> list[int]:
    """Draft tokens per request (caps[i] at most, `budget` in all) maximising expected tokens per second of a
    forward that also holds `base_rows` rows (none until a forward of `base_rows` rows was measured). Drafting
    itself costs `step_seconds` per draft step (the deepest draft's length; an EAGLE head's pass)."""
    sizes = [0] * len(alphas)
    if base_rows not in cost.seconds:
        return sizes  # a plain step first: its time is what every draft is weighed against
    order: list[int] = []  # the request each successive draft token goes to
    taken = [0] * len(alphas)
    for _ in range(min(budget, sum(caps))):
        best = max((i for i in range(len(alphas)) if taken[i] < caps[i]),
                   key=lambda i: alphas[i] ** (taken[i] + 1), default=None)
        if best is None:
            break
        taken[best] += 1
        order.append(best)
    tokens, best_rate, best_m = float(base_rows), base_rows / cost.estimate(base_rows), 0
    counts = [0] * len(alphas)
    for m, i in enumerate(order, start=1):
        counts[i] += 1
        tokens += alphas[i] ** counts[i]
        rate = tokens / (cost.estimate(base_rows + m) + step_seconds * max(counts))
        if rate > best_rate:
            best_rate, best_m = rate, m
    for i in order[:best_m]:
        sizes[i] += 1
    return sizes


def fill_caps(caps: list[int], budget: int) -> list[int]:
    """The fixed policy: every request drafts up to its cap; a short budget goes round one token at a time
    (a first draft token is the likeliest kept)."""
    sizes = [0] * len(caps)
    while budget > 0 and any(s < c for s, c in zip(sizes, caps)):
        for i, cap in enumerate(caps):
            if budget > 0 and sizes[i] < cap:
                sizes[i] += 1
                budget -= 1
    return sizes
