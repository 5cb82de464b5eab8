"""Shared test setup: stay on loopback, never touch a cluster or token we did not make."""

import atexit
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before Ray is imported anywhere: bind and advertise 127.0.0.1 only, no token auth.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Mooncake clients in this process (baselines) fail fast on a dead master.
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
# vLLM's ZMQ sockets (``ipc://<VLLM_RPC_BASE_PATH>/<uuid>``, ~7 per server, default the
# system's temp dir) outlive the processes that bound them: they go in a directory of
# this process's, removed when it exits (also when it fails in this file, below).
RPC_DIR = tempfile.mkdtemp(prefix="kvray-vllm-rpc-")
os.environ["VLLM_RPC_BASE_PATH"] = RPC_DIR
atexit.register(shutil.rmtree, RPC_DIR, ignore_errors=True)

# vLLM's engines rendezvous through a torch FileStore file, ``<temp dir>/vllm_dist_<uuid>``,
# that an engine process leaves behind when it exits. The run's first process (xdist's
# controller, or pytest alone) removes those that appeared while the run lasted.
VLLM_DIST_GLOB = "vllm_dist_*"


def _vllm_dist_files() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(VLLM_DIST_GLOB))


if not os.environ.get("PYTEST_XDIST_WORKER"):
    _BEFORE_RUN = _vllm_dist_files()
    # vLLM inspects a model's class in a fresh interpreter (it imports vLLM: ~10 s of CPU
    # here) unless ``VLLM_CACHE_ROOT/modelinfos`` holds it already: one cache root for the
    # run, made here and inherited by the xdist workers, so that every engine and server
    # of the run after the first of each architecture reads it from there.
    VLLM_CACHE = tempfile.mkdtemp(prefix="kvray-vllm-cache-")
    os.environ["VLLM_CACHE_ROOT"] = VLLM_CACHE
    atexit.register(shutil.rmtree, VLLM_CACHE, ignore_errors=True)

    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        for path in _vllm_dist_files() - _BEFORE_RUN:
            path.unlink(missing_ok=True)


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


# Parallel runs (`make test` runs pytest-xdist's `-n 2`): the suite's processes mostly
# wait (servers starting, engines loading, timeouts), using ~30-50 % of the two cores when
# run one test at a time.
FIRST = ("tests/e2e/", "tests/multinode/", "tests/integration/", "tests/unit/")
"""Under xdist, modules are handed out in this order of their directories (the long ones
first, so that no worker starts a long module last)."""


LOOKUP_TIMEOUT_MS = 5000
"""The connector's lookup timeout in the tests that run engines and claim hits: the
default, 200 ms, can count a lookup as a miss on 2 cores shared with another test's
engines, and the test would fail by the machine's load, not by kvray. (The timeout itself
is tested in the unit and integration tiers.)"""


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp directory every xdist worker of this run shares (each has its own below)."""
    return Path(str(tmp_path_factory.getbasetemp())).parent


def built_once(tmp_path_factory, name: str, build) -> str:  # type: ignore[no-untyped-def]
    """``build(path)``'s model, built once per run in ``name`` (the xdist workers share it:
    a lock in the run's temp root, the first worker builds it)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return str(build(tmp_path_factory.mktemp("model") / name))
    root = run_dir(tmp_path_factory)
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"{name}.done"
        if not done.exists():
            build(root / name)
            done.touch()
    return str(root / name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Llama, built once per run."""
    from kvray.testing.tiny_model import build_tiny_llama

    return built_once(tmp_path_factory, "tiny-llama", build_tiny_llama)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """The tiny Gemma 3 (sliding-window and full-attention layers: several KV cache groups),
    built once per run."""
    from kvray.testing.tiny_model import build_tiny_gemma3

    return built_once(tmp_path_factory, "tiny-gemma3", build_tiny_gemma3)


@pytest.fixture(scope="session")
def deep_gemma3(tmp_path_factory):
    """The tiny Gemma 3 with eight layers: vLLM's hybrid allocator makes four KV cache
    groups of two layers each (three sliding-window, one full); built once per run."""
    from kvray.testing.tiny_model import build_tiny_gemma3

    return built_once(
        tmp_path_factory, "tiny-gemma3-deep", lambda path: build_tiny_gemma3(path, num_layers=8)
    )


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory):
    """The tiny Qwen3-Next (Gated DeltaNet and full-attention layers: state groups beside
    an attention group), built once per run; vLLM runs it in bfloat16."""
    from kvray.testing.tiny_model import build_tiny_qwen3_next

    return built_once(tmp_path_factory, "tiny-qwen3-next", build_tiny_qwen3_next)


@pytest.fixture(scope="session")
def tiny_nemotron_h(tmp_path_factory):
    """The tiny Nemotron-H (Mamba-2 and attention layers: a state group beside an
    attention group), built once per run."""
    from kvray.testing.tiny_model import build_tiny_nemotron_h

    return built_once(tmp_path_factory, "tiny-nemotron-h", build_tiny_nemotron_h)


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory):
    """The tiny DeepSeek-V2 (latent attention: one MLA group, the same latent on every TP
    rank), built once per run; vLLM runs it in bfloat16."""
    from kvray.testing.tiny_model import build_tiny_deepseek_mla

    return built_once(tmp_path_factory, "tiny-mla", build_tiny_deepseek_mla)


def _unit_of_work(nodeid: str) -> str:
    """Under xdist, every module is one unit of work (its module fixtures are made once, on
    one worker), and so is the multi-node harness (one two-node cluster for its tests), and
    so are the MemCache modules (MemCache allows one MetaService per host: two workers'
    tests each starting one failed)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/multinode/"):
        return "tests/multinode/"
    if path.startswith("tests/integration/test_memcache"):
        return "tests/integration/test_memcache"
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid)

    config.option.loadscopereorder = False  # in FIRST's order, not by test count
    return ByModule(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):

        def rank(item: pytest.Item) -> int:
            return next((i for i, d in enumerate(FIRST) if item.nodeid.startswith(d)), len(FIRST))

        items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, a test marked ``exclusive`` runs, setup and teardown included, while no
    other worker runs one: it waits for the running ones to end, and new ones wait for it
    (a gate lock first, so that it is not starved). Every other test holds a shared lock."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    root = run_dir(item.config._tmp_path_factory)  # type: ignore[attr-defined]
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(root / "kvray-gate.lock", "a") as gate, open(root / "kvray-run.lock", "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


REQUIRE_MULTINODE = os.environ.get("KVRAY_REQUIRE_MULTINODE") == "1"
"""CI (.ci/run) sets KVRAY_REQUIRE_MULTINODE=1: a multinode test that skips (its harness
cannot run, vLLM missing) fails the run instead; what breaks across hosts must show."""


def _no_multinode_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if REQUIRE_MULTINODE and report.skipped and report.nodeid.startswith("tests/multinode/"):
        why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"KVRAY_REQUIRE_MULTINODE=1: a multinode test may not skip ({why})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    _no_multinode_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    report = yield
    _no_multinode_skip(report)
    return report
