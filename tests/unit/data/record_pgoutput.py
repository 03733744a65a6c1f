"""Records ``pgoutput_pg17.json``: a real pgoutput byte stream for the decoder tests.

    python tests/unit/data/record_pgoutput.py "host=... dbname=postgres" > pgoutput_pg17.json

Needs a scratch PostgreSQL 17+ with ``wal_level=logical`` and
``max_prepared_transactions > 0`` (it creates tables, a publication, a slot and an origin
there). The payloads come from ``pg_logical_slot_peek_binary_changes``, which returns
exactly what a walsender puts after the XLogData header, under the session settings the
bridge uses. Two recordings: ``regular`` (every row-change shape, origin, messages,
two-phase) and ``streamed`` (decoded with debug_logical_replication_streaming=immediate,
so small transactions show every streamed shape, including subtransaction aborts).
"""

from __future__ import annotations

import json
import sys

import psycopg

OPTIONS = (
    "'proto_version', '4', 'publication_names', 'pub', 'messages', 'true', "
    "'streaming', 'parallel', 'two_phase', 'true'"
)

SETUP = [
    "SET TimeZone = 'UTC'",
    "SET DateStyle = ISO",
    "SET IntervalStyle = iso_8601",
    "SET extra_float_digits = 3",
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    """CREATE TABLE t (id int8 PRIMARY KEY, i2 int2, i4 int4, num numeric, f4 float4,
       f8 float8, b bool, txt text, vc varchar(10), bp char(3), u uuid, j json, jb jsonb,
       by bytea, d date, tm time, ttz timetz, ts timestamp, tstz timestamptz, iv interval,
       ia int4[], ta text[], m mood, big text)""",
    "CREATE TABLE full_t (id int PRIMARY KEY, v text)",
    "ALTER TABLE full_t REPLICA IDENTITY FULL",
    "CREATE TABLE bulk (id int, pad text)",
    "CREATE PUBLICATION pub FOR ALL TABLES",
    "SELECT pg_create_logical_replication_slot('rec', 'pgoutput', false, true)",
    "SELECT pg_replication_origin_create('upstream')",
]

REGULAR = [
    r"""INSERT INTO t VALUES (1, -32768, 2147483647, -12.340, 'NaN', '-Infinity', true,
       E'h\u00e9llo "q" \\ ,{}', 'NULL', 'ab', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
       ' [1, "two"] ', '{"b": [1, 2.5, null], "a": "x"}', '\x00ff0a', '0044-03-15 BC',
       '23:59:59.999999', '12:00:00+05:30', 'infinity', '2024-11-21 00:43:10.5+00',
       '1 year 2 months 3 days 04:05:06.5', '[0:2]={1,NULL,3}',
       ARRAY['plain', 'with space', 'q"uote', 'back\slash', 'NULL', NULL, ''], 'happy',
       (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 400) i))""",
    "INSERT INTO t (id) VALUES (2)",
    "UPDATE t SET txt = 'changed' WHERE id = 1",  # big is TOASTed and unchanged: 'u'
    "UPDATE t SET id = 3 WHERE id = 2",  # key change: 'K'
    "INSERT INTO full_t VALUES (1, 'one'), (2, 'two')",
    "UPDATE full_t SET v = 'uno' WHERE id = 1",  # REPLICA IDENTITY FULL: 'O'
    "DELETE FROM full_t WHERE id = 2",
    "DELETE FROM t WHERE id = 3",
    "TRUNCATE full_t, bulk RESTART IDENTITY CASCADE",
    "SELECT pg_logical_emit_message(true, 'app', 'transactional')",
    r"SELECT pg_logical_emit_message(false, 'app', '\x00ff'::bytea)",
    # One transaction replayed from an upstream: it carries an Origin message.
    "BEGIN",
    "SELECT pg_replication_origin_session_setup('upstream')",
    "SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())",
    "INSERT INTO full_t VALUES (10, 'from upstream')",
    "COMMIT",
    "SELECT pg_replication_origin_session_reset()",
    "BEGIN",
    "INSERT INTO full_t VALUES (20, 'prepared')",
    "PREPARE TRANSACTION 'gid-1'",
    "COMMIT PREPARED 'gid-1'",
    "BEGIN",
    "INSERT INTO full_t VALUES (21, 'rolled back')",
    "PREPARE TRANSACTION 'gid-2'",
    "ROLLBACK PREPARED 'gid-2'",
]

STREAMED = [
    "BEGIN",
    "INSERT INTO full_t VALUES (30, 'a'), (31, 'b')",
    "SAVEPOINT s1",
    "INSERT INTO full_t VALUES (32, 'rolled back subxact')",
    "ROLLBACK TO SAVEPOINT s1",  # Stream Abort of the subtransaction
    "UPDATE full_t SET v = 'c' WHERE id = 30",
    "DELETE FROM full_t WHERE id = 31",
    "SELECT pg_logical_emit_message(true, 'app', 'in stream')",
    "TRUNCATE bulk",
    "COMMIT",
    "BEGIN",
    "INSERT INTO full_t VALUES (40, 'aborted')",
    "ROLLBACK",
    "BEGIN",
    "INSERT INTO full_t VALUES (50, 'streamed prepared')",
    "PREPARE TRANSACTION 'gid-3'",
    "COMMIT PREPARED 'gid-3'",
]


def main() -> None:
    with psycopg.connect(sys.argv[1], autocommit=True) as conn:

        def run(statements: list[str]) -> None:
            for statement in statements:
                conn.execute(statement.encode())

        def peek() -> list[str]:
            rows = conn.execute(
                f"SELECT data FROM pg_logical_slot_peek_binary_changes("
                f"'rec', NULL, NULL, {OPTIONS})".encode()
            ).fetchall()
            return [bytes(row[0]).hex() for row in rows]

        run(SETUP + REGULAR)
        regular = peek()
        run(
            [
                "SELECT pg_replication_slot_advance('rec', pg_current_wal_lsn())",
                *STREAMED,
                "SET debug_logical_replication_streaming = immediate",
            ]
        )
        streamed = peek()
        row = conn.execute("SHOW server_version").fetchone()
        assert row is not None
        json.dump(
            {
                "server_version": row[0],
                "options": OPTIONS,
                "regular": regular,
                "streamed": streamed,
            },
            sys.stdout,
            indent=0,
        )
        print()


if __name__ == "__main__":
    main()
