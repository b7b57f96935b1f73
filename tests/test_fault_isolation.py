"""One request's fault fails that request alone: the real scheduler over a scripted model (tests/scripted.py), with
a fault planted in one request's own handling (its grammar matcher, its stop check, its sampler); the other requests
of the same batches finish with the tokens they get alone."""

from __future__ import annotations

import msgspec
import pytest
from scripted import drain, msg, scheduler, varied

from plait.runtime.scheduler.scheduler import Scheduler

PROMPTS = [[2000, 2001, 2002], [2010, 2011], [2020, 2021, 2022, 2023], [2030]]


class Boom(RuntimeError):
    pass


def _boom(*args, **kwargs):
    raise Boom("planted fault")


def _run(sched: Scheduler, outs: list, reqs, plant=None) -> dict:
    for m in reqs:
        sched.add_request(m)
    planted = plant is None

    def try_plant(s, step):
        nonlocal planted
        if not planted:
            planted = plant(s)

    return drain(sched, outs, timeout=120, between=try_plant)  # a grammar waits for its compile worker to start


def _msg(rid: str, prompt: list[int], **params):
    return msg(rid, prompt, **{"max_new_tokens": 12, **params})


def _find(sched: Scheduler, rid: str):
    for req in sched.running + sched.waiting:
        if req.rid == rid:
            return req
    return None


def _plant_on(rid: str, attr_path: str, value=_boom, needs_grammar: bool = False):
    """A planter that replaces req.<attr_path> by `value` (a raising function by default) once the
    request has a token (and, for grammar attributes, once its grammar compiled)."""

    def plant(sched: Scheduler) -> bool:
        req = _find(sched, rid)
        if req is None or (needs_grammar and req.matcher is None) or req.output_len == 0:
            return False
        obj = req
        *parents, name = attr_path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, name, value)
        return True

    return plant


@pytest.fixture(scope="module")
def shared():
    """One scheduler for the faults: its grammar compile worker starts once."""
    sched, outs = scheduler(varied)
    yield sched, outs
    sched.close()


@pytest.mark.parametrize("fault", ["stop_check", "grammar_accept", "grammar_mask", "sampler"])
def test_a_fault_in_one_request_fails_it_alone(shared, fault):
    sched, outs = shared
    failed = sched.stats()["num_failed"]
    good = [_msg(f"good{i}", p) for i, p in enumerate(PROMPTS)]
    alone = _run(sched, outs, good)
    assert all(r["finish"].type == "length" and len(r["ids"]) == 12 for r in alone.values())

    victim_params = {
        "stop_check": {},
        "grammar_accept": {"regex": "[a-z ]+"},  # plain greedy: its mask is filled lazily on rejection
        "grammar_mask": {"regex": "[a-z ]+", "top_k": 5},  # masked up front, on the worker thread
        "sampler": {"temperature": 0.7},
    }[fault]
    plant = {
        "stop_check": _plant_on("victim", "check_finished"),
        "grammar_accept": _plant_on("victim", "constraint.matcher.accept_token", needs_grammar=True),
        "grammar_mask": _plant_on("victim", "constraint.matcher.fill_bitmask", needs_grammar=True),
        # torch.rand(generator=...) raises inside the batched sample
        "sampler": _plant_on("victim", "generator", value=object()),
    }[fault]

    victim = _msg("victim", [2040, 2041], **victim_params)
    again = [msgspec.structs.replace(m, rid=m.rid + "-again") for m in good]
    results = _run(sched, outs, [victim, *again], plant)

    v = results["victim"]["finish"]
    assert v.type == "abort" and v.status == 500 and "internal error" in v.message, v
    for m in good:
        r = results[m.rid + "-again"]
        assert r["finish"].type == "length" and r["ids"] == alone[m.rid]["ids"]  # batch-mates unaffected
    assert sched.stats()["num_failed"] == failed + 1
    assert sched.idle and sched.kv.check() is None  # the failed request's KV went back
    sched.kv.flush()


def test_a_large_request_does_not_starve_a_small_one():
    """Two running slots; a request of six sequences arrives first, then a single one. Fair admission
    gives the single request the first free slot instead of queueing it behind the whole group."""
    sched, outs = scheduler(varied, max_running_requests=2)
    group = [_msg(f"big{i}", PROMPTS[i % 4], max_new_tokens=8, group="big") for i in range(6)]
    for m in group + [_msg("small", [2050], max_new_tokens=2)]:
        sched.add_request(m)
    first_output: dict[str, int] = {}
    for step in range(200):
        if not sched.step():
            break
        for o in outs:
            first_output.setdefault(o.rid, step)
        outs.clear()
    assert len(first_output) == 7
    later_big = sorted(first_output[f"big{i}"] for i in range(2, 6))
    assert first_output["small"] < later_big[0], first_output
    assert sched.kv.check() is None
    sched.kv.flush()
