"""Waiting requests by priority class, FCFS inside a class; preempted requests re-enter at the front."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from ominix_runtime.contract import Priority
from ominix_runtime.engine.request import EngineRequest


class WaitingQueue:
    """One ordered dict per priority class: O(1) push front/back and removal by request id."""

    def __init__(self) -> None:
        self._classes: dict[Priority, OrderedDict[str, EngineRequest]] = {p: OrderedDict() for p in Priority}

    def __len__(self) -> int:
        return sum(len(q) for q in self._classes.values())

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in q for q in self._classes.values())

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens still to be computed by waiting requests (prompt + outputs so far)."""
        return sum(len(r.all_token_ids) for q in self._classes.values() for r in q.values())

    def push_back(self, req: EngineRequest) -> None:
        self._classes[req.priority][req.request_id] = req

    def push_front(self, req: EngineRequest) -> None:
        q = self._classes[req.priority]
        q[req.request_id] = req
        q.move_to_end(req.request_id, last=False)

    def remove(self, request_id: str) -> EngineRequest | None:
        for q in self._classes.values():
            req = q.pop(request_id, None)
            if req is not None:
                return req
        return None

    def __iter__(self) -> Iterator[EngineRequest]:
        """In scheduling order. Do not add or remove while iterating."""
        for p in sorted(self._classes):
            yield from self._classes[p].values()
