"""The start-up exit codes: a code bug restarts (70), a bad configuration does not (78)."""

from __future__ import annotations

import json

import pytest

from specd.exit_codes import EXIT_CONFIG, EXIT_SOFTWARE, startup_exit_code


@pytest.mark.parametrize("error", [
    AttributeError("'SpeculativeWorker' object has no attribute 'tree'"),
    TypeError("launch() missing 1 required positional argument"),
    NameError("name 'batch' is not defined"),
    UnboundLocalError("cannot access local variable 'x'"),
    KeyError("layers.0.q_proj"),
    IndexError("list index out of range"),
    AssertionError(),
])
def test_a_code_bug_during_start_up_is_restartable(error: BaseException) -> None:
    assert startup_exit_code(error) == EXIT_SOFTWARE


@pytest.mark.parametrize("error", [
    ValueError("max_model_len 9000 exceeds the model's limit 2048"),
    FileNotFoundError("draft model: /m/eagle3 not found"),
    json.JSONDecodeError("Expecting value", "", 0),
    MemoryError(),
    RuntimeError("CUDA out of memory"),  # a budget too large for the device
])
def test_bad_configuration_or_an_unknown_failure_is_not_restarted(error: BaseException) -> None:
    assert startup_exit_code(error) == EXIT_CONFIG
