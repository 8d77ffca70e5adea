"""Progress of a start-up stage that reports none of its own: loading the model.

Loading is one long call (`EngineCore(config)`: read the checkpoint, build the runner, pack
or capture) that says nothing while it runs, so a load that hangs (a deadlock, a read from
a dead network filesystem) looked like a slow one until the 30-minute start-up timeout.
`StageWatch` samples the main thread once a second from a thread of its own and sends a
`StartupStage` heartbeat, with what moved, only when the main thread moved: its CPU time
or page faults (/proc/self/task/TID/stat; safetensors reads through mmap), the bytes its
read calls returned (/proc/self/task/TID/io), or where its Python code is. The front counts
those heartbeats as progress and treats silence for the hang timeout as a hang (stacks
dumped, exit 75); a stopped process sends nothing either.

A main thread that waits on other processes still moves while they work: rank 0 of a
tensor-parallel model, waiting for ranks 1..N-1 to start and load their shards, reads a
beat from each of them every second (parallel/rank_main.py `StatusPipe.beating`, from the
rank's interpreter start on), and those reads count in its `rchar` and CPU time. A
stopped worker sends no beats, so its silence is rank 0's too and the hang timeout ends
it; a worker whose load hangs while its process runs keeps beating
(a thread of its own sends them) until rank 0's wait for it times out
(`parallel/context.py` COLLECTIVE_TIMEOUT), which fails the load stage.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import cast

from specd.ipc import messages as m
from specd.workers.process.io_threads import LinkIO

SAMPLE_S = 1.0


class StageWatch:
    """While running (`with StageWatch(io, stage):`), heartbeats for `stage` whenever the
    main thread moved since the last sample."""

    def __init__(self, io: LinkIO, stage: str, sample_s: float = SAMPLE_S) -> None:
        self.io = io
        self.stage = stage
        self.sample_s = sample_s
        main = threading.main_thread()
        self._main_ident = cast(int, main.ident)  # set: the main thread is running
        self._task = Path(f"/proc/self/task/{main.native_id}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{stage}", daemon=True)

    def __enter__(self) -> StageWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
        """(counters: CPU ticks, minor and major faults, bytes read; the main thread's
        Python position: file and line of each frame)."""
        fields = (self._task / "stat").read_text().rpartition(")")[2].split()
        # After the command name: state is field 3 (index 0), so minflt (10) is index 7,
        # majflt (12) index 9, utime (14) index 11, stime (15) index 12 (proc(5)).
        minflt, majflt, utime, stime = (int(fields[i]) for i in (7, 9, 11, 12))
        frame = sys._current_frames().get(self._main_ident)  # another thread's frame
        return (utime + stime, minflt, majflt, self._bytes_read()), _position(frame)

    def _bytes_read(self) -> int:
        """The main thread's `rchar`; 0 where the sandbox hides /proc/self/task/TID/io
        (CPU time, faults and the Python position still show progress)."""
        try:
            text = (self._task / "io").read_text()
        except PermissionError:
            return 0
        return int(dict(line.split(": ") for line in text.splitlines())["rchar"])

    def _run(self) -> None:
        last = self.sample()
        while not self._stop.wait(self.sample_s):
            now = self.sample()
            if now != last:
                ticks, _, majflt, rchar = now[0]
                self.io.send(m.StartupStage(self.stage, detail=(
                    f"{ticks / os.sysconf('SC_CLK_TCK'):.0f} s CPU, {rchar / 2**20:.0f} MiB read, "
                    f"{majflt} major faults")))
            last = now


def _position(frame: FrameType | None) -> tuple[tuple[str, int], ...]:
    position = []
    while frame is not None:
        position.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(position)

