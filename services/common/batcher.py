"""Coalescing concurrent batched RPCs into one call of a batched function on one worker thread.

Several schedulers call Verify (or Propose) at the same time; `Coalescer.submit(items)` queues the
call's items, and a single loop merges whatever is queued (up to `max_items`, waiting at most
`max_wait_s` for company) into one `fn(items)` call on the service's one model thread, then hands each
caller its own slice of the results. If the merged call raises, each call is retried on its own so one
bad call cannot fail the others. Knows nothing about models or protos.

A call that names its `caller` waits for company only while another caller has been heard from in the last
`company_window_s`: a scheduler sends one Verify / Propose per pod per step, so with one scheduler the wait
could only ever delay its step, never merge anything (2 ms a step on each pod, issue 21). Calls without a
caller (several Prefills of one scheduler) always wait up to `max_wait_s`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Callable


class Coalescer:
    def __init__(self, fn: Callable[[list], list], executor: Executor, max_items: int = 256,
                 max_wait_s: float = 0.0, company_window_s: float = 1.0, wait_alone: bool = False):
        """`wait_alone`: wait `max_wait_s` even for a lone caller (tests that want slow rounds)."""
        self.fn, self.executor, self.max_items, self.max_wait_s = fn, executor, max_items, max_wait_s
        self.wait_alone = wait_alone
        self.company_window_s = company_window_s
        self._heard: dict[str, float] = {}  # caller -> when its last call arrived (monotonic)
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0  # merged calls run so far (for tests and metrics)
        self.last_batch_calls = 0

    async def submit(self, items: list, caller: str | None = None) -> tuple[list, float]:
        """Run `items` (possibly merged with other calls); returns (results, queue_seconds). `caller`: who
        calls (one call in flight per caller at a time), so that a lone caller is not kept waiting."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.ensure_future(self._loop())
        fut = asyncio.get_running_loop().create_future()
        if caller is not None:
            now = time.monotonic()
            self._heard[caller] = now
            if len(self._heard) > 64:  # forget callers long gone
                self._heard = {c: t for c, t in self._heard.items() if now - t < self.company_window_s}
        await self._queue.put((items, fut, time.perf_counter(), caller))
        return await fut

    def _may_get_company(self, calls: list) -> bool:
        """Whether waiting could merge another call: some call came without a caller, or a caller heard from
        recently has no call in this batch yet."""
        here = {c[3] for c in calls}
        if None in here or self.wait_alone:
            return True
        now = time.monotonic()
        return any(c not in here and now - t < self.company_window_s for c, t in self._heard.items())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            calls = [await self._queue.get()]
            total = len(calls[0][0])
            deadline = loop.time() + self.max_wait_s
            while total < self.max_items:
                if self._queue.empty():
                    remaining = deadline - loop.time()
                    if remaining <= 0 or not self._may_get_company(calls):
                        break
                    try:
                        calls.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:
                        break
                else:
                    calls.append(self._queue.get_nowait())
                total += len(calls[-1][0])
            calls = [c for c in calls if not c[1].cancelled()]
            if not calls:
                continue
            started = time.perf_counter()
            merged = [it for items, *_ in calls for it in items]
            self.batches += 1
            self.last_batch_calls = len(calls)
            try:
                results = await loop.run_in_executor(self.executor, self.fn, merged)
            except Exception:  # noqa: BLE001 - isolate the failing call
                for items, fut, t0, _ in calls:
                    try:
                        res = await loop.run_in_executor(self.executor, self.fn, items)
                        if not fut.done():
                            fut.set_result((res, started - t0))
                    except Exception as exc:  # noqa: BLE001 - handed to its caller
                        if not fut.done():
                            fut.set_exception(exc)
                continue
            i = 0
            for items, fut, t0, _ in calls:
                if not fut.done():
                    fut.set_result((results[i : i + len(items)], started - t0))
                i += len(items)
