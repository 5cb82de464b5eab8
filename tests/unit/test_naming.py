"""Actor names, and reading them back (a restarted manager finds its node actors so)."""

from __future__ import annotations

import pytest

from kvray.naming import client_name, lookup_name, manager_name, parse_node_actor, ssd_name

NODE = "0e9bf2d4" * 7


def test_a_node_actors_name_reads_back():
    assert parse_node_actor("p", client_name("p", NODE, 3)) == ("client", NODE, 3)
    assert parse_node_actor("p", ssd_name("p", NODE, 0)) == ("ssd", NODE, 0)
    assert parse_node_actor("p", lookup_name("p", NODE)) == ("lookup", NODE, None)


@pytest.mark.parametrize(
    "name",
    [
        manager_name("p"),
        client_name("other", NODE, 0),  # another pool's
        client_name("p-2", NODE, 0),
        f"p.client.{NODE}",  # no slot
        f"p.client.{NODE}.x",
        f"p.lookup.{NODE}.0",
        f"p.pg.{NODE}.0",
        "p",
    ],
)
def test_other_names_are_not_the_pools_node_actors(name):
    assert parse_node_actor("p", name) is None
