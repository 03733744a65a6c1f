"""A major-version upgrade of a stack node with PostgreSQL's own ``pg_upgrade``.

The stack's PostgreSQL builds ship only ``initdb``, ``pg_ctl`` and ``postgres``; the tools
``pg_upgrade`` needs come from complete builds of the same majors (``bootstrap.
PG_UPGRADE_WHEELS``). The old cluster still runs on the stack's own binaries: ``pg_upgrade``
reads it with the stack's ``postgres`` and ``pg_ctl`` beside ``pg_controldata`` and
``pg_resetwal`` of the same release, gathered in one folder of symlinks. The new cluster
is made and filled by the complete build of the new major; afterwards the stack runs it
with its own binaries of that major (a major's catalog version never changes within it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from slotbridge_dev import bootstrap
from slotbridge_dev.stack.cluster import Node, StackError, say

# What pg_upgrade runs from the old cluster's bin folder (check_bin_dir in pg_upgrade's
# exec.c): the server and pg_ctl are the stack's, the other two the complete build's.
_OLD_SERVER_TOOLS = ("postgres", "pg_ctl")
_OLD_CONTROL_TOOLS = ("pg_controldata", "pg_resetwal")


def old_bin_dir(node: Node, old_major: str) -> Path:
    """A folder of symlinks: the node's own server binaries and the complete build's control
    tools of the same major, readable by the PostgreSQL OS user."""
    folder = node.dir.parent / f"pg-upgrade-bin-{old_major}"
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o755)
    control = bootstrap.pg_upgrade_bin(bootstrap.cache_dir(), old_major)
    for name in _OLD_SERVER_TOOLS + _OLD_CONTROL_TOOLS:
        source = (node.bin_dir if name in _OLD_SERVER_TOOLS else control) / name
        if not source.exists():
            raise StackError(f"{source} is missing; run python3 -m slotbridge_dev.bootstrap")
        link = folder / name
        link.unlink(missing_ok=True)
        link.symlink_to(source)
    return folder


def pg_upgrade(old: Node, new: Node, old_bin: Path) -> None:
    """Upgrade ``old``'s stopped cluster into ``new``'s freshly made one (``new.bin_dir`` is
    the complete build holding ``pg_upgrade``). Both use ``old.port`` in turn: pg_upgrade
    never runs the two servers at once."""
    say(f"{old.name}: pg_upgrade {old.data_dir} -> {new.data_dir}")
    work = new.dir / "pg_upgrade"
    work.mkdir(exist_ok=True)
    if new.run_as is not None:
        new.run_as.chown(work)
    proc = new.run(
        [
            str(new.bin_dir / "pg_upgrade"),
            "--old-bindir",
            str(old_bin),
            "--new-bindir",
            str(new.bin_dir),
            "--old-datadir",
            str(old.data_dir),
            "--new-datadir",
            str(new.data_dir),
            "--old-port",
            str(old.port),
            "--new-port",
            str(old.port),
            "--username",
            "postgres",
            "--no-sync",
        ],
        timeout=600,
        cwd=work,
    )
    (new.dir / "pg_upgrade.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        # Its last line is "Failure, exiting"; the one before says why.
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        raise StackError(
            f"{old.name}: pg_upgrade failed (exit {proc.returncode}: "
            f"{' / '.join(lines[-2:]) or 'no output'}); see {new.dir / 'pg_upgrade.log'}"
        )


def replace_data_dir(old: Node, new: Node) -> None:
    """The upgraded cluster takes the node's folder; the old one is deleted (pg_upgrade
    copied its files, so nothing refers to it any more)."""
    shutil.rmtree(old.data_dir)
    new.data_dir.rename(old.data_dir)
