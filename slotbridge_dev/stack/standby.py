"""A hot standby of the local stack: cloned from a running primary, streaming from it.

The clone is a non-exclusive base backup (``pg_backup_start``, a copy of the primary's
folder, ``pg_backup_stop``, all in one session of the primary) through a physical slot
created just before it, so the standby can stream from the backup's start. The primary
then waits for that slot before it sends logical changes (``synchronized_standby_slots``),
and the standby syncs failover slots itself (``sync_replication_slots``): a promotion
never leaves a failover slot behind. Which node is primary or standby is the caller's
(``stack.Stack``): after a drill the old primary is cloned from the new one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import psycopg

from slotbridge_dev.stack.cluster import Node, StackError, say, wait_until

# The physical slot a standby streams through, on its primary.
STANDBY_SLOT = "standby1"

# Not copied by a base backup: runtime state, and what the standby must rebuild itself
# (its WAL comes by streaming, its synced slots from the slotsync worker).
_SKIP_FILES = {
    "postmaster.pid",
    "postmaster.opts",
    "backup_label",
    "tablespace_map",
    "standby.signal",
    "recovery.signal",
    "pg_internal.init",
}
_EMPTY_DIRS = {
    "pg_wal",
    "pg_replslot",
    "pg_dynshmem",
    "pg_notify",
    "pg_serial",
    "pg_snapshots",
    "pg_stat_tmp",
    "pg_subtrans",
}


def _copy_data_dir(src: Path, dst: Path) -> None:
    """Copy a running cluster's folder; files vanishing mid-copy are fine under backup mode."""
    for folder, dirs, files in os.walk(src):
        rel = Path(folder).relative_to(src)
        (dst / rel).mkdir(mode=0o700, exist_ok=True)
        if rel.parts and rel.parts[0] in _EMPTY_DIRS:
            # pg_wal keeps its subfolders (archive_status, summaries); an empty slot
            # folder under pg_replslot would stop the clone from starting, so no subfolders.
            if rel.parts[0] != "pg_wal":
                dirs.clear()
            continue
        for name in files:
            if name in _SKIP_FILES or name.startswith("pgsql_tmp"):
                continue
            source = Path(folder) / name
            try:
                if source.is_symlink():
                    os.symlink(os.readlink(source), dst / rel / name)
                else:
                    shutil.copy2(source, dst / rel / name)
            except FileNotFoundError:
                continue


def wait_for_standby_slot(conn: psycopg.Connection[Any]) -> None:
    """The primary sends logical changes only once the standby has them
    (``synchronized_standby_slots``), so a promotion never leaves a failover slot behind."""
    conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'")
    conn.execute("SELECT pg_reload_conf()")


def _ensure_standby_slot(conn: psycopg.Connection[Any]) -> None:
    """A fresh physical slot reserving WAL now, so the clone can stream from its start."""
    row = conn.execute(
        "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (STANDBY_SLOT,)
    ).fetchone()
    if row is not None:
        if row[0]:
            raise StackError(
                f"primary: slot {STANDBY_SLOT} is still in use by another standby; stop it first"
            )
        conn.execute("SELECT pg_drop_replication_slot(%s)", (STANDBY_SLOT,))
    conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (STANDBY_SLOT,))


def clone_standby(primary: Node, standby: Node, settings: dict[str, object]) -> None:
    """``standby`` made a copy of the running ``primary`` that streams from it, with the
    stack's common ``settings``; ``standby``'s folder must be empty (wiped)."""
    standby.make_dir()
    say(f"{standby.name}: cloning {primary.name} (pg_backup_start / copy / pg_backup_stop)")
    with primary.connect() as conn:
        _ensure_standby_slot(conn)
        # Non-exclusive backup: it belongs to this session, which must also end it.
        conn.execute("SELECT pg_backup_start('slotbridge standby', true)")
        _copy_data_dir(primary.data_dir, standby.data_dir)
        row = conn.execute("SELECT labelfile, spcmapfile FROM pg_backup_stop(false)").fetchone()
    assert row is not None
    label, spcmap = row
    (standby.data_dir / "backup_label").write_text(label)
    if spcmap:
        (standby.data_dir / "tablespace_map").write_text(spcmap)
    (standby.data_dir / "standby.signal").write_text("")
    standby.write_config(
        {
            **settings,
            "primary_conninfo": f"{primary.dsn} application_name={standby.name}",
            "primary_slot_name": STANDBY_SLOT,
            "hot_standby_feedback": True,
            "sync_replication_slots": True,
        }
    )
    os.chmod(standby.data_dir, 0o700)
    if standby.run_as is not None:
        standby.run_as.chown_tree(standby.dir)


def wait_streaming(standby: Node, timeout: float = 90) -> None:
    """Until ``standby``'s WAL receiver streams from its primary."""
    say(f"{standby.name}: waiting until it streams from the primary (up to {timeout:.0f}s)")

    def streaming() -> bool:
        if not standby.is_running():
            raise StackError(f"{standby.name}: postgres exited; log: {standby.log_path}")
        try:
            rows = standby.query("SELECT status FROM pg_stat_wal_receiver")
        except (StackError, psycopg.Error):
            return False
        return rows == [("streaming",)]

    if not wait_until(streaming, timeout, interval=0.5):
        raise StackError(
            f"{standby.name}: never reached streaming within {timeout:.0f}s; "
            f"log: {standby.log_path}"
        )


def standby_status(node: Node, primary_lsn: str | None) -> dict[str, Any]:
    """A standby's part of ``Stack.status``: streaming, replay lag, synced slots."""
    with node.connect() as conn:
        receiver = conn.execute("SELECT status FROM pg_stat_wal_receiver").fetchone()
        lag = None
        if primary_lsn is not None:
            lag_row = conn.execute(
                "SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())::bigint",
                (primary_lsn,),
            ).fetchone()
            lag = lag_row[0] if lag_row else None
        slots = conn.execute(
            "SELECT slot_name, synced, temporary, invalidation_reason "
            "FROM pg_replication_slots WHERE slot_type = 'logical' ORDER BY 1"
        ).fetchall()
    streaming = receiver is not None and receiver[0] == "streaming"
    return {
        "streaming": streaming,
        "healthy": streaming,
        "replay_lag_bytes": lag,
        "synced_slots": [
            {"name": n, "synced": s, "temporary": t, "invalidation_reason": r}
            for n, s, t, r in slots
        ],
    }
