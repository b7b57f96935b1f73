"""KV memory: request -> slot table, per-layer K/V buffers, and a paged free-slot allocator.

Vocabulary: a *slot* is one token's KV position in the pool; a *page* is `page_size`
consecutive slots (page p holds slots p*page_size .. p*page_size+page_size-1). Slot 0's page
(page 0) is never handed out, so slot 0 can serve as padding in gather indices.

Models with sliding-window layers (Gemma 2/3, Mistral, Phi-3) keep those layers' K/V in a second, smaller slot
space: every token's slot (a *full* slot, the one tables, the radix tree and full-attention layers use) maps to a
*window* slot while a sliding-window layer may still read it (`WindowedKVAllocator.window_of`, 0 once released).
A request releases the window slots of its tokens that fell behind its window; the radix tree releases them
under pressure (a prefix is reusable only while the window before its end is intact).
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Maps a request row to the KV slots of its tokens: table[row, i] = slot of token i."""

    def __init__(self, max_requests: int, context_length: int, device: str = "cpu"):
        self.table = torch.zeros((max_requests, context_length), dtype=torch.int64, device=device)
        self._free = list(range(max_requests - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def available(self) -> int:
        return len(self._free)


class KVAllocator:
    """Free-page allocator. Allocation and freeing are in pages; callers see slots."""

    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < 2 * page_size:
            raise ValueError(f"KV pool of {num_slots} slots is too small for page_size {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        # page 0 is reserved as padding; pages are handed out lowest first (better locality)
        self._free_pages = torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64)
        self._top = self.num_pages - 1  # number of free pages, stack grows at the end

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    @property
    def capacity(self) -> int:
        """Slots that can ever be allocated (all pages but the padding page)."""
        return (self.num_pages - 1) * self.page_size

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        return self._take_pages(n)

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._top:
            return None
        pages = self._free_pages[self._top - n : self._top].flip(0).clone()
        self._top -= n
        return pages

    def alloc_extend(self, last_slot: int, cur_len: int, n: int) -> torch.Tensor | None:
        """Slots for tokens cur_len .. cur_len+n-1 of a sequence whose last slot is `last_slot`.

        The tail of the sequence's current page is used first; whole pages after that.
        Returns None (allocating nothing) when the pool is short.
        """
        return self._extend(last_slot, cur_len, n)

    def _extend(self, last_slot: int, cur_len: int, n: int) -> torch.Tensor | None:
        ps = self.page_size
        if ps == 1:
            return self._take_pages(n)
        in_page = (-cur_len) % ps if cur_len > 0 else 0
        head = min(n, in_page)
        rest = n - head
        pages = self._take_pages((rest + ps - 1) // ps)
        if pages is None:
            return None
        head_slots = torch.arange(last_slot + 1, last_slot + 1 + head, dtype=torch.int64)
        tail_slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:rest]
        return torch.cat([head_slots, tail_slots])

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages these slots live in (callers pass whole pages' worth of slots)."""
        if slots.numel() == 0:
            return
        pages = slots // self.page_size if self.page_size > 1 else slots
        if self.page_size > 1:
            pages = torch.unique(pages)
        n = pages.numel()
        self._free_pages[self._top : self._top + n] = pages
        self._top += n


class WindowedKVAllocator(KVAllocator):
    """Full slots as KVAllocator hands them out, each with a window slot for the sliding-window layers from a second
    space of `num_window_slots` (one slot per page: it is never gathered by page). Freeing a full slot frees its
    window slot too; `release_window` frees the window slot alone."""

    def __init__(self, num_slots: int, page_size: int, num_window_slots: int):
        self.window = KVAllocator(num_window_slots, 1)
        self.window_of = torch.zeros(num_slots // page_size * page_size, dtype=torch.int64)  # 0: none
        super().__init__(num_slots, page_size)

    def clear(self) -> None:
        super().clear()
        self.window.clear()
        self.window_of.zero_()

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        if n * self.page_size > self.window.free_slots:
            return None
        pages = super().alloc_pages(n)
        if pages is not None:
            self._attach((pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten())
        return pages

    def alloc_extend(self, last_slot: int, cur_len: int, n: int) -> torch.Tensor | None:
        if n > self.window.free_slots:
            return None
        slots = self._extend(last_slot, cur_len, n)
        if slots is not None:
            self._attach(slots)
        return slots

    def _attach(self, slots: torch.Tensor) -> None:
        self.window_of[slots] = self.window.alloc_pages(slots.numel())

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.release_window(slots)
        super().free(slots)

    def release_window(self, slots: torch.Tensor) -> int:
        """Free the window slots of these full slots (those that still have one). Returns how many."""
        window = self.window_of[slots]
        held = window[window != 0]
        if held.numel():
            self.window.free(held)
            self.window_of[slots] = 0
        return held.numel()

    def window_live(self, slots: torch.Tensor) -> torch.Tensor:
        """Whether each full slot still has its window slot."""
        return self.window_of[slots] != 0

    def window_count(self, slots: torch.Tensor) -> int:
        """How many of these full slots still have their window slot."""
        return int(self.window_live(slots).sum())


class KVPool:
    """Per-layer K and V buffers of shape [num_kv_heads, num_slots, head_dim]: head-major, so the keys
    of one head and consecutive slots lie in one contiguous run (decode attention streams them).
    The layers in `window_layers` (sliding-window layers) get `num_window_slots` slots instead."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        v_head_dim: int | None = None,
        window_layers: frozenset[int] = frozenset(),
        num_window_slots: int = 0,
    ):
        v_dim = v_head_dim or head_dim
        sizes = [num_window_slots if i in window_layers else num_slots for i in range(num_layers)]
        # zeros, not empty: the whole pool is resident from the start. With empty pages, a pool larger than
        # the memory left started fine and died later, and resident memory rose under steady load for a
        # quarter of an hour as the radix cache first touched each page (a soak could not tell that from a
        # leak). The padding page is read before being written (masked out, but NaN * 0 is NaN): zeros too.
        self.k = [torch.zeros((num_kv_heads, n, head_dim), dtype=dtype, device=device) for n in sizes]
        self.v = [torch.zeros((num_kv_heads, n, v_dim), dtype=dtype, device=device) for n in sizes]
        self.num_slots = num_slots
        self.window_layers = window_layers
        self.nbytes = sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
