"""Tensor and expert parallelism over torch.distributed (`--tensor-parallel-size N`).

* `context.py`: a rank's place in the group (`ParallelContext`) and its collectives; the
  single-process `SINGLE_RANK`, whose collectives return their input, is what every model
  holds at size 1.
* `sharding.py`: which slice of each checkpoint tensor a rank holds (column, row, vocabulary,
  whole experts), the rank's own `ModelConfig` (local heads and widths) and the vocab-parallel
  embedding. Each rank loads through the one loader (workers/models/loader.py), reading
  only its slices of the safetensors files (`get_slice`).
* `expert_parallel.py`: whole routed experts per rank, dispatch and combine.
* `driver.py` (rank 0, in the scheduler process) and `worker.py` (ranks 1..N-1, one process
  each): the driver sends every model call to the workers, all ranks run it, outputs are
  taken on rank 0.
"""
