"""The stand-in Endpoint Picker of the llm-d simulation (tests/llmd_picker.py) scores as
llm-d-router v0.10.0 does: queue depth normalised between the shortest and the longest queue,
prefix match over the request's blocks in the per-pod index of what it sent there (adapters told
apart), a session bound to the pod last picked for it; and the engine model caches whole blocks
per adapter, evicting the least recently used."""

from __future__ import annotations

import random

from tests.llmd_picker import BLOCK, LRU, Picker, Replica, block_hashes


def _picker(n: int, capacity: int = 1000) -> tuple[Picker, list[Replica]]:
    replicas = [Replica(capacity, 100.0) for _ in range(n)]
    return Picker(replicas, capacity, random.Random(0)), replicas


def test_a_session_stays_on_its_pod_and_its_prefix_follows_it():
    picker, _ = _picker(4)
    prompt = list(range(10 * BLOCK))
    first = picker.pick(0.0, "s1", "L2", prompt)
    assert all(picker.pick(0.0, "s1", "L2", prompt + [i] * BLOCK) == first for i in range(5))
    # another session with the same prefix goes where the prefix is (prefix 3 > a tie broken at random)
    assert picker.pick(0.0, "s2", "L2", prompt) == first
    # the same tokens on another adapter match nothing there: the pick is a tie among all pods
    same_pod = 0
    for seed in range(40):
        fresh = Picker([Replica(1000, 100.0) for _ in range(4)], 1000, random.Random(seed))
        l2 = fresh.pick(0.0, "a", "L2", prompt)
        same_pod += fresh.pick(0.0, "b", "L1", prompt) == l2
    assert 0 < same_pod < 40


def test_a_long_queue_outweighs_neither_session_nor_prefix_but_breaks_ties():
    picker, replicas = _picker(2)
    prompt = list(range(4 * BLOCK))
    pod = picker.pick(0.0, "s1", "L0", prompt)
    other = 1 - pod
    replicas[pod].waiting = [5.0, 6.0, 7.0]  # three queued prefills
    assert picker.pick(1.0, "s1", "L0", prompt) == pod  # session 3 + prefix 3 > queue 2
    assert picker.pick(1.0, "fresh", "L3", [9] * (4 * BLOCK)) == other  # nothing else differs


def test_the_engine_cache_serves_whole_blocks_per_adapter_and_evicts_lru():
    engine = Replica(capacity=4, prefill_us=100.0)
    prompt = list(range(3 * BLOCK + 5))
    _, cached, _ = engine.admit(0.0, "L0", prompt)
    assert cached == 0
    _, cached, _ = engine.admit(1.0, "L0", prompt + [1, 2, 3])
    assert cached == 3 * BLOCK
    _, cached, _ = engine.admit(2.0, "L1", prompt)
    assert cached == 0  # the adapter is part of the hash
    lru = LRU(2)
    hashes = block_hashes("L0", list(range(3 * BLOCK)))
    lru.add(hashes)
    assert lru.match(hashes) == 0 and lru.match(hashes[1:]) == 2  # the oldest block went first
