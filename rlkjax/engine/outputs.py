"""The engine's one way out: a request's output queue. On the engine thread, after each decode round, what the
round added to each sample (`SampleOutput`, for queues that follow rounds) and, last, the request's end
(`RequestEnd`) go onto it; the caller takes them on its own thread, or awaits them on an event loop (the queue
wakes the loop it was made for, through `loop.call_soon_threadsafe`). Items are frozen (tuples, read-only
arrays): neither side writes what the other reads. The engine calls no caller code; detokenising, stop strings
and streaming happen where the items are taken, as vLLM's output processor does.
"""

import asyncio
import dataclasses
import queue

import numpy as np


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What one decode round added to one sample."""

    request: int  # the EngineRequest's id
    index: int  # the sample's index in the request
    tokens: tuple[int, ...]
    logprobs: np.ndarray  # float32 [t], read-only
    top: tuple[np.ndarray, np.ndarray] | None  # with top_logprobs=k: ids [t, k] int32, logprobs [t, k] float32
    finish_reason: str | None  # the engine's, in the round the sample ended ("stop" | "length"); None: it goes on


@dataclasses.dataclass(frozen=True)
class RequestEnd:
    """The request ended (finished, cancelled or failed): nothing of it follows on the queue."""

    request: int  # the EngineRequest's id
    results: tuple  # the Completion of each sample (a sample stopped with `Engine.stop` keeps what it sampled)
    error: str | None  # why the engine failed it (Engine.abort); None otherwise


def frozen_array(values, dtype) -> np.ndarray:
    out = np.array(values, dtype)
    out.flags.writeable = False
    return out


class OutputQueue:
    """A request's outputs (several requests of one caller may share one: each item names its request).
    rounds: also each round's SampleOutputs (else only the RequestEnd). loop: the event loop that awaits
    `get` (None: taken with `get_nowait` or `get_blocking`, e.g. after `Engine.run_until_done`)."""

    def __init__(self, rounds: bool = False, loop: asyncio.AbstractEventLoop | None = None):
        self.rounds, self.loop = rounds, loop
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = asyncio.Event() if loop is not None else None  # set on the loop after a put

    def put(self, item) -> None:
        """Engine thread."""
        self._items.put(item)
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop closed (the process is exiting): nobody waits any more
                pass

    def get_nowait(self):
        """The next item; queue.Empty if none."""
        return self._items.get_nowait()

    def drain(self) -> list:
        """Every item put so far, taken."""
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items

    def get_blocking(self, timeout: float | None = None):
        """The next item, waiting on this thread for it; queue.Empty after `timeout` seconds."""
        return self._items.get(timeout=timeout)

    async def get(self):
        """The next item, awaited on the queue's event loop."""
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            # Cleared before looking again: a put after the look sets it again (its call comes later on the loop).
            self._ready.clear()
            try:
                return self._items.get_nowait()
            except queue.Empty:
                await self._ready.wait()


def results(request) -> list:
    """The completions of a request that ended, taken from its own queue (which holds its RequestEnd, and before it
    its rounds' outputs if it followed them): how a caller that ran the engine until done reads them."""
    ends = [item for item in request.outputs.drain() if isinstance(item, RequestEnd)]
    if not ends:
        raise RuntimeError(f"request {request.id} has not ended: run the engine until it is done first")
    return list(ends[-1].results)
