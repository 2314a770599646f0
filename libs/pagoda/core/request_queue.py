"""The scheduler's waiting queue, ordered by its scheduling policy (vLLM's `RequestQueue`).

Two orders, one interface:

  fcfs      arrival order; a preempted request goes back to the *front*, so it
            resumes before anything that arrived after it.
  priority  lowest `priority` value first, ties by arrival time (then by the order
            requests were added); a preempted request simply re-enters at its rank.

`peek_request`/`pop_request` give the next request to admit; `prepend_request(s)` put
requests back that were taken out this step (preempted, or skipped while their grammar
compiles) so they are considered first again under fcfs, and at their rank under
priority. Iteration yields the queue's order (a heap's order only for `priority`:
callers that iterate, e.g. to wait for grammars, need membership, not rank).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagoda.core.request import Request


class SchedulingPolicy(enum.Enum):
    """`--scheduling-policy`: the order in which waiting requests are admitted."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """Waiting requests. Invariant: each request is in the queue at most once."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit (IndexError when empty)."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit, left in the queue (IndexError when empty)."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put back a request taken out earlier (it is considered first again)."""

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put back several requests, keeping their relative order."""
        for request in reversed(list(requests)):
            self.prepend_request(request)

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Remove a queued request (an abort); ValueError if it is not queued."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order, preempted requests first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap keyed by (priority, arrival_time, insertion count): the count breaks
    exact ties deterministically and keeps `Request`s from ever being compared.

    Removal is lazy: a removed request's entry stays in the heap, marked dead, and is
    dropped when it reaches the top, so an abort costs O(1) instead of a re-heapify.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}  # request id -> count of its live heap entry
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued")
        count = next(self._counter)
        self._live[request.request_id] = count
        heapq.heappush(self._heap, (request.priority, request.arrival_time, count, request))

    def pop_request(self) -> Request:
        self._drop_dead()
        _, _, _, request = heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def peek_request(self) -> Request:
        self._drop_dead()
        return self._heap[0][3]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)  # its rank, not the front, decides

    def remove_request(self, request: Request) -> None:
        if self._live.pop(request.request_id, None) is None:
            raise ValueError(f"request {request.request_id!r} is not queued")

    def _drop_dead(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].request_id) != self._heap[0][2]:
            heapq.heappop(self._heap)
        if not self._heap:
            raise IndexError("pop from an empty request queue")

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap)
                if self._live.get(entry[3].request_id) == entry[2])


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    policy = SchedulingPolicy(policy)
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
