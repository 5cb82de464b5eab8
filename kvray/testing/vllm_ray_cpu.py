"""TEST ONLY: a vLLM platform plugin that lets vLLM's CPU workers run under its Ray
executor (``--distributed-executor-backend ray``), which vLLM's own CPU platform refuses
("current platform cpu does not support ray": it has no ``ray_device_key``).

It is vLLM's ``CpuPlatform`` with one difference: the device a worker holds is Ray's
``GPU`` resource, as on CUDA. The Ray executor then does what it does on a GPU cluster:
one placement-group bundle ``{"GPU": 1}`` per worker, one ``RayWorkerWrapper`` actor per
bundle, local ranks from the workers' nodes, and kvray's connector inside those actors.
The Ray nodes of such a test advertise ``--num-gpus N`` as N worker slots; no CUDA is
involved (the workers run vLLM's CPU model runner, as every CPU test does).

One more change makes TP across nodes possible: vLLM's CPU communicator uses a
shared-memory all-reduce whenever the ranks agree on a group name (derived from the
distributed init port, equal on every node), and fails to open the other node's segment.
Here it is used only when the ranks also share /dev/shm
(``kvray.testing.vllm_ray_cpu_comm``);
otherwise the group falls back to torch.distributed (gloo over TCP), as vLLM does for
ranks whose names differ. Everything else (the executor, placement, the workers, kvray)
is the real code.

Registered through the ``vllm.platform_plugins`` entry point, and active only in a
process whose environment has ``KVRAY_TEST_RAY_CPU_PLATFORM=1``: the vLLM server of
such a test, and the raylets of its Ray nodes (whose worker processes inherit it).
Otherwise ``register`` returns None and vLLM picks its platform as always.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

ENV = "KVRAY_TEST_RAY_CPU_PLATFORM"


def register() -> str | None:
    """vLLM platform plugin hook (runs while vLLM picks its platform, so it imports
    nothing of vLLM): this platform when ``KVRAY_TEST_RAY_CPU_PLATFORM=1``."""
    if os.environ.get(ENV) != "1":
        return None
    return f"{__name__}.RayCpuTestPlatform"


if TYPE_CHECKING or os.environ.get(ENV) == "1":
    from vllm.platforms.cpu import CpuPlatform

    class RayCpuTestPlatform(CpuPlatform):
        """vLLM's CPU platform whose workers Ray places as ``GPU`` resources (tests
        only)."""

        ray_device_key: str = "GPU"
        # As on CUDA: Ray must not narrow what a worker sees (vLLM indexes by local rank).
        ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return "kvray.testing.vllm_ray_cpu_comm.NodeLocalShmCpuCommunicator"
