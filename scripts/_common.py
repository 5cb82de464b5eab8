"""What every script shares: Ray on loopback (set on import, before Ray starts), ``log``
for progress on stderr, and the common command line: ``--smoke`` and ``--json``.

``--smoke`` is the script's full run with small arguments (``SMOKE``, a list of ordinary
arguments each script declares next to its defaults): the same code path, the same JSON
keys, in seconds to a minute or two instead of minutes to hours. Arguments given after
``--smoke`` on the command line override its values. The test suite runs every script
this way (``tests/*/test_scripts.py``), so a script that no longer runs fails a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# One node on loopback: without it Ray binds the machine's external address; and no
# token auth for a cluster the script starts itself (docs/security.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def log(msg: str, *, stamp: bool = False) -> None:
    """Progress on stderr (stdout is the script's table), with the time if ``stamp``."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}" if stamp else msg, file=sys.stderr, flush=True)


def parse(
    parser: argparse.ArgumentParser, smoke: Sequence[str], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser``'s arguments, with ``--smoke`` added: when given, ``smoke`` is parsed
    before the command line's own arguments (which win)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"the full run with small arguments ({' '.join(smoke)}); arguments given "
        "with it override them",
    )
    args_in = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_in)
    if args.smoke:
        args = parser.parse_args([*smoke, *args_in])
    return args


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    """``results`` as JSON at ``path`` (nothing without one)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


Step = Callable[[], object]
#: a benchmarked path's ``(clear, put or None, between, get, check)``
RoundTrip = tuple[Step, Step | None, Step, Step, Callable[[], bool]]


def round_trips(
    paths: dict[str, RoundTrip],
    reps: int,
    ops: tuple[str, str],
) -> dict[str, dict[str, list[float]]]:
    """Each path's ``(clear, put, between, get, check)``: one warm-up rep, then ``reps``
    recorded, every path in turn (order rotated per rep). Returns the seconds of each
    ``ops`` (put, get) per path; a path without a put records gets only. A round trip that
    is not byte-exact (``check()`` false) fails the run."""
    names = list(paths)
    times: dict[str, dict[str, list[float]]] = {n: {op: [] for op in ops} for n in names}
    for rep in range(reps + 1):
        k = rep % len(names)
        line = []
        for name in names[k:] + names[:k]:
            clear, put, between, get, check = paths[name]
            clear()
            tp = timed(put) if put is not None else None
            between()
            tg = timed(get)
            if not check():
                raise RuntimeError(f"{name}: round trip is not byte-exact (rep {rep})")
            if rep:
                if tp is not None:
                    times[name][ops[0]].append(tp)
                times[name][ops[1]].append(tg)
            line.append(f"{name} {'-' if tp is None else f'{tp * 1e3:.0f}'}/{tg * 1e3:.0f}")
        label = "warm-up" if rep == 0 else f"rep {rep}/{reps}"
        log(f"   {label} ({'/'.join(ops)} ms): " + ", ".join(line))
    return times
