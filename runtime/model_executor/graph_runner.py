"""Graph runners: a forward step's layer stack run as one unit instead of the Python layer loop.

A runner says which batches it takes and runs the layer stack over them; the model's forward asks its
runner first and keeps the loop for every batch the runner declines (and for steps that capture hidden
states for a draft head). Runners register by name and `build_graph_runner` keeps the first that the
model supports, so a captured or compiled step (CUDA graphs, torch.compile) plugs in as one more module.
Today's runner, `c`, runs decode and verify steps as one C call over the quantized blocks (kernels/cpu_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.kernels.cpu_decode import DecodeLayers, LoraTable, StepTables
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.model_config import FULL, SLIDING
from plait.runtime.forward.batch import ForwardBatch
from plait.runtime.lora.adapter import PROJECTIONS
from plait.runtime.forward.graph import GraphRunner, Rope

GraphFactory = Callable[[nn.Module, KVPool], "GraphRunner | None"]
GRAPH_RUNNERS: dict[str, GraphFactory] = {}


def register(name: str) -> Callable[[GraphFactory], GraphFactory]:
    def add(factory: GraphFactory) -> GraphFactory:
        GRAPH_RUNNERS[name] = factory
        return factory
    return add


def build_graph_runner(model: nn.Module, pool: KVPool) -> GraphRunner | None:
    """The first registered runner that supports `model` over `pool`, or None (the layer loop runs every step)."""
    for factory in GRAPH_RUNNERS.values():
        runner = factory(model, pool)
        if runner is not None:
            return runner
    return None


class NativeDecodeRunner:
    """Decode and verify steps through the C layer stack: one call for every layer's matmuls, attention and norms.
    A verify item's tokens are rows like decode tokens, each attending to the keys up to itself (a tree node: its
    own key row): the stack stores every row's K/V before any row attends, so a draft token sees those before it."""

    name = "c"

    def __init__(self, stack: DecodeLayers, layers: list[nn.Module] | None = None):
        self.stack = stack
        self.layers = layers or []  # their linear layers' LoRA pairs (runtime/lora), for steps that use adapters
        self._lora: LoraTable | None = None  # the table of the last adapter set seen

    def takes(self, fb: ForwardBatch) -> bool:
        """Decode and verify items (no prompt chunk), no shared-prefix split (the loop's cascade pass), and few
        enough rows that every matmul of the loop would run the block kernel too (more go to a GEMM), unless
        batch-invariant."""
        return (not fb.has_prompt and all(g is None or g.prefix_slots is None for g in (fb.extend, fb.decode))
                and (fb.num_tokens <= self.stack.max_rows or fb.batch_invariant))

    def run(self, x: torch.Tensor, fb: ForwardBatch, rope: Rope) -> torch.Tensor:
        lora = self._lora_rows(fb) if fb.lora else None
        return self.stack(x.contiguous(), step_tables(fb, rope), fb.batch_invariant, lora)

    def _lora_rows(self, fb: ForwardBatch) -> tuple[LoraTable, torch.Tensor]:
        """The step's adapters' table (rebuilt when the set of adapters changes; a slot is never reused, so an
        unchanged set means unchanged pairs) and each row's index into it."""
        rows = torch.full((fb.num_tokens,), -1, dtype=torch.int64)
        slots: list[int] = []
        for start, stop, slot in fb.lora:
            if slot not in slots:
                slots.append(slot)
            rows[start:stop] = slots.index(slot)
        if self._lora is None or self._lora.slots != tuple(slots):
            self._lora = LoraTable(tuple(slots), [[getattr(layer, p).lora for p in PROJECTIONS]
                                                  for layer in self.layers])
        return self._lora, rows


@register("c")
def _native(model: nn.Module, pool: KVPool) -> NativeDecodeRunner | None:
    native = getattr(model, "native_decode", None)
    stack = native(pool) if native is not None else None
    return None if stack is None else NativeDecodeRunner(stack, list(model.layers))


def step_tables(fb: ForwardBatch, rope: Rope) -> StepTables:
    """The batch's rotary tables, output slots and KV slots as the C stack reads them (windowed layers' own)."""
    local = rope.get(SLIDING)
    slots, lens = token_rows(fb)
    win = token_rows(fb.windowed)[0] if fb.windowed is not None else None
    return StepTables(
        (rope[FULL][0].contiguous(), None if local is None else local[0].contiguous()),
        (rope[FULL][1].contiguous(), None if local is None else local[1].contiguous()),
        (fb.out_slots.contiguous(), None if win is None else fb.windowed.out_slots.contiguous()),
        (slots.contiguous(), None if win is None else win.contiguous()),
        lens.contiguous())


def token_rows(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's key slots and how many of them it sees, in token order (verify items, then decode tokens): a
    decode group's rows as they are, a verify group's row of each token (its request's, or a tree node's own)
    with the keys up to that token."""
    parts = []
    for g in (fb.extend, fb.decode):
        if g is not None:
            parts.append((g.kv_slots, g.kv_lens) if g.q_req is None else (g.kv_slots[g.q_req], g.q_kv_lens))
    if len(parts) == 1:
        return parts[0]
    width = max(slots.shape[1] for slots, _ in parts)
    return (torch.cat([torch.nn.functional.pad(slots, (0, width - slots.shape[1])) for slots, _ in parts]),
            torch.cat([lens for _, lens in parts]))
