"""Compilation off the serving thread (`--cpu-compile-background`; part of the CPU backend).

torch.compile compiles a function at its first call of each kind of input: minutes on two
cores with a cold inductor cache, about 45 s with a warm one (the fixture in float32), which
the warm-up would otherwise pay before the daemon is ready. In the background, the warm-up
and the first steps run eagerly; each compiled step kind's first eager call hands a copy of
its inputs to this one thread, which calls the compiled function on that copy (what makes
dynamo trace and inductor compile that kind; the result is dropped), and from the next step
of that kind on the serving thread runs it compiled. Only pure compiled functions are
submitted (they read their inputs and the caches and write nothing), so a call on a copy
changes nothing the engine holds.

Contracts:

* `submit(name, job)`: `job` runs once, on the compile thread, in submission order, under
  `torch.inference_mode` (as the engine's steps run: dynamo guards on grad mode, and a
  kind traced under another mode would compile again on the serving thread). `is_ready`
  is True from when it returned; `pending()` names what is submitted and not done.
* A job that raises is not swallowed: `on_error(exc)`, the submitter's (called from the
  except block on the compile thread: it logs the traceback and marks its kind eager), and
  the thread goes on with the next job.
* Every kind that becomes compiled is one INFO record (event `cpu_compiled`: the kind and
  the seconds it took): the step's mode changed.
* One process-wide compile at a time is dynamo's own rule; the eager steps beside it share
  the interpreter, so they run slower (the GIL) until every kind is compiled. Each torch op
  an eager step dispatches releases the GIL, and dynamo's tracing (rerun at every start:
  the on-disk caches keep inductor's code, not the trace) takes it; at CPython's default
  switch interval (5 ms) the serving thread then waits up to 5 ms to run its next op, for
  ~700 ops a step. So while anything is pending the interpreter's switch interval is
  `SWITCH_INTERVAL_S` (0.1 ms), and the previous one is restored when nothing is: on the
  fixture in float32 with a warm cache the warm-up beside the compile thread took 8.5 s
  (15 s at 0.5 ms, 50-72 s at 5 ms; 7.7 s with nothing compiling).

Not for tensor parallelism: a compiled step there holds all-reduces, which a call on the
compile thread would run out of the ranks' step order (config.py refuses the combination).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("specd.cpu_compile")

SWITCH_INTERVAL_S = 1e-4


@dataclass(frozen=True)
class _Job:
    name: str
    run: Callable[[], object]
    on_error: Callable[[Exception], None]


class BackgroundCompiles:
    """One daemon thread that runs compile jobs in order (module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: list[str] = []  # submitted, not yet done (in order)
        self._done: set[str] = set()
        self._thread: threading.Thread | None = None
        self._switch_interval = sys.getswitchinterval()  # restored when nothing is pending

    def submit(self, name: str, run: Callable[[], object],
               on_error: Callable[[Exception], None]) -> None:
        """Queue `run` (see the contracts); a name already submitted is ignored."""
        with self._lock:
            if name in self._pending or name in self._done:
                return
            if not self._pending:
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(SWITCH_INTERVAL_S, self._switch_interval))
            self._pending.append(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specd-cpu-compile",
                                                daemon=True)
                self._thread.start()
        self._jobs.put(_Job(name, run, on_error))

    def is_ready(self, name: str) -> bool:
        """True once `name`'s job returned (or raised: its on_error decided what follows)."""
        with self._lock:
            return name in self._done

    def is_submitted(self, name: str) -> bool:
        with self._lock:
            return name in self._pending or name in self._done

    def pending(self) -> list[str]:
        """Submitted and not done, in submission order."""
        with self._lock:
            return list(self._pending)

    def wait(self, timeout_s: float) -> bool:
        """Block until nothing is pending (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    job.run()
            except Exception as exc:  # noqa: BLE001 - handed to the submitter, which logs it
                job.on_error(exc)
            else:
                seconds = time.perf_counter() - t0
                log.info("compiled %s in the background (%.1f s)", job.name, seconds,
                         extra={"event": "cpu_compiled", "kind": job.name,
                                "seconds": round(seconds, 3)})
            finally:
                with self._lock:
                    self._pending.remove(job.name)
                    self._done.add(job.name)
                    if not self._pending:
                        sys.setswitchinterval(self._switch_interval)
