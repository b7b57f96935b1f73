"""ModelRunner: owns the model and the KV memory, turns a list of work items into one forward."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass

import torch

from plait.kernels.cpu_build import loaded_kernels
from plait.radix_cache.memory_pool import KVAllocator, KVPool, ReqToTokenPool, WindowedKVAllocator
from plait.runtime.model_executor import step_sync
from plait.runtime.model_executor.config import RunnerConfig
from plait.runtime.distributed.group import SINGLE, Group
from plait.runtime.forward.batch import ForwardBatch, ForwardMode, build_group, tree_depths
from plait.runtime.model_executor.graph_runner import build_graph_runner
from plait.runtime.model_executor.threads import ThreadGovernor, apply
from plait.runtime.model_config import SLIDING
from plait.runtime.lora.manager import LoRAManager, lora_paths
from plait.runtime.model_loader import load_model

logger = logging.getLogger(__name__)

# the default pool's room per running request (prompt and output of a typical chat turn; longer ones share it, and
# the scheduler retracts or queues requests when it runs out)
AUTO_KV_TOKENS_PER_REQUEST = 256

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkItem:
    """One request's share of a forward: compute tokens at positions cached_len .. cached_len+len(tokens)-1.
    Their KV slots must already be in the request row of the req->token table."""

    row: int
    cached_len: int
    tokens: list[int]
    logit_offsets: list[int]  # offsets into `tokens` whose next-token logits are wanted
    mode: ForwardMode = ForwardMode.EXTEND  # DECODE: one token attending to its whole row
    # TARGET_VERIFY of a draft tree: tokens are the last sampled token, then the tree's nodes; tree[i] is the
    # node that node i follows (-1: the sampled token). Node i sits at position cached_len + its depth and
    # attends to the keys before the sampled token, that token, its ancestors and itself
    tree: list[int] | None = None
    lora: int = -1  # the LoRA adapter's slot its tokens are computed with (runtime/lora); -1: the base model


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab] float32: the items' logit offsets, in item order then offset order
    features: list[torch.Tensor] | None = None  # per item, [len(tokens), F]: the layers `capture` named


class ModelRunner:
    """Rank 0's runner (the scheduler's) runs each forward and, under tensor or expert parallelism,
    first broadcasts its batch (runtime/model_executor/step_sync.py); the other ranks' runners `follow`."""

    def __init__(self, args, progress: bool = True, group: Group = SINGLE):
        """`args`: a ServerArgs (or a RunnerConfig); the runner keeps only its RunnerConfig."""
        args = RunnerConfig.of(args)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.args = args
        self.group = group
        # decode steps run with all the threads unless fewer measure faster (a busy core: threads.py); ranks
        # wait on each other, so one rank's thread count alone would measure nothing useful
        adaptive = args.thread_policy == "adaptive" and not group.distributed
        self.threads = ThreadGovernor(torch.get_num_threads()) if adaptive else None
        self.dtype = _DTYPES[args.dtype]
        self.kv_dtype = _DTYPES[args.kv_cache_dtype if args.kv_cache_dtype != "auto" else args.dtype]
        self.batch_invariant = args.enable_deterministic_inference
        self.kernels = loaded_kernels()  # built now: a bad PLAIT_CPU_ISA fails before the model loads
        if self.batch_invariant:
            _check_batch_invariant_kernels(self.kernels)
        # packed copies are built while loading: before the KV pool takes its share of free memory
        _map_large_allocations()
        loaded = load_model(args.model_path, self.dtype, args.context_length, args.tokenizer_path, progress,
                            with_tokenizer=not args.skip_tokenizer_init, quantization=args.quantization,
                            packed=not args.disable_packed_weights, group=group,
                            matmul=args.quantized_matmul)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        # LoRA adapters over the base weights (a decoder's): --lora-paths now, /load_lora_adapter later
        self.lora = LoRAManager(self.model, args.lora_memory_mb << 20) if self.config.causal else None
        if args.lora_paths and (self.lora is None or group.distributed):
            raise ValueError("LoRA adapters need a decoder model on one rank (no encoder, no tensor parallelism)")
        for name, path in lora_paths(args.lora_paths):
            self.lora.register(name, path)
        self.num_kv_heads = self.model.layers[0].num_kv_heads  # this rank's share
        self.weight_formats = self.model.weight_formats()
        self.context_length = args.context_length or self.config.context_length
        cfg = self.config
        # the cascade split's shared-prefix pass knows no window and no score cap (runtime/layers/attention.py)
        self.cascade = not self.batch_invariant and not cfg.has_sliding_window and not cfg.attn_softcap
        # sliding-window layers keep their window only, in slots of their own (memory_pool.WindowedKVAllocator)
        self.window_layers = frozenset(
            i for i in range(cfg.num_layers) if cfg.layer_type(i) == SLIDING
        ) if (cfg.has_sliding_window and cfg.sliding_window < self.context_length
              and not args.disable_hybrid_swa_memory) else frozenset()
        self.kv_window = cfg.sliding_window if self.window_layers else 0
        num_slots = args.max_total_tokens or self._auto_kv_tokens()
        # every rank's pool has the same slots (rank 0 hands out slot numbers): the smallest any rank can hold
        num_slots = group.min_int(max(num_slots, 2 * args.page_size))
        num_window = group.min_int(self._window_slots(num_slots)) if self.window_layers else 0
        # an encoder keeps no KV: its slots are bookkeeping only (the scheduler's token budget)
        self.kv_pool = KVPool(num_slots, cfg.num_layers if cfg.causal else 0, self.num_kv_heads, cfg.head_dim,
                              self.kv_dtype, window_layers=self.window_layers, num_window_slots=num_window)
        self.allocator = (WindowedKVAllocator(num_slots, args.page_size, num_window) if self.window_layers
                          else KVAllocator(num_slots, args.page_size))
        # steps the layer stack runs as one unit (decode: one C call where every layer fits it)
        self.model.graph = None if args.disable_native_decode else build_graph_runner(self.model, self.kv_pool)
        # a few spare rows: retracted and chunked requests hold rows beside the running ones
        self.req_to_token = ReqToTokenPool(args.max_running_requests + 8, self.context_length + 1)
        logger.info("KV pool: %d tokens%s (%.0f MiB)", self.allocator.capacity,
                    f", sliding-window layers {num_window} (window {self.kv_window})" if num_window else "",
                    self.kv_pool.nbytes / 2**20)
        _release_freed_memory()
        logger.info("dtype %s, weights %s, KV %s%s; decode steps: %s; CPU kernels: %s", args.dtype,
                    "+".join(self.weight_formats), self.kv_dtype, ", batch-invariant" * self.batch_invariant,
                    f"graph runner {self.model.graph.name}" if self.model.graph is not None else "the layer loop",
                    ", ".join(f"{k} {v}" for k, v in self.kernels.items()))

    def _kv_bytes_per_token(self) -> float:
        """A token's K and V over all layers; a sliding-window layer's counted at its share of window slots."""
        cfg = self.config
        per_layer = KVPool.bytes_per_token(1, self.num_kv_heads, cfg.head_dim, self.kv_dtype)
        windowed = len(self.window_layers)
        return per_layer * (cfg.num_layers - windowed + windowed * self.args.swa_full_tokens_ratio)

    def _window_slots(self, num_slots: int) -> int:
        """Slots of the sliding-window layers: the configured share of the pool, but room for two requests'
        windows and a prefill chunk (a request that fits the pool fits them), and no more than the pool."""
        args = self.args
        chunk = min(args.max_prefill_tokens, args.chunked_prefill_size if args.chunked_prefill_size > 0 else 1 << 30)
        wanted = max(int(num_slots * args.swa_full_tokens_ratio), 2 * self.kv_window + chunk)
        return min(wanted, num_slots)

    def _auto_kv_tokens(self) -> int:
        """The pool without --max-total-tokens: one request at the model's full context, or every running request
        at AUTO_KV_TOKENS_PER_REQUEST, whichever is more; at most --mem-fraction-static of free memory. Sized from
        the model and the flags, not from the machine: a laptop keeps its memory (a share of free RAM gave the
        default model a 2-3 GB pool)."""
        if not self.config.causal:  # slots cost an encoder nothing: every running request at full length
            return self.args.max_running_requests * self.context_length
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 8 * 2**30
        cap = int(avail * self.args.mem_fraction_static / self._kv_bytes_per_token())
        wanted = max(self.context_length, self.args.max_running_requests * AUTO_KV_TOKENS_PER_REQUEST)
        return max(1024, min(wanted, cap))

    def forward(self, items: list[WorkItem], capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the items as one batch: float32 logits, one row per requested offset, in item order then offset
        order; with `capture` (layer ids, see LlamaForCausalLM.forward), also each item's features at all its
        tokens ([len(tokens), F] per item)."""
        fb, order = self.build_batch(items)
        if self.group.distributed:
            step_sync.send(self.group, step_sync.forward_msg(fb, capture))
        timed = self.threads is not None and fb.mode is ForwardMode.DECODE
        if self.threads is not None:
            apply(self.threads.threads() if timed else self.threads.current)
        start = time.perf_counter()
        with fb.active():
            logits, features = self.model(self.kv_pool, capture)
        if timed:
            self.threads.record(time.perf_counter() - start, fb.num_tokens)
        # logits came out in extend-then-decode order; put them back in item order
        logits = logits if order is None else logits[order]
        return ForwardOutput(logits, None if features is None else self._per_item(items, features))

    @staticmethod
    def _per_item(items: list[WorkItem], flat: torch.Tensor) -> list[torch.Tensor]:
        """Split flat per-token rows (extend items first, then decode items) back into item order."""
        out: list[torch.Tensor] = [flat[:0]] * len(items)
        start = 0
        for i in sum(_flat_order(items), []):
            n = len(items[i].tokens)
            out[i] = flat[start : start + n]
            start += n
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def describe(self) -> dict:
        """What the runner adds to the scheduler's stats."""
        return {
            "kv_bytes": self.kv_pool.nbytes,
            "kernels": self.kernels,
            "weight_formats": self.weight_formats,
            # decode steps of few rows run the layer stack as one C call (kernels/cpu_decode.py), else the loop
            "decode_stack": self.model.graph.name if self.model.graph is not None else "loop",
        }

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """Copy the KV of slots `src` to slots `dst`, its keys moved on by `shift` positions (a KV join)."""
        if self.group.distributed:
            step_sync.send(self.group, step_sync.CopyKV(*map(step_sync.Tensor.of, (src, dst, shift))))
        self._copy_kv(src, dst, shift)

    def tick(self) -> None:
        """Rank 0, idle: let the other ranks know it lives (their wait for a step would time out)."""
        if self.group.distributed:
            step_sync.send(self.group, step_sync.Tick())

    def stop(self) -> None:
        """Rank 0: end the other ranks' `follow`."""
        if self.group.distributed:
            step_sync.send(self.group, step_sync.Stop())

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts, step by step, until it says stop."""
        while True:
            step = step_sync.receive(self.group)
            if isinstance(step, step_sync.Forward):
                with step_sync.forward_batch(step).active():
                    self.model(self.kv_pool, tuple(step.capture))
            elif isinstance(step, step_sync.CopyKV):
                self._copy_kv(step.src.get(), step.dst.get(), step.shift.get())
            elif isinstance(step, step_sync.Stop):
                return

    @torch.inference_mode()
    def _copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        pool = self.kv_pool
        for i, (k, v) in enumerate(zip(pool.k, pool.v)):  # [kv_heads, slots, head_dim] per layer
            k[:, dst] = self.model.rotary_of(i).shift_keys(k[:, src], shift).to(k.dtype)
            v[:, dst] = v[:, src]

    def build_batch(self, items: list[WorkItem]) -> tuple[ForwardBatch, torch.Tensor | None]:
        ext, dec = _flat_order(items)
        if any(len(items[i].tokens) != 1 for i in dec):
            raise ValueError("a DECODE work item computes exactly one token")
        ordered = ext + dec
        table = self.req_to_token.table
        ids, pos, slots, logit_rows, item_of_row = [], [], [], [], []
        lora: list[tuple[int, int, int]] = []
        start = 0
        for i in ordered:
            it = items[i]
            n = len(it.tokens)
            if it.lora >= 0:
                lora.append((start, start + n, it.lora))
            ids.extend(it.tokens)
            offsets = torch.arange(n) if it.tree is None else torch.tensor([0] + tree_depths(it.tree))
            pos.append(it.cached_len + offsets)
            slots.append(table[it.row, it.cached_len : it.cached_len + n])
            logit_rows.extend(start + o for o in it.logit_offsets)
            item_of_row.extend([i] * len(it.logit_offsets))
            start += n

        def group(indices: list[int], first: int):
            if not indices:
                return None
            rows = torch.tensor([items[i].row for i in indices])
            kv_lens = torch.tensor([items[i].cached_len + len(items[i].tokens) for i in indices])
            q_lens = torch.tensor([len(items[i].tokens) for i in indices])
            kv_max = int(kv_lens.max())
            trees = any(items[i].tree is not None for i in indices)
            g = build_group(first, table[:, :kv_max][rows], kv_lens, q_lens,
                            cascade=self.cascade and not trees)
            if trees:
                _tree_rows(g, [items[i] for i in indices], table)
            return g

        ext_group = group(ext, 0)
        dec_group = group(dec, ext_group.num_tokens if ext_group else 0)
        modes = {it.mode for it in items}
        mode = modes.pop() if len(modes) == 1 else ForwardMode.MIXED
        fb = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(pos),
            out_slots=torch.cat(slots),
            extend=ext_group,
            decode=dec_group,
            logits_rows=torch.tensor(logit_rows, dtype=torch.int64),
            batch_invariant=self.batch_invariant,
            has_prompt=any(it.mode is ForwardMode.EXTEND for it in items),
            lora=lora or None,
        )
        if self.window_layers:
            fb.windowed = fb.in_slots(self.allocator.window_of)
        # logits come out grouped; a stable sort by item index restores the callers' order
        order = None
        if ext and dec and item_of_row:
            order = torch.argsort(torch.tensor(item_of_row), stable=True)
        return fb, order


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libc.so.6")
        return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None  # not glibc


_M_MMAP_THRESHOLD = -3


def _map_large_allocations() -> None:
    """While loading: allocations from 8 MB up get pages of their own, returned to the system when freed. glibc's
    default moves that threshold up to 32 MB as large blocks are freed, so the copies a load makes (a weight's
    bytes, its repacked blocks) stay in the heap after it: ~400 MB of peak memory for a 1.5B model."""
    lib = _libc()
    if lib is not None:
        lib.mallopt(_M_MMAP_THRESHOLD, 8 << 20)


def _release_freed_memory() -> None:
    """After loading: hand the heap's free pages back to the system, then keep every later allocation in the heap.
    A step's activations and the weight panels dequantized for a GEMM are allocated again every step; pages of
    their own would be faulted in again every step (15 ms of a 55 MB dequantized weight's 16)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
        lib.mallopt(_M_MMAP_THRESHOLD, 1 << 30)


def _tree_rows(g, items: list[WorkItem], table: torch.Tensor) -> None:
    """Give each draft-tree node its own key row: the keys up to the sampled token, then its ancestors' and
    its own slots (a tree mask over the paged KV: each node sees its ancestors only)."""
    rows = [g.kv_slots]
    extra = g.kv_slots.shape[0]
    q_req, q_kv_lens = g.q_req.clone(), g.q_kv_lens.clone()
    start = 0
    for it in items:
        if it.tree is not None:
            own = table[it.row]
            base = it.cached_len + 1  # keys up to and including the sampled token
            for i in range(len(it.tree)):
                chain = [i]
                while chain[-1] >= 0 and it.tree[chain[-1]] >= 0:
                    chain.append(it.tree[chain[-1]])
                node_slots = own[[base + a for a in reversed(chain)]]
                row = torch.cat([own[:base], node_slots])
                rows.append(row)
                q_req[start + 1 + i] = extra
                q_kv_lens[start + 1 + i] = row.numel()
                extra += 1
        start += len(it.tokens)
    width = max(r.shape[-1] for r in rows)
    padded = [torch.nn.functional.pad(r.view(-1, r.shape[-1]), (0, width - r.shape[-1])) for r in rows]
    g.kv_slots = torch.cat(padded)
    g.q_req, g.q_kv_lens = q_req, q_kv_lens


def _flat_order(items: list[WorkItem]) -> tuple[list[int], list[int]]:
    """The items whose tokens come first in a batch (runs: extend, verify), then the one-token decodes."""
    return ([i for i, it in enumerate(items) if it.mode is not ForwardMode.DECODE],
            [i for i, it in enumerate(items) if it.mode is ForwardMode.DECODE])


def _check_batch_invariant_kernels(kernels: dict[str, str]) -> None:
    """Batch invariance rests on the C matmul and attention kernels (the torch references promise none)."""
    if not all(kernels[name].startswith("c/") for name in ("skinny_linear", "quant_linear", "paged_attention")):
        raise RuntimeError("--enable-deterministic-inference needs the C kernels (a C compiler, and PLAIT_CPU_ISA "
                           "not 'ref', PLAIT_DISABLE_C_KERNELS unset)")
