"""What one session streams with, prepared from what Kafka and PostgreSQL durably hold.

The order is the argument for exactly once: the producer fences its predecessors before
Kafka's progress is read (a killed predecessor can commit nothing after that read), the
progress picks the server (``server.open_server``), and the high-water mark comes from both
the origin and Kafka before the slot streams. Everything opened here is closed by the
session's ``ExitStack``, in reverse.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass

import psycopg

from services.bridge.assemble import reader
from services.bridge.assemble.assembler import Assembler
from services.bridge.assemble.reader import TransactionReader
from services.bridge.assemble.spool import Spool, SpoolStats, prepare_spool_dir
from services.bridge.decode import decoder
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.metrics import BridgeMetrics
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.progress.highwater import high_water
from services.bridge.progress.kafka_reader import read_kafka_progress, read_topic
from services.bridge.progress.origin import OriginStore
from services.bridge.progress.record import is_gap_key
from services.bridge.publish.publisher import Publisher, TxnQueue
from services.bridge.records import catalog
from services.bridge.records.catalog import KnownVersion, RelationCatalog, known_versions
from services.bridge.records.debezium import DebeziumEventBuilder
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import EventBuilder, RecordChoices, max_change_bytes
from services.bridge.records.masking import Masking
from services.bridge.server import Server, open_server
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink, kafka_client_config
from services.bridge.slot import SlotClaim
from services.bridge.snapshot.reader import SnapshotBook
from services.bridge.source import (
    check_published,
    preflight,
    published_tables,
    publishes_all_tables,
    table_facts,
    warn_keyless_tables,
)
from services.common.logs import log_event
from services.common.lsn import format_lsn
from services.contract.records import ProgressRecord
from services.contract.topics import schema_topic

log = logging.getLogger(__name__)

_QUEUE_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 15.0  # three times this stays inside the chart's 60 s termination grace


@dataclass(frozen=True, slots=True)
class Session:
    """What one session streams with, prepared before the slot starts streaming."""

    server: Server
    sink: KafkaSink
    book: SnapshotBook
    tracker: ConfirmTracker
    queue: TxnQueue
    publisher: Publisher
    reader: TransactionReader


def stop_if_running(publisher: Publisher) -> None:
    """A session that ended on an error stops its publisher, which commits its open
    batch (what it had published from the stream so far)."""
    if publisher.is_alive():
        publisher.stop()
        publisher.join(STOP_GRACE_S)


class SessionSetup:
    """Prepares each session of one daemon: the same settings, metrics and slot claim,
    new clients and threads every time."""

    def __init__(
        self,
        settings: BridgeSettings,
        dsn: str,
        metrics: BridgeMetrics,
        spool_stats: SpoolStats,
        masking: Masking | None,
        slot: SlotClaim,
    ) -> None:
        self._settings = settings
        self._dsn = dsn
        self._metrics = metrics
        self._spool_stats = spool_stats
        self._masking = masking
        self._slot = slot

    def prepare(self, ending: ExitStack) -> Session:
        """A session's collaborators, from what Kafka and PostgreSQL durably hold; what is
        opened here is closed by ``ending``."""
        s = self._settings
        spool_dir = prepare_spool_dir(s.spool_dir, s.slot_name)
        sink = KafkaSink(
            s,
            on_wait=self._metrics.kafka_wait.set,
            on_latencies=self._metrics.broker_latencies,
        )
        ending.callback(sink.close)
        sink.start()  # fences a killed predecessor; must precede reading progress
        sink.topics.ensure({s.progress_topic: True})
        kafka_progress = read_kafka_progress(kafka_client_config(s), s.progress_topic, s.slot_name)
        if kafka_progress is not None:
            sink.topics.expect_ids(kafka_progress.topic_ids)
        # Progress before PostgreSQL: it decides which server of source_dsn may be used.
        server = open_server(self._dsn, kafka_progress, s.slot_name)
        ending.callback(server.close)
        sql, identity = server.sql, server.identity
        preflight(sql, s)
        origin = OriginStore(sql, s.origin_name)

        mark = high_water(origin.progress(), kafka_progress)
        builder = self._builder(sql, server.system.dbname, mark)
        sink.topics.ensure(
            {builder.schema_topic: True}
            | ({builder.transaction_topic: False} if s.transaction_metadata else {})
        )
        with self._slot.racing(sql, sink):
            self._slot.ensure(sql, server.repl, sink, origin, server.system.dbname, kafka_progress)
        shaped = check_published(
            sql, s.publication_name, builder.catalog.masking, builder.catalog.routing
        )
        if shaped:
            # Which columns leave masked and where records go: names only, never a value.
            log_event(log, logging.INFO, "transforms, routes and keys", tables=shaped)
        warn_keyless_tables(sql, s.publication_name)
        book = self._snapshots(sql, kafka_progress, mark)

        parallel = s.streaming == "parallel"
        tracker = ConfirmTracker(0)
        queue = TxnQueue(_QUEUE_BYTES)
        control = PgOutputDecoder(4, parallel_abort=parallel)
        assembler = Assembler(
            control.decode,
            lambda name: Spool(spool_dir, name, s.spool_memory_bytes, self._spool_stats),
            on_prepared=tracker.prepared,
            on_rolled_back=tracker.finished,
            max_change_bytes=max_change_bytes(s.max_row_bytes),
            on_untied_message=self._untied_message,
        )
        ending.callback(assembler.discard_all)
        replay = PgOutputDecoder(4, parallel_abort=parallel)
        stream_reader = TransactionReader(server.repl, assembler, s.spool_memory_bytes)
        self._spool_stats.count_unsealed(lambda: stream_reader.unsealed_bytes)
        ending.callback(self._spool_stats.count_unsealed, None)
        publisher = Publisher(
            settings=s,
            sink=sink,
            origin=origin,
            builder=builder,
            tracker=tracker,
            identity=identity,
            high_water=mark,
            last_commit_lsn=kafka_progress.commit_lsn if kafka_progress is not None else mark,
            queue=queue,
            decode=replay.decode,
            metrics=self._metrics,
            book=book,
            snapshot_added=s.snapshot_mode != "never"
            and not publishes_all_tables(sql, s.publication_name),
            published=lambda: {p.name for p in published_tables(sql, s.publication_name)},
            receiving=lambda: stream_reader.mid_transaction,
        )
        ending.callback(stop_if_running, publisher)
        log_event(
            log,
            logging.INFO,
            "session starting",
            slot=s.slot_name,
            server=server.address,
            system=identity.system_identifier,
            timeline=identity.timeline,
            high_water=format_lsn(mark),
            compiled_hot_path=decoder.COMPILED and catalog.COMPILED and reader.COMPILED,
            snapshots=[
                f"{e.schema_}.{e.table} ({e.id}, {e.chunks} chunks done)" for e in book.states()
            ],
        )
        return Session(server, sink, book, tracker, queue, publisher, stream_reader)

    def _builder(
        self, sql: psycopg.Connection[tuple[object, ...]], dbname: str, mark: int
    ) -> EventBuilder:
        """The record format's builder, over a catalogue that knows the table versions
        Kafka already has."""
        s = self._settings
        catalog = RelationCatalog(
            s.topic_prefix,
            lambda oid: table_facts(sql, oid),
            self._known_versions(schema_topic(s.topic_prefix)),
            masking=self._masking,
            routing=s.routing(),
        )
        choices = RecordChoices(
            begin_records=s.transaction_metadata and s.transaction_begin_records,
            end_records=s.transaction_metadata,
            tombstones=s.tombstones_on_delete,
        )
        if s.value_format == "debezium":
            # Before anything was published there is no previous commit to name.
            return DebeziumEventBuilder(
                catalog,
                s.topic_prefix,
                dbname,
                s.max_row_bytes,
                mark or None,
                choices=choices,
                schemas=s.debezium_schemas,
                context_headers=s.debezium_context_headers,
            )
        return DefaultEventBuilder(
            catalog,
            s.topic_prefix,
            dbname,
            s.max_row_bytes,
            choices=choices,
        )

    def _untied_message(self, message: m.LogicalMessage) -> None:
        self._metrics.untied_messages.inc()
        log_event(
            log,
            logging.DEBUG,
            "non-transactional logical message not published",
            prefix=message.prefix,
            lsn=format_lsn(message.lsn),
        )

    def _snapshots(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        kafka_progress: ProgressRecord | None,
        mark: int,
    ) -> SnapshotBook:
        """The snapshots to go on with (as far as Kafka says they got), or, on a slot that
        never published anything, the initial snapshot of every published table."""
        s = self._settings
        if kafka_progress is not None:
            return SnapshotBook(
                kafka_progress.snapshots, held=s.snapshot_workers, ended=kafka_progress.ended
            )
        book = SnapshotBook(held=s.snapshot_workers)
        if s.snapshot_mode != "never" and mark == 0:
            for table in published_tables(sql, s.publication_name):
                book.add(table.name, "initial")
            log_event(
                log,
                logging.INFO,
                "initial snapshot starting",
                slot=s.slot_name,
                tables=[f"{a}.{b}" for a, b in book.tables()],
            )
        return book

    def _known_versions(self, schema_topic: str) -> dict[tuple[str, str], KnownVersion]:
        """Table versions already announced, so a restart reuses instead of re-minting."""
        return known_versions(
            json.loads(value)
            for key, value in read_topic(kafka_client_config(self._settings), schema_topic)
            if value is not None and not is_gap_key(key)
        )
