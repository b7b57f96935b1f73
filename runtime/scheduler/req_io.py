"""What a request takes from a forward (its committed tokens, its prompt's logprobs) and sends out (a TokenOut
with the deltas not yet sent): the one writer of `Req.output_ids` and of its Stream."""

from __future__ import annotations

import torch

from plait.runtime.ipc.messages import DecodeSpec, TokenOut
from plait.runtime.model_executor.model_runner import WorkItem
from plait.runtime.scheduler.req import Req


def take_token(req: Req, tok: int, logprob: tuple[float, int] | None = None,
               top: list[tuple[float, int]] | None = None) -> None:
    """Commit `tok` to the output (sampled, or a verified draft token) and queue it for the stream."""
    req.output_ids.append(tok)
    req.stream.ids.append(tok)
    if logprob is not None and req.return_logprob:
        req.stream.logprobs.append(logprob)
        if req.top_logprobs_num:
            req.stream.top.append(top or [])


def record_input_logprobs(req: Req, item: WorkItem, rows: torch.Tensor) -> None:
    """The logprobs of the prompt tokens this item's logits `rows` score (and their top alternatives)."""
    start, s = item.cached_len, req.stream
    if start == 0 and req.input_logprob_start() == 0:
        s.input_logprobs.append((None, req.origin_input_ids[0]))  # nothing scores token 0
        s.input_top.append(None)
    scored = [(i, start + off + 1) for i, off in enumerate(item.logit_offsets) if start + off + 1 < req.prompt_len]
    if scored:
        lps = torch.log_softmax(rows[[i for i, _ in scored]], dim=-1)
        for k, (_, pos) in enumerate(scored):
            tok = req.origin_input_ids[pos]
            s.input_logprobs.append((float(lps[k, tok]), tok))
            top = None
            if req.top_logprobs_num:
                v, ix = torch.topk(lps[k], req.top_logprobs_num)
                top = list(zip(v.tolist(), ix.tolist()))
            s.input_top.append(top)
    if start + len(item.tokens) >= req.prompt_len:
        s.input_logprobs_done = True


def has_news(req: Req) -> bool:
    return bool(req.stream.ids or req.finish is not None or req.stream.input_logprobs)


def token_out(req: Req) -> TokenOut:
    """What `req` has to say since its last TokenOut; the deltas are cleared."""
    p, s = req.params, req.stream
    out = TokenOut(
        rid=req.rid,
        new_ids=s.ids,
        finish=req.finish,
        prompt_tokens=req.prompt_len,
        completion_tokens=req.output_len,
        cached_tokens=max(req.cached_tokens, 0),
        output_logprobs=s.logprobs,
        output_top_logprobs=s.top,
        input_logprobs=s.input_logprobs,
        input_top_logprobs=s.input_top,
        queue_time=None if s.queue_time_sent else req.queue_time,
        num_retractions=req.num_retractions,
        grammar_backend=req.constraint.backend,
        grammar_narrowed=[] if s.decode_sent else req.constraint.narrowed,
        spec_verify_ct=req.draft.verifies,
        spec_drafted=req.draft.drafted,
        spec_accepted=req.draft.accepted,
        embedding=_embedding(req),
        decode=None if s.decode_sent else DecodeSpec(p.stop, p.skip_special_tokens, p.no_stop_trim,
                                                     p.spaces_between_special_tokens),
    )
    s.decode_sent = True
    s.queue_time_sent = s.queue_time_sent or req.queue_time is not None
    s.ids, s.logprobs, s.top = [], [], []
    s.input_logprobs, s.input_top = [], []
    return out


def _embedding(req: Req) -> list[float] | None:
    """An embedding request's pooled vector, on its last output."""
    emb = req.embedding
    if emb is None or emb.vector is None or req.finish is None or req.finish.type != "stop":
        return None
    return emb.vector.tolist()
