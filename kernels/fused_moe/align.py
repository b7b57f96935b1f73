"""moe_align_block_size: the (token, expert) pairs of a batch sorted by expert, each expert's run
padded to a multiple of the block size, so that every block of BLOCK_M rows of the grouped GEMM
belongs to one expert.

Given topk_ids [T, k] (an id outside 0..E-1, e.g. -1 for an expert on another rank, is dropped), it
returns:
- sorted_ids int32 [T*k + E*(block-1)]: flat pair indices (t*k + j), expert by expert, in their order
  within an expert; padding and the unused tail hold T*k (one past the last pair);
- expert_ids int32 [len(sorted_ids) / block]: the expert of each block; -1 past the used blocks;
- num_tokens_post_padded int32 [1]: the used length of sorted_ids (a multiple of the block).
`moe_align_block_size_ref` (torch) and `moe_align_block_size_triton` give the same tensors.
"""

from __future__ import annotations

import functools

import torch


def _sizes(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> tuple[int, int]:
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size and num_experts must be >= 1, got {block_size} and {num_experts}")
    pairs = topk_ids.numel()
    capacity = -(-(pairs + num_experts * (block_size - 1)) // block_size) * block_size
    return pairs, capacity


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_size: int,
                             num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs, capacity = _sizes(topk_ids, block_size, num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    local = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[local], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = padded.cumsum(0) - padded
    order = torch.nonzero(local).view(-1)
    order = order[torch.argsort(flat[order], stable=True)]  # by expert, in pair order within one
    experts = flat[order]
    rank = torch.arange(order.numel(), device=dev) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    used = int(padded.sum())
    expert_ids = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=dev)
    expert_ids[: used // block_size] = torch.repeat_interleave(
        torch.arange(num_experts, device=dev, dtype=torch.int32), padded // block_size)
    return sorted_ids, expert_ids, torch.tensor([used], dtype=torch.int32, device=dev)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def count_kernel(ids_ptr, counts_ptr, pairs, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        n = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
            n += (ids == e).to(tl.int32)
        tl.store(counts_ptr + e, tl.sum(n, 0))

    @triton.jit
    def place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, pairs, num_experts,
                     block_size, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        # program e: its run starts after the padded runs of experts 0..e-1; its pairs go there in order
        e = tl.program_id(0)
        e_offs = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + e_offs, mask=e_offs < num_experts, other=0)
        padded = (counts + block_size - 1) // block_size * block_size
        start = tl.sum(tl.where(e_offs < e, padded, 0), 0)
        mine = tl.sum(tl.where(e_offs == e, padded, 0), 0)
        if e == 0:
            tl.store(post_pad_ptr, tl.sum(padded, 0))
        for b in range(start // block_size, (start + mine) // block_size):
            tl.store(expert_ids_ptr + b, e)
        placed = start
        for first in range(0, pairs, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            hit = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1) == e
            rank = tl.cumsum(hit.to(tl.int32), 0) - 1
            tl.store(sorted_ptr + placed + rank, offs, mask=hit)
            placed += tl.sum(hit.to(tl.int32), 0)

    return count_kernel, place_kernel


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_size: int,
                                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import triton

    pairs, capacity = _sizes(topk_ids, block_size, num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=dev)
    expert_ids = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=dev)
    post_pad = torch.zeros(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    count_kernel, place_kernel = _kernels()
    block = min(1024, triton.next_power_of_2(max(pairs, 16)))
    count_kernel[(num_experts,)](flat, counts, pairs, BLOCK=block)
    place_kernel[(num_experts,)](flat, counts, sorted_ids, expert_ids, post_pad, pairs, num_experts, block_size,
                                 BLOCK=block, BLOCK_E=triton.next_power_of_2(num_experts))
    return sorted_ids, expert_ids, post_pad
