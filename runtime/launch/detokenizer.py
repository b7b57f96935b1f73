"""Incremental detokenization: correct for multi-byte UTF-8 split across tokens and for stop
strings that span tokens (text that may be the start of a stop string is held back)."""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 no_stop_trim: bool = False, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        self.stop = list(stop or [])
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""  # decoded and safe to show
        self._surr = 0  # tokens before this are fully reflected in self._decoded
        self._read = 0
        self._decoded = ""  # all text decoded so far (may include a held-back tail)
        self._stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # skip_tokenizer_init: ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip,
                                     spaces_between_special_tokens=self.spaces)

    def feed(self, new_ids: list[int]) -> str:
        """Add tokens; returns the newly visible text."""
        self.ids.extend(new_ids)
        if self._stopped:
            return ""
        # decode from a few tokens back so merges across the boundary come out right
        prefix = self._decode(self.ids[self._surr : self._read])
        full = self._decode(self.ids[self._surr :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._decoded += full[len(prefix) :]
            self._surr, self._read = self._read, len(self.ids)
        return self._visible(final=False)

    def finish(self) -> str:
        """Flush everything (incomplete bytes included) and trim at a stop string."""
        if not self._stopped:
            prefix = self._decode(self.ids[self._surr : self._read])
            full = self._decode(self.ids[self._surr :])
            self._decoded += full[len(prefix) :]
            self._surr = self._read = len(self.ids)
        return self._visible(final=True)

    def _visible(self, final: bool) -> str:
        text = self._decoded
        for s in self.stop:
            idx = text.find(s)
            if idx != -1:
                text = text[: idx + (len(s) if self.no_stop_trim else 0)]
                self._stopped = True
                final = True
                self._decoded = text
        if not final and self.stop:
            # hold back a tail that could still grow into a stop string
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            text = text[: len(text) - hold]
        elif not final and text.endswith(_REPLACEMENT):
            text = text.rstrip(_REPLACEMENT)
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text if len(text) >= len(self.text) else self.text
        return delta


# ---- the detokenizer process ----------------------------------------------------------------
def run_detokenizer_process(args, addrs, ready) -> None:
    """Process entry point: ids from the scheduler in, text deltas to the client out. Control
    replies and stats pass through unchanged."""
    import logging
    import os

    import msgspec
    import zmq

    from plait.runtime.ipc.messages import BatchStrOut, BatchTokenOut, FinishReason, StrOut, ToDetokenizer
    from plait.runtime.ipc.channels import BadMessage, Receiver, Sender
    from plait.runtime.lifetime import die_with_parent, parent_alive

    die_with_parent(addrs.root)
    ppid = os.getppid()
    logging.basicConfig(level=args.log_level.upper(), format="[plait detokenizer %(asctime)s] %(message)s")
    with ready.starting():
        tokenizer = None
        if not args.skip_tokenizer_init:
            from plait.runtime.model_loader import load_tokenizer

            tokenizer = load_tokenizer(args.model_path, args.tokenizer_path)
        ctx = zmq.Context()
        inbox = Receiver(ctx, addrs.detokenizer, ToDetokenizer)
        out = Sender(ctx, addrs.client)

    decoders: dict[str, IncrementalDecoder] = {}
    failed: set[str] = set()  # requests this process failed; their later outputs are dropped
    while True:
        if not inbox.poll(1000):
            if not parent_alive(ppid):
                return
            continue
        try:
            msg = inbox.recv()
        except BadMessage as e:
            logging.error("dropped a message that does not decode: %s", e)
            continue
        if not isinstance(msg, BatchTokenOut):
            out.send(msg)
            continue
        outs = []
        for o in msg.outs:
            if o.rid in failed:
                if o.finish is not None:
                    failed.discard(o.rid)
                continue
            try:
                outs.append(StrOut(o, _detokenize(decoders, tokenizer, o)))
            except Exception as e:  # noqa: BLE001 - one request's text failing ends that request alone
                logging.exception("detokenizing request %s failed", o.rid)
                decoders.pop(o.rid, None)
                if o.finish is None:
                    failed.add(o.rid)
                reason = FinishReason("abort", status=500, message=f"internal error while detokenizing: "
                                                                    f"{type(e).__name__}: {e}")
                outs.append(StrOut(msgspec.structs.replace(o, new_ids=[], finish=reason), ""))
        out.send(BatchStrOut(outs))


def _detokenize(decoders: dict[str, IncrementalDecoder], tokenizer, o) -> str:
    """The newly visible text of one request's output."""
    from plait.runtime.ipc.messages import DecodeSpec

    dec = decoders.get(o.rid)
    if dec is None:
        spec = o.decode or DecodeSpec()  # only the first output carries it
        dec = decoders[o.rid] = IncrementalDecoder(tokenizer, spec.skip_special_tokens, spec.stop,
                                                   spec.no_stop_trim, spec.spaces_between_special_tokens)
    text = dec.feed(o.new_ids)
    if o.finish is not None:
        text += dec.finish()
        del decoders[o.rid]
    return text
