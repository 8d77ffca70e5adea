"""Progress of a start-up stage that reports none of its own: loading the model.

Loading is one long call (`EngineCore(config)`: read the checkpoint, build the runner, pack
or capture) that says nothing while it runs, so a load that hangs (a deadlock, a read from
a dead network filesystem) looked like a slow one until the 30-minute start-up timeout.
`StageWatch` samples the main thread once a second from a thread of its own and sends a
`StartupStage` heartbeat only when the load moved: the bytes the main thread's reads
returned (/proc/self/task/TID/io `rchar`: the checkpoint, a `pytorch_model.bin`, module
files) or its page faults (/proc/self/task/TID/stat: safetensors reads through mmap, and
memory the load fills: new weights, the KV cache, packed copies). CPU time alone is no
progress, nor is the Python line the thread is on: a load that spins (a busy loop, a retry
that never succeeds) reads and fills nothing, so it is a hang like one that blocks. The
front counts the heartbeats as progress and treats silence for the hang timeout as a hang
(stacks dumped, exit 75); a stopped process sends nothing either. The heartbeat's detail
says what moved (and the CPU time, for the operator).

A main thread that waits on other processes still moves while they work: rank 0 of a
tensor-parallel model, waiting for ranks 1..N-1 to start and load their shards, reads a
beat from each of them every second (parallel/rank_spec.py `StatusPipe.beating`, from the
rank's interpreter start on), and those reads count in its `rchar`. A stopped worker sends
no beats, so its silence is rank 0's too and the hang timeout ends it; a worker whose load
hangs while its process runs keeps beating (a thread of its own sends them) until rank 0's
wait for it times out (`parallel/context.py` COLLECTIVE_TIMEOUT), which fails the load stage.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from specd.ipc import messages as m
from specd.workers.process.io_threads import LinkIO

SAMPLE_S = 1.0


class StageWatch:
    """While running (`with StageWatch(io, stage):`), heartbeats for `stage` whenever the
    load moved since the last sample: the main thread read bytes or faulted pages in."""

    def __init__(self, io: LinkIO, stage: str, sample_s: float = SAMPLE_S) -> None:
        self.io = io
        self.stage = stage
        self.sample_s = sample_s
        self._task = Path(f"/proc/self/task/{threading.main_thread().native_id}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{stage}", daemon=True)

    def __enter__(self) -> StageWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> tuple[int, int, int, int]:
        """(bytes read, minor faults, major faults, CPU ticks) of the main thread: the
        first three are the load's progress, the CPU time only shown."""
        fields = (self._task / "stat").read_text().rpartition(")")[2].split()
        # After the command name: state is field 3 (index 0), so minflt (10) is index 7,
        # majflt (12) index 9, utime (14) index 11, stime (15) index 12 (proc(5)).
        minflt, majflt, utime, stime = (int(fields[i]) for i in (7, 9, 11, 12))
        return self._bytes_read(), minflt, majflt, utime + stime

    def _bytes_read(self) -> int:
        """The main thread's `rchar`; 0 where the sandbox hides /proc/self/task/TID/io
        (page faults still show a load that reads through mmap)."""
        try:
            text = (self._task / "io").read_text()
        except PermissionError:
            return 0
        return int(dict(line.split(": ") for line in text.splitlines())["rchar"])

    def _run(self) -> None:
        last = self.sample()
        while not self._stop.wait(self.sample_s):
            now = self.sample()
            rchar, minflt, majflt, ticks = now
            if (rchar, minflt, majflt) != last[:3]:
                self.io.send(m.StartupStage(self.stage, detail=(
                    f"{rchar / 2**20:.0f} MiB read, {minflt + majflt} page faults "
                    f"({majflt} major), {ticks / os.sysconf('SC_CLK_TCK'):.0f} s CPU")))
            last = now
