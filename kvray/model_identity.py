"""A model's identity, as the default key namespace carries it.

vLLM's block hashes depend on tokens only, so two models that share a tokenizer and a KV
layout would share every key if their namespace did. The namespace an engine uses when
``model_namespace`` is not set is ``<model dir's last part>-m<digest>``, the digest
covering what makes the KV of one prompt differ:

- the weights, by their *content*: for a safetensors shard, its header (every tensor's
  name, dtype, shape and place) and :data:`SAMPLE_BYTES` at the start, middle and end of
  every tensor's data; for any other weight file (``.bin``, ``.pt``, ``.gguf``, ...), its
  size and :data:`SPREAD_SAMPLES` ranges spread over it. Paths, mtimes and inodes are not
  in it: byte-identical copies on other paths or hosts agree, checkpoints whose tensor
  values differ do not (a change confined to bytes no sample reads is the limit of
  sampling: set ``model_namespace`` where that matters). Reading a 70B checkpoint this way
  reads ~``tensors x 3 x SAMPLE_BYTES`` (~10 MB), not its 140 GB;
- the effective model config, after vLLM applied overrides (``--hf-overrides``, rope
  scaling, quantization, dtype);
- the KV cache dtype (``--kv-cache-dtype``).

Not a local path (a hub id): the snapshot in the local hub cache vLLM loaded from; if
there is none (another load format), the id and revision stand for the weights, said once
in the log.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

SAMPLE_BYTES = 4096
"""Bytes read at each sampled place of a tensor."""
SPREAD_SAMPLES = 64
"""Ranges read from a weight file that is not safetensors (evenly spread, ends included)."""
SPREAD_BYTES = 64 << 10
"""Bytes of each of those ranges."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
DIGEST_CHARS = 12


@dataclass(frozen=True)
class ModelIdentity:
    """What the digest was made of, for the log line that names it."""

    digest: str
    weights: str
    """How the weights were identified: ``"N files, M bytes sampled"`` or why not."""
    config: str
    """sha256 (short) of the effective config and KV cache dtype."""

    def namespace(self, model: str) -> str:
        base = os.path.basename(model.rstrip("/")) or model
        return f"{base[:120]}-m{self.digest}"


def _ranges(offset: int, length: int, sample: int) -> Iterator[tuple[int, int]]:
    """Start, middle and end of ``[offset, offset + length)``: ``sample`` bytes each, or
    the whole range when it is small."""
    if length <= 3 * sample:
        yield offset, length
        return
    for start in (offset, offset + (length - sample) // 2, offset + length - sample):
        yield start, sample


def _safetensors_samples(fd: int, size: int) -> Iterator[tuple[int, int]] | None:
    """The header and every tensor's sampled ranges, or None if the file is not a
    well-formed safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    if n <= 0 or 8 + n > size:
        return None
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            return None
        spans.append((8 + n + int(offsets[0]), int(offsets[1]) - int(offsets[0])))

    def ranges() -> Iterator[tuple[int, int]]:
        yield 0, 8 + n
        for start, length in sorted(spans):
            yield from _ranges(start, length, SAMPLE_BYTES)

    return ranges()


def _spread_samples(size: int) -> Iterator[tuple[int, int]]:
    if size <= SPREAD_SAMPLES * SPREAD_BYTES:
        yield 0, size
        return
    step = (size - SPREAD_BYTES) / (SPREAD_SAMPLES - 1)
    for i in range(SPREAD_SAMPLES):
        yield int(i * step), SPREAD_BYTES


def file_digest(path: Path) -> tuple[bytes, int]:
    """(sha256 of the file's sampled content, bytes read)."""
    h = hashlib.sha256()
    read = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(struct.pack("<Q", size))
        ranges = _safetensors_samples(fd, size) if path.suffix == ".safetensors" else None
        for start, length in ranges if ranges is not None else _spread_samples(size):
            chunk = os.pread(fd, length, start)
            h.update(struct.pack("<QQ", start, len(chunk)))
            h.update(chunk)
            read += len(chunk)
    finally:
        os.close(fd)
    return h.digest(), read


def weight_files(root: Path) -> list[Path]:
    """The weight files of a checkpoint directory (or the file itself), by relative path."""
    if root.is_file():
        return [root]
    return sorted(
        p
        for p in root.rglob("*")
        if p.suffix in WEIGHT_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


@functools.lru_cache(maxsize=8)
def weights_digest(root: str) -> tuple[str, str]:
    """(hex digest of the checkpoint's weight files, a description of what was read)."""
    base = Path(root)
    files = weight_files(base)
    h = hashlib.sha256(b"kvray-weights-v1\0")
    read = 0
    for f in files:
        digest, n = file_digest(f)
        rel = "" if f == base else f.relative_to(base).as_posix()
        h.update(rel.encode() + b"\0" + digest)
        read += n
    if not files:
        return h.hexdigest(), "no weight files found"
    return h.hexdigest(), f"{len(files)} weight file(s), {read} bytes sampled"


def _local_snapshot(model: str, revision: str | None) -> Path | None:
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not in the local cache (another load format, or no hub model)
        return None


def _plain(value: Any) -> Any:
    """A config value as stable JSON (private and path-like keys dropped)."""
    if isinstance(value, dict):
        return {
            str(k): _plain(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k not in ("transformers_version",)
        }
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def config_digest(vllm_config: VllmConfig) -> str:
    """sha256 of the effective model config (after overrides) and the KV cache dtype."""
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    data = {
        "hf_config": _plain(hf.to_dict() if hasattr(hf, "to_dict") else vars(hf)),
        "dtype": str(model_config.dtype),
        "quantization": str(model_config.quantization),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def model_identity(vllm_config: VllmConfig) -> ModelIdentity:
    model_config = vllm_config.model_config
    model = model_config.model
    revision = getattr(model_config, "revision", None)
    local = _local_snapshot(model, revision)
    if local is not None:
        weights, how = weights_digest(str(local.resolve()))
    else:
        weights = hashlib.sha256(f"{model}@{revision or 'default'}".encode()).hexdigest()
        how = f"no local copy of {model}'s weights: identified by its id and revision"
        logger.warning(
            "kvray: %s; engines of another checkpoint with this id share its keys unless "
            "model_namespace tells them apart",
            how,
        )
    config = config_digest(vllm_config)
    digest = hashlib.sha256(f"{weights}\0{config}".encode()).hexdigest()[:DIGEST_CHARS]
    return ModelIdentity(digest, how, config[:DIGEST_CHARS])
