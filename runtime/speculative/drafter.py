"""Drafters: what proposes speculative tokens, behind one interface, chosen by `--speculative-algorithm`.

A drafter only guesses. Everything else is shared and lives in the scheduler's SpecManager: the row budget
and the measured draft policy (how many tokens each request may draft), a grammar's cut of a guess,
verification (the model's own picks, so a draft never changes the output), the walk of a tree, and
jump-forward's forced text, which is one more source of drafts. So a new drafter is a module that
registers a factory here and adds a line to `ALGORITHMS`; the scheduler has no branch per algorithm.

Each step, after the tokens are committed, SpecManager hands the drafter a `DraftStep`: the positions the
forward committed (with the target's features where the drafter asked for some layers' outputs) and the
most tokens each request may draft; the drafter returns its drafts. A request that ends is released.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.sampling.params import SamplingParams
    from plait.runtime.speculative.config import DraftConfig


@dataclass(frozen=True)
class Algorithm:
    module: str  # the module under plait.runtime.speculative that registers its drafter (imported on first use)
    draft_model: str | None = None  # what --speculative-draft-model-path names for it (None: it takes none)
    shipped: bool = False  # the default model has one shipped (used when no path is given)


# --speculative-algorithm -> its drafter's module. A new drafter adds its module and one line here
ALGORITHMS: dict[str, Algorithm] = {
    "EAGLE": Algorithm("eagle_worker", "an EAGLE head folder"),
    "EAGLE3": Algorithm("eagle_worker", "an EAGLE-3 head folder", shipped=True),
    "NGRAM": Algorithm("ngram"),
    "SUFFIX": Algorithm("suffix"),
    "STANDALONE": Algorithm("standalone", "a draft model of the target's vocabulary (GGUF file, HF folder or "
                                          "packaged model name)"),
}


class Req(Protocol):
    """What drafters and verification read of a scheduler's request (its `Req`); they write only
    `verified_rows`. Hashable: drafts are keyed by request."""

    row: int  # its row of the request-to-KV-slot table
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]  # prompt + output
    prompt_len: int
    output_len: int
    seq_len: int
    cached_len: int  # tokens whose KV is written
    draft: list[int]  # drafted tokens at the end of output_ids, not yet verified
    verified_rows: list[int] | None  # a tree's kept path, for the drafter's features
    finish: object | None  # its FinishReason once it ended
    params: SamplingParams
    generator: torch.Generator | None
    return_logprob: bool
    top_logprobs_num: int


@dataclass
class Committed:
    """Positions [start, start + count) of one request that the last forward committed."""

    req: Req
    start: int
    count: int
    features: torch.Tensor | None  # the target's features at the rows of that work item (drafters with `capture`)
    prompt: bool  # a prompt chunk (not decoded or verified tokens)


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int] | None = None  # a tree: the node each node follows (-1: the last sampled token); None: a chain


@dataclass
class DraftStep:
    committed: list[Committed]  # every work item of the forward, finished requests' included
    sizes: dict[Req, int]  # requests that draft now -> the most tokens (nodes of a tree) they may draft
    depths: dict[Req, int]  # the deepest a tree of theirs may go (tokens left before a length limit)
    no_room: bool  # the row budget leaves no room for drafts this step (a full batch, a queue)


@dataclass
class Proposal:
    drafts: dict[Req, Draft] = field(default_factory=dict)
    steps: int = 0  # sequential draft passes run (a model's steps; 0 for lookups), pricing the next ones
    seconds: float = 0.0  # the time of those passes


class Drafter(Protocol):
    capture: tuple[int, ...]  # target layers whose outputs it reads each forward (none: ())
    follows_forced: bool  # may guess after forced text the model has not verified (lookups can; a model cannot)
    drafts_trees: bool  # drafts trees for requests without a grammar (their nodes verified in one forward)

    def propose(self, step: DraftStep) -> Proposal: ...

    def release(self, req: Req) -> None:
        """`req` ended: forget what the drafter keeps for it."""

    def flush(self) -> None:
        """The caches are flushed: forget what earlier requests taught (nothing runs)."""

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """A KV join moved the target's slots `src` to `dst`: move any K/V the drafter keeps at those slots."""

    def stats(self) -> dict: ...


_FACTORIES: dict[str, Callable[[DraftConfig, ModelRunner], Drafter]] = {}


def register(*names: str):
    """Decorator: `factory(config, runner) -> Drafter` builds the drafter for these algorithm names."""
    def wrap(factory):
        for name in names:
            _FACTORIES[name] = factory
        return factory
    return wrap


def build_drafter(args: DraftConfig, runner: ModelRunner) -> Drafter | None:
    name = args.speculative_algorithm
    if name is None:
        return None
    if name not in ALGORITHMS:
        raise ValueError(f"unknown speculative_algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    importlib.import_module(f"plait.runtime.speculative.{ALGORITHMS[name].module}")
    return _FACTORIES[name](args, runner)
