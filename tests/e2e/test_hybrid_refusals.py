"""What KVRayConnector refuses on hybrid models, on real vLLM engines: a tiny Nemotron-H
(Mamba-2 and attention layers). With vLLM's prefix cache off, vLLM keeps Mamba states in
its "none" mode (one state per request, none per block boundary), which kvray cannot pool:
the engine with the connector fails at startup and says how to run it (vLLM's "align"
mode, which prefix caching turns on). The same engine without the connector runs, so the
refusal is kvray's, not the model's. (With prefix caching on, vLLM's CPU build crashes on
Mamba-2 models by itself.)
"""

from __future__ import annotations

import pytest

from .conftest import connector

pytestmark = pytest.mark.e2e
NAMESPACE = "tiny-nemotron-h"


def spec(model: str, with_connector: bool) -> dict:  # type: ignore[type-arg]
    """An engine of the tiny Nemotron-H with vLLM's prefix cache off."""
    conn = connector(model_namespace=NAMESPACE) if with_connector else None
    return {"model": model, "connector": conn, "prefix_caching": False, "dtype": "float32"}


def test_a_mamba_model_without_align_mode_is_refused_at_startup(pool, engines, tiny_nemotron_h):
    with pytest.raises(RuntimeError) as failed:
        engines.get(spec(tiny_nemotron_h, with_connector=True))
    text = str(failed.value)
    assert "ConfigError" in text, text
    assert "which vLLM keeps per block boundary only in its 'align' mode" in text, text
    assert "this engine runs 'none'" in text, text
    assert "start vLLM with --enable-prefix-caching (vLLM then uses 'align')" in text, text


def test_the_same_model_runs_without_the_connector(engines, tiny_nemotron_h):
    eng = engines.get(spec(tiny_nemotron_h, with_connector=False))
    assert eng.call(op="kv_cache_groups")["groups"] == ["MambaSpec", "FullAttentionSpec"]
    out = eng.generate([list(range(3, 200))], max_tokens=8)
    assert out["finish_reasons"] == ["length"], out
    assert len(out["outputs"][0]) == 8, out
