"""molctl.proxy.pipeline.admission driven directly: slots, per-key round-robin, queue bounds, deadline,
Retry-After from the service rate (the clock is a fake the test moves)."""

from __future__ import annotations

import asyncio

import pytest

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.pipeline.admission import Admission, FairGate, Rejected


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_free_slots_admit_at_once_and_release_frees_them():
    async def main():
        gate = FairGate(2, 10, 5.0, FakeClock())
        assert await gate.acquire("a") == 0.0 and await gate.acquire("b") == 0.0
        assert gate.inflight == 2
        gate.release()
        gate.release()
        assert gate.inflight == 0 and gate.waiting == 0

    run(main())


def test_waiters_of_different_keys_take_turns():
    """Key a queues 6 before b and c queue one each: b and c are served 2nd and 3rd, not after a's burst."""

    async def main():
        gate = FairGate(1, 100, 30.0, FakeClock())
        await gate.acquire("holder")
        order: list[str] = []

        async def one(key: str, n: int):
            await gate.acquire(key)
            order.append(f"{key}{n}")

        tasks = [asyncio.ensure_future(one("a", i)) for i in range(6)]
        await settle()
        tasks += [asyncio.ensure_future(one("b", 0)), asyncio.ensure_future(one("c", 0))]
        await settle()
        for _ in range(8):
            gate.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order[:3] == ["a0", "b0", "c0"], order
        assert sorted(order) == sorted(["a0", "a1", "a2", "a3", "a4", "a5", "b0", "c0"])  # each exactly once
        assert gate.waiting == 0 and gate.inflight == 1  # the last one still holds its slot

    run(main())


def test_full_queue_refuses_the_newcomer_of_the_fullest_key():
    async def main():
        clock = FakeClock()
        gate = FairGate(1, 3, 30.0, clock)
        await gate.acquire("holder")
        a = [asyncio.ensure_future(gate.acquire("a")) for _ in range(3)]
        await settle()
        with pytest.raises(Rejected) as exc:  # a alone fills the queue: its 4th is refused
            await gate.acquire("a")
        assert exc.value.reason == "queue_full" and exc.value.retry_after >= 1
        b = asyncio.ensure_future(gate.acquire("b"))  # b has none waiting: a's newest makes room
        await settle()
        assert a[2].done() and isinstance(a[2].exception(), Rejected)
        assert not b.done() and gate.waiting == 3
        for _ in range(3):
            gate.release()
            await settle()
        assert a[0].done() and b.done() and a[1].done()
        assert gate.stats.rejected["queue_full"] == 2

    run(main())


def test_deadline_refuses_and_leaves_the_queue_clean():
    async def main():
        gate = FairGate(1, 10, 0.05, FakeClock())
        await gate.acquire("holder")
        with pytest.raises(Rejected) as exc:
            await gate.acquire("a")
        assert exc.value.reason == "deadline"
        assert gate.waiting == 0 and not gate.queues
        gate.release()
        assert gate.inflight == 0

    run(main())


def test_cancelled_waiter_leaves_no_trace_and_a_granted_one_passes_its_slot_on():
    async def main():
        gate = FairGate(1, 10, 30.0, FakeClock())
        await gate.acquire("holder")
        gone = asyncio.ensure_future(gate.acquire("a"))
        nxt = asyncio.ensure_future(gate.acquire("b"))
        await settle()
        gate.release()  # granted to a ...
        gone.cancel()  # ... which is cancelled before it runs: the slot goes to b
        await asyncio.gather(gone, return_exceptions=True)
        await settle()
        assert nxt.done() and gate.inflight == 1 and gate.waiting == 0

    run(main())


def test_retry_after_follows_the_service_rate():
    async def main():
        clock = FakeClock()
        gate = FairGate(1, 100, 60.0, clock)
        assert gate.retry_after() == 60  # nothing served yet: the deadline
        for _ in range(10):  # 10 served over 10 s: 1 per second
            await gate.acquire("x")
            clock.now += 1.0
            gate.release()
        await gate.acquire("holder")
        waiters = [asyncio.ensure_future(gate.acquire("a")) for _ in range(4)]
        await settle()
        assert gate.retry_after() == 5  # 4 ahead + this one at ~1/s
        clock.now += 100  # the window passed: back to the deadline
        assert gate.retry_after() == 60
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    run(main())


def test_default_answer_budget_is_the_engines_limit():
    tiny = load_profile("tiny", profile_dirs())
    assert Admission.from_profile(tiny, get_engine("vllm")).answers.capacity == tiny.engine.args["max-num-seqs"]
    override = load_profile("tiny", profile_dirs(), [("proxy.max_inflight", 3)])
    assert Admission.from_profile(override, get_engine("vllm")).answers.capacity == 3
    unset = [("proxy.max_inflight", None)]  # venti-sglang sets 8 itself
    sgl = load_profile("venti-sglang", profile_dirs(), [*unset, ("engine.args.max-running-requests", 12)])
    assert Admission.from_profile(sgl, get_engine("sglang")).answers.capacity == 12
    bare = load_profile("venti-sglang", profile_dirs(), unset)
    assert Admission.from_profile(bare, get_engine("sglang")).answers.capacity == get_engine("sglang").default_running
    assert (
        Admission.from_profile(load_profile("venti-sglang", profile_dirs()), get_engine("sglang")).answers.capacity == 8
    )


def test_the_service_rate_keeps_only_its_window():
    async def main():
        clock = FakeClock()
        gate = FairGate(1, 10, 5.0, clock, rate_window_s=10.0)
        for _ in range(1000):
            await gate.acquire("x")
            clock.now += 0.1
            gate.release()
        assert len(gate._releases) <= 101  # 10 s at 10 per second, not all 1000
        assert gate.service_rate() == pytest.approx(10.0, rel=0.05)

    run(main())


def test_retry_after_is_at_most_five_minutes():
    """A long queue deadline (an hour) or a slow service rate does not tell a refused client to
    come back in an hour: Retry-After stays within 1-300 s."""

    async def main():
        clock = FakeClock()
        gate = FairGate(1, 100, 3600, clock)
        assert gate.retry_after() == 300  # nothing served yet
        await gate.acquire("x")
        clock.now += 3000.0  # one answer in 50 minutes
        gate.release()
        await gate.acquire("holder")
        assert 1 <= gate.retry_after() <= 300

    run(main())
