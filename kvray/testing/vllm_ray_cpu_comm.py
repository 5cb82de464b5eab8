"""TEST ONLY: the CPU communicator of ``kvray.testing.vllm_ray_cpu`` (its own module: the
platform module is imported while vLLM picks its platform, before vLLM's communicator
modules can be)."""

from __future__ import annotations

import torch.distributed
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from kvray.shm import node_identity


class NodeLocalShmCpuCommunicator(CpuCommunicator):
    """vLLM's CPU communicator whose shared-memory all-reduce needs one /dev/shm: ranks on
    several nodes fall back to torch.distributed (gloo over TCP)."""

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        nodes: list[str] = [""] * self.world_size
        torch.distributed.all_gather_object(nodes, node_identity(), group=self.device_group)
        # Every rank runs the same collectives (the parent's gather too), whatever the answer.
        return super()._all_group_ranks_share_shm_group_name() and len(set(nodes)) == 1
