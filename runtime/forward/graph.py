"""The interface of a graph runner: a forward step's layer stack run as one unit. A model asks its runner first
and keeps its layer loop for the batches the runner declines; the runners themselves (and their registry) are
the model executor's (model_executor/graph_runner.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from plait.runtime.forward.batch import ForwardBatch

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer kind -> (cos, sin) at the batch's positions


class GraphRunner(Protocol):
    name: str

    def takes(self, fb: ForwardBatch) -> bool:
        """Whether this runner runs the layer stack for batch `fb`."""

    def run(self, x: torch.Tensor, fb: ForwardBatch, rope: Rope) -> torch.Tensor:
        """The residual stream after the last layer, for the embedded tokens x [T, H]."""
