"""The bridge daemon: one session per connection, restarted with backoff until stopped.

A session: fence older producers, read Kafka's progress record, pick the server of
source_dsn that may continue it (``server.open_server``), preflight it, make sure
publication, slot and origin exist, compute the high-water mark, then run the socket loop
(this thread) next to the publisher thread. Any error ends the session; the next one
starts again from what PostgreSQL and Kafka durably hold, so a restart can neither lose
nor duplicate.

Errors that a retry cannot fix (bad settings, wrong server, a gap: each error class says
so in its ``retryable``) end the daemon with one line and a non-zero exit, plus the
traceback when the error is a bug (``logs.log_failure``); so does any error before the
first session streamed, because at start-up a failure is far more often a typo than an
outage.

Of two bridges on one slot, the one that started last wins (``SlotBusy``).

The wait between sessions doubles while sessions keep failing and starts over once one
streamed: each outage is waited out on its own terms, whatever happened before it.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import FrameType

import psycopg
from psycopg.errors import DuplicateObject, ObjectInUse, UndefinedObject

from services.bridge.assemble.assembler import Assembler
from services.bridge.assemble.spool import Spool, SpoolStats, prepare_spool_dir
from services.bridge.decode import decoder
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.metrics import BridgeMetrics, SnapshotCollector
from services.bridge.poller import POLL_OPTIONS, CatalogPoller
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.progress.highwater import high_water
from services.bridge.progress.kafka_reader import read_kafka_progress, read_topic
from services.bridge.progress.origin import OriginStore
from services.bridge.progress.record import is_gap_key
from services.bridge.publish.publisher import (
    HEARTBEAT_S,
    Publisher,
    TxnQueue,
)
from services.bridge.receive.feedback import StreamPosition
from services.bridge.receive.stream import ReplicationConnection, StreamError, drop_slot
from services.bridge.records import catalog
from services.bridge.records.catalog import KnownVersion, RelationCatalog, known_versions
from services.bridge.records.debezium import DebeziumEventBuilder
from services.bridge.records.events import EventBuilder, max_change_bytes
from services.bridge.records.masking import Masking
from services.bridge.server import Server, open_server
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import (
    FencedError,
    KafkaSink,
    SinkError,
    kafka_client_config,
)
from services.bridge.snapshot.reader import ChunkReader, SnapshotBook
from services.bridge.source import (
    check_published,
    check_slot,
    ensure_publication,
    preflight,
    publication_dropped,
    published_tables,
    publishes_all_tables,
    slot_state,
    table_facts,
    warn_keyless_tables,
)
from services.bridge.takeover import end_walsender, slot_holder
from services.common.errors import retryable
from services.common.failpoints import failpoint
from services.common.httpserver import HealthServer, HttpServerError
from services.common.logs import log_event, log_failure, one_line
from services.common.lsn import PG_EPOCH_UNIX_US, format_lsn
from services.common.pg import SourceError, SourceRefused, connect, with_password
from services.contract.records import ProgressRecord
from services.contract.topics import schema_topic

log = logging.getLogger(__name__)

_QUEUE_BYTES = 64 * 1024 * 1024
_STOP_GRACE_S = 15.0  # three times this stays inside the chart's 60 s termination grace
# How long a successor waits for the predecessor's walsender to exit once it ended it.
_TAKEOVER_WAIT_S = 10.0


class SlotBusy(SourceError):
    """The slot is in use by another walsender.

    Two bridges on a slot: the one that registered its Kafka transactional id last wins.
    Every session starts by fencing the producers before it and ends a fenced bridge's
    walsender itself (``takeover``); where it may not, the walsender in the way stops at its
    bridge's next Kafka call, within HEARTBEAT_S, or the server ends it after
    wal_sender_timeout. ``wait_s`` covers both; a slot still held after that is streamed by
    something else.
    """

    retryable = True  # and waited out even before a session streamed (``retry_session``)

    def __init__(self, slot: str, holder: str, wait_s: float) -> None:
        super().__init__(
            f"slot {slot} is in use by {holder}; waiting until it is released "
            f"(at most {wait_s:.0f}s)"
        )
        self.slot = slot
        self.holder = holder
        self.wait_s = wait_s


def retry_session(exc: BaseException, streamed: bool) -> bool:
    """Whether a new session follows one that ended with ``exc``.

    A busy slot is waited out from the start (``SlotBusy``); any other error only once a
    session streamed, and only if a retry may get past it (``errors.retryable``).
    """
    return isinstance(exc, SlotBusy) or (streamed and retryable(exc))


@dataclass
class Backoff:
    """The wait before the next session: ``first_s``, doubled for each further session in
    a row that ended without streaming, at most ``max_s``.

    A session that streamed resets the count: a daemon that rode out long outages earlier
    must not wait ``max_s`` after every brief one later.
    """

    first_s: float = 0.5
    max_s: float = 30.0
    failures: int = 0  # sessions ended in a row, counting the last one that streamed

    def session_ended(self, streamed: bool) -> float:
        """Count the session that just ended; returns the seconds to wait."""
        self.failures = 1 if streamed else self.failures + 1
        # The exponent is capped: a float overflows past 2**1023, nine hours into an outage.
        return min(self.max_s, self.first_s * 2.0 ** min(self.failures - 1, 32))


@dataclass
class _Health:
    streaming: bool = False
    last_loop: float = 0.0
    error: str = ""
    # A wait the source imposes and a restart would only repeat (slot creation waits for
    # the transactions open at that moment): live while it lasts, however long.
    waiting: str = ""
    waiting_since: float = 0.0


@dataclass(frozen=True, slots=True)
class _Session:
    """What one session streams with, prepared before the slot starts streaming."""

    server: Server
    sink: KafkaSink
    book: SnapshotBook
    tracker: ConfirmTracker
    queue: TxnQueue
    publisher: Publisher
    assembler: Assembler


def _stop_if_running(publisher: Publisher) -> None:
    """A session that ended on an error stops its publisher, which commits its open
    batch (what it had published from the stream so far)."""
    if publisher.is_alive():
        publisher.stop()
        publisher.join(_STOP_GRACE_S)


class Bridge:
    def __init__(self, settings: BridgeSettings) -> None:
        self.settings = settings
        self.spool_stats = SpoolStats()
        self._book = SnapshotBook()  # this session's snapshots
        self._readers: list[ChunkReader] = []
        self.metrics = BridgeMetrics(settings.slot_name, self.spool_stats)
        self.metrics.registry.register(
            SnapshotCollector(settings.slot_name, lambda: self._book.report())
        )
        self._stop = threading.Event()
        self._health = _Health(last_loop=time.monotonic())
        self._sessions_streamed = 0
        self._masking: Masking | None = None
        self._dsn = with_password(
            settings.source_dsn,
            settings.source_password.get_secret_value() if settings.source_password else None,
        )

    # -- lifecycle -------------------------------------------------------------------

    def stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        """Run until SIGTERM/SIGINT or a fatal error; returns the process exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # A bridge that stands still without a word: `kill -USR1 <pid>` writes where each of
        # its threads is to stderr, and it goes on.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        server = None
        try:
            if self.settings.http_port:
                server = HealthServer(
                    self.settings.http_host,
                    self.settings.http_port,
                    self._live,
                    self._ready,
                    self.metrics.registry,
                    {"/snapshot": lambda: self._book.report()},
                ).start()
            self._masking = self.settings.masking()  # a missing key: one line, at once
            self._sessions()
            return 0
        except (SourceError, HttpServerError) as exc:
            log_event(log, logging.ERROR, str(exc))
            return 2
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            log_failure(log, exc)
            return 1
        finally:
            if server is not None:
                server.stop()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log_event(log, logging.INFO, "stopping", signal=signal.Signals(signum).name)
        self._stop.set()

    def _sessions(self) -> None:
        """Sessions one after another until stopped or an error no new session can fix."""
        backoff = Backoff()
        busy_since: float | None = None  # first of the sessions in a row that found the slot busy
        while True:
            streamed_before = self._sessions_streamed
            try:
                self._session()
                return
            except Exception as exc:
                if not isinstance(exc, SlotBusy):
                    busy_since = None
                elif busy_since is None:
                    busy_since = time.monotonic()
                elif time.monotonic() - busy_since > exc.wait_s:
                    raise SourceRefused(
                        f"slot {exc.slot} is still in use by {exc.holder} after "
                        f"{time.monotonic() - busy_since:.0f}s although this bridge holds its "
                        f"Kafka transactional id {self.settings.transactional_id}: something "
                        "other than a slotbridge streams it; stop that consumer or choose "
                        "another slot_name"
                    ) from None
                if not self._retryable(exc):
                    raise
                wait_s = backoff.session_ended(self._sessions_streamed > streamed_before)
                self.metrics.reconnects.inc()
                self._health.error = one_line(exc)
                log_event(
                    log,
                    logging.WARNING,
                    "session ended, reconnecting",
                    error=self._health.error,
                    attempt=backoff.failures,
                    retry_in_s=round(wait_s, 1),
                )
                if self._stop.wait(wait_s):
                    return

    def _retryable(self, exc: BaseException) -> bool:
        return not self._stop.is_set() and retry_session(exc, self._sessions_streamed > 0)

    def _live(self) -> tuple[bool, str]:
        now = time.monotonic()
        if self._health.waiting:
            return True, f"{self._health.waiting} ({now - self._health.waiting_since:.0f}s so far)"
        stale = now - self._health.last_loop
        # Outside a known wait (above), a session set up or a socket loop that stops
        # for this long is wedged.
        if stale >= 120:
            return False, f"main loop last ran {stale:.0f}s ago"
        stalled = now - self._book.last_progress
        if self._book.tables() and stalled >= self.settings.snapshot_stall_s:
            return False, f"snapshot made no progress for {stalled:.0f}s"
        return True, f"main loop last ran {stale:.0f}s ago"

    def _ready(self) -> tuple[bool, str]:
        if self._health.streaming:
            return True, "streaming"
        return False, self._health.error or "not streaming yet"

    # -- one session -----------------------------------------------------------------

    def _session(self) -> None:
        with ExitStack() as ending:  # undone in reverse: what streams first, clients last
            session = self._prepare(ending)
            ending.callback(self._end_streaming)
            self._stream(session)

    def _prepare(self, ending: ExitStack) -> _Session:
        """A session's collaborators, from what Kafka and PostgreSQL durably hold; what is
        opened here is closed by ``ending``."""
        s = self.settings
        spool_dir = prepare_spool_dir(s.spool_dir, s.slot_name)
        sink = KafkaSink(s, on_wait=self.metrics.kafka_wait.set)
        ending.callback(sink.close)
        sink.start()  # fences a killed predecessor; must precede reading progress
        sink.ensure_topics({s.progress_topic: True})
        kafka_progress = read_kafka_progress(kafka_client_config(s), s.progress_topic, s.slot_name)
        if kafka_progress is not None:
            sink.expect_topic_ids(kafka_progress.topic_ids)
        # Progress before PostgreSQL: it decides which server of source_dsn may be used.
        server = open_server(self._dsn, kafka_progress, s.slot_name)
        ending.callback(server.close)
        sql, identity = server.sql, server.identity
        preflight(sql, s)
        origin = OriginStore(sql, s.origin_name)

        mark = high_water(origin.progress(), kafka_progress)
        builder = self._builder(sql, server.system.dbname, mark)
        sink.ensure_topics({builder.schema_topic: True, builder.transaction_topic: False})
        with self._racing_for_slot(sql):
            self._ensure_slot(sql, server.repl, sink, origin, server.system.dbname, kafka_progress)
        shaped = check_published(
            sql, s.publication_name, builder.catalog.masking, builder.catalog.routing
        )
        if shaped:
            # Which columns leave masked and where records go: names only, never a value.
            log_event(log, logging.INFO, "transforms, routes and keys", tables=shaped)
        warn_keyless_tables(sql, s.publication_name)
        book = self._book = self._snapshots(sql, kafka_progress, mark)

        parallel = s.streaming == "parallel"
        tracker = ConfirmTracker(0)
        queue = TxnQueue(_QUEUE_BYTES)
        control = PgOutputDecoder(4, parallel_abort=parallel)
        assembler = Assembler(
            control.decode,
            lambda name: Spool(spool_dir, name, s.spool_memory_bytes, self.spool_stats),
            on_prepared=tracker.prepared,
            on_rolled_back=tracker.finished,
            max_change_bytes=max_change_bytes(s.max_row_bytes),
            on_untied_message=self._untied_message,
        )
        ending.callback(assembler.discard_all)
        replay = PgOutputDecoder(4, parallel_abort=parallel)
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
            metrics=self.metrics,
            book=book,
            snapshot_added=s.snapshot_mode != "never"
            and not publishes_all_tables(sql, s.publication_name),
            published=lambda: {p.name for p in published_tables(sql, s.publication_name)},
            receiving=lambda: assembler.mid_transaction,
        )
        ending.callback(_stop_if_running, publisher)
        log_event(
            log,
            logging.INFO,
            "session starting",
            slot=s.slot_name,
            server=server.address,
            system=identity.system_identifier,
            timeline=identity.timeline,
            high_water=format_lsn(mark),
            compiled_hot_path=decoder.COMPILED and catalog.COMPILED,
            snapshots=[
                f"{e.schema_}.{e.table} ({e.id}, {e.chunks} chunks done)" for e in book.states()
            ],
        )
        return _Session(server, sink, book, tracker, queue, publisher, assembler)

    def _builder(
        self, sql: psycopg.Connection[tuple[object, ...]], dbname: str, mark: int
    ) -> EventBuilder:
        """The record format's builder, over a catalogue that knows the table versions
        Kafka already has."""
        s = self.settings
        catalog = RelationCatalog(
            s.topic_prefix,
            lambda oid: table_facts(sql, oid),
            self._known_versions(schema_topic(s.topic_prefix)),
            masking=self._masking,
            routing=s.routing(),
        )
        if s.value_format == "debezium":
            # Before anything was published there is no previous commit to name.
            return DebeziumEventBuilder(
                catalog,
                s.topic_prefix,
                dbname,
                s.max_row_bytes,
                mark or None,
                begin_records=s.transaction_begin_records,
            )
        return EventBuilder(
            catalog,
            s.topic_prefix,
            dbname,
            s.max_row_bytes,
            begin_records=s.transaction_begin_records,
        )

    def _stream(self, session: _Session) -> None:
        """Start the publisher and the slot, run the socket loop until stopped, then stop
        cleanly."""
        s = self.settings
        server, publisher = session.server, session.publisher
        publisher.start()
        options = {
            "proto_version": "4",
            "publication_names": f'"{s.publication_name}"',
            "streaming": s.streaming,
            "messages": "true",
        }
        if s.two_phase:
            options["two_phase"] = "on"
        with self._racing_for_slot(server.sql):
            server.repl.start(s.slot_name, 0, options)
        self._sessions_streamed += 1
        self._health.streaming, self._health.error = True, ""
        self.metrics.streaming.set(1)
        log_event(log, logging.INFO, "streaming", slot=s.slot_name, publication=s.publication_name)
        try:
            with connect(server.dsn, options=POLL_OPTIONS) as poll:
                poller = CatalogPoller(
                    poll, s.slot_name, s.publication_name, self.metrics, publisher, session.queue
                )
                poller.start()
                try:
                    self._loop(session, poller)
                finally:
                    poller.stop(_STOP_GRACE_S)
        except Exception as exc:
            # Undefined object while streaming our existing slot: the publication, which
            # pgoutput reads as of each change's WAL position, is gone there.
            if (
                isinstance(exc, StreamError)
                and exc.sqlstate == UndefinedObject.sqlstate
                and slot_state(server.sql, s.slot_name)
            ):
                raise publication_dropped(s) from None
            # A session that ends for a reason a new one could get past: first make sure no
            # successor took the slot over, or the new session would fence it in turn.
            if retryable(exc) and not isinstance(exc, FencedError):
                fenced = self._superseded(session)
                if fenced is not None:
                    raise fenced from None
            raise
        self._stop_cleanly(session)

    def _stop_cleanly(self, session: _Session) -> None:
        """Let the publisher commit what it holds, then confirm it (and, once an
        ``initial_only`` snapshot is published, drop the slot)."""
        s = self.settings
        publisher, repl = session.publisher, session.server.repl
        publisher.stop()
        publisher.join(_STOP_GRACE_S)
        if publisher.is_alive():
            log_event(
                log,
                logging.WARNING,
                "stopped before the publisher finished: its "
                "open batch is not committed and will be published at the next start",
                waited_s=2 * _STOP_GRACE_S,
            )
            return
        if publisher.error is not None:
            raise publisher.error
        confirmed = session.tracker.confirmable()
        repl.send_status(confirmed, confirmed)
        if s.snapshot_mode == "initial_only" and not session.book.tables():
            repl.close()  # the stream holds the slot: a drop on it would be refused
            drop_slot(session.server.dsn, s.slot_name)
            log_event(
                log,
                logging.INFO,
                "initial_only: snapshot published, slot dropped",
                slot=s.slot_name,
            )
            return
        log_event(
            log,
            logging.INFO,
            "stopped cleanly",
            confirmed=format_lsn(confirmed) if confirmed else "nothing this session",
        )

    def _end_streaming(self) -> None:
        """Stop the chunk readers; the session no longer streams."""
        self._book.close()
        for reader in self._readers:
            reader.stop()
        for reader in self._readers:
            reader.join(_STOP_GRACE_S)
        self._readers = []
        self._health.streaming = False
        self.metrics.streaming.set(0)

    def _untied_message(self, message: m.LogicalMessage) -> None:
        self.metrics.untied_messages.inc()
        log_event(
            log,
            logging.DEBUG,
            "non-transactional logical message not published",
            prefix=message.prefix,
            lsn=format_lsn(message.lsn),
        )

    def _ensure_slot(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        repl: ReplicationConnection,
        sink: KafkaSink,
        origin: OriginStore,
        dbname: str,
        kafka_progress: ProgressRecord | None,
    ) -> None:
        """Create the slot (and the publication, and first the origin that marks the slot
        as ours) if needed. No snapshot is exported: snapshots are read in chunks while the
        slot streams."""
        s = self.settings
        state = slot_state(sql, s.slot_name)
        if state is not None:
            # Before anything else: is it ours at all?
            check_slot(state, s, ours=kafka_progress is not None or origin.exists())
        if state is not None and state.active_pid is not None:
            self._take_over(sql, repl, sink, state.active_pid)
        ensure_publication(sql, s, slot_is_new=state is None)
        if state is None:
            # The origin first: a crash between the two leaves an origin without a slot
            # (harmless), never a slot of ours without its mark.
            origin.ensure()
            with self._known_wait(
                f"creating slot {s.slot_name}: waits until the source's "
                "transactions open now have ended"
            ):
                created = repl.create_slot(s.slot_name, two_phase=s.two_phase)
            log_event(
                log,
                logging.INFO,
                "created failover slot",
                slot=s.slot_name,
                consistent_point=format_lsn(created.consistent_point),
                db=dbname,
            )
            return
        if not state.failover:
            repl.command(f"ALTER_REPLICATION_SLOT {s.slot_name} (FAILOVER true)")
            log_event(log, logging.INFO, "enabled failover on existing slot", slot=s.slot_name)

    def _take_over(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        repl: ReplicationConnection,
        sink: KafkaSink,
        pid: int,
    ) -> None:
        """End the walsender of a predecessor this session's producer has fenced (see
        ``takeover``); SlotBusy to wait for it where that is not allowed."""
        holder = slot_holder(sql, pid)
        if holder is None:
            return  # gone since the slot was read: it is free
        if holder.application_name != repl.application_name():
            raise self._slot_busy(sql, f"{holder}, not a bridge")
        # Still the newest? Two bridges starting together each fence the other's earlier
        # registration; only the last one registered may end the other's walsender
        # (FencedError stops this one instead).
        sink.prove_not_fenced()
        try:
            ended = end_walsender(sql, holder, _TAKEOVER_WAIT_S)
        except psycopg.errors.InsufficientPrivilege:
            log_event(
                log,
                logging.WARNING,
                f"cannot end the walsender of the fenced predecessor, {holder}: role "
                f"{sql.info.user} may not signal it; waiting until the server ends it "
                "(wal_sender_timeout). GRANT pg_signal_backend to this role, or run every "
                "bridge of the slot as one role, to take over at once",
                slot=self.settings.slot_name,
            )
            raise self._slot_busy(sql, str(holder)) from None
        if not ended:
            raise self._slot_busy(sql, f"{holder}, still exiting")
        log_event(
            log,
            logging.INFO,
            f"ended the walsender of the predecessor, {holder}: this bridge registered the "
            "slot's Kafka transactional id, so the predecessor can publish and confirm nothing "
            "more",
            slot=self.settings.slot_name,
            pid=holder.pid,
        )

    def _superseded(self, session: _Session) -> FencedError | None:
        """After the stream broke: whether a successor fenced this bridge (it may have
        ended our walsender to take the slot over). Asked with this session's producer,
        the one a successor fenced: a new producer would fence the successor instead. While
        Kafka cannot answer, it keeps asking rather than start a session that could."""
        publisher = session.publisher
        publisher.stop()
        publisher.join(_STOP_GRACE_S)
        if isinstance(publisher.error, FencedError):
            return publisher.error
        if publisher.is_alive():
            return None  # its batch is stuck in Kafka; the session ends as before
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                session.sink.prove_not_fenced()
                return None
            except FencedError as exc:
                return exc
            except SinkError as exc:
                if not exc.retryable:
                    raise
                wait_s = backoff.session_ended(False)
                log_event(
                    log,
                    logging.WARNING,
                    "session ended and Kafka cannot say yet whether another bridge took over; "
                    "asking again before any new session",
                    error=one_line(exc),
                    retry_in_s=round(wait_s, 1),
                )
                self._stop.wait(wait_s)
        return None

    @contextmanager
    def _known_wait(self, what: str) -> Iterator[None]:
        log_event(log, logging.INFO, what)
        self._health.waiting, self._health.waiting_since = what, time.monotonic()
        try:
            yield
        finally:
            self._health.waiting = ""

    @contextmanager
    def _racing_for_slot(self, sql: psycopg.Connection[tuple[object, ...]]) -> Iterator[None]:
        """Replication commands that may lose a race for the slot to another bridge: that
        is SlotBusy, not a failure."""
        try:
            yield
        except StreamError as exc:
            if exc.sqlstate == ObjectInUse.sqlstate:
                state = slot_state(sql, self.settings.slot_name)
                holder = state.active_pid if state is not None else None
                raise self._slot_busy(
                    sql, f"process {holder}" if holder else "a process that has just let it go"
                ) from None
            if exc.sqlstate == DuplicateObject.sqlstate:  # both found no slot; the other made it
                raise self._slot_busy(sql, "another bridge that just created it") from None
            raise

    def _slot_busy(self, sql: psycopg.Connection[tuple[object, ...]], holder: str) -> SlotBusy:
        with sql.cursor() as cur:
            cur.execute("SELECT setting::int FROM pg_settings WHERE name = 'wal_sender_timeout'")
            row = cur.fetchone()
        timeout_ms = int(str(row[0])) if row else 0
        # 0 disables the timeout: a dead client's walsender then lingers until TCP notices.
        linger_s = timeout_ms / 1000 if timeout_ms > 0 else 60.0
        return SlotBusy(self.settings.slot_name, holder, linger_s + 2 * HEARTBEAT_S + 10)

    def _snapshots(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        kafka_progress: ProgressRecord | None,
        mark: int,
    ) -> SnapshotBook:
        """The snapshots to go on with (as far as Kafka says they got), or, on a slot that
        never published anything, the initial snapshot of every published table."""
        s = self.settings
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
            for key, value in read_topic(kafka_client_config(self.settings), schema_topic)
            if value is not None and not is_gap_key(key)
        )

    def _loop(self, session: _Session, poller: CatalogPoller) -> None:
        """The socket loop: receive, confirm, keep the other threads' work in view."""
        repl, tracker = session.server.repl, session.tracker
        position = StreamPosition()
        while not self._stop.is_set():
            now = time.monotonic()
            self._health.last_loop = now
            if self._housekeeping(session, poller):
                return  # the clean stop publishes the last chunk's batch, then drops the slot
            reply = self._receive(repl, session.assembler, session.queue, position)
            self._confirm(repl, session.assembler, tracker, position, reply, now)
            in_flight = position.in_flight(tracker.published_lsn)
            self.metrics.lag_bytes.set(
                max(0, position.received - tracker.published_lsn) if in_flight else 0
            )
            self.metrics.lag_seconds.set(
                _lag_seconds(session.publisher.last_commit_ts) if in_flight else 0
            )

    def _housekeeping(self, session: _Session, poller: CatalogPoller) -> bool:
        """Raise what ended another thread of the session, start the chunk readers when
        a snapshot is under way; True when an ``initial_only`` snapshot is done."""
        if session.publisher.error is not None:
            raise session.publisher.error
        for reader in self._readers:
            if reader.error is not None:
                raise reader.error
        if poller.error is not None:
            raise poller.error
        book = session.book
        if book.tables() and not self._readers:
            self._start_readers(session.server.dsn, book)
        return self.settings.snapshot_mode == "initial_only" and not book.tables()

    def _receive(
        self,
        repl: ReplicationConnection,
        assembler: Assembler,
        queue: TxnQueue,
        position: StreamPosition,
    ) -> bool:
        """Feed what the server sent to the assembler, sealed transactions to the
        publisher, until a keepalive, a pause or a full queue; True if the server asked
        for a reply."""
        if queue.full:
            self._stop.wait(0.05)  # back-pressure: the server waits, status goes on
            return False
        received = position.received  # kept here per message, on the object once
        try:
            for kind, a, b, payload in repl.messages(0.1):
                if kind == "w":
                    if b > received:
                        received = b
                    txn = assembler.feed(a, payload)  # type: ignore[arg-type]
                    if txn is not None:
                        queue.put(txn)
                        position.queued_end = txn.end_lsn
                        # Only a put fills the queue: asked per transaction, not per message.
                        if queue.full:
                            break
                else:
                    received = max(received, a)
                    position.idle_end = a
                    return bool(payload)
        finally:
            position.received = received
        return False

    def _confirm(
        self,
        repl: ReplicationConnection,
        assembler: Assembler,
        tracker: ConfirmTracker,
        position: StreamPosition,
        reply: bool,
        now: float,
    ) -> None:
        """Send a status update when one is due, confirming what ``feedback`` allows."""
        confirm = position.to_confirm(tracker.confirmable(), tracker.published_lsn, assembler.idle)
        if not position.status_due(confirm, reply, now, self.settings.status_interval_s):
            return
        confirm = max(confirm, position.sent)
        repl.send_status(position.received, confirm)
        if confirm > position.sent:
            failpoint("after_slot_confirm")
        position.sent, position.last_status = confirm, now
        self.metrics.confirmed_lsn.set(confirm)

    def _start_readers(self, dsn: str, book: SnapshotBook) -> None:
        """Chunk readers, one connection each; they work on different tables."""
        s = self.settings
        self._readers = [
            ChunkReader(
                f"chunk-reader-{n}",
                dsn,
                s.slot_name,
                s.publication_name,
                book,
                s.snapshot_chunk_rows,
                s.snapshot_chunk_bytes,
            )
            for n in range(s.snapshot_workers)
        ]
        for reader in self._readers:
            reader.start()


def _lag_seconds(commit_ts_us: int) -> float:
    if not commit_ts_us:
        return 0.0
    return max(0.0, time.time() - (commit_ts_us + PG_EPOCH_UNIX_US) / 1_000_000)
