"""How many threads the forward uses: all the cores, unless measurements say fewer run faster.

With N threads every parallel region of a step ends in a barrier, so a step runs at the pace of
the slowest thread. When another process keeps one core busy, the thread sharing that core is
descheduled for whole time slices (milliseconds) while the others wait at the barrier, and a decode
step of ~150 regions can run several times slower than it would on one thread fewer. Work handed
out in chunks (the C kernels) limits, but cannot remove, that wait.

The governor measures instead of guessing: after `probe_every` decode steps it runs `probe_steps`
steps with the other candidate thread count, and keeps whichever was faster per token over the
probe and the same number of steps just before it (by more than `margin`, so noise does not flip
it). A probe that loses doubles the wait before the next one, up to `max_probe_every`. With every
thread, a probe after the first runs only on suspicion: when the steps before it are slower per token
than the best of their batch size lately (by more than `margin`). On a quiet machine the probes ran one step
in sixteen at half speed (6% of batch-1 decode), then ever fewer; now one, once. A neighbour that arrives
slows the steps and is noticed within the wait. With a thread given up, probes stay periodic (the
neighbour's leaving does not slow anything). A switch starts the waits over. Decode steps only, and a probe
is weighed size by size against the steps of its own batch sizes: a step's cost per token falls as its batch
grows, and under speculation plain decode steps come at any batch size now and then. With one thread to give
there is nothing to choose and it does nothing.
"""

from __future__ import annotations

import collections
import logging
import math

import torch

logger = logging.getLogger(__name__)


class ThreadGovernor:
    def __init__(self, max_threads: int, probe_every: int = 32, probe_steps: int = 8, margin: float = 0.1,
                 max_probe_every: int = 1024):
        self.max_threads = max(1, max_threads)
        self.current = self.max_threads
        self.probe_every, self.probe_steps, self.margin = probe_every, probe_steps, margin
        self.max_probe_every = max(probe_every, max_probe_every)
        self.wait = probe_every  # decode steps before the next probe
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=probe_steps)
        self._probe: list[tuple[float, int]] = []
        self._steps = 0
        self._probed = False  # the first probe runs unasked (a neighbour from the start slows nothing later)
        # per batch size, the best time per token at every thread lately (it creeps up: contexts grow)
        self._best: dict[int, float] = {}
        self.switches = 0

    @property
    def probing(self) -> bool:
        if self._probe:
            return True
        due = self._steps >= self.wait and len(self._recent) == self.probe_steps
        return due and (self.current < self.max_threads or not self._probed or self._suspect())

    def _suspect(self) -> bool:
        """Whether every recent step ran slower per token than the best of its size, by more than the margin (one
        slow step is noise, and the probe is weighed against these steps)."""
        sizes = [(s / n, self._best.get(n)) for s, n in self._recent]
        return all(best is not None and t > best * (1 + self.margin) for t, best in sizes)

    def threads(self) -> int:
        """The thread count for the next decode step."""
        if self.max_threads == 1:
            return 1
        return self._other() if self.probing else self.current

    def record(self, seconds: float, tokens: int) -> None:
        """A decode step's time and token count, run with `threads()` threads."""
        if self.max_threads == 1 or tokens <= 0:
            return
        if not self.probing:
            self._recent.append((seconds, tokens))
            self._steps += 1
            if self.current == self.max_threads:
                best = self._best.get(tokens, math.inf) * (1 + _CREEP)
                self._best[tokens] = min(best, seconds / tokens)
            return
        self._probe.append((seconds, tokens))
        if len(self._probe) < self.probe_steps:
            return
        self._probed = True
        ratio = _ratio(self._recent, self._probe)
        if ratio is None:  # no step of the probe's sizes before it: nothing to weigh, try again soon
            self.wait = self.probe_every
        elif ratio < 1 - self.margin:
            logger.info("forward threads %d -> %d (%.2fx the time per token)", self.current, self._other(), ratio)
            self.current = self._other()
            self.switches += 1
            self.wait = self.probe_every
        else:
            self.wait = min(2 * self.wait, self.max_probe_every)
        self._probe, self._steps = [], 0
        self._recent.clear()

    def _other(self) -> int:
        # the full count, or one fewer: a neighbour taking one core is what costs
        return self.max_threads - 1 if self.current == self.max_threads else self.max_threads


_CREEP = 1 / 512  # a size's best time per token rises this share a step: a longer context costs more per token


def _per_token(samples) -> float:
    return sum(s for s, _ in samples) / max(1, sum(n for _, n in samples))


def _ratio(base, probe) -> float | None:
    """The probe's time per token over the steps' before it, size by size (a bigger batch costs less per token,
    so sizes are never mixed), weighted by the probe's steps of each size; None when they share no size."""
    sizes = {n for _, n in probe} & {n for _, n in base}
    if not sizes:
        return None
    weight = {n: sum(1 for _, m in probe if m == n) for n in sizes}
    return sum(weight[n] * _per_token([x for x in probe if x[1] == n]) / _per_token([x for x in base if x[1] == n])
               for n in sizes) / sum(weight.values())


def apply(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
