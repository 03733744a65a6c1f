"""PostgreSQL errors reach the bridge's decisions as SQLSTATEs, never as message text.

The stack's PostgreSQL builds carry no translations (no share/locale), so a run under a
translated ``lc_messages`` cannot be made here; instead each replication-protocol error the
daemon decides on is provoked on the real server and held to its code, which is all the
daemon reads (``slot.SlotClaim.racing``, the dropped-publication check). SQL-side errors
are caught by psycopg's SQLSTATE classes (``psycopg.errors``) throughout.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from psycopg import errors

from services.bridge.receive.stream import ReplicationConnection, StreamError
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import sql

OPTIONS = {"proto_version": "4", "publication_names": '"codes"'}


@pytest.fixture
def slot(stack: Stack) -> Iterator[str]:
    name = f"codes_{uuid.uuid4().hex[:8]}"
    repl = ReplicationConnection(stack.primary_dsn)
    repl.create_slot(name, two_phase=False)
    repl.close()
    yield name
    sql(
        stack.primary_dsn,
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
        "WHERE slot_name = %s AND NOT active",
        (name,),
    )


def _error(call: object) -> StreamError:
    with pytest.raises(StreamError) as caught:
        call()  # type: ignore[operator]
    return caught.value


def test_slot_that_exists_is_duplicate_object(stack: Stack, slot: str) -> None:
    repl = ReplicationConnection(stack.primary_dsn)
    try:
        error = _error(lambda: repl.create_slot(slot, two_phase=False))
    finally:
        repl.close()
    assert error.sqlstate == errors.DuplicateObject.sqlstate, error


def test_slot_in_use_is_object_in_use(stack: Stack, slot: str) -> None:
    holder, second = (
        ReplicationConnection(stack.primary_dsn),
        ReplicationConnection(stack.primary_dsn),
    )
    try:
        holder.start(slot, 0, OPTIONS)
        error = _error(lambda: second.start(slot, 0, OPTIONS))
    finally:
        second.close()
        holder.close()
    assert error.sqlstate == errors.ObjectInUse.sqlstate, error


def test_missing_slot_is_undefined_object(stack: Stack) -> None:
    repl = ReplicationConnection(stack.primary_dsn)
    try:
        error = _error(lambda: repl.start(f"nothing_{uuid.uuid4().hex[:8]}", 0, OPTIONS))
    finally:
        repl.close()
    assert error.sqlstate == errors.UndefinedObject.sqlstate, error


def test_missing_publication_ends_the_stream_with_undefined_object(stack: Stack, slot: str) -> None:
    table = f"codes_{uuid.uuid4().hex[:8]}"
    sql(stack.primary_dsn, f"CREATE TABLE {table} (id int PRIMARY KEY)")
    repl = ReplicationConnection(stack.primary_dsn)
    try:
        repl.start(slot, 0, OPTIONS)  # publication "codes" does not exist
        sql(stack.primary_dsn, f"INSERT INTO {table} VALUES (1)")

        def read_until_error() -> None:
            for _ in range(600):  # pgoutput loads publications at the first change
                while repl.next_message() is not None:
                    pass
                repl.wait(0.1)

        error = _error(read_until_error)
    finally:
        repl.close()
        sql(stack.primary_dsn, f"DROP TABLE {table}")
    assert error.sqlstate == errors.UndefinedObject.sqlstate, error


def test_role_without_replication_grant_is_refused_by_code(stack: Stack) -> None:
    role = f"codes_{uuid.uuid4().hex[:8]}"
    sql(stack.primary_dsn, f"CREATE ROLE {role} LOGIN REPLICATION")
    try:
        repl = ReplicationConnection(f"{stack.primary_dsn} user={role}")
        try:
            error = _error(lambda: repl.command("SELECT pg_replication_origin_create('x')"))
        finally:
            repl.close()
    finally:
        sql(stack.primary_dsn, f"DROP ROLE {role}")
    assert error.sqlstate == errors.InsufficientPrivilege.sqlstate, error
