"""kvray's one warn-once gate: the first warning of each kind is logged (with what
becomes of later ones), later ones of that kind are not."""

from __future__ import annotations

import logging

from kvray.warn_once import WarnOnce


def test_each_kind_is_logged_once_with_its_arguments(caplog):
    warn = WarnOnce(logging.getLogger("kvray.test"), " (further ones are only counted)")
    with caplog.at_level(logging.WARNING, "kvray.test"):
        warn("timeout", "lookup slower than %.0f ms", 200.0)
        warn("timeout", "lookup slower than %.0f ms", 900.0)
        warn(("pool", 1), "slot %d: 100%% different", 1)
        warn(("pool", 1), "slot %d: 100%% different", 1)
    assert [r.getMessage() for r in caplog.records] == [
        "lookup slower than 200 ms (further ones are only counted)",
        "slot 1: 100% different (further ones are only counted)",
    ]
