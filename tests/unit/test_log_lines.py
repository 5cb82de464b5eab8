"""The connector's log lines read back by tools (kvray/connector/log_lines.py): what the
scheduler writes with the formats parses to the same values, inside vLLM's prefixes."""

from __future__ import annotations

import logging

import pytest

from kvray.connector.log_lines import (
    KEYS_FORMAT,
    REQUEST_FORMAT,
    RequestLine,
    key_space,
    log_request,
    request_counts,
    request_lines,
)
from kvray.keys import geometry_digest


def test_request_lines_round_trip_with_and_without_an_engine_prefix():
    log = "\n".join(
        [
            "(EngineCore_DP1 pid=4242) INFO 12-01 10:00:00 [scheduler.py:457] "
            + REQUEST_FORMAT % ("cmpl-a-0", 4, 0, 4, 3, 1, 0),
            "INFO kvray.connector.scheduler: "
            + REQUEST_FORMAT % ("r2", 2, 1, 0, 0, 0, 1)
            + " miss=lookup_timeout",  # why its lookup stopped short
            "INFO some other line total_blocks=9",
        ]
    )
    first, second = request_lines(log)
    assert (first.request_id, first.engine_pid, first.loaded, first.failed) == (
        "cmpl-a-0",
        "4242",
        3,
        1,
    )
    assert (second.request_id, second.engine_pid) == ("r2", None)
    assert (first.miss, second.miss) == ("", "lookup_timeout")
    assert request_counts(log) == [
        {"total_blocks": 4, "hit_local": 0, "hit_pool": 4, "loaded": 3, "failed": 1, "saved": 0},
        {"total_blocks": 2, "hit_local": 1, "hit_pool": 0, "loaded": 0, "failed": 0, "saved": 1},
    ]


@pytest.mark.parametrize(
    "line",
    [
        RequestLine("cmpl-1", 4, 0, 4, 4, 0, 0),
        RequestLine("cmpl-2", 4, 1, 2, 2, 0, 1, miss="evicted"),
        RequestLine("cmpl-3", 3, 0, 3, 3, 0, 0, est_load_ms=1.5, est_compute_ms=2.25),
        RequestLine("c4", 3, 0, 0, 0, 0, 0, None, "not_worth_loading", 3.1, 0.48),
    ],
)
def test_a_logged_request_line_reads_back_whole(caplog, line):
    """What the scheduler logs (:func:`log_request`) parses back to the same line, its
    estimates included, and the record carries the line for in-process readers."""
    with caplog.at_level(logging.INFO, "kvray.test"):
        log_request(logging.getLogger("kvray.test"), line)
    (record,) = caplog.records
    assert record.kvray_request == line  # type: ignore[attr-defined]
    assert request_lines(caplog.text) == [line]


def test_key_space_round_trips_and_is_none_before_the_line():
    geos = [geometry_digest("p4x128x128", [f"model.layers.{i}.self_attn.attn"]) for i in (0, 1)]
    assert key_space("nothing yet") is None
    line = "(EngineCore pid=7) " + KEYS_FORMAT % (
        "tiny-m0123456789ab",
        "float32-b128-h4x64",
        ",".join(geos),
        "",
    )
    tp = key_space(line)
    assert tp is not None and (tp.namespace, tp.layout, tp.tp_size, tp.pp_size) == (
        "tiny-m0123456789ab", "float32-b128-h4x64", 2, 1)  # fmt: skip
    assert tp.geometries == tuple(geos)
    pp = key_space(line, pp_size=2)
    assert pp is not None and (pp.tp_size, pp.pp_size) == (1, 2)
    # a hybrid model: one geometry per rank and KV cache group, the group count after them
    hybrid = key_space(line.replace(",".join(geos), ",".join(geos) + ", kv_groups 2"))
    assert hybrid is not None
    assert (hybrid.tp_size, hybrid.kv_groups, hybrid.geometries) == (1, 2, tuple(geos))
    assert hybrid.columns == 2 and hybrid.geometry_of(0, 1) == geos[1]
