"""Shared test setup: stay on loopback, never touch a cluster or token we did not make."""

import os

import pytest

# Before Ray is imported anywhere: bind and advertise 127.0.0.1 only, no token auth.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Mooncake clients in this process (baselines) fail fast on a dead master.
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

if os.environ.get("KVRAY_REQUIRE_VLLM") == "1":
    # CI (.ci/run) sets this: a missing or broken vLLM fails the run here instead of
    # skipping every test that needs it (the e2e tier, the connector's unit tests).
    import vllm  # noqa: F401


@pytest.fixture(scope="session")
def ray_cluster():
    """A new local Ray cluster on 127.0.0.1 for the whole session; yields its address."""
    import ray

    from kvray.ray_env import ray_init

    # Logical CPUs: actors reserve fractions; the real 2 cores are shared anyway.
    # num_gpus: one slot for vLLM's Ray executor under the test-only platform
    # (kvray.testing.vllm_ray_cpu); a Ray resource only, no CUDA.
    ray_init(
        "local", num_cpus=4, num_gpus=1, include_dashboard=False, object_store_memory=200 << 20
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
