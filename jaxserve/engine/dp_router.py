"""Data-parallel routing (two ranks or more): each request goes to the rank holding its longest
cached prefix, else to the least loaded one, and stays there (n > 1 samples travel together)."""

from __future__ import annotations

from jaxserve.core.scheduler import Scheduler
from jaxserve.core.request import Request


def rank_load(scheduler: Scheduler) -> int:
    """Tokens a rank still has to compute or generate for its requests."""
    return sum(r.num_tokens - r.num_computed_tokens + max(r.max_tokens - r.num_output_tokens, 0)
               for r in (*scheduler.running, *scheduler.waiting))


class DPRouter:
    def __init__(self, schedulers: list[Scheduler]):
        self.schedulers = schedulers
        self.routes: dict[str, tuple[int, str | None]] = {}  # request id -> (rank, group id)
        self.groups: dict[str, list[int]] = {}  # group id -> [rank, live requests]

    def rank_of(self, request_id: str) -> int | None:
        route = self.routes.get(request_id)
        return None if route is None else route[0]

    def route(self, request: Request) -> int:
        group = self.groups.get(request.group_id) if request.group_id else None
        rank = group[0] if group else self._pick(request)
        if request.group_id:
            self.groups.setdefault(request.group_id, [rank, 0])[1] += 1
        self.routes[request.request_id] = (rank, request.group_id)
        return rank

    def _pick(self, request: Request) -> int:
        hits = [s.kv.find_cached_prefix(request)[1] for s in self.schedulers]
        loads = [rank_load(s) for s in self.schedulers]
        # Longest hit first; among equal hits (no hit at all included), the lightest load.
        return min(range(len(self.schedulers)), key=lambda r: (-hits[r], loads[r], r))

    def forget(self, request_id: str) -> None:
        rank, group_id = self.routes.pop(request_id, (None, None))
        if group_id is None:
            return
        group = self.groups[group_id]
        group[1] -= 1
        if group[1] == 0:
            del self.groups[group_id]
