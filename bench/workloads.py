"""The change kinds users run, as bench workloads over the same WAL for every reader.

Each workload has two steps: ``prefill`` runs before the slots exist (rows the changes
need, invisible to every reader), ``load`` after (the WAL every reader then catches up on).
A workload counts in *changes* (row changes in the WAL) and says how many transactions its
load commits and how many change records each record format publishes for it, so a bench
can verify the topics and print per-change and per-transaction costs.

- ``insert``: inserts of a five-column row (bigint key, int, text, numeric, timestamptz).
- ``update``: updates of three non-key columns of those rows (REPLICA IDENTITY DEFAULT:
  no old tuple in the WAL).
- ``update-full``: the same updates under REPLICA IDENTITY FULL (old and new tuples).
- ``delete``: a purge of those rows (a record and a tombstone each).
- ``wide``: 40 columns (jsonb, numeric, text[], timestamptz, bytea, a TOASTed text column);
  each transaction inserts half its rows and updates the other half's small columns, so the
  TOASTed value is unchanged in every update (its placeholder in the records).
- ``oltp``: pgbench's built-in TPC-B-like script (three single-row UPDATEs and one INSERT
  per transaction over four keyed tables; ``pgbench_history`` gets a key first), many
  clients, a few changes per transaction.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

PGBENCH = Path("/usr/lib/postgresql/15/bin/pgbench")
# pgbench's TPC-B-like script: four row changes per transaction.
OLTP_CHANGES_PER_TXN = 4
OLTP_CLIENTS = 8


@dataclass(frozen=True)
class Plan:
    """What a workload's load step put in the WAL."""

    changes: int
    transactions: int


class Workload:
    """A change kind: its tables (in the run's own schema), prefill and load."""

    name = ""
    # The tables a run of this workload publishes, unqualified.
    tables: tuple[str, ...] = ("t",)
    # Change records per change, by record format.
    records_per_change = {"slotbridge": 1.0, "debezium": 1.0}
    # Tombstones per change (a delete's), unless the bridge runs without them
    # (tombstones_on_delete: false).
    tombstones_per_change = 0.0

    def create(self, conn: psycopg.Connection[Any], schema: str) -> None:
        conn.execute(
            f"CREATE TABLE {schema}.t (id bigint PRIMARY KEY, a int, b text,"
            " c numeric, d timestamptz)"
        )

    def prefill(self, dsn: str, schema: str, rows: int) -> None:
        """Rows the load needs, written before any slot exists."""

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        """The changes every reader catches up on; returns what went into the WAL."""
        raise NotImplementedError

    def expected_records(self, value_format: str, plan: Plan, tombstones: bool = True) -> int:
        tombstones_per_change = self.tombstones_per_change if tombstones else 0.0
        return round(plan.changes * (self.records_per_change[value_format] + tombstones_per_change))


_ROWS = (
    "SELECT g, (g % 100000)::int, 'customer ' || g || ' note', (g * 1.25)::numeric(14,2), "
    "timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second' "
    "FROM generate_series({lo}, {hi}) g"
)


def _in_transactions(dsn: str, rows: int, txn_size: int, statement: str) -> Plan:
    """``statement`` (with ``{lo}``/``{hi}`` for its id range) over ids 1..rows, one
    transaction per ``txn_size`` ids, all in one server-side loop."""
    txns = -(-rows // txn_size)
    lo, hi = f"i * {txn_size} + 1", f"least((i + 1) * {txn_size}, {rows})"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            f"DO $$ BEGIN FOR i IN 0..{txns - 1} LOOP "
            + statement.format(lo=lo, hi=hi)
            + "; COMMIT; END LOOP; END $$"
        )
    return Plan(rows, txns)


def _fill(dsn: str, schema: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {schema}.t " + _ROWS.format(lo=1, hi=rows))
        conn.execute(f"VACUUM ANALYZE {schema}.t")


class Insert(Workload):
    name = "insert"

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        return _in_transactions(dsn, rows, txn_size, f"INSERT INTO {schema}.t " + _ROWS)


class Update(Workload):
    name = "update"

    def prefill(self, dsn: str, schema: str, rows: int) -> None:
        _fill(dsn, schema, rows)

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        return _in_transactions(
            dsn,
            rows,
            txn_size,
            f"UPDATE {schema}.t SET a = a + 1, b = b || 'u', d = d + interval '1 day'"
            " WHERE id BETWEEN {lo} AND {hi}",
        )


class UpdateFull(Update):
    name = "update-full"

    def create(self, conn: psycopg.Connection[Any], schema: str) -> None:
        super().create(conn, schema)
        conn.execute(f"ALTER TABLE {schema}.t REPLICA IDENTITY FULL")


class Delete(Workload):
    name = "delete"
    tombstones_per_change = 1.0

    def prefill(self, dsn: str, schema: str, rows: int) -> None:
        _fill(dsn, schema, rows)

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        return _in_transactions(
            dsn, rows, txn_size, f"DELETE FROM {schema}.t WHERE id BETWEEN {{lo}} AND {{hi}}"
        )


# The wide row: 40 columns. ``doc`` is about 6 kB of incompressible text, so it is stored
# out of line (TOAST) and an update that leaves it alone sends the unchanged-TOAST marker.
_WIDE_COLUMNS = (
    "id bigint PRIMARY KEY, "
    + ", ".join(f"n{i} int" for i in range(8))
    + ", "
    + ", ".join(f"s{i} text" for i in range(8))
    + ", "
    + ", ".join(f"m{i} numeric(18,4)" for i in range(6))
    + ", "
    + ", ".join(f"ts{i} timestamptz" for i in range(6))
    + ", attrs jsonb, meta jsonb, tags text[], codes int[], blob bytea, flag boolean,"
    " day date, amount double precision, ref uuid, doc text"
)
_WIDE_ROW = (
    "SELECT g, "
    + ", ".join(f"(g * {i + 3}) % 100000" for i in range(8))
    + ", "
    + ", ".join(f"'value ' || g || ' of s{i}'" for i in range(8))
    + ", "
    + ", ".join(f"(g * {i + 1}.0625)::numeric(18,4)" for i in range(6))
    + ", "
    + ", ".join(
        f"timestamptz '2024-01-01 00:00:00+00' + (g + {i}) * interval '1 minute'" for i in range(6)
    )
    + ", jsonb_build_object('id', g, 'name', 'item ' || g, 'price', g * 0.5,"
    " 'labels', jsonb_build_array('a', 'b', g % 7), 'nested', jsonb_build_object('x', g % 13)),"
    " jsonb_build_object('source', 'bench', 'rev', g % 5),"
    " ARRAY['red', 'green', 'tag' || (g % 11)], ARRAY[g % 3, g % 5, g % 7]::int[],"
    " decode(md5(g::text), 'hex'), g % 2 = 0, date '2024-01-01' + (g % 365)::int,"
    " g * 1.5, md5(g::text)::uuid,"
    " (SELECT string_agg(md5((g * 1000 + k)::text), '') FROM generate_series(1, 190) k)"
    " FROM generate_series({lo}, {hi}) g"
)


class Wide(Workload):
    name = "wide"

    def create(self, conn: psycopg.Connection[Any], schema: str) -> None:
        conn.execute(f"CREATE TABLE {schema}.t ({_WIDE_COLUMNS})")
        # Incompressible or not, store doc out of line rather than try to compress it.
        conn.execute(f"ALTER TABLE {schema}.t ALTER COLUMN doc SET STORAGE EXTERNAL")

    def prefill(self, dsn: str, schema: str, rows: int) -> None:
        # The rows the updates touch: ids -rows/2 .. -1, apart from the inserted ones.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {schema}.t " + _WIDE_ROW.format(lo=f"-{rows // 2}", hi="-1"))
            conn.execute(f"VACUUM ANALYZE {schema}.t")

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        half = max(1, txn_size // 2)
        inserts = _WIDE_ROW.format(lo=f"i * {half} + 1", hi=f"least((i + 1) * {half}, {rows // 2})")
        txns = -(-(rows // 2) // half)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.execute(
                f"DO $$ BEGIN FOR i IN 0..{txns - 1} LOOP "
                f"INSERT INTO {schema}.t {inserts}; "
                f"UPDATE {schema}.t SET n0 = n0 + 1, s0 = s0 || 'u', m0 = m0 + 1,"
                " ts0 = ts0 + interval '1 hour',"
                " attrs = jsonb_set(attrs, '{price}', to_jsonb((attrs->>'price')::numeric + 1))"
                f" WHERE id BETWEEN -(i + 1) * {half} AND -i * {half} - 1; "
                "COMMIT; END LOOP; END $$"
            )
        return Plan(2 * half * txns, txns)


class Oltp(Workload):
    name = "oltp"
    tables = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")

    def create(self, conn: psycopg.Connection[Any], schema: str) -> None:
        """pgbench creates the tables itself (``prefill``)."""

    def run_pgbench(self, dsn: str, schema: str, *args: str) -> None:
        """pgbench with ``args`` on the workload's tables in ``schema``; its sessions write
        timestamps (pgbench_history.mtime) in UTC."""
        env = {**os.environ, "PGOPTIONS": f"-c search_path={schema} -c timezone=UTC"}
        done = subprocess.run(
            [str(PGBENCH), *args, dsn], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"pgbench {' '.join(args)} failed: {done.stderr.strip()[-500:]}")

    def prefill(self, dsn: str, schema: str, rows: int) -> None:
        # Scale 10: 1M accounts, so the clients' random accounts rarely collide.
        self.run_pgbench(dsn, schema, "-i", "-q", "-s", "10", "--foreign-keys")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                f"ALTER TABLE {schema}.pgbench_history"
                " ADD COLUMN hid bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY"
            )

    def load(self, dsn: str, schema: str, rows: int, txn_size: int) -> Plan:
        per_client = max(1, rows // OLTP_CHANGES_PER_TXN // OLTP_CLIENTS)
        self.run_pgbench(
            dsn, schema, "-n", "-c", str(OLTP_CLIENTS), "-j", "2", "-t", str(per_client)
        )
        txns = per_client * OLTP_CLIENTS
        return Plan(txns * OLTP_CHANGES_PER_TXN, txns)


WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (Insert(), Update(), UpdateFull(), Delete(), Wide(), Oltp())
}
