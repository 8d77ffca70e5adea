"""Drafting on its own CUDA stream, verification on the main one, ordered by events.

Order of a speculative step (see worker.py): the worker catches up the draft K/V and runs
the draft loop inside `drafting()`, which first makes the draft stream wait for everything
the main stream has issued (the verify whose aux rows and accepted tokens the drafts start
from) and at its end records an event; the next launch calls `wait_for_drafts()` before its
verify forward, so the main stream waits for that event, never for the whole device. Work
queued on the main stream meanwhile (the next step's uploads and plain rows) is free to
run beside the drafts.

Memory: the drafts stay on the device (`DraftFutures`), and the step's own tensors that the
draft stream reads are kept alive by its `PendingSpec` until it is resolved, which reads
the draft loop's checks (and so waits for the draft stream) after the next step was
launched and ordered after the drafts: the caching allocator cannot hand their memory to
the main stream while the drafts still read it; what the main stream made and the drafts
read (the verify's aux rows, the acceptance) is marked with `reads`.

On the CPU both are synchronous stand-ins; the order of sections and waits is recorded
the same way on both, so tests check it in CI.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DraftStreams:
    """The worker's two streams. `order` keeps the last 64 ("draft", n) / ("wait", n)
    records: n counts draft sections, and a wait names the section it waited for."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._drafted: torch.cuda.Event | None = None
        self.num_drafts = 0
        self.order: deque[tuple[str, int]] = deque(maxlen=64)

    @contextmanager
    def drafting(self) -> Iterator[None]:
        """Run the block's device work on the draft stream, after the main stream's."""
        self.num_drafts += 1
        self.order.append(("draft", self.num_drafts))
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        self._drafted = torch.cuda.Event()
        self._drafted.record(self.stream)

    def reads(self, tensors: list[torch.Tensor]) -> None:
        """Tensors the main stream made that the draft section reads (call inside
        `drafting()`): their memory is not handed out again before the draft stream has
        run past this point (CUDA's `record_stream`; nothing to do on the CPU)."""
        if self.stream is not None:
            for t in tensors:
                t.record_stream(self.stream)

    def wait_for_drafts(self) -> None:
        """Order the main stream after the last draft section (before a verify forward)."""
        self.order.append(("wait", self.num_drafts))
        if self._drafted is not None:
            torch.cuda.current_stream(self._drafted.device).wait_event(self._drafted)
