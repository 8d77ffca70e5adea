"""The daemon's exit codes: the contract with the service manager (see the systemd unit).

0 (clean stop after a drain or `specctl stop`), 78 EX_CONFIG (bad configuration, a model
that cannot load, a scheduler built from different code: restarting will not help), 75
EX_TEMPFAIL (the scheduler died or hung: restart), 70 EX_SOFTWARE (a bug in the front).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_SOFTWARE = 70
EXIT_SCHEDULER_FAILED = 75
EXIT_CONFIG = 78
