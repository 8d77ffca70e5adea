"""Tensor and expert parallelism over torch.distributed (`--tensor-parallel-size N`), on one
node or several (`--nnodes`).

* `context.py`: a rank's place in the group (`ParallelContext`) and its collectives; the
  single-process `SINGLE_RANK`, whose collectives return their input, is what every model
  holds at size 1.
* `sharding.py`: which slice of each checkpoint tensor a rank holds (column, row, vocabulary,
  whole experts), the rank's own `ModelConfig` (local heads and widths) and the vocab-parallel
  embedding. Each rank loads through the one loader (workers/models/loader.py), reading
  only its slices of the safetensors files (`get_slice`).
* `expert_parallel.py`: whole routed experts per rank, dispatch and combine.
* `peers.py`: how rank 0's runner and backends announce every model execution to the
  other ranks (`Peers.call`), and `RankFailed`.
* `driver.py` (rank 0, in the scheduler process): starts the group (`RankGroup`), sends
  every call; `codec.py` encodes a call (no pickling), `ring.py` carries it to the ranks of
  a node through shared memory.
* `launch.py`, `rank_main.py`, `worker.py` (ranks 1..N-1, one fresh interpreter each): start,
  join, load, then follow rank 0's calls on their own runner; `local_ranks.py` starts and
  watches the ranks of one host.
* `nodes.py` (node 0's links to the others), `node_agent.py` (`specd-worker`, the other
  nodes), `node_messages.py` (their control link).
"""
