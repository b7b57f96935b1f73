"""SUFFIX drafts (SuffixDecoding, Oliaro et al.): no model, what followed the context's longest earlier match.

Agent loops, code edits and structured output repeat themselves: a tool call's JSON, the code just read, a
phrase from the prompt. Two stores of earlier text are searched:
- the request's own tokens (its prompt and what it has generated), and
- the outputs of earlier requests (each with the tail of its prompt, so the start of an answer matches too),
  bounded to `--speculative-suffix-max-cached-requests`, the least recently matched dropped first.

A suffix tree of depth `--speculative-suffix-max-depth` answers two questions: the longest suffix of the
context seen before, and how often each continuation followed it. The same answers come from an index of
where each pair of adjacent tokens occurs: the pair ending the context gives the candidates, each is extended
backwards to its match length, the longest win, and their continuations form the tree's subtree with its
counts. Indexing is one dictionary entry per token instead of one node per token and depth.

From those continuations the draft is the most frequent path (or, where the scheduler verifies trees, the
likeliest nodes): a token's probability is the share of the occurrences reaching its parent that continue
with it, and a draft stops where that product falls below `--speculative-suffix-min-token-prob`, or at
`--speculative-suffix-max-spec-factor` times the match's length (a long match earns a long draft). Of the
request's store and the shared one, the draft with more expected kept tokens wins. How many tokens a
request may draft at all is the measured policy's (SpecManager), as for every drafter.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from plait.runtime.speculative.drafter import Draft, DraftStep, Proposal, register

_PER_PAIR = 64  # occurrences kept per token pair, the latest: enough for a context's recent repeats
_PROMPT_TAIL = 16  # tokens of a finished request's prompt stored before its output
_SHIFT = 32  # an occurrence is (sequence << _SHIFT) | end


def _match_len(a: list[int], a_end: int, b: list[int], b_end: int, cap: int) -> int:
    """How many tokens a[:a_end] and b[:b_end] share at their ends, at most `cap` (slices compare in C)."""
    cap = min(cap, a_end, b_end)
    lo, hi = 0, cap  # a[a_end - lo:a_end] == b[b_end - lo:b_end] holds for lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[a_end - mid : a_end] == b[b_end - mid : b_end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SuffixIndex:
    """Where each pair of adjacent tokens ends in a set of growing token sequences (the latest `_PER_PAIR`)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.pairs: dict[tuple[int, int], list[int]] = {}  # pair -> occurrences, oldest first
        self.tokens = 0

    def extend(self, seq: int, tokens: list[int]) -> None:
        """Append `tokens` to sequence `seq` (a new one if unknown) and index the pairs they end."""
        s = self.seqs.setdefault(seq, [])
        start = len(s)
        s.extend(tokens)
        self.tokens += len(tokens)
        for end in range(max(start, 1) + 1, len(s) + 1):
            occ = self.pairs.setdefault((s[end - 2], s[end - 1]), [])
            occ.append(seq << _SHIFT | end)
            if len(occ) > _PER_PAIR:
                del occ[0]

    def remove(self, seq: int) -> None:
        s = self.seqs.pop(seq)
        self.tokens -= len(s)
        for end in range(2, len(s) + 1):
            key = (s[end - 2], s[end - 1])
            occ = self.pairs.get(key)
            if occ is not None:
                occ[:] = [o for o in occ if o >> _SHIFT != seq]
                if not occ:
                    del self.pairs[key]

    def matches(self, ctx: list[int], depth: int) -> tuple[int, list[tuple[int, int]]]:
        """(the longest match of ctx's last tokens, at most `depth`; the occurrences matching that long with a
        continuation, as (sequence, end))."""
        if len(ctx) < 2:
            return 0, []
        best, found = 0, []
        mask = (1 << _SHIFT) - 1
        for occ in reversed(self.pairs.get((ctx[-2], ctx[-1]), ())):
            seq, end = occ >> _SHIFT, occ & mask
            s = self.seqs[seq]
            if end >= len(s):  # nothing followed it yet (the context's own end)
                continue
            if best and s[end - best : end] != ctx[-best:]:
                continue  # shorter than the best so far (one compare rules most out)
            m = _match_len(ctx, len(ctx), s, end, depth)
            if m > best:
                best, found = m, [(seq, end)]
            elif m == best:
                found.append((seq, end))
        return best, found


def draft_from(conts: list[list[int]], size: int, min_prob: float, tree: bool) -> tuple[Draft, float]:
    """A draft from the continuations of a match's occurrences, and its expected kept tokens (the sum of its
    tokens' probabilities). A chain follows the most frequent child; a tree takes the likeliest nodes."""
    # trie of the continuations: node -> {token: child}; counts[child]: occurrences passing through it
    children: list[dict[int, int]] = [{}]
    counts = [len(conts)]
    for cont in conts:
        node = 0
        for t in cont:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = children[node][t] = len(counts)
                children.append({})
                counts.append(0)
            counts[nxt] += 1
            node = nxt
    tokens, parents, score = [], [], 0.0
    if not tree:
        node, prob = 0, 1.0
        while len(tokens) < size and children[node]:
            t, nxt = max(children[node].items(), key=lambda kv: counts[kv[1]])
            prob *= counts[nxt] / counts[node]
            if prob < min_prob:
                break
            tokens.append(t)
            score += prob
            node = nxt
        return Draft(tokens), score
    # best first: (-probability, order, node, token, its parent's index in the draft)
    heap, order = [], 0
    for t, nxt in children[0].items():
        heapq.heappush(heap, (-counts[nxt] / counts[0], order, nxt, t, -1))
        order += 1
    while heap and len(tokens) < size:
        neg, _, node, t, parent = heapq.heappop(heap)
        if -neg < min_prob:
            break
        tokens.append(t)
        parents.append(parent)
        score -= neg
        for tc, nxt in children[node].items():
            heapq.heappush(heap, (neg * counts[nxt] / counts[node], order, nxt, tc, len(tokens) - 1))
            order += 1
    return Draft(tokens, parents), score


class _Own:
    """A request's own store: its prompt and the output tokens verified so far."""

    def __init__(self, prompt: list[int]) -> None:
        self.index = SuffixIndex()
        self.index.extend(0, prompt)
        self.indexed_out = 0  # output tokens indexed


@register("SUFFIX")
class SuffixDrafter:
    capture: tuple[int, ...] = ()
    follows_forced = True

    def __init__(self, args, runner=None):
        self.depth = args.speculative_suffix_max_depth
        self.factor = args.speculative_suffix_max_spec_factor
        self.min_prob = args.speculative_suffix_min_token_prob
        self.max_requests = args.speculative_suffix_max_cached_requests
        self.drafts_trees = args.page_size == 1  # a kept tree path moves its KV slots one by one
        self.own: dict = {}  # Req -> _Own
        self.shared = SuffixIndex()
        self.recent: OrderedDict[int, None] = OrderedDict()  # shared sequences, least recently matched first
        self.next_seq = 0
        self.wins = {"own": 0, "shared": 0}  # drafts taken from each store

    def propose(self, step: DraftStep) -> Proposal:
        drafts = {}
        for req, size in step.sizes.items():
            ctx = self._context(req)
            tree = req in step.depths
            best, score, used = None, 0.0, None
            for name, index in (("own", self.own[req].index), ("shared", self.shared)):
                length, found = index.matches(ctx, self.depth)
                if not found:
                    continue
                reach = math.ceil(self.factor * length)  # a long match earns a long draft
                span = min(reach, step.depths[req] if tree else size)
                conts = [index.seqs[seq][end : end + span] for seq, end in found]
                draft, s = draft_from(conts, size if tree else span, self.min_prob, tree)
                if draft.tokens and s > score:
                    best, score, used = draft, s, (name, found)
            if best is not None:
                drafts[req] = best
                self.wins[used[0]] += 1
                if used[0] == "shared":
                    for seq, _ in used[1]:
                        self.recent.move_to_end(seq)
        return Proposal(drafts)

    def _context(self, req) -> list[int]:
        """The request's last `depth` tokens (unverified forced text included), its store caught up with the
        verified ones."""
        own = self.own.get(req)
        if own is None:
            own = self.own[req] = _Own(req.origin_input_ids)
        if req.output_len > own.indexed_out:
            own.index.extend(0, req.output_ids[own.indexed_out :])
            own.indexed_out = req.output_len
        seq = own.index.seqs[0]
        return seq[-self.depth :] + req.draft.tokens

    def release(self, req) -> None:
        """The request's output joins the shared store; its own store goes."""
        self.own.pop(req, None)
        out = req.output_ids
        if not out or self.max_requests == 0:
            return
        seq = self.next_seq
        self.next_seq += 1
        self.shared.extend(seq, req.origin_input_ids[-_PROMPT_TAIL:] + out)
        self.recent[seq] = None
        while len(self.recent) > self.max_requests:
            old, _ = self.recent.popitem(last=False)
            self.shared.remove(old)

    def flush(self) -> None:
        self.shared, self.recent = SuffixIndex(), OrderedDict()

    def copy_kv(self, src, dst, shift) -> None:
        pass

    def stats(self) -> dict:
        return {"spec_suffix": {"cached_requests": len(self.recent), "cached_tokens": self.shared.tokens,
                                "drafts_own": self.wins["own"], "drafts_shared": self.wins["shared"]}}

