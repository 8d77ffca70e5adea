"""The scheduler's link I/O on two threads, so the engine loop never waits on a socket or a
msgpack encoder: a receive thread decodes `ToScheduler` messages into `inbox`, a send thread
encodes whatever the loop puts in `outbox` and sends it.

A failure on either thread is not lost: it is put into `inbox` as a `LinkFailure`, which
the engine loop raises (stage "link"), so it reaches the front as a SchedulerFailed.
"""

from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from specd.ipc.messages import FromScheduler, ToScheduler
from specd.ipc.zmq_link import LinkPaths, TypedSocket

POLL_MS = 100  # how often the receive thread checks whether it should stop


@dataclass(frozen=True)
class LinkFailure:
    """An exception on an IO thread, with its formatted traceback."""

    thread: str
    error: str
    traceback: str


class LinkIO:
    """Connects to the front's sockets and runs the two IO threads (started by `start`)."""

    def __init__(self, paths: LinkPaths) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._receiver: TypedSocket[ToScheduler] = TypedSocket.connect(
            self._context, zmq.PULL, paths.to_scheduler, ToScheduler)
        self._sender: TypedSocket[FromScheduler] = TypedSocket.connect(
            self._context, zmq.PUSH, paths.from_scheduler)
        self.inbox: queue.SimpleQueue[ToScheduler | LinkFailure] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[FromScheduler | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = (
            threading.Thread(target=self._receive_loop, name="link-recv", daemon=True),
            threading.Thread(target=self._send_loop, name="link-send", daemon=True),
        )

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def send(self, message: FromScheduler) -> None:
        """Queue a message for the send thread (never blocks)."""
        self.outbox.put(message)

    def receive_all(self, timeout: float | None) -> list[ToScheduler | LinkFailure]:
        """Every message waiting now; first waits up to `timeout` s (None: forever) for one."""
        messages: list[ToScheduler | LinkFailure] = []
        if timeout is None or timeout > 0:
            try:
                messages.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop both threads and close the sockets."""
        self._stop.set()
        self.outbox.put(None)
        for thread in self._threads:
            thread.join(timeout)

    def _receive_loop(self) -> None:
        try:
            while not self._stop.is_set():
                message = self._receiver.recv(timeout_ms=POLL_MS)
                if message is not None:
                    self.inbox.put(message)
        except Exception as exc:  # noqa: BLE001 - handed to the engine loop, which raises it
            self.inbox.put(LinkFailure("link-recv", repr(exc), traceback.format_exc()))
        finally:
            self._receiver.close()

    def _send_loop(self) -> None:
        try:
            while (message := self.outbox.get()) is not None:
                self._sender.send(message)
        except Exception as exc:  # noqa: BLE001 - handed to the engine loop, which raises it
            self.inbox.put(LinkFailure("link-send", repr(exc), traceback.format_exc()))
