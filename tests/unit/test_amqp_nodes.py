"""SAGA_AMQP_URL with one node or several: how it is split, and what a message shows of it."""

from __future__ import annotations

import asyncio
import socket

import pytest
from yarl import URL

from orchestrator.bus.connect import (
    FailoverConnection,
    NoBrokerReachable,
    blocking_parameters,
    connect_robust,
    node_urls,
    redacted,
    with_options,
)


def test_one_url_is_left_as_it_is() -> None:
    url = "amqp://guest:guest@127.0.0.1:5672/saga?heartbeat=5"
    assert node_urls(url) == [url]


def test_whole_urls_separated_by_commas() -> None:
    spec = "amqp://u:p@127.0.0.1:5681/v, amqp://u:p@127.0.0.1:5682/v,amqps://u:p@127.0.0.1:5683/v"
    assert node_urls(spec) == [
        "amqp://u:p@127.0.0.1:5681/v",
        "amqp://u:p@127.0.0.1:5682/v",
        "amqps://u:p@127.0.0.1:5683/v",
    ]


def test_hosts_of_one_url_share_its_credentials_vhost_and_options() -> None:
    spec = "amqp://u:p@127.0.0.1:5681,127.0.0.1:5682,localhost:5683/v?heartbeat=5"
    assert node_urls(spec) == [
        "amqp://u:p@127.0.0.1:5681/v?heartbeat=5",
        "amqp://u:p@127.0.0.1:5682/v?heartbeat=5",
        "amqp://u:p@localhost:5683/v?heartbeat=5",
    ]


def test_hosts_without_credentials() -> None:
    assert node_urls("amqp://h1:1,h2:2/") == ["amqp://h1:1/", "amqp://h2:2/"]


@pytest.mark.parametrize(
    "spec",
    ["", " , ", "h1:5672", "amqp://u:p@h1:1,amqp://u:p@h2:2/v,h3:3", "amqp://u:p@h1:1,,h2:2/v"],
)
def test_specs_that_name_no_node_clearly_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="SAGA_AMQP_URL"):
        node_urls(spec)


def test_the_refusal_of_a_mixed_spec_hides_the_password() -> None:
    with pytest.raises(ValueError) as raised:
        node_urls("amqp://u:secret@h1:1,amqp://u:secret@h2:2/v,h3:3")
    assert "secret" not in str(raised.value)


def test_redacted_hides_every_password_and_keeps_the_rest() -> None:
    spec = "amqp://u:one@h1:1/v,amqp://w:two@h2:2/v"
    assert redacted(spec) == "amqp://u:***@h1:1/v,amqp://w:***@h2:2/v"
    assert redacted("amqp://h1:1/") == "amqp://h1:1/"


def test_options_are_added_without_overriding_the_url_s_own() -> None:
    url = with_options("amqp://u:p@h:1/v?heartbeat=30", heartbeat=5, reconnect_interval=1)
    assert URL(url).query == {"heartbeat": "30", "reconnect_interval": "1"}
    assert URL(url).path == "/v"


def test_blocking_parameters_name_every_node() -> None:
    params = blocking_parameters("amqp://u:p@h1:5681,h2:5682/v")
    assert [(p.host, p.port, p.virtual_host) for p in params] == [("h1", 5681, "v"), ("h2", 5682, "v")]


def test_a_password_may_hold_an_at_sign() -> None:
    assert node_urls("amqp://u:p@ss@h1:1,h2:2/v") == ["amqp://u:p@ss@h1:1/v", "amqp://u:p@ss@h2:2/v"]
    assert redacted("amqp://u:p@ss@h1:1/v") == "amqp://u:***@h1:1/v"


def test_a_comma_in_a_password_is_read_in_one_url_and_refused_in_a_list_with_how_to_write_it() -> None:
    assert node_urls("amqp://u:pa,ss@h1:1,h2:2/v") == ["amqp://u:pa,ss@h1:1/v", "amqp://u:pa,ss@h2:2/v"]
    with pytest.raises(ValueError, match="%2C") as raised:
        node_urls("amqp://u:pa,ss@h1:1/v,amqp://u:pa,ss@h2:2/v")
    assert "ss@h1" not in str(raised.value)


def test_messages_show_no_options() -> None:
    assert redacted("amqp://u:p@h1:1/v?heartbeat=5&reconnect_interval=1") == "amqp://u:***@h1:1/v"


def _nothing_listening(port_count: int) -> list[int]:
    """Loopback ports that refuse connections (bound, then closed)."""
    ports = []
    for _ in range(port_count):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    return ports


def test_no_reachable_node_names_every_node_tried() -> None:
    async def go() -> None:
        ports = _nothing_listening(2)
        spec = "amqp://u:secret@" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/v"
        with pytest.raises(NoBrokerReachable) as raised:
            await connect_robust(spec, timeout_s=2)
        message = str(raised.value)
        assert all(str(p) in message for p in ports) and "secret" not in message
        assert "reconnect_interval" not in message

    asyncio.run(go())


def test_a_failover_connection_moves_round_its_nodes_on_every_close() -> None:
    async def go() -> list[str]:
        nodes = ["amqp://h1:1/", "amqp://h2:2/", "amqp://h3:3/"]
        connection = FailoverConnection(URL(nodes[1]), nodes=nodes)
        seen = []
        for _ in range(4):
            closing = asyncio.get_running_loop().create_future()
            closing.set_exception(ConnectionRefusedError())
            await connection._on_connection_close(closing)
            seen.append(str(connection.url))
        await connection.close()
        return seen

    assert asyncio.run(go()) == ["amqp://h3:3/", "amqp://h1:1/", "amqp://h2:2/", "amqp://h3:3/"]
