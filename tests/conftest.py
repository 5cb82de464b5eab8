"""Shared test setup: stay on loopback, never touch a cluster or token we did not make."""

import os

# Before Ray is imported anywhere: bind and advertise 127.0.0.1 only, no token auth.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Mooncake clients in this process (baselines) fail fast on a dead master.
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
