"""A request's choices (`n`) admitted to the request flow, the prompt's KV shared.

Each choice is a generate of its own in the flow, answering to the request's one
`HttpPeer` with its index as the client id, so one disconnect aborts them all. The first
choice goes at once; the others once it has output. By then its prompt's full KV blocks
are computed and registered in the prefix cache, so the other choices take them instead of
computing the prompt again (only the last, partial block is computed once per choice).
Admitted together, every choice would compute the whole prompt: a block is shared only
once it is computed.
"""

from __future__ import annotations

from specd.daemon.http.peer import HttpPeer
from specd.daemon.request_flow import RequestFlow
from specd.ipc import messages as m


class Choices:
    """Admits `generates` (choice i has id i) for `peer` through `flow`: `start`, then
    `on_frames` with every frame the peer receives."""

    def __init__(self, flow: RequestFlow, peer: HttpPeer, generates: list[m.Generate],
                 warmup: bool = False) -> None:
        self.flow = flow
        self.peer = peer
        self.generates = generates
        self.warmup = warmup  # the front's own warm-up request (daemon/http_warmup.py)
        self.num_admitted = 0

    def start(self) -> None:
        self._admit(1)

    def on_frames(self, frames: list[m.ServerMessage]) -> None:
        """The rest go once the first choice's prompt is computed: its first output."""
        if self.num_admitted < len(self.generates) and any(
                isinstance(f, m.Final) or (isinstance(f, m.Delta) and f.token_ids)
                for f in frames if getattr(f, "id", None) == 0):
            self._admit(len(self.generates))

    def _admit(self, up_to: int) -> None:
        while self.num_admitted < up_to:
            self.flow.admit(self.peer, self.generates[self.num_admitted], warmup=self.warmup)
            self.num_admitted += 1
