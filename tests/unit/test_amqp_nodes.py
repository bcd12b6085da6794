"""SAGA_AMQP_URL with one node or several: how it is split, and what a message shows of it."""

from __future__ import annotations

import pytest
from yarl import URL

from orchestrator.bus.connect import blocking_parameters, node_urls, redacted, with_options


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
