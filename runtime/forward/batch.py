"""ForwardBatch: what one model forward computes, and the per-batch context layers read it from.

Tokens of a batch are flat ([num_tokens]) with no padding. Items computing a run of tokens (prefill
chunks, and drafts being verified) come first, causal within each item; items decoding one token
come after them, so a mixed batch runs both through the same weights once. Attention metadata for each group is built
once per batch, outside the layer loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from enum import Enum

import torch


# in a model's capture list: the last hidden state (after a decoder's final norm): what EAGLE heads read, and
# what embeddings pool
FINAL_HIDDEN = -1


class ForwardMode(Enum):
    """What a work item computes, set by the scheduler (never inferred from a token count). A batch's
    mode is its items' one mode, or MIXED."""

    EXTEND = "extend"  # prompt tokens (a prefill chunk)
    DECODE = "decode"  # the one token sampled last step
    TARGET_VERIFY = "target_verify"  # that token and a draft after it, verified by their logits
    MIXED = "mixed"


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a draft tree (1 below the sampled token); parents come before their children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class AttnGroup:
    """Attention metadata for one group of requests.

    kv_slots[b, j] is the KV slot of key j of request b (padded with slot 0). Each query token
    reads one row of it and attends to that row's first keys: decode tokens read their own row
    (the first kv_lens[b] keys); extend tokens read row q_req[t] and see q_kv_lens[t] keys, up to
    their own position, which makes attention causal without a mask. For batches whose requests
    share a cached prefix (same KV slots), `prefix_slots` holds that prefix once and kv_slots
    covers only the rest (cascade attention: the prefix is read once for the whole batch, not
    once per request).
    """

    start: int  # first flat token of the group
    num_tokens: int
    kv_slots: torch.Tensor  # [B, kv_max]
    kv_lens: torch.Tensor  # [B] keys per request in kv_slots
    q_req: torch.Tensor | None = None  # [num_tokens] request of each token, extend only
    q_kv_lens: torch.Tensor | None = None  # [num_tokens] keys each token sees in its row, extend only
    prefix_slots: torch.Tensor | None = None  # [P]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slots the new tokens' K/V are written to
    extend: AttnGroup | None
    decode: AttnGroup | None
    logits_rows: torch.Tensor  # flat token indices whose logits are computed
    # every kernel sums in an order fixed per row (--enable-deterministic-inference): a row's result
    # is then the same whatever shares its batch and wherever its cached prefix ends
    batch_invariant: bool = False
    # the same batch in the window slot space (memory_pool.WindowedKVAllocator), which sliding-window layers read
    # and write; None when they share the full slots
    windowed: "ForwardBatch | None" = None
    has_prompt: bool = True  # some item is a prompt chunk (EXTEND); False: decode and verify items only
    # LoRA adapters: (start, stop, slot) runs of flat tokens computed with adapter `slot` (runtime/lora); None: none
    lora: list[tuple[int, int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def in_slots(self, slot_map: torch.Tensor) -> "ForwardBatch":
        """This batch with every KV slot s read as slot_map[s]."""
        def group(g: AttnGroup | None) -> AttnGroup | None:
            if g is None:
                return None
            prefix = None if g.prefix_slots is None else slot_map[g.prefix_slots]
            return dataclasses.replace(g, kv_slots=slot_map[g.kv_slots], prefix_slots=prefix)

        return dataclasses.replace(self, out_slots=slot_map[self.out_slots], extend=group(self.extend),
                                   decode=group(self.decode), windowed=None)

    @contextlib.contextmanager
    def active(self):
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[ForwardBatch] = contextvars.ContextVar("plait_forward_batch")


def current_batch() -> ForwardBatch:
    """The batch being run; layers read positions and attention metadata from it."""
    return _CURRENT.get()


def build_group(
    start: int,
    kv_slot_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    cascade: bool = True,
) -> AttnGroup:
    """Attention metadata for requests whose keys are kv_slot_rows[b, :kv_lens[b]]
    and whose queries are their last q_lens[b] positions. `cascade` allows a shared prefix to be
    split off (its result then depends on the batch: off for batch invariance)."""
    batch = kv_lens.numel()
    kv_max = int(kv_lens.max())
    q_max = int(q_lens.max())
    kv_slots = kv_slot_rows[:, :kv_max]
    prefix_slots = None
    if batch >= 2 and cascade:
        # the prefix must precede every query of every request (no causal cut inside it)
        shared = min(_shared_prefix_len(kv_slots, kv_lens), int((kv_lens - q_lens).min()))
        if shared >= _CASCADE_MIN_PREFIX:
            prefix_slots = kv_slots[0, :shared]
            kv_lens = kv_lens - shared
            kv_max -= shared
            kv_slots = kv_slots[:, shared:].contiguous()
    if q_max == 1:
        return AttnGroup(start, batch, kv_slots, kv_lens, prefix_slots=prefix_slots)
    # token i of request b sits at position kv_len - q_len + i of its row and sees the keys up to it
    q_req = torch.repeat_interleave(torch.arange(batch), q_lens)
    first = torch.cumsum(q_lens, 0) - q_lens
    q_kv_lens = kv_lens[q_req] - q_lens[q_req] + (torch.arange(int(q_lens.sum())) - first[q_req]) + 1
    return AttnGroup(start, int(q_lens.sum()), kv_slots, kv_lens, q_req, q_kv_lens, prefix_slots)


# below this many shared tokens, reading the prefix per request costs less than a second attention pass
_CASCADE_MIN_PREFIX = 64


def _shared_prefix_len(kv_slots: torch.Tensor, kv_lens: torch.Tensor) -> int:
    """Leading keys with the same KV slot in every row (all but each row's last key)."""
    same = (kv_slots == kv_slots[:1]).to(torch.int32).cumprod(dim=1).sum(dim=1)
    return int(torch.minimum(same, kv_lens - 1).min())
