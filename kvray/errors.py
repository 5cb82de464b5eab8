"""kvray's exception tree.

Every error kvray raises on purpose is a :class:`KVRayError`. Backend return codes
(Mooncake's negative ints, ...) are mapped to this tree at exactly one place per
backend adapter, always with ``raise ... from exc`` when a native exception exists.

::

    KVRayError
    ├── ConfigError              bad config value, names the field and the fix
    ├── KeyFormatError           a key string that kvray cannot parse or encode
    ├── PoolNotFoundError        attach to a pool name that is not running
    ├── PoolConflictError        start a pool whose name runs with another config
    ├── EmbeddedPoolError        the node's embedded pool could not be started or joined
    ├── HashMismatchError        ranks derive different block hashes for the probe
    ├── RegionError              transfer region missing, too small, out of bounds
    └── BackendError             the storage backend failed
        ├── BackendUnavailableError   server unreachable / client not set up / timeout
        ├── PoolFullError             no space left for (some of) a batch
        └── TransferError             a batch where some keys failed for other reasons

Per-key outcomes of a batch are *not* exceptions: adapters return a
:class:`kvray.backends.base.KeyStatus` per key, and the Pool API raises
:class:`PoolFullError` / :class:`TransferError` listing the failed keys when the
caller asked for all-or-error behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence


class KVRayError(Exception):
    """Base class of every error kvray raises on purpose."""


class ConfigError(KVRayError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class KeyFormatError(KVRayError, ValueError):
    """A key cannot be built, parsed or encoded for a backend."""


class PoolNotFoundError(KVRayError, LookupError):
    """No pool with this name runs in the connected Ray cluster."""


class PoolConflictError(KVRayError):
    """A pool with this name already runs with a different configuration."""


class EmbeddedPoolError(KVRayError):
    """The node's embedded pool (an engine with no Ray cluster configured) could not be
    started or joined."""


class HashMismatchError(KVRayError):
    """Ranks derive different block hashes for the same probe: refuse to run."""


class RegionError(KVRayError, ValueError):
    """A transfer region is unknown, too small, or a descriptor points outside it."""


class BackendError(KVRayError):
    """The storage backend failed."""


class BackendUnavailableError(BackendError):
    """The backend server is unreachable, the client is not set up, or a call timed out."""


class _KeysError(BackendError):
    """A batch in which some keys failed; ``failed`` maps key -> reason."""

    def __init__(self, message: str, failed: dict[str, str], stored: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failed = dict(failed)
        self.stored = list(stored)

    def __reduce__(self) -> tuple[type[_KeysError], tuple[str, dict[str, str], list[str]]]:
        # Pickled whole (the node channel sends errors so): the keys are not only text.
        return (type(self), (str(self), self.failed, self.stored))


class PoolFullError(_KeysError):
    """The pool had no space for some keys of a batch; those keys are absent.

    A block is stored whole or not at all: keys in ``failed`` were not written,
    keys in ``stored`` were written completely.
    """


class TransferError(_KeysError):
    """Some keys of a batch failed to transfer; they are absent (put) or unread (get)."""
