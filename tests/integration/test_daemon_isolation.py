"""Through the real daemon: a request whose engine step fails ends with `internal_error`
for its client only, while another client's request runs to its end and the daemon keeps
serving (workers/engine/isolation.py).

The fault is planted in the scheduler process by a test-only `sitecustomize` module on
PYTHONPATH (Python imports it at start-up; the daemon has no hook for it): the sampler
raises for any batch holding a request with the poison seed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from specd.exit_codes import EXIT_OK
from specd.ipc import errors
from tests.integration.daemon_harness import Daemon

POISON_SEED = 987_654_321
PLUGIN = f'''
import sys

if "--engine-config" in sys.argv:  # the scheduler process only, not the front
    from specd.workers.runner import sampler

    _real_sample = sampler.sample

    def _poisoned_sample(logits, params, *args):
        if any(p.seed == {POISON_SEED} for p in params):
            raise RuntimeError("planted fault: the poisoned request's row")
        return _real_sample(logits, params, *args)

    sampler.sample = _poisoned_sample
'''


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(plugin), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return Daemon(tmp_path)


def test_a_request_that_fails_its_step_errors_alone_and_the_daemon_serves_on(
        daemon: Daemon) -> None:
    daemon.wait_ready()
    try:
        with daemon.client() as healthy, daemon.client() as poisoned:
            stream = healthy.stream("def main():\n", max_tokens=300, ignore_eos=True)
            deltas = iter(stream)
            next(deltas)  # decoding: the poisoned request joins its batch
            with pytest.raises(errors.InternalError) as caught:
                poisoned.generate("import os\n", max_tokens=8, seed=POISON_SEED)
            assert caught.value.message == (
                "RuntimeError: planted fault: the poisoned request's row")
            for _ in deltas:
                pass
            assert stream.result is not None and stream.result.finish_reason == "length"
            assert stream.result.num_output_tokens == 300
            # A client that repeats it gets the same error; the daemon does not restart.
            with pytest.raises(errors.InternalError):
                poisoned.generate("import os\n", max_tokens=8, seed=POISON_SEED)
            assert healthy.generate("x = 1\n", max_tokens=4, ignore_eos=True
                                    ).finish_reason == "length"
            assert healthy.status().state == "ready"
            stats = healthy.stats()
            assert stats["engine"]["num_requests_failed"] == 2
            assert stats["engine"]["num_step_failures"] == 2
            assert stats["front"]["error_internal_error"] == 2
        [first, _] = daemon.events("step_failure")
        assert first["outcome"] == "failed" and len(first["request_ids"]) == 2
        assert len(first["cleared"]) == 1 and first["culprits"] != first["cleared"]
        failed = daemon.events("request_failed")
        assert len(failed) == 2 and "planted fault" in failed[0]["traceback"]
        assert not daemon.events("scheduler_failed")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == EXIT_OK
    finally:
        daemon.stop()
