"""openYuanrong datasystem, NPU device path: the same contract as the host path, with
``HeteroClient.mset_d2h`` / ``mget_h2d`` moving each key's pieces between NPU memory and
the worker's host memory (vLLM-Ascend's Yuanrong backend uses the same calls).

Addresses given to :meth:`put` / :meth:`get` are device addresses valid in this process
(the rank's KV cache, reached through NPU IPC). ``torch_npu`` is imported lazily, when a
client is made; nothing here can run without an Ascend NPU and its driver, so this path
has not run on hardware in kvray's CI (its tests skip, saying so). On a CPU machine the
SDK's device calls fail with ``No device manager available``, which kvray reports as a
failed batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvray.backends.base import Check, KeyStatus, Pieces, Seal
from kvray.backends.yuanrong import DatasystemBackend, classify, code_of, logger
from kvray.errors import BackendUnavailableError


def npu_device_id() -> int:
    """The NPU this process uses (``torch.npu.current_device()``)."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        raise BackendUnavailableError(
            "yuanrong.device='npu' needs torch_npu and an Ascend NPU; use device='host' here"
        ) from exc
    npu: Any = getattr(torch, "npu")  # noqa: B009  (added by torch_npu at import)
    return int(npu.current_device())


class YuanrongDeviceBackend(DatasystemBackend):
    """The NPU data path: one HeteroClient; a key is the concatenation of its pieces."""

    data_path = "npu"

    def _make_client(self, ds: Any, host: str, port: int) -> Any:
        self._device_id = npu_device_id()
        self._ds = ds
        return ds.HeteroClient(
            host,
            port,
            connect_timeout_ms=self._config.connect_timeout_ms,
            req_timeout_ms=self._config.request_timeout_ms,
            enable_exclusive_connection=self._config.enable_exclusive_connection,
            enable_remote_h2d=self._config.enable_remote_h2d,
        )

    def _blob_lists(self, ptrs: Pieces, sizes: Pieces) -> list[Any]:
        return [
            self._ds.DeviceBlobList(
                self._device_id,
                [self._ds.Blob(ptr, size) for ptr, size in zip(p, s, strict=True)],
            )
            for p, s in zip(ptrs, sizes, strict=True)
        ]

    def _writer(
        self, keys: list[str], ptrs: Pieces, sizes: Pieces, seal: Seal | None
    ) -> tuple[Callable[[int, int], list[KeyStatus]], int]:
        if seal is not None:
            raise ValueError("the device data path moves device memory: the host cannot seal it")
        from yr.datasystem.kv_client import SetParam

        param = SetParam()
        param.write_mode = self._write_mode
        blobs = self._blob_lists(ptrs, sizes)

        def write(lo: int, hi: int) -> list[KeyStatus]:
            try:
                self._native(self._client.mset_d2h, keys[lo:hi], blobs[lo:hi], param)
            except RuntimeError as exc:
                logger.warning("datasystem mset_d2h of %d key(s): %s", hi - lo, code_of(exc))
                return [classify(exc) or KeyStatus.ERROR] * (hi - lo)
            return [KeyStatus.OK] * (hi - lo)

        return write, 0  # device copies: not split by size

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if check is not None:
            raise ValueError("the device data path moves device memory: the host cannot check it")
        if not keys:
            return []
        enc = self._encode(keys)
        blobs = self._blob_lists(ptrs, sizes)

        def read(lo: int, hi: int) -> list[KeyStatus]:
            try:
                failed = set(self._native(self._client.mget_h2d, enc[lo:hi], blobs[lo:hi], 0))
            except RuntimeError as exc:
                return [classify(exc) or KeyStatus.ERROR] * (hi - lo)
            if not failed:
                return [KeyStatus.OK] * (hi - lo)
            # mget_h2d names the failed keys but not why: absent keys are misses, the
            # rest failed transfers (their destination must not be used).
            present = self._exist([k for k in enc[lo:hi] if k in failed])
            why = dict(zip([k for k in enc[lo:hi] if k in failed], present, strict=True))
            return [
                KeyStatus.OK
                if k not in failed
                else (KeyStatus.TRANSFER_FAILED if why[k] else KeyStatus.NOT_FOUND)
                for k in enc[lo:hi]
            ]

        return await self._split(read, len(enc), 0)

    async def health(self) -> bool:
        if self._calls.closed:
            return False
        try:
            await self._call(self._exist, ["kvray-health-probe"])
        except BackendUnavailableError:
            return False
        return True
