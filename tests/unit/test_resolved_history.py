"""``tables.resolved_history_sql`` read by the engines other than Spark (DuckDB in memory,
delta-rs's DataFusion over Delta tables in a temporary folder): an end counts once the
history holds the change it ends at, so a reader between a batch's two commits (its ends,
then its changes) sees the history before the batch, never half of it. Spark runs the same
text in tests/integration/test_spark_consume.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from spark_consumers.tables import resolved_history_sql

KEY, LSN, ORDER, END = "id", "_cdc_commit_lsn", "_cdc_total_order", "valid_to_lsn"
Row = tuple[object, ...]
Rows = Sequence[Row]
HISTORY_COLUMNS = (KEY, "v", LSN, ORDER, END)
ENDS_COLUMNS = (KEY, LSN, ORDER, END)

# Batch 1 stored key 1's version at LSN 10 and key 2's at 11, both open; batch 2 changes
# key 1 at LSN 20: it ends the version at 10 (an ends row), then appends the new one.
BEFORE = [(1, "a", 10, 1, None), (2, "b", 11, 1, None)]
ENDS = [(1, 10, 1, 20)]
BATCH_2 = [(1, "a2", 20, 1, None)]


def _table(rows: Rows, columns: tuple[str, ...]) -> pa.Table:
    types = {KEY: pa.int64(), "v": pa.string()}
    schema = pa.schema([(c, types.get(c, pa.int64())) for c in columns])
    return pa.Table.from_pylist([dict(zip(columns, r, strict=True)) for r in rows], schema)


def _duckdb(history: Rows, ends: Rows) -> set[Row]:
    con = duckdb.connect()
    con.register("history", _table(history, HISTORY_COLUMNS))
    con.register("history_ends", _table(ends, ENDS_COLUMNS))
    sql = resolved_history_sql(HISTORY_COLUMNS, ENDS_COLUMNS, quote_char='"')
    return set(con.sql(sql).fetchall())


def _delta_rs(folder: Path, history: Rows, ends: Rows) -> set[Row]:
    for name, rows, columns in (
        ("history", history, HISTORY_COLUMNS),
        ("history_ends", ends, ENDS_COLUMNS),
    ):
        write_deltalake(str(folder / name), _table(rows, columns), mode="overwrite")
    query = (
        QueryBuilder()
        .register("history", DeltaTable(str(folder / "history")))
        .register("history_ends", DeltaTable(str(folder / "history_ends")))
        .execute(resolved_history_sql(HISTORY_COLUMNS, ENDS_COLUMNS, quote_char='"'))
    )
    result = pa.table(query.read_all())
    return set(zip(*(result.column(c).to_pylist() for c in HISTORY_COLUMNS), strict=True))


@pytest.mark.parametrize("engine", ["duckdb", "delta-rs"])
def test_a_reader_sees_a_batch_whole_or_not_at_all(engine: str, tmp_path: Path) -> None:
    def read(history: Rows, ends: Rows) -> set[Row]:
        return _duckdb(history, ends) if engine == "duckdb" else _delta_rs(tmp_path, history, ends)

    before = set(BEFORE)
    # Between the batch's two commits: its end is written, its change not yet.
    assert read(BEFORE, ENDS) == before
    # Both committed: key 1's first version ends where its next one starts.
    assert read([*BEFORE, *BATCH_2], ENDS) == {(1, "a", 10, 1, 20), (2, "b", 11, 1, None), *BATCH_2}
    # Folded by housekeeping: the history holds the end, the ends table is empty.
    folded: list[Row] = [(1, "a", 10, 1, 20), (2, "b", 11, 1, None), *BATCH_2]
    assert read(folded, []) == set(folded)
