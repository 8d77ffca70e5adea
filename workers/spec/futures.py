"""What a speculative step leaves on the device for the next one (overlap scheduling).

With overlap scheduling step N + 1 is launched before the host has read step N. A
sequence that step N verified (or prefilled) and drafted for continues in step N + 1 from
values only the device has: how many drafts step N accepted (which shifts every position
of step N + 1) and the draft tree step N proposed. They are kept here, indexed like the
runner's `future_tokens` (the bonus token): by the sample id of step N, modulo the size.
At most two samples per sequence are ever unresolved, so an entry is never overwritten
while a step that reads it is still to be launched.
"""

from __future__ import annotations

import torch

from specd.workers.runner.host_copy import upload
from specd.workers.spec.tree import DraftTree


class DraftFutures:
    """Per sample id: accepted drafts (int64) and the next draft tree (T nodes)."""

    def __init__(self, size: int, num_nodes: int, device: torch.device) -> None:
        self.size = size
        self.num_nodes = num_nodes
        self.accepted = torch.zeros(size, dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(size, num_nodes, dtype=torch.int64, device=device)
        self.parents = torch.full((size, num_nodes), -1, dtype=torch.int64, device=device)
        self.depths = torch.zeros(size, num_nodes, dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros(size, num_nodes, dtype=torch.int64, device=device)

    def index(self, sample_ids: list[int], device: torch.device) -> torch.Tensor:
        # Staged through pinned memory: a pageable copy would wait for the step in flight.
        return upload(torch.tensor(sample_ids, dtype=torch.int64), device) % self.size

    def write_accepted(self, index: torch.Tensor, accepted: torch.Tensor) -> None:
        self.accepted[index] = accepted

    def write_tree(self, index: torch.Tensor, tree: DraftTree) -> None:
        if tree.token_ids.shape[1] != self.num_nodes:
            raise ValueError(f"draft trees have {self.num_nodes} nodes here, got "
                             f"{tree.token_ids.shape[1]}")
        self.token_ids[index] = tree.token_ids
        self.parents[index] = tree.parents
        self.depths[index] = tree.depths
        self.tree_mask[index] = tree.tree_mask

    def tree(self, index: torch.Tensor) -> DraftTree:
        return DraftTree(token_ids=self.token_ids[index], parents=self.parents[index],
                         depths=self.depths[index], tree_mask=self.tree_mask[index])
