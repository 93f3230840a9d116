"""Coalescing concurrent batched RPCs into one call of a batched function on one worker thread.

Several schedulers call Verify (or Propose) at the same time; `Coalescer.submit(items)` queues the
call's items, and a single loop merges whatever is queued (up to `max_items`, waiting at most
`max_wait_s` for company) into one `fn(items)` call on the service's one model thread, then hands each
caller its own slice of the results. If the merged call raises, each call is retried on its own so one
bad call cannot fail the others. Knows nothing about models or protos.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Callable


class Coalescer:
    def __init__(self, fn: Callable[[list], list], executor: Executor, max_items: int = 256,
                 max_wait_s: float = 0.0):
        self.fn, self.executor, self.max_items, self.max_wait_s = fn, executor, max_items, max_wait_s
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0  # merged calls run so far (for tests and metrics)
        self.last_batch_calls = 0

    async def submit(self, items: list) -> tuple[list, float]:
        """Run `items` (possibly merged with other calls); returns (results, queue_seconds)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.ensure_future(self._loop())
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((items, fut, time.perf_counter()))
        return await fut

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
                    if remaining <= 0:
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
            merged = [it for items, _, _ in calls for it in items]
            self.batches += 1
            self.last_batch_calls = len(calls)
            try:
                results = await loop.run_in_executor(self.executor, self.fn, merged)
            except Exception:  # noqa: BLE001 - isolate the failing call
                for items, fut, t0 in calls:
                    try:
                        res = await loop.run_in_executor(self.executor, self.fn, items)
                        if not fut.done():
                            fut.set_result((res, started - t0))
                    except Exception as exc:  # noqa: BLE001 - handed to its caller
                        if not fut.done():
                            fut.set_exception(exc)
                continue
            i = 0
            for items, fut, t0 in calls:
                if not fut.done():
                    fut.set_result((results[i : i + len(items)], started - t0))
                i += len(items)
