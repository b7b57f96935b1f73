"""StandaloneDrafter: a smaller model of the same vocabulary drafts for the target (SGLang's STANDALONE).

The draft model keeps its own K/V in a pool indexed by the target's KV slots, as an EAGLE head does: its K/V
for position p of a request lives at the slot where the target keeps p's. So a prefix the radix cache shares
carries the draft's K/V with the target's, a KV join moves both, and freeing a slot frees both.

It works lazily. A request's committed positions get draft K/V only when the request drafts: the first pass
of a draft catches up from the first position whose slot holds none (`valid`, one bit per slot, cleared
whenever the target commits a position there, since a slot may hold an earlier owner's) through the token
just sampled, and its last row predicts the first draft token. Requests the measured policy leaves without a
draft (a full batch, a draft that does not pay) cost the draft model nothing. Further draft tokens feed back
the draft's own picks; their K/V are guesses, so they go to scratch slots past the pool's end, as does the
just-sampled token's (its slot is the target's to fill).

Drafts are the draft model's argmax: a deterministic draft, which the shared verification keeps or cuts
token by token without changing what the target generates, greedy or sampled. The argmax runs over a
restricted vocabulary (`--speculative-draft-vocab-size`, as FR-Spec and EAGLE-3's heads do): BPE vocabularies
number tokens roughly by how often they occur, so the first ids and the stop tokens hold nearly every token a
draft keeps, while a 152k-entry LM head is a third of a small draft model's step.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from plait.kernels import cpu_quant
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.forward.batch import ForwardBatch, ForwardMode, build_group
from plait.runtime.model_executor.graph_runner import build_graph_runner
from plait.runtime.model_loader import load_model
from plait.runtime.speculative.drafter import Draft, DraftStep, Proposal, register


@register("STANDALONE")
def create(args, runner) -> "StandaloneDrafter":
    """The draft model, whole on this process (under tensor parallelism it drafts on rank 0 alone)."""
    loaded = load_model(args.speculative_draft_model_path, runner.dtype, runner.context_length + 1, progress=False,
                        with_tokenizer=runner.tokenizer is not None, quantization=args.quantization,
                        packed=not args.disable_packed_weights, matmul=args.quantized_matmul)
    _check_vocabulary(runner, loaded, args.speculative_draft_model_path)
    steps = min(args.speculative_num_steps or args.speculative_num_draft_tokens - 1,
                args.speculative_num_draft_tokens - 1)
    vocab = min(runner.config.vocab_size, loaded.config.vocab_size)
    if 0 < args.speculative_draft_vocab_size < vocab:
        stops = set(runner.config.eos_token_ids) | set(loaded.config.eos_token_ids)
        keep = sorted(set(range(args.speculative_draft_vocab_size)) | {t for t in stops if t < vocab})
        loaded.model.lm_head = SubsetHead(loaded.model.lm_head, torch.tensor(keep))
    return StandaloneDrafter(loaded.model, runner.req_to_token.table, runner.kv_pool.num_slots,
                             max(1, args.speculative_token_budget), steps, runner.kv_dtype, vocab,
                             native=not args.disable_native_decode, batch_invariant=runner.batch_invariant)


class SubsetHead(nn.Module):
    """An LM head over some token ids only: their rows of the full head, in 8-bit blocks where the C kernels run
    (the logits' column i is token ids[i])."""

    def __init__(self, full, ids: torch.Tensor):
        super().__init__()
        self.ids = ids
        w = full.embed(ids).float()
        fmt = cpu_quant.Q8_0
        self.blocks = cpu_quant.QuantMatmul(cpu_quant.interleave(cpu_quant.quantize(w, fmt), fmt), fmt) \
            if w.shape[1] % fmt.block_size == 0 else None
        self.weight = None if self.blocks is not None else w

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        x = x.float()
        return self.blocks(x, batch_invariant) if self.blocks is not None else x @ self.weight.T


def _check_vocabulary(runner, loaded, path: str) -> None:
    """A draft speaks in the target's token ids: the two tokenizers must be one vocabulary."""
    if runner.tokenizer is not None and loaded.tokenizer is not None:
        same = runner.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    else:  # no tokenizers to compare (--skip-tokenizer-init): the sizes at least
        same = runner.config.vocab_size == loaded.config.vocab_size
    if not same:
        raise ValueError(f"speculative_draft_model_path {path}: its vocabulary is not the target's (a draft model "
                         "must share the target's tokenizer, e.g. a smaller model of the same family)")


class StandaloneDrafter:
    """The Drafter of STANDALONE (runtime/speculative/drafter.py). Its guesses cannot follow forced text the target
    has not verified (they would need the draft's K/V for it); chains only."""

    capture: tuple[int, ...] = ()
    follows_forced = False
    drafts_trees = False

    def __init__(self, model, table: torch.Tensor, num_slots: int, max_drafts: int, max_steps: int,
                 kv_dtype: torch.dtype, vocab: int, native: bool = True, batch_invariant: bool = False):
        self.model, self.table = model, table
        self.max_steps = max_steps
        self.scratch = num_slots  # first scratch slot: max_steps of them per drafting request follow
        cfg = model.cfg
        self.pool = KVPool(num_slots + max_drafts * max_steps, cfg.num_layers, model.layers[0].num_kv_heads,
                           cfg.head_dim, kv_dtype)
        self.model.graph = build_graph_runner(model, self.pool) if native else None
        self.valid = torch.zeros(num_slots, dtype=torch.bool)  # see the module docstring
        self.done: dict = {}  # Req -> its leading positions known to have valid draft K/V
        head = model.lm_head
        # the logits' columns as token ids (a subset head's), and the columns the target's vocabulary holds
        self.ids = head.ids if isinstance(head, SubsetHead) else None
        self.vocab = vocab if self.ids is None else len(self.ids)
        self.passes = self.drafted = self.caught_up = 0
        self.batch_invariant = batch_invariant  # the target's: a draft of the target itself then matches it bit for bit

    def propose(self, step: DraftStep) -> Proposal:
        for c in step.committed:  # the target wrote these slots: whatever draft K/V they held is not theirs
            if c.count > 0:
                self.valid[self.table[c.req.kv.row, c.start : c.start + c.count]] = False
                if c.req in self.done:
                    self.done[c.req] = min(self.done[c.req], c.start)
        reqs = list(step.sizes)
        if not reqs:
            return Proposal()
        start = time.perf_counter()
        picks, prompt = self._catch_up(reqs)
        seconds = 0.0 if prompt else time.perf_counter() - start  # a prompt's catch-up is a prefill: not a step's price
        drafts = [[t] for t in picks]
        sizes = [step.sizes[r] for r in reqs]
        start = time.perf_counter()
        for s in range(1, max(sizes)):
            active = [b for b, n in enumerate(sizes) if n > s]
            picks = self._step([reqs[b] for b in active], active, s, [drafts[b][-1] for b in active])
            for b, tok in zip(active, picks):
                drafts[b].append(tok)
        seconds += time.perf_counter() - start
        self.drafted += sum(sizes)
        steps = max(sizes) - (1 if prompt else 0)
        return Proposal({req: Draft(d[:n]) for req, d, n in zip(reqs, drafts, sizes)}, steps, seconds)

    def _first_missing(self, req) -> int:
        """The first position of req's committed ones whose slot holds no draft K/V."""
        known = self.done.get(req)
        if known is None:  # a new request: a prefix from the radix cache may carry draft K/V already
            ok = self.valid[self.table[req.kv.row, : req.kv.cached_len]]
            known = int(ok.to(torch.int32).cumprod(0).sum()) if ok.numel() else 0
        return known

    def _catch_up(self, reqs: list) -> tuple[list[int], bool]:
        """One pass over each request's positions without draft K/V, through the token just sampled (at position
        cached_len, stored in the request's first scratch slot); returns the first draft token of each, and
        whether a prompt was read (some catch-up started inside the prompt)."""
        ids, positions, out_slots, rows, q_lens, prompt = [], [], [], [], [], False
        for b, req in enumerate(reqs):
            first, end = self._first_missing(req), req.kv.cached_len
            fill = req.fill_ids
            own = self.table[req.kv.row, :end]
            sampled = torch.tensor([self.scratch + b * self.max_steps])
            ids.extend(fill[first : end + 1])
            positions.append(torch.arange(first, end + 1))
            out_slots.append(torch.cat([own[first:], sampled]))
            rows.append(torch.cat([own, sampled]))
            q_lens.append(end + 1 - first)
            prompt |= first < req.prompt_len
            self.valid[own[first:]] = True
            self.done[req] = end
            self.caught_up += end - first
        return self._forward(ids, torch.cat(positions), torch.cat(out_slots), rows, q_lens, prompt), prompt

    def _step(self, reqs: list, index: list[int], s: int, tokens: list[int]) -> list[int]:
        """Draft step s: each request's draft token s at position cached_len + s, its K/V in scratch."""
        positions, out_slots, rows = [], [], []
        for b, req in zip(index, reqs):
            base = self.scratch + b * self.max_steps
            positions.append(req.kv.cached_len + s)
            out_slots.append(base + s)
            rows.append(torch.cat([self.table[req.kv.row, : req.kv.cached_len], torch.arange(base, base + s + 1)]))
        return self._forward(tokens, torch.tensor(positions), torch.tensor(out_slots), rows, [1] * len(reqs), False)

    @torch.inference_mode()
    def _forward(self, ids: list[int], positions: torch.Tensor, out_slots: torch.Tensor, rows: list[torch.Tensor],
                 q_lens: list[int], prompt: bool) -> list[int]:
        """The draft model over the requests' new tokens (each request's keys: its row, its new tokens' last);
        the argmax at each request's last token."""
        kv_lens = torch.tensor([r.numel() for r in rows])
        width = int(kv_lens.max())
        kv = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
        q = torch.tensor(q_lens)
        group = build_group(0, kv, kv_lens, q, cascade=False)
        one = max(q_lens) == 1
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if one else ForwardMode.TARGET_VERIFY,
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=positions, out_slots=out_slots,
            extend=None if one else group, decode=group if one else None,
            logits_rows=torch.cumsum(q, 0) - 1, batch_invariant=self.batch_invariant, has_prompt=prompt)
        with fb.active():
            logits, _ = self.model(self.pool)
        self.passes += 1
        picks = logits[:, : self.vocab].argmax(-1)
        return (picks if self.ids is None else self.ids[picks]).tolist()

    def flush(self) -> None:
        pass  # its K/V go with the target's slots

    def release(self, req) -> None:
        self.done.pop(req, None)

    @torch.inference_mode()
    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """The draft's K/V follow a KV join like the target's (keys moved on by `shift` positions)."""
        for i, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
            k[:, dst] = self.model.rotary_of(i).shift_keys(k[:, src], shift).to(k.dtype)
            v[:, dst] = v[:, src]
        self.valid[dst] = self.valid[src]

    def stats(self) -> dict:
        cfg = self.model.cfg
        return {"spec_draft_model": {"model_type": cfg.model_type, "layers": cfg.num_layers,
                                     "hidden_size": cfg.hidden_size, "passes": self.passes,
                                     "draft_tokens": self.drafted, "caught_up_tokens": self.caught_up}}
