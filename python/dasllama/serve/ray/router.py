"""Ray Serve request routers for the engine replicas.

`PrefixRouter` sends a request to the replica that last served the longest prefix of its prompt (the
replica whose prefix cache holds those pages), unless that replica is a full batch busier than the
least loaded one; a prompt no replica has seen goes to the least loaded replica. `RoundRobinRouter`
is the baseline that ignores prompts. Both rank every candidate, so a replica that is full (at its
`max_ongoing_requests`) or gone is passed over for the next.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import rendezvous

log = logging.getLogger("dasllama.serve.ray")


def _chain(pending: PendingRequest | None) -> list[str]:
    if pending is None or not pending.args:
        return []
    return list(getattr(pending.args[0], "chain", None) or [])


class PrefixRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8, max_keys: int = 200_000, **kwargs: Any) -> None:
        """`imbalance`: how many more requests in flight the cache-holding replica may have than the
        least loaded one before the request goes to the least loaded instead (default: one batch
        of the default --streams 8). `max_keys`: chain links remembered, least recently used first
        out (a link is 16 hex digits plus a replica id)."""
        self._imbalance = imbalance
        self._max_keys = max_keys
        self._owner: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()

    def _load(self, r: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(r.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        chain = _chain(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        best: RunningReplica | None = None
        # The deepest link some live replica served: links are chained, so it also served every
        # shorter one (unless evicted since, which the engine's LRU would have done as well).
        for link in reversed(chain):
            rid = self._owner.get(link)
            if rid is not None and rid in by_id:
                best = by_id[rid]
                break
        first = chain[0] if chain else ""
        others = sorted(candidate_replicas, key=lambda r: (self._load(r), -rendezvous(first, r.replica_id.unique_id)))
        if best is not None and self._load(best) - self._load(others[0]) > self._imbalance:
            log.debug("prefix held by %s, but it is %d requests busier than %s: routing by load", best.replica_id, self._load(best) - self._load(others[0]), others[0].replica_id)
            best = None
        ranked = ([best] if best is not None else []) + [r for r in others if r is not best]
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for link in _chain(pending_request):
            self._owner[link] = replica_id
            self._owner.move_to_end(link)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        # Its cache died with it: those prefixes are nobody's now.
        for link in [k for k, v in self._owner.items() if v == replica_id]:
            del self._owner[link]


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, whatever the prompt: the baseline the prefix router is measured against."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % len(ordered)
        return [[r] for r in ordered[i:] + ordered[:i]]
