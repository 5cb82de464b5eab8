"""One warn-once gate for kvray: a warning is logged the first time of its kind and never
again in the process (or object) that holds the gate; what follows is counted where it
matters, by the caller."""

from __future__ import annotations

import logging
from collections.abc import Hashable


class WarnOnce:
    """``warn(kind, msg, *args)`` logs ``msg % args`` on ``logger`` the first time of
    ``kind``, with ``then`` after it (what becomes of later ones); later ones: nothing."""

    def __init__(self, logger: logging.Logger, then: str = "") -> None:
        self._logger = logger
        self._then = then
        self._seen: set[Hashable] = set()

    def __call__(self, kind: Hashable, msg: str, *args: object) -> None:
        if kind not in self._seen:
            self._seen.add(kind)
            self._logger.warning("%s%s", msg % args if args else msg, self._then)
