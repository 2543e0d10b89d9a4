"""A stand-in for llm-d-router v0.10.0's Endpoint Picker and a vLLM-like engine model, for
bench/bench_llmd_scheduler.py (issue 43): tests and benchmarks only, never the product. What each
scorer does, and where the real one does it, is in `Picker`'s docstring; `Replica` is an engine's
prefix cache (16-token blocks, hash chained and seeded with the adapter, LRU) and prefill queue."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from molctl.render.llmd import SCORER_WEIGHTS  # the weights `render k8s --scheduler llm-d` writes

BLOCK = 16  # vLLM's default block size, and the EPP's (approximateprefix/types.go defaultBlockSizeTokens)


def block_hashes(model: str, tokens: list[int]) -> list[bytes]:
    """Chained hashes of the full blocks, seeded with the model (vLLM's and the EPP's both tell
    adapters apart)."""
    out, prev = [], hashlib.sha256(model.encode()).digest()
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        prev = hashlib.sha256(prev + str(tokens[i : i + BLOCK]).encode()).digest()
        out.append(prev)
    return out


class LRU:
    def __init__(self, capacity: int):
        self.capacity, self.blocks = capacity, OrderedDict()

    def match(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Replica:
    def __init__(self, capacity: int, prefill_us: float):
        self.cache, self.prefill_s = LRU(capacity), prefill_us / 1e6
        self.free_at = 0.0  # the prefill queue: when the last queued prefill ends
        self.waiting: list[float] = []  # prefill start times of queued requests (the waiting queue)
        self.running: list[tuple[float, int]] = []  # (when it ends, KV blocks it holds) per request in flight

    def queue_len(self, now: float) -> int:
        self.waiting = [t for t in self.waiting if t > now]
        return len(self.waiting)

    def kv_use(self, now: float) -> float:
        """The share of the KV cache the requests in flight hold (vllm:kv_cache_usage_perc)."""
        self.running = [(end, blocks) for end, blocks in self.running if end > now]
        return min(1.0, sum(blocks for _, blocks in self.running) / self.cache.capacity)

    def admit(
        self, now: float, model: str, prompt: list[int], output_tokens: int = 0, decode_s: float = 0.0
    ) -> tuple[float, int, float]:
        """(ttft, cached tokens, when the prefill ends) of a request arriving now; it holds its
        prompt's and output's blocks until its `output_tokens` are decoded (`decode_s` each)."""
        hashes = block_hashes(model, prompt)
        cached = min(self.cache.match(hashes) * BLOCK, len(prompt) - 1)
        start = max(now, self.free_at)
        end = start + 0.020 + (len(prompt) - cached) * self.prefill_s
        self.free_at = end
        self.waiting.append(start)
        self.running.append((end + output_tokens * decode_s, (len(prompt) + output_tokens) // BLOCK + 1))
        self.cache.add(hashes)  # its blocks are computed (and shareable) from here on
        return end - now, cached, end


class Picker:
    """The stand-in Endpoint Picker: every request scored on its own by the scorers `render k8s
    --scheduler llm-d` configures, with their weights (molctl.render.llmd.SCORER_WEIGHTS), then the
    max-score picker, ties at random (pkg/epp/framework/plugins/scheduling/picker/maxscore):
    - queue-scorer: (max - q) / (max - min) of the pods' waiting queues, 1 when all are equal
      (pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go);
    - kv-cache-utilization-scorer: 1 - KV-cache use (.../scorer/kvcacheutilization), the use being
      the blocks the requests in flight hold (`Replica.kv_use`);
    - prefix-cache-scorer: matched blocks / the request's blocks (.../scorer/prefix/plugin.go,
      match-length weight 0), matched in the approximate prefix index: per pod, an LRU of the block
      hashes of the prompts the picker sent there, chained and seeded with the model (adapter) name
      (.../requestcontrol/dataproducer/approximateprefix, prefixhash/hashing.go);
    - session-affinity-scorer, strategy session_id: 1 for the pod the `x-session-id` is bound to,
      0 for the others, the binding (re)made to the picked pod in PreRequest
      (.../scheduling/util/sessionaffinity/session_id.go);
    - lora-affinity-scorer: every pod serves the four adapters (vLLM --max-loras 4), so it scores
      all alike; left out."""

    def __init__(self, replicas: list[Replica], capacity: int, rng: random.Random):
        self.replicas, self.rng = replicas, rng
        self.index = [LRU(capacity) for _ in replicas]
        self.sessions: dict[str, int] = {}

    def pick(self, now: float, session: str, model: str, prompt: list[int]) -> int:
        hashes = block_hashes(model, prompt)
        queues = [r.queue_len(now) for r in self.replicas]
        lo, hi = min(queues), max(queues)
        bound = self.sessions.get(session)
        scores = []
        for i, r in enumerate(self.replicas):
            queue = 1.0 if hi == lo else (hi - queues[i]) / (hi - lo)
            kv = 1.0 - r.kv_use(now)
            prefix = _peek(self.index[i], hashes) / len(hashes) if hashes else 0.0
            sticky = 1.0 if bound == i else 0.0
            scores.append(
                SCORER_WEIGHTS["queue-scorer"] * queue
                + SCORER_WEIGHTS["kv-cache-utilization-scorer"] * kv
                + SCORER_WEIGHTS["prefix-cache-scorer"] * prefix
                + SCORER_WEIGHTS["session-affinity-scorer"] * sticky
            )
        best = max(scores)
        chosen = self.rng.choice([i for i, s in enumerate(scores) if s == best])
        self.sessions[session] = chosen  # PreRequest: bind (or rebind) the session
        self.index[chosen].add(hashes)
        return chosen


def _peek(lru: LRU, hashes: list[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in lru.blocks:
            break
        n += 1
    return n
