"""What rank 0 tells the other ranks each step: a typed message (msgspec, never pickle) broadcast
over the group.

Rank 0's scheduler decides everything (admission, the radix cache, KV slots, sampling); a step's
message carries only what the model's forward reads (the ForwardBatch: token ids, positions, KV
slots and attention metadata, and which layers' features to keep), so the other ranks run the same
forward over their shard of the weights and KV heads with no scheduler state of their own. Other
operations on the KV pool (a KV join's copy) travel the same way; `tick` keeps an idle group's
collectives from timing out; `stop` ends the other ranks.
"""

from __future__ import annotations

import msgspec
import torch

from plait.runtime.distributed.group import Group
from plait.runtime.forward.batch import AttnGroup, ForwardBatch, ForwardMode


class Tensor(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes

    @staticmethod
    def of(t: torch.Tensor) -> "Tensor":
        t = t.contiguous()
        return Tensor(str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())

    def get(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.dtype)) if self.data else \
            torch.empty(0, dtype=getattr(torch, self.dtype))
        return flat.view(self.shape)


class AttnMsg(msgspec.Struct, array_like=True):
    start: int
    num_tokens: int
    kv_slots: Tensor
    kv_lens: Tensor
    q_req: Tensor | None
    q_kv_lens: Tensor | None
    prefix_slots: Tensor | None


class Forward(msgspec.Struct, tag="forward", array_like=True):
    mode: str
    input_ids: Tensor
    positions: Tensor
    out_slots: Tensor
    extend: AttnMsg | None
    decode: AttnMsg | None
    logits_rows: Tensor
    batch_invariant: bool
    capture: list[int]
    windowed: "Forward | None" = None  # the batch in the window slot space (sliding-window layers)
    has_prompt: bool = True


class CopyKV(msgspec.Struct, tag="copy_kv", array_like=True):
    src: Tensor
    dst: Tensor
    shift: Tensor


class Tick(msgspec.Struct, tag="tick", array_like=True):
    pass


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


Step = Forward | CopyKV | Tick | Stop
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Step)


def _opt(t: torch.Tensor | None) -> Tensor | None:
    return None if t is None else Tensor.of(t)


def _group(g: AttnGroup | None) -> AttnMsg | None:
    if g is None:
        return None
    return AttnMsg(g.start, g.num_tokens, Tensor.of(g.kv_slots), Tensor.of(g.kv_lens), _opt(g.q_req),
                  _opt(g.q_kv_lens), _opt(g.prefix_slots))


def _attn(g: AttnMsg | None) -> AttnGroup | None:
    if g is None:
        return None
    get = lambda t: None if t is None else t.get()  # noqa: E731
    return AttnGroup(g.start, g.num_tokens, g.kv_slots.get(), g.kv_lens.get(), get(g.q_req), get(g.q_kv_lens),
                     get(g.prefix_slots))


def forward_msg(fb: ForwardBatch, capture: tuple[int, ...]) -> Forward:
    return Forward(fb.mode.value, Tensor.of(fb.input_ids), Tensor.of(fb.positions), Tensor.of(fb.out_slots),
                   _group(fb.extend), _group(fb.decode), Tensor.of(fb.logits_rows), fb.batch_invariant, list(capture),
                   None if fb.windowed is None else forward_msg(fb.windowed, capture), fb.has_prompt)


def forward_batch(msg: Forward) -> ForwardBatch:
    return ForwardBatch(ForwardMode(msg.mode), msg.input_ids.get(), msg.positions.get(), msg.out_slots.get(),
                        _attn(msg.extend), _attn(msg.decode), msg.logits_rows.get(), msg.batch_invariant,
                        None if msg.windowed is None else forward_batch(msg.windowed), msg.has_prompt)


def send(group: Group, step: Step) -> None:
    """Rank 0: broadcast one step to the other ranks."""
    group.broadcast_bytes(_ENC.encode(step))


def receive(group: Group) -> Step:
    """Ranks > 0: the next step rank 0 broadcast (blocks until it comes)."""
    return _DEC.decode(group.broadcast_bytes(None))
