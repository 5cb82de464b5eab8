import pytest

from kvray.backends.base import KeyStatus
from kvray.backends.mooncake import _raise_if_unavailable, status_of
from kvray.errors import BackendUnavailableError


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (0, KeyStatus.OK),
        (-200, KeyStatus.POOL_FULL),
        (-600, KeyStatus.INVALID),
        (-704, KeyStatus.NOT_FOUND),
        (-706, KeyStatus.BUSY),
        (-707, KeyStatus.TRANSFER_FAILED),
        (-800, KeyStatus.TRANSFER_FAILED),
        (-703, KeyStatus.NOT_FOUND),
        (-12345, KeyStatus.ERROR),
    ],
)
def test_codes_map_to_statuses(code, status):
    assert status_of(code) is status


def test_whole_batch_rpc_failure_is_unavailable():
    with pytest.raises(BackendUnavailableError, match="127.0.0.1:1"):
        _raise_if_unavailable("put", [-900, -900], "127.0.0.1:1")
    _raise_if_unavailable("put", [-900, 0], "127.0.0.1:1")  # per-key outcome, not an outage
    _raise_if_unavailable("put", [], "127.0.0.1:1")
