"""What a request puts into a forward (its work item), what it reads back besides its next token (its prompt's
logprobs), and what it sends out (a TokenOut with the deltas not yet sent)."""

from __future__ import annotations

import torch

from plait.runtime.forward.batch import ForwardMode
from plait.runtime.ipc.messages import DecodeSpec, TokenOut
from plait.runtime.model_executor.model_runner import WorkItem
from plait.runtime.scheduler.req import Req


def work_item(req: Req, n: int, decoding: bool) -> WorkItem:
    """The next `n` tokens of `req` (a prefill chunk, one decode token, or a draft to verify) and the
    offsets whose logits it needs: prompt positions it scores, then its last token and each draft token."""
    start = req.cached_len
    tokens = req.fill_ids[start : start + n]
    offsets: list[int] = []
    lp_start = req.input_logprob_start()
    if lp_start < req.prompt_len:
        # logits at position p score prompt token p+1
        lo, hi = max(lp_start, 1) - 1, req.prompt_len - 1
        offsets = [p - start for p in range(max(lo, start), min(hi, start + n))]
    if start + n == req.seq_len:  # logits at the last token, and at each draft token before it
        offsets.extend(range(n - 1 - len(req.draft), n))
    mode = ForwardMode.TARGET_VERIFY if req.draft else (ForwardMode.DECODE if decoding else ForwardMode.EXTEND)
    return WorkItem(req.row, start, tokens, offsets, mode, req.draft_parents if req.draft else None)


def record_input_logprobs(req: Req, item: WorkItem, rows: torch.Tensor) -> None:
    """The logprobs of the prompt tokens this item's logits `rows` score (and their top alternatives)."""
    start = item.cached_len
    if start == 0 and req.input_logprob_start() == 0:
        req.pending_input_logprobs.append((None, req.origin_input_ids[0]))  # nothing scores token 0
        req.pending_input_top.append(None)
    scored = [(i, start + off + 1) for i, off in enumerate(item.logit_offsets) if start + off + 1 < req.prompt_len]
    if scored:
        lps = torch.log_softmax(rows[[i for i, _ in scored]], dim=-1)
        for k, (_, pos) in enumerate(scored):
            tok = req.origin_input_ids[pos]
            req.pending_input_logprobs.append((float(lps[k, tok]), tok))
            top = None
            if req.top_logprobs_num:
                v, ix = torch.topk(lps[k], req.top_logprobs_num)
                top = list(zip(v.tolist(), ix.tolist()))
            req.pending_input_top.append(top)
    if req.cached_len >= req.prompt_len:
        req.input_logprobs_done = True


def has_news(req: Req) -> bool:
    return bool(req.pending_ids or req.finish is not None or req.pending_input_logprobs)


def token_out(req: Req) -> TokenOut:
    """What `req` has to say since its last TokenOut; the deltas are cleared."""
    p = req.params
    out = TokenOut(
        rid=req.rid,
        new_ids=req.pending_ids,
        finish=req.finish,
        prompt_tokens=req.prompt_len,
        completion_tokens=req.output_len,
        cached_tokens=max(req.cached_tokens, 0),
        output_logprobs=req.pending_logprobs,
        output_top_logprobs=req.pending_top,
        input_logprobs=req.pending_input_logprobs,
        input_top_logprobs=req.pending_input_top,
        queue_time=None if req.queue_time_sent else req.queue_time,
        num_retractions=req.num_retractions,
        grammar_backend=req.grammar_backend,
        grammar_narrowed=[] if req.decode_sent else req.grammar_narrowed,
        spec_verify_ct=req.spec_verify_ct,
        spec_drafted=req.spec_drafted,
        spec_accepted=req.spec_accepted,
        decode=None if req.decode_sent else DecodeSpec(p.stop, p.skip_special_tokens, p.no_stop_trim,
                                                       p.spaces_between_special_tokens),
    )
    req.decode_sent = True
    req.queue_time_sent = req.queue_time_sent or req.queue_time is not None
    req.pending_ids, req.pending_logprobs, req.pending_top = [], [], []
    req.pending_input_logprobs, req.pending_input_top = [], []
    return out
