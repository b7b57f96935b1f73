"""EagleDrafter: an EAGLE head running beside the target, on the target's request table.

The head has one attention layer and keeps its own K/V in a one-layer pool indexed by the target's KV
slots: the head's K/V for position p of a request lives at the slot where the target keeps that
position's K/V. So the radix cache shares the head's K/V with the target's (a cached prefix carries
both), and freeing a slot frees both.

Two calls per step:
- `extend`: after each target forward, the head runs over every position the target just committed
  (prompt chunks, decoded tokens, kept draft tokens), reading the target's feature at p and the token
  at p + 1, and writes its K/V at their slots. Its output at a request's last committed position
  predicts the token after the one just sampled: the first draft token.
  While no request may draft (a full batch), the head skips that pass over decoded positions (`forget`):
  its cost is spared where drafts do not pay. `valid` marks the slots whose head K/V are those of the position the
  target keeps there; the head attends to valid slots only (keys carry their positions in their
  rotation, so leaving some out needs no mask), so a skipped stretch is a gap in the head's context,
  never wrong keys. A KV join carries validity with the K/V.
- `draft`: further steps feed the head its own output. Their K/V are guesses, so they go to scratch
  slots past the pool's end (not the request's slots); each step attends to the committed positions
  plus the scratch of its own earlier steps. Drafts are greedy (the head's argmax): a deterministic
  draft, which verification keeps or cuts without changing what the target generates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plait.kernels.cpu_attention import paged_attention
from plait.kernels.cpu_fused import rope_store
from plait.radix_cache.memory_pool import KVPool
from plait.runtime.layers.rotary import RotaryEmbedding
from plait.runtime.forward.batch import FINAL_HIDDEN
from plait.runtime.speculative.drafter import Draft, DraftStep, Proposal, register
from plait.runtime.speculative.eagle import EagleHead, load_eagle_head


@register("EAGLE", "EAGLE3")
def create(args, runner) -> "EagleDrafter":
    """The head beside the target (its kind must be the algorithm's)."""
    vocab = runner.model
    if runner.group.distributed:  # the head runs on rank 0 alone: it reads a whole copy of the vocabulary layers
        from plait.runtime.model_loader import load_vocab_layers

        vocab = load_vocab_layers(args.model_path, runner.dtype, args.quantization, not args.disable_packed_weights,
                                  args.quantized_matmul)
    head = load_eagle_head(args.speculative_draft_model_path, runner.config, vocab)
    if head.cfg.kind != args.speculative_algorithm:
        raise ValueError(f"speculative_algorithm {args.speculative_algorithm} but the draft model at "
                         f"{args.speculative_draft_model_path} is an {head.cfg.kind} head")
    steps = min(args.speculative_num_steps or args.speculative_num_draft_tokens - 1,
                args.speculative_num_draft_tokens - 1)
    return EagleDrafter(head, runner.req_to_token.table, runner.kv_pool.num_slots,
                        max(1, args.speculative_token_budget), steps, runner.context_length + 1,
                        runner.kv_dtype, runner.config.hf_config, args.speculative_eagle_topk)


@dataclass
class ExtendRun:
    """Positions [start, start + len(next_tokens)) of one request, just committed by the target."""

    row: int  # the request's row in the req->token table
    start: int
    features: torch.Tensor  # [n, feature_size] the target's features at those positions
    next_tokens: list[int]  # the token at p + 1 for each position p
    want_draft: bool  # keep the head's output at the last position (the request drafts next)


@dataclass
class DraftSeed:
    """Where one request's draft starts: the head's output and logits at its last committed position."""

    row: int
    committed: int  # positions with committed K/V (the sampled token sits at position `committed`)
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [draft vocab]


class EagleDrafter:
    """The Drafter of EAGLE and EAGLE3 (runtime/speculative/drafter.py); `extend`, `draft` and `draft_tree` are its
    steps. Its guesses cannot follow forced text: the head has no features for tokens the target has not computed."""

    follows_forced = False

    def __init__(self, head: EagleHead, table: torch.Tensor, num_slots: int, max_drafts: int, max_steps: int,
                 max_positions: int, kv_dtype: torch.dtype, rope_config=None, topk: int = 1):
        cfg = head.cfg
        self.head, self.table = head, table
        self.capture = cfg.aux_layer_ids if head.eagle3 else (FINAL_HIDDEN,)
        self.max_steps = max_steps
        self.scratch = num_slots  # first scratch slot; scratch_size of them follow
        self.scratch_size = max_drafts * max_steps * topk
        self.pool = KVPool(num_slots + self.scratch_size, 1, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        self.valid = torch.zeros(num_slots, dtype=torch.bool)  # see the module docstring
        self.rotary = RotaryEmbedding(rope_config, cfg.head_dim, cfg.rope_theta, max_positions, torch.float32)
        self.scale = cfg.head_dim ** -0.5
        self.topk, self.drafts_trees = topk, topk > 1

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, store: torch.Tensor,
              kv_slots: torch.Tensor, lens: torch.Tensor, q_rows: torch.Tensor) -> torch.Tensor:
        """One pass of the head's layer: K/V stored at `store`, query t attends to kv_slots[q_rows[t], :lens[t]]."""
        cfg, head = self.head.cfg, self.head
        qkv, residual = head.layer_input(head.embed_tokens(tokens), head.fuse(hidden))
        cos, sin = self.rotary.tables(positions)
        q = rope_store(qkv.contiguous(), cos, sin, cfg.num_heads, cfg.num_kv_heads, self.pool.k[0], self.pool.v[0],
                       store)
        t = q.shape[0]
        groups = cfg.num_heads // cfg.num_kv_heads
        out, _ = paged_attention(q.view(t, cfg.num_kv_heads, groups, cfg.head_dim), self.pool.k[0], self.pool.v[0],
                                 kv_slots, lens, self.scale, q_rows)
        return head.layer_output(out.reshape(t, cfg.num_heads * cfg.head_dim), residual)

    def _valid_rows(self, rows: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Request b's slots at positions [0, ends[b]) with valid head K/V, packed to the left ([B, W], padded
        with slot 0), and cum[b, p]: how many of positions 0..p are valid (None when every one is: the slots
        are then the table's own rows and counts are positions + 1)."""
        width = int(ends.max())
        slots = self.table[rows, :width]
        inside = torch.arange(width) < ends[:, None]
        ok = self.valid[slots] & inside
        if bool((ok == inside).all()):
            return slots, None
        cum = ok.cumsum(1)
        packed = torch.zeros_like(slots)
        b, p = ok.nonzero(as_tuple=True)
        packed[b, cum[b, p] - 1] = slots[b, p]
        return packed, cum

    def forget(self, runs: list[ExtendRun]) -> None:
        """The target committed these positions and the head did not read them: their slots hold no valid
        head K/V (they may hold an earlier owner's)."""
        for r in runs:
            self.valid[self.table[r.row, r.start : r.start + len(r.next_tokens)]] = False

    @torch.inference_mode()
    def extend(self, runs: list[ExtendRun]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The head over committed positions; for each run that wants a draft, (hidden, logits) at its last."""
        runs_ = [r for r in runs if r.next_tokens]
        if not runs_:
            return [None] * len(runs)
        counts = torch.tensor([len(r.next_tokens) for r in runs_])
        positions = torch.cat([torch.arange(r.start, r.start + len(r.next_tokens)) for r in runs_])
        rows = torch.tensor([r.row for r in runs_])
        q_rows = torch.repeat_interleave(torch.arange(len(runs_)), counts)
        store = self.table[rows[q_rows], positions]
        self.valid[store] = True
        kv_slots, cum = self._valid_rows(rows, torch.tensor([r.start + len(r.next_tokens) for r in runs_]))
        lens = positions + 1 if cum is None else cum[q_rows, positions]
        tokens = torch.tensor([t for r in runs_ for t in r.next_tokens], dtype=torch.int64)
        hidden = torch.cat([r.features for r in runs_])
        h = self._step(tokens, hidden, positions, store, kv_slots, lens, q_rows)
        last = torch.cumsum(counts, 0) - 1
        wanted = [i for i, r in enumerate(runs_) if r.want_draft]
        logits = self.head.logits(h[last[wanted]]) if wanted else None
        found = {id(runs_[i]): (h[last[i]], logits[k]) for k, i in enumerate(wanted)}
        return [found.get(id(r)) for r in runs]

    @torch.inference_mode()
    def draft(self, seeds: list[DraftSeed], sizes: list[int]) -> list[list[int]]:
        """Greedy drafts of sizes[b] tokens (b < max_drafts, sizes within max_steps) in target ids."""
        if not seeds:
            return []
        head = self.head
        drafts = [[int(head.to_target(s.logits.argmax()).item())] for s in seeds]
        steps = max(sizes)
        committed = torch.tensor([s.committed for s in seeds])
        rows = torch.tensor([s.row for s in seeds])
        packed, cum = self._valid_rows(rows, committed)
        known = committed if cum is None else cum[:, -1]  # valid committed keys of each request (packed first)
        kv_slots = torch.nn.functional.pad(packed, (0, int(known.max()) + steps - packed.shape[1]))
        hidden = torch.stack([s.hidden for s in seeds])
        for s in range(1, steps):
            active = [b for b, n in enumerate(sizes) if n > s]
            if not active:
                break
            idx = torch.tensor(active)
            positions = committed[idx] + s - 1
            col = known[idx] + s - 1  # where this step's key sits in each packed row
            store = self.scratch + idx * self.max_steps + (s - 1)
            kv_slots[idx, col] = store
            tokens = torch.tensor([drafts[b][-1] for b in active], dtype=torch.int64)
            h = self._step(tokens, hidden[idx], positions, store, kv_slots[idx], col + 1, torch.arange(len(active)))
            picks = head.to_target(head.logits(h).argmax(-1)).tolist()
            for k, b in enumerate(active):
                drafts[b].append(picks[k])
            hidden[idx] = h
        return [d[:n] for d, n in zip(drafts, sizes)]

    @torch.inference_mode()
    def draft_tree(self, seeds: list[DraftSeed], sizes: list[int], depth: list[int], topk: int
                   ) -> list[tuple[list[int], list[int]]]:
        """EAGLE-2 dynamic trees: from each seed the `topk` likeliest tokens; then, step by step down to
        depth[b], the `topk` nodes of the deepest level with the highest cumulative draft log-probability are
        expanded by one head pass each, their children scored. The tree is the sizes[b] best nodes overall (by
        cumulative log-probability, a node only after its parent). Returns (tokens, parents) per seed, in
        target ids, parents before children (-1: the sampled token)."""
        if not seeds:
            return []
        head = self.head
        # per request: candidates (score, depth, token, parent candidate); frontier: (b, candidate, hidden, chain)
        cands: list[list[tuple[float, int, int, int]]] = [[] for _ in seeds]
        frontier = []
        logp = torch.log_softmax(torch.stack([s.logits for s in seeds]).float(), -1)
        vals, ids = logp.topk(topk, -1)
        toks = head.to_target(ids).tolist()
        for b, seed in enumerate(seeds):
            for k in range(topk):
                cands[b].append((float(vals[b, k]), 1, toks[b][k], -1))
                frontier.append((b, len(cands[b]) - 1, seed.hidden, []))
        for d in range(2, max(depth) + 1):
            frontier = [f for f in frontier if depth[f[0]] >= d]
            if not frontier:
                break
            positions = torch.tensor([seeds[b].committed + d - 2 for b, *_ in frontier])
            local = [sum(1 for f in frontier[:j] if f[0] == b) for j, (b, *_) in enumerate(frontier)]
            # scratch slot of (request b, level d, frontier node k): unique within this draft
            store = torch.tensor([self.scratch + (b * self.max_steps + d - 2) * topk + k
                                  for k, (b, *_) in zip(local, frontier)])
            rows = [torch.cat([self._valid_prefix(seeds[b]), torch.tensor(chain, dtype=torch.int64),
                               store[j : j + 1]]) for j, (b, _, _, chain) in enumerate(frontier)]
            width = max(r.numel() for r in rows)
            kv_slots = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
            tokens = torch.tensor([cands[b][c][2] for b, c, _, _ in frontier], dtype=torch.int64)
            hidden = torch.stack([h for _, _, h, _ in frontier])
            lens = torch.tensor([r.numel() for r in rows])
            h = self._step(tokens, hidden, positions, store, kv_slots, lens, torch.arange(len(frontier)))
            logp = torch.log_softmax(head.logits(h), -1)
            vals, ids = logp.topk(topk, -1)
            toks = head.to_target(ids).tolist()
            children: dict[int, list] = {}
            for j, (b, c, _, chain) in enumerate(frontier):
                for k in range(topk):
                    cands[b].append((cands[b][c][0] + float(vals[j, k]), d, toks[j][k], c))
                    children.setdefault(b, []).append((cands[b][-1][0], len(cands[b]) - 1, h[j], chain + [int(store[j])]))
            frontier = [(b, c, hj, chain) for b, kids in children.items()
                        for _, c, hj, chain in sorted(kids, key=lambda x: -x[0])[:topk]]
        return [_best_tree(cands[b], sizes[b]) for b in range(len(seeds))]

    def _valid_prefix(self, seed: DraftSeed) -> torch.Tensor:
        """The slots of a request's committed positions whose head K/V are valid."""
        slots = self.table[seed.row, : seed.committed]
        return slots[self.valid[slots]]

    def propose(self, step: DraftStep) -> Proposal:
        """The head first reads every position the forward committed, then drafts from the last of each request
        in `step.sizes`: chains, or trees for those in `step.depths`."""
        runs, owners, dropped = [], [], []
        for c in step.committed:
            req, feats = c.req, c.features
            if req.draft.verified_rows is not None:  # a tree's kept path, in position order
                feats = feats[req.draft.verified_rows]
            if c.count <= 0:
                continue
            # a finished request's positions too: a later request may reuse them from the radix cache
            nxt = req.fill_ids[c.start + 1 : c.start + c.count + 1]
            run = ExtendRun(req.kv.row, c.start, feats[: len(nxt)], nxt, req in step.sizes)
            # with no room for drafts (a full batch), the head skips decoded positions: a gap in its context when
            # drafting resumes; prompt chunks it still reads (a request's whole prompt context)
            if (step.no_room and not c.prompt) or (req.finish is not None and req.finish.type == "abort"):
                dropped.append(run)
            else:
                runs.append(run)
                owners.append(req)
        self.forget(dropped)
        seeds: dict[bool, list[DraftSeed]] = {False: [], True: []}
        drafting: dict[bool, list] = {False: [], True: []}
        for req, out in zip(owners, self.extend(runs)):
            if out is not None:
                tree = req in step.depths
                seeds[tree].append(DraftSeed(req.kv.row, req.kv.cached_len, *out))
                drafting[tree].append(req)
        start = time.perf_counter()
        chain_sizes = [step.sizes[r] for r in drafting[False]]
        drafts = {req: Draft(d) for req, d in zip(drafting[False], self.draft(seeds[False], chain_sizes))}
        depth = [step.depths[r] for r in drafting[True]]
        trees = self.draft_tree(seeds[True], [step.sizes[r] for r in drafting[True]], depth, self.topk)
        drafts.update({req: Draft(*t) for req, t in zip(drafting[True], trees)})
        return Proposal(drafts, max(chain_sizes + depth, default=0), time.perf_counter() - start)

    def flush(self) -> None:
        pass  # its K/V go with the target's

    def release(self, req) -> None:
        pass  # its K/V live at the request's slots, which the radix cache keeps or frees

    def stats(self) -> dict:
        cfg = self.head.cfg
        return {"spec_draft_head": {"kind": cfg.kind, "draft_vocab_size": cfg.draft_vocab_size,
                                    "aux_layer_ids": list(cfg.aux_layer_ids)}}

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """The head's K/V follow a KV join like the target's (keys moved on by `shift` positions)."""
        k, v = self.pool.k[0], self.pool.v[0]
        k[:, dst] = self.rotary.shift_keys(k[:, src], shift).to(k.dtype)
        v[:, dst] = v[:, src]
        self.valid[dst] = self.valid[src]


def _best_tree(cands: list[tuple[float, int, int, int]], size: int) -> tuple[list[int], list[int]]:
    """The `size` candidates with the highest cumulative log-probability, each only after its parent (so the
    set is a tree), as (tokens, parents) with parents indexing the chosen list (-1: the root)."""
    chosen: dict[int, int] = {}  # candidate -> its index in the tree
    tokens, parents = [], []
    pending = sorted(range(len(cands)), key=lambda i: (-cands[i][0], cands[i][1]))
    progress = True
    while len(tokens) < size and progress:
        progress = False
        for i in pending:
            if i in chosen:
                continue
            parent = cands[i][3]
            if parent >= 0 and parent not in chosen:
                continue
            chosen[i] = len(tokens)
            tokens.append(cands[i][2])
            parents.append(-1 if parent < 0 else chosen[parent])
            progress = True
            break
    return tokens, parents
