"""The model digest of the default key namespace (kvray.model_identity): from the
weights' content, the effective config and the KV cache dtype."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from kvray.model_identity import (
    SAMPLE_BYTES,
    config_digest,
    file_digest,
    model_identity,
    weights_digest,
)


def _checkpoint(path: Path, seed: int, *, shards: int = 2, tweak: str | None = None) -> Path:
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for s in range(shards):
        tensors = {f"layers.{s}.{n}": torch.randn(64, 256, generator=gen) for n in "qkvo"}
        if tweak is not None and tweak in tensors:
            tensors[tweak][31, 100] += 1.0  # one value, deep inside one tensor
        save_file(tensors, str(path / f"model-{s:05d}.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def _digest(path: Path) -> str:
    weights_digest.cache_clear()
    return weights_digest(str(path))[0]


def test_copies_agree_wherever_they_are(tmp_path):
    a = _checkpoint(tmp_path / "runs" / "a" / "checkpoint-1000", seed=1)
    b = tmp_path / "elsewhere" / "checkpoint-1000"
    shutil.copytree(a, b)
    (b / "model-00000.safetensors").touch()  # another mtime (and inode): same content
    assert _digest(a) == _digest(b)


def test_checkpoints_differing_only_in_values_differ(tmp_path):
    a = _checkpoint(tmp_path / "a" / "model", seed=1)
    b = _checkpoint(tmp_path / "b" / "model", seed=2)  # same names, dtypes, shapes
    assert (a / "model-00000.safetensors").stat().st_size == (
        b / "model-00000.safetensors"
    ).stat().st_size
    assert _digest(a) != _digest(b)


def test_a_change_in_one_sampled_tensor_is_seen(tmp_path):
    """Each tensor is sampled at its start, middle and end: a change there is seen even
    when everything else is equal (a change no sample reads is the limit of sampling)."""
    a = _checkpoint(tmp_path / "a", seed=1)
    b = _checkpoint(tmp_path / "b", seed=1, tweak="layers.1.v")
    # the tweaked value (row 31 of 64, col 100) sits inside the tensor's middle sample
    row_bytes = 256 * 4
    middle = (64 * row_bytes - SAMPLE_BYTES) // 2
    assert middle <= 31 * row_bytes + 100 * 4 < middle + SAMPLE_BYTES
    assert _digest(a) != _digest(b)


def test_a_checkpoint_is_sampled_not_read(tmp_path):
    a = _checkpoint(tmp_path / "a", seed=1, shards=1)
    f = a / "model-00000.safetensors"
    _, read = file_digest(f)
    assert read < f.stat().st_size / 4, "every tensor sampled at 3 places, not read whole"
    assert read >= 4 * 3 * SAMPLE_BYTES


def test_other_weight_formats_are_spread_sampled(tmp_path):
    blob = bytearray(torch.randn(4 << 20, generator=torch.Generator().manual_seed(0)).numpy())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "pytorch_model.bin").write_bytes(blob)
    blob[0] ^= 1
    (tmp_path / "b" / "pytorch_model.bin").write_bytes(blob)
    assert _digest(tmp_path / "a") != _digest(tmp_path / "b")
    _, read = file_digest(tmp_path / "a" / "pytorch_model.bin")
    assert read < len(blob) / 2


def _vllm_config(model: str, hf: dict, kv_cache_dtype: str = "auto") -> SimpleNamespace:
    hf_config = SimpleNamespace(to_dict=lambda: dict(hf))
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=None, hf_config=hf_config, dtype="float32", quantization=None
        ),
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
    )


def test_config_overrides_and_kv_cache_dtype_change_the_digest(tmp_path):
    base = {"num_hidden_layers": 2, "rope_scaling": None, "_name_or_path": "/x/model"}
    d = config_digest(_vllm_config("m", base))  # type: ignore[arg-type]
    moved = {**base, "_name_or_path": "/y/model"}
    assert config_digest(_vllm_config("m", moved)) == d  # type: ignore[arg-type]
    rope = {**base, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert config_digest(_vllm_config("m", rope)) != d  # type: ignore[arg-type]
    assert config_digest(_vllm_config("m", base, "fp8")) != d  # type: ignore[arg-type]


def test_namespace_carries_the_digest(tmp_path):
    a = _checkpoint(tmp_path / "runs" / "a" / "checkpoint-1000", seed=1)
    b = _checkpoint(tmp_path / "runs" / "b" / "checkpoint-1000", seed=2)
    weights_digest.cache_clear()
    ia = model_identity(_vllm_config(str(a), {}))  # type: ignore[arg-type]
    ib = model_identity(_vllm_config(str(b), {}))  # type: ignore[arg-type]
    na, nb = ia.namespace(str(a)), ib.namespace(str(b))
    assert na.startswith("checkpoint-1000-m") and nb.startswith("checkpoint-1000-m")
    assert na != nb
    assert "2 weight file(s)" in ia.weights


def test_a_hub_id_without_a_local_copy_is_named_by_id_and_revision(caplog):
    pytest.importorskip("huggingface_hub")
    ident = model_identity(_vllm_config("nobody/no-such-model-kvray", {}))  # type: ignore[arg-type]
    assert "no local copy" in ident.weights
    assert ident.namespace("nobody/no-such-model-kvray").startswith("no-such-model-kvray-m")
