"""What tests/unit/test_forkserver.py's fork-server children run (a module the server
imports before it forks, as the engine servers import vLLM)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path


def echo() -> int:
    """Answers each stdin line with what the child sees; exits with ``argv[1]``."""
    for line in sys.stdin:
        print(json.dumps({
            "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "line": line.strip(),
            "only_here": os.environ.get("ONLY_HERE"), "ray": os.environ.get("RAY_ADDRESS"),
        }), flush=True)  # fmt: skip
        print("to stderr", file=sys.stderr, flush=True)
    return int(sys.argv[1])


def sleep() -> int:
    """Says it is up, then sleeps until killed."""
    print("up", flush=True)
    time.sleep(600)
    return 0


def at_exit() -> int:
    """Registers an exit handler that writes ``argv[1]``, then returns."""
    atexit.register(lambda: Path(sys.argv[1]).write_text("ran"))
    return 0
