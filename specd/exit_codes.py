"""The daemon's exit codes: the contract with the service manager (see the systemd unit).

0 (clean stop after a drain or `specctl stop`), 78 EX_CONFIG (bad configuration, a model
that cannot load, a scheduler built from different code: restarting will not help), 75
EX_TEMPFAIL (the scheduler died or hung: restart), 70 EX_SOFTWARE (a bug in specd's code,
in the front or in building or warming up the engine: restart, and report it).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_SOFTWARE = 70
EXIT_SCHEDULER_FAILED = 75
EXIT_CONFIG = 78

# Exceptions no configuration explains: the code is wrong. Configuration and model problems
# raise ValueError or OSError naming the option or file (EngineConfig, ModelConfig, the
# loader); anything else that is not listed here keeps 78, so that an unknown failure never
# turns into a restart loop of a daemon that cannot start.
CODE_BUG_ERRORS: tuple[type[BaseException], ...] = (
    AttributeError, TypeError, NameError, AssertionError, KeyError, IndexError,
    ZeroDivisionError, NotImplementedError, RecursionError)


def startup_exit_code(error: BaseException) -> int:
    """The exit code for a scheduler that failed to build or warm up with `error`: 70 for a
    code bug (restartable, like a crash; the service manager restarts it), 78 otherwise."""
    return EXIT_SOFTWARE if isinstance(error, CODE_BUG_ERRORS) else EXIT_CONFIG
