"""The process entry of ranks 1..N-1: `python -P -m specd.workers.parallel.rank_main ...`
(launch.py starts it; never by hand).

Only what the control pipe needs is imported before the pipe is open (rank_spec.py): from
its first second the rank beats (`loading`, every HEARTBEAT_S, from a thread), through the
import of torch and the model code, joining the group and loading its shard (worker.py),
until it reports `ready` or `failed` with the traceback. A slow interpreter start on a
loaded host is then progress to rank 0's wait and to the scheduler's stage watch
(stage_watch.py); a stopped rank is silence; one that hangs while running is ended by rank
0's timeout.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection

from specd.workers.parallel.rank_spec import RankSpec, StatusPipe
from specd.workers.process.parent import die_with_parent


def main(argv: list[str] | None = None) -> None:
    """Start rank `--rank` (module docstring), then serve rank 0's calls until `stop`."""
    spec, control_fd = RankSpec.parse(argv)
    # Killed with rank 0 even when stopped or inside a collective (prctl(2)).
    die_with_parent(spec.parent_pid)
    status = StatusPipe(Connection(control_fd))
    try:
        with status.beating():
            from specd.workers.parallel.worker import start_rank

            server = start_rank(spec, status)
    except BaseException:
        status.report("failed", traceback.format_exc())
        raise
    status.report("ready")
    server.serve()


if __name__ == "__main__":
    main()
