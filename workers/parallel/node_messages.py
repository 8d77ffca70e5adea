"""The control link between node 0 and each other node's agent (nodes.py, node_agent.py):
one tagged union each way, msgpack over a ZeroMQ DEALER (the agent) / ROUTER (node 0).

Node -> node 0: `NodeHello` once connected (its host, its code's version, the ranks it
started), `NodeStatus` while they start (the statuses of rank_spec.py, one for the whole
node: `loading` for each beat of any rank, `joining` and `ready` once all are, `failed`
with the failing rank's message), `NodeBeat` every BEAT_S from then on, and `NodeFailed`
when one of its ranks dies after start-up. Node 0 -> node: `HeadBeat` every BEAT_S,
`HeadStop` when node 0 stops its ranks (the `stop` call went down the step socket first).

Either side that hears nothing from the other for SILENCE_S takes it for gone: node 0
fails (every open request, exit 75), the agent stops its ranks and exits.
"""

from __future__ import annotations

import msgspec

BEAT_S = 1.0
SILENCE_S = 5.0


class RankEntry(msgspec.Struct, array_like=True, frozen=True):
    """A rank a node started: its global rank, its pid there, its device."""

    rank: int
    pid: int
    device: str


class NodeHello(msgspec.Struct, tag="hello", frozen=True):
    node_rank: int
    host: str
    code_version: str
    source_root: str
    ranks: list[RankEntry]


class NodeStatus(msgspec.Struct, tag="status", frozen=True):
    status: str
    detail: str = ""


class NodeBeat(msgspec.Struct, tag="beat", frozen=True):
    pass


class NodeFailed(msgspec.Struct, tag="failed", frozen=True):
    error: str


class HeadBeat(msgspec.Struct, tag="beat", frozen=True):
    pass


class HeadStop(msgspec.Struct, tag="stop", frozen=True):
    pass


FromNode = NodeHello | NodeStatus | NodeBeat | NodeFailed
ToNode = HeadBeat | HeadStop

ENCODER = msgspec.msgpack.Encoder()
FROM_NODE = msgspec.msgpack.Decoder(FromNode)
TO_NODE = msgspec.msgpack.Decoder(ToNode)

# TCP store keys node 0 sets for the agents.
CONFIG_KEY = "specd/engine_config"
CONTROL_KEY = "specd/control"


def steps_key(node_rank: int) -> str:
    """The store key of node `node_rank`'s step socket address."""
    return f"specd/steps/{node_rank}"


def node_identity(node_rank: int) -> bytes:
    """The agent's DEALER identity: how node 0's ROUTER tells nodes apart."""
    return f"node{node_rank}".encode()
