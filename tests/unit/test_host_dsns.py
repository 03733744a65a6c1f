"""Splitting a multi-host DSN into one DSN per server: pure string work, no server."""

from __future__ import annotations

import pytest
from psycopg import conninfo

from services.common.pg import SourceError, host_dsns, server_address


def params(dsn: str) -> dict[str, str]:
    return {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items()}


def test_each_server_keeps_every_other_parameter_in_the_dsn_order() -> None:
    dsns = host_dsns(
        "host=old,new port=5432,5433 user=cdc password=pw dbname=app "
        "target_session_attrs=read-write"
    )
    assert [server_address(d) for d in dsns] == ["old:5432", "new:5433"]
    for dsn in dsns:
        assert {k: v for k, v in params(dsn).items() if k not in ("host", "port")} == {
            "user": "cdc",
            "password": "pw",
            "dbname": "app",
            "target_session_attrs": "read-write",
        }


def test_one_port_serves_every_host_and_uris_split_too() -> None:
    assert [server_address(d) for d in host_dsns("host=a,b port=6432")] == ["a:6432", "b:6432"]
    assert [server_address(d) for d in host_dsns("postgresql://u@a:1,b:2/db")] == ["a:1", "b:2"]
    assert (
        server_address(host_dsns("host=10.0.0.1,10.0.0.2 hostaddr=10.0.0.1,10.0.0.2")[1])
        == "10.0.0.2:5432"
    )


def test_a_one_server_dsn_is_kept_as_written() -> None:
    assert host_dsns("host=a port=1 user=u") == ["host=a port=1 user=u"]


def test_mismatched_lists_are_refused_in_one_line() -> None:
    with pytest.raises(SourceError, match="lists 3 servers but 2 port values"):
        host_dsns("host=a,b,c port=1,2")
