"""How many draft tokens pay: measured forward cost against expected kept tokens.

Whether a draft pays depends on the machine and the weight format: on a 2-core AVX2 CPU a float32
forward of 8 rows costs about 1.8x one row (the weights are read once), but with Q4_1 blocks about
3.9x (the kernel unpacks the blocks for every row). So the cost is measured, not assumed:
`RowCost` keeps the time of decode/verify forwards (no prefill in them) by their row count, and
`choose_sizes` adds draft tokens one at a time, each to the request whose next token is likeliest
to be kept (`Acceptance`: a draft token i deep is kept with probability first * rest^(i-1), both
measured per request), and keeps the number of additions that maximises expected tokens per second
of the next forward. A row count never measured is costed as the nearest smaller one measured, so
it is tried once and then known; a batch size never measured first runs one plain step.
"""

from __future__ import annotations

_WEIGHT = 0.3  # of the latest measurement in a row count's running mean
_STEP_WEIGHT = 0.1  # of the latest step in StepRate's decayed sums (a memory of about ten steps)
_ACCEPT_WEIGHT = 0.3  # of the latest verify in a request's acceptance
PRIOR = 0.7  # acceptance assumed before a request's first verify
# per step without a draft, a request's acceptance moves this share back to the prior: text changes (a quote, a
# list) and a request that once drafted badly is tried again after ~10 steps, not never
_RELAX = 0.05


def running_mean(old: float | None, new: float, weight: float) -> float:
    """`old` moved `weight` of the way to `new` (`new` itself when there is no `old`)."""
    return new if old is None else old + weight * (new - old)


class Acceptance:
    """A request's recent acceptance, in two parts: of a draft's first token, and of each further token once the
    one before it was kept. Drafts that copy text (NGRAM) keep all or nothing, so their first token is the doubt
    and the rest mostly hold; one per-token rate would price the deep tokens far too low."""

    def __init__(self, first: float = PRIOR, rest: float = PRIOR):
        self.first, self.rest = first, rest

    def kept(self, depth: int) -> float:
        """The probability that the draft token `depth` deep (from 1) is kept."""
        return self.first * self.rest ** (depth - 1)

    def update(self, kept: int, tried: int) -> None:
        """One verify: `kept` draft tokens kept of the `tried` whose fate it decided (the kept and the miss)."""
        if tried:
            self.first = running_mean(self.first, float(kept > 0), _ACCEPT_WEIGHT)
        if kept and tried > 1:
            self.rest = running_mean(self.rest, (kept - 1) / (tried - 1), _ACCEPT_WEIGHT)

    def relax(self) -> None:
        """A step without a draft: drift back toward the prior."""
        self.first = running_mean(self.first, PRIOR, _RELAX)
        self.rest = running_mean(self.rest, PRIOR, _RELAX)


class RowCost:
    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # rows -> running mean of a forward's wall time

    def record(self, rows: int, seconds: float) -> None:
        self.seconds[rows] = running_mean(self.seconds.get(rows), seconds, _WEIGHT)

    def estimate(self, rows: int) -> float | None:
        if rows in self.seconds:
            return self.seconds[rows]
        below = [r for r in self.seconds if r < rows]
        if below:
            return self.seconds[max(below)]
        above = [r for r in self.seconds if r > rows]
        return self.seconds[min(above)] if above else None


def choose_sizes(cost: RowCost, base_rows: int, accepts: list[Acceptance], caps: list[int], budget: int,
                 step_seconds: float | RowCost = 0.0, overhead: float = 0.0) -> list[int]:
    """Draft tokens per request (caps[i] at most, `budget` in all) maximising expected tokens per second of a
    step whose forward also holds `base_rows` rows (none until a forward of `base_rows` rows was measured). Drafting
    itself costs `step_seconds` per draft step (the deepest draft's length; an EAGLE head's or a draft model's
    pass): a constant, or measured by how many requests draft in the pass (a RowCost keyed by requests: a draft
    model's pass over four requests costs more than over one), and every step `overhead` beyond its forward
    (sampling, grammar masks, bookkeeping: what makes extra rows relatively cheap)."""
    def per_pass(requests: int) -> float:
        if isinstance(step_seconds, RowCost):
            return step_seconds.estimate(requests) or 0.0
        return step_seconds

    sizes = [0] * len(accepts)
    if base_rows not in cost.seconds:
        return sizes  # a plain step first: its time is what every draft is weighed against
    order: list[int] = []  # the request each successive draft token goes to
    taken = [0] * len(accepts)
    for _ in range(min(budget, sum(caps))):
        best = max((i for i in range(len(accepts)) if taken[i] < caps[i]),
                   key=lambda i: accepts[i].kept(taken[i] + 1), default=None)
        if best is None:
            break
        taken[best] += 1
        order.append(best)
    tokens, best_rate, best_m = float(base_rows), base_rows / (cost.estimate(base_rows) + overhead), 0
    counts = [0] * len(accepts)
    for m, i in enumerate(order, start=1):
        counts[i] += 1
        tokens += accepts[i].kept(counts[i])
        drafting = per_pass(sum(c > 0 for c in counts)) * max(counts)
        rate = tokens / (cost.estimate(base_rows + m) + overhead + drafting)
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


class StepRate:
    """Tokens a second of recent whole steps, as decayed sums of tokens and of seconds: a step that kept a long
    draft counts by its tokens, where a running mean of per-step rates would let a few steps that kept
    nothing forget it (drafts that copy text keep all or nothing)."""

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = running_mean(self.tokens, tokens, _STEP_WEIGHT)
        self.seconds = running_mean(self.seconds, seconds, _STEP_WEIGHT)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds
