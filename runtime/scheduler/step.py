"""One step's plan as data: what each request feeds the next forward and which logits rows it reads back.

Admission decides the work (`Work`: a request, how many tokens, and what they are: a prompt chunk, a decode,
or a draft to verify); `Step` lays it out for the runner (a WorkItem each) and says where each request's rows
are in the logits the forward returns."""

from __future__ import annotations

from dataclasses import dataclass

from plait.runtime.forward.batch import ForwardMode
from plait.runtime.model_executor.model_runner import WorkItem
from plait.runtime.scheduler.req import Req


@dataclass(frozen=True)
class Work:
    """`n` tokens of `req` from its kv.cached_len on: EXTEND (a prompt chunk, or a resumed request's
    recomputed tokens), DECODE (the token sampled last step) or TARGET_VERIFY (that token and its draft)."""

    req: Req
    n: int
    mode: ForwardMode


@dataclass(frozen=True)
class Planned:
    work: Work
    item: WorkItem
    rows: range  # its rows of the forward's logits: scored prompt positions, then its last token and its draft

    @property
    def req(self) -> Req:
        return self.work.req

    @property
    def completes(self) -> bool:
        """Whether the forward computes the rest of the request's tokens (it then samples or verifies)."""
        return self.item.cached_len + self.work.n == self.req.fill_len

    @property
    def next_row(self) -> int:
        """The row at the request's last committed token: its next token's logits (a draft's rows follow)."""
        return self.rows.stop - 1 - len(self.req.draft.tokens)


def work_item(work: Work) -> WorkItem:
    """The WorkItem of `work` and the offsets whose logits it needs: prompt positions it scores, then (when it
    completes the request's tokens) its last committed token and each draft token."""
    req, n = work.req, work.n
    start = req.kv.cached_len
    offsets: list[int] = []
    lp_start = req.input_logprob_start()
    if lp_start < req.prompt_len:
        # logits at position p score prompt token p+1
        lo, hi = max(lp_start, 1) - 1, req.prompt_len - 1
        offsets = [p - start for p in range(max(lo, start), min(hi, start + n))]
    if start + n == req.fill_len:
        offsets.extend(range(n - 1 - len(req.draft.tokens), n))
    tree = req.draft.parents if work.mode is ForwardMode.TARGET_VERIFY else None
    return WorkItem(req.kv.row, start, req.fill_ids[start : start + n], offsets, work.mode, tree, req.lora_slot)


class Step:
    """The works of one forward, in the runner's item order, each with its item and logits rows."""

    def __init__(self, works: list[Work]):
        self.planned: list[Planned] = []
        row = 0
        for w in works:
            item = work_item(w)
            self.planned.append(Planned(w, item, range(row, row + len(item.logit_offsets))))
            row += len(item.logit_offsets)

    def __len__(self) -> int:
        return len(self.planned)

    @property
    def items(self) -> list[WorkItem]:
        return [p.item for p in self.planned]

    @property
    def reqs(self) -> list[Req]:
        return [p.req for p in self.planned]

    @property
    def decoding_only(self) -> bool:
        """Decodes and verifies only, no prompt chunk: the forwards drafts are weighed against."""
        return all(p.work.mode is not ForwardMode.EXTEND for p in self.planned)

    @property
    def speculative(self) -> bool:
        """Whether it verifies a speculative guess (not only the grammar's forced text)."""
        return any(p.req.draft.guess_len for p in self.planned)

    def completing(self) -> list[Req]:
        """The requests that sample or verify after this forward."""
        return [p.req for p in self.planned if p.completes]

    def tokens(self) -> int:
        return sum(p.work.n for p in self.planned)
