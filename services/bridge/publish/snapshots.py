"""Where snapshots meet the stream, in the publisher's thread and in stream order.

A transaction that holds nothing but a message of ours is a chunk's watermark (its rows,
less what the stream overtook, go into the open batch at that place, see
``snapshot/reader.py`` and ``snapshot/chunks.py``) or a signal (an on-demand snapshot or
its cancellation, so it takes effect in stream order). A table published but not yet in
Kafka (added to the publication later) gets a snapshot when the socket loop finds it
missing (``SnapshotRequest``) or the stream first describes it, whichever comes first
(planned from the transaction's Relation messages before its records are built). While a
table is snapshotted, the stream's changes to it are noted in ``StreamWatch`` so a chunk
never publishes a row the stream has already overtaken.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator

from services.bridge.assemble.assembler import Transaction
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import is_logical_message
from services.bridge.records.catalog import RelationInfo
from services.bridge.records.events import EventBuilder, Record
from services.bridge.snapshot.chunks import StreamWatch, TableName
from services.bridge.snapshot.reader import SIGNAL, WATERMARK, Chunk, SnapshotBook
from services.common.failpoints import failpoint
from services.common.logs import log_event

log = logging.getLogger(__name__)

Decode = Callable[[bytes, bool], m.Message]


class StreamSnapshots:
    """The snapshots of one session as the publisher meets them: started, fed their
    chunks at their watermarks, cancelled, and watched while they run."""

    def __init__(
        self,
        *,
        slot_name: str,
        builder: EventBuilder,
        book: SnapshotBook,
        decode: Decode,
        produce: Callable[[Iterable[Record]], int],
        snapshot_added: bool,
        published: Callable[[], set[TableName]],
    ) -> None:
        """``snapshot_added``: whether tables missing from Kafka get a snapshot (not with
        ``snapshot_mode: never``, nor for a FOR ALL TABLES publication, whose new tables
        stream from their creation)."""
        self.snapshot_added = snapshot_added
        self._slot_name = slot_name
        self._builder = builder
        self._book = book
        self._decode = decode
        self._produce = produce
        self._published = published
        self.watch = StreamWatch()
        for table in book.tables():
            self.watch.watch(table)
        # Tables the stream described that the publication does not publish: the
        # partitions a change went through, described next to the root that
        # publish_via_partition_root publishes them as. Asked about once per session.
        self._not_published: set[TableName] = set()

    def is_missing(self, table: TableName) -> bool:
        """Published, not in Kafka, and no snapshot of it under way (any thread may ask)."""
        return (
            self.snapshot_added
            and table not in self._builder.catalog.known
            and not self._book.covers(table)
        )

    def add_if_missing(self, table: TableName) -> None:
        if self.is_missing(table):
            self.start(table, "added", None)

    def start(self, table: TableName, request: str, where: str | None) -> None:
        name = f"{table[0]}.{table[1]}"
        under_way = self._book.add(table, request, where)
        if under_way is not None:
            if under_way != request:
                log_event(
                    log,
                    logging.WARNING,
                    "snapshot request ignored: the table's "
                    "snapshot is under way; cancel that one first",
                    table=name,
                    request=request,
                    under_way=under_way,
                )
            return
        self.watch.watch(table)
        log_event(log, logging.INFO, "snapshot requested", table=name, request=request, where=where)

    def start_described(self, txn: Transaction) -> None:
        """Start a snapshot of every table the transaction describes that is published but
        missing from Kafka: its changes may come before its rows. Before the transaction's
        records are built: a snapshot started while the builder pulls its messages would
        change what is being built."""
        if not self.snapshot_added:
            return
        started: set[TableName] = set()
        for relation in self.relations(txn):
            name = (relation.namespace, relation.name)
            if name in started or name in self._not_published or not self.is_missing(name):
                continue
            if name in self._published():
                self.start(name, "added", None)
                started.add(name)
            else:
                self._not_published.add(name)

    def relations(self, txn: Transaction) -> Iterator[m.Relation]:
        for payload in txn.relations:
            relation = self._decode(payload, txn.streamed)
            assert isinstance(relation, m.Relation)
            yield relation

    def control(self, txn: Transaction) -> int | None:
        """None unless ``txn`` holds nothing but a message of ours; then acts on it and
        returns how many records that published (a chunk's rows, or 0)."""
        if txn.spool.count != 1:
            return None
        ((lsn, payload),) = txn.spool
        if not is_logical_message(payload):
            return None
        msg = self._decode(payload, txn.streamed)
        if not isinstance(msg, m.LogicalMessage) or msg.prefix not in (WATERMARK, SIGNAL):
            return None
        txn.spool.discard()
        try:
            body = json.loads(msg.content)
        except ValueError:
            log_event(
                log,
                logging.WARNING,
                "ignored a malformed message of ours",
                prefix=msg.prefix,
                lsn=lsn,
            )
            return 0
        if not isinstance(body, dict) or body.get("slot") != self._slot_name:
            return 0  # another bridge's, on the same database
        if msg.prefix == WATERMARK:
            chunk = self._book.take(str(body.get("chunk")))
            return 0 if chunk is None else self._publish_chunk(chunk, txn, lsn)
        if isinstance(body.get("snapshot"), dict):
            request = body["snapshot"]
            schema, _, name = str(request.get("table", "")).partition(".")
            where = request.get("where")
            self.start(
                (schema, name), str(request.get("id")), str(where) if where is not None else None
            )
        elif body.get("cancel") is not None:
            for table in self._book.cancel(str(body["cancel"])):
                self.watch.unwatch(table)
                log_event(
                    log,
                    logging.INFO,
                    "snapshot cancelled",
                    table=f"{table[0]}.{table[1]}",
                    request=body["cancel"],
                )
        return 0

    def _publish_chunk(self, chunk: Chunk, txn: Transaction, lsn: int) -> int:
        """A chunk's rows, less those the stream overtook, at its watermark's place."""
        catalog = self._builder.catalog
        stream_shape = catalog.by_oid.get(chunk.relation.oid)
        info = catalog.apply(chunk.relation)
        rows = self.watch.fresh(chunk.table, chunk.snapshot, chunk.rows, info.key_idx, chunk.xmins)
        name = f"{chunk.table[0]}.{chunk.table[1]}"
        if rows is None:
            log_event(
                log,
                logging.INFO,
                "snapshot chunk read again: a transaction committed "
                "before the snapshot was requested was still running",
                table=name,
            )
            self._restore(stream_shape)
            self._book.again(chunk)
            return 0
        count = self._produce(
            self._builder.snapshot_rows(info, rows, txn.commit_lsn, txn.commit_ts, lsn)
        )
        # The stream's own description stays in force for its changes: pgoutput does not
        # send it again.
        self._restore(stream_shape)
        if self._book.advance(chunk, len(rows)):
            self.watch.unwatch(chunk.table)
            done = self._book.report()["tables"][name]
            log_event(
                log,
                logging.INFO,
                "snapshot of table published",
                table=name,
                rows=done["rows_done"],
                chunks=done["chunks_done"],
                seconds=done["seconds"],
                rows_per_s=done["rows_per_s"],
            )
        failpoint("after_chunk")
        return count

    def _restore(self, stream_shape: RelationInfo | None) -> None:
        if stream_shape is not None:
            self._builder.catalog.by_oid[stream_shape.oid] = stream_shape

    def note(self, msg: m.Message, xid: int) -> None:
        """Tell the watch what a change did to a table being snapshotted.

        The relation's shape is the catalog's: the builder applied the transaction's
        Relation messages before it asked for the changes after them."""
        by_oid = self._builder.catalog.by_oid
        watch = self.watch
        if isinstance(msg, m.Truncate):
            for oid in msg.relation_oids:
                name = (by_oid[oid].schema, by_oid[oid].table)
                if name in watch:
                    watch.truncated(name, xid)
            return
        if not isinstance(msg, m.Insert | m.Update | m.Delete):
            return
        info = by_oid[msg.relation_oid]
        name = (info.schema, info.table)
        if name not in watch:
            return
        at = info.key_idx
        if isinstance(msg, m.Insert):
            watch.inserted(name, xid)
            if at:
                watch.changed(
                    name,
                    xid,
                    tuple(msg.new[i] for i in at),  # type: ignore[misc]
                    insert=True,
                )
            return
        if at:
            for tup in (msg.old, getattr(msg, "new", None)):
                if tup is not None:
                    watch.changed(name, xid, tuple(tup[i] for i in at))  # type: ignore[misc]

    def unwatch_given_up(self) -> None:
        """Stop watching the tables whose snapshot a chunk reader gave up."""
        for table in self.watch.tables():
            if not self._book.covers(table):
                self.watch.unwatch(table)
