"""The thread governor: it probes the other thread count now and then and keeps the faster one."""

from plait.runtime.model_executor.threads import ThreadGovernor


def _run(gov: ThreadGovernor, ms_per_token: dict[int, float], steps: int, tokens: int = 4) -> list[int]:
    used = []
    for _ in range(steps):
        n = gov.threads()
        used.append(n)
        gov.record(ms_per_token[n] * tokens / 1e3, tokens)
    return used


def test_switches_to_fewer_threads_when_they_are_faster_and_back():
    gov = ThreadGovernor(2, probe_every=16, probe_steps=4)
    used = _run(gov, {2: 10.0, 1: 4.0}, 40)  # a busy neighbour: 2 threads collapse
    assert gov.current == 1 and gov.switches == 1
    assert used[:16] == [2] * 16 and used[20:36] == [1] * 16  # probes are short; the rest runs the winner
    _run(gov, {2: 2.0, 1: 4.0}, 40)  # the neighbour left
    assert gov.current == 2 and gov.switches == 2


def test_noise_within_the_margin_never_switches():
    gov = ThreadGovernor(2, probe_every=8, probe_steps=4, margin=0.1)
    _run(gov, {2: 10.0, 1: 9.5}, 200)
    assert gov.current == 2 and gov.switches == 0


def test_one_thread_has_nothing_to_choose():
    gov = ThreadGovernor(1, probe_every=2, probe_steps=1)
    assert set(_run(gov, {1: 1.0}, 20)) == {1} and gov.switches == 0


def test_on_a_quiet_machine_one_probe_then_only_on_suspicion():
    gov = ThreadGovernor(2, probe_every=16, probe_steps=4, max_probe_every=128)
    used = _run(gov, {2: 2.0, 1: 4.0}, 1000)  # a quiet machine: one probe of one thread, which loses
    assert used[16:20] == [1] * 4 and used.count(1) == 4 and gov.current == 2 and gov.switches == 0
    used = _run(gov, {2: 10.0, 1: 4.0}, 160)  # a neighbour arrives: the steps slow, so it probes within the wait
    assert gov.current == 1 and gov.switches == 1
    switched = next(i for i in range(1, len(used)) if used[i] == 1 and used[i - 1] == 2) + 4
    assert switched <= 132 and used[switched:switched + 16] == [1] * 16  # the next probe of 2 threads: 16 later
    assert used[switched + 16] == 2


def test_probes_that_lose_come_ever_less_often_while_the_steps_stay_slow():
    gov = ThreadGovernor(2, probe_every=16, probe_steps=4, max_probe_every=128)
    _run(gov, {2: 2.0, 1: 4.0}, 40)  # the best two threads do
    used = _run(gov, {2: 4.0, 1: 8.0}, 1000)  # then everything slower (a hotter machine): suspect, yet 1 loses
    probes = [i for i in range(1, len(used)) if used[i] == 1 and used[i - 1] == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [68, 132]  # the wait doubles (64, 128, plus the probe), and once the slower pace is the best
    assert gov.current == 2 and gov.switches == 0  # lately (it creeps up ~300 steps) nothing is suspect


def test_a_probe_is_weighed_against_steps_of_its_own_size():
    """Per token, a bigger batch costs less: a probe run on bigger steps than the steps before it must not look
    faster for that (plain decode steps of a speculative run come at any batch size)."""
    gov = ThreadGovernor(2, probe_every=4, probe_steps=2)
    per_token = {(2, 1): 4.0, (2, 4): 1.0, (1, 1): 6.0, (1, 4): 1.5}  # two threads always faster, any size
    for i in range(400):
        tokens = 1 if (i // 3) % 2 == 0 else 4  # sizes change every few steps
        n = gov.threads()
        gov.record(per_token[n, tokens] * tokens / 1e3, tokens)
    assert gov.current == 2 and gov.switches == 0
