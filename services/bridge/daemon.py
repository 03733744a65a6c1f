"""The bridge daemon: one session per connection, restarted with backoff until stopped.

A session: fence older producers, read Kafka's progress record, pick the server of
source_dsn that may continue it (``server.open_server``), preflight it, make sure
publication, slot and origin exist, compute the high-water mark, then run the socket loop
(this thread) next to the publisher thread. ``session.SessionSetup`` prepares a session and
``slot.SlotClaim`` gets it its slot; this module runs the sessions one after another. Any
error ends the session; the next one starts again from what PostgreSQL and Kafka durably
hold, so a restart can neither lose nor duplicate.

Errors that a retry cannot fix (bad settings, wrong server, a gap: each error class says
so in its ``retryable``) end the daemon with one line and a non-zero exit, plus the
traceback when the error is a bug (``logs.log_failure``); so does any error before the
first session streamed, because at start-up a failure is far more often a typo than an
outage.

Of two bridges on one slot, the one that started last wins (``slot.SlotBusy``).

The wait between sessions doubles while sessions keep failing and starts over once one
streamed: each outage is waited out on its own terms, whatever happened before it.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import FrameType

from psycopg.errors import UndefinedObject

from services.bridge.assemble.reader import TransactionReader
from services.bridge.assemble.spool import SpoolStats
from services.bridge.metrics import BridgeMetrics, SnapshotCollector
from services.bridge.poller import POLL_OPTIONS, CatalogPoller
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.publish.publisher import TxnQueue
from services.bridge.receive.feedback import StreamPosition
from services.bridge.receive.stream import ReplicationConnection, StreamError, drop_slot
from services.bridge.session import STOP_GRACE_S, Session, SessionSetup
from services.bridge.settings import BridgeSettings
from services.bridge.sink.errors import FencedError, ProducerStranded, SinkError
from services.bridge.sink.kafka import KafkaSink
from services.bridge.slot import SlotBusy, SlotClaim
from services.bridge.snapshot.reader import ChunkReader, SnapshotBook
from services.bridge.source import publication_dropped, slot_state
from services.common.errors import retryable
from services.common.failpoints import failpoint
from services.common.httpserver import HealthServer, HttpServerError
from services.common.logs import log_event, log_failure, one_line
from services.common.lsn import PG_EPOCH_UNIX_US, format_lsn
from services.common.pg import SourceError, SourceRefused, connect, with_password

log = logging.getLogger(__name__)

# Spooled bytes of the transactions one read hands to the publisher at most: the queue's
# bound (session._QUEUE_BYTES) is checked between reads, so it is overrun by less than this.
_READ_BYTES = 4 * 1024 * 1024


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
        self._slot = SlotClaim(settings, self._known_wait, self._fenced)
        self._setup: SessionSetup | None = None

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
            password = self.settings.source_password
            self._setup = SessionSetup(
                self.settings,
                with_password(
                    self.settings.source_dsn, password.get_secret_value() if password else None
                ),
                self.metrics,
                self.spool_stats,
                self.settings.masking(),  # a missing key: one line, at once
                self._slot,
            )
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
            assert self._setup is not None  # made by run() before the first session
            session = self._setup.prepare(ending)
            self._book = session.book
            ending.callback(self._end_streaming)
            self._stream(session)

    def _stream(self, session: Session) -> None:
        """Start the publisher and the slot, run the socket loop until stopped, then stop
        cleanly."""
        s = self.settings
        server, publisher = session.server, session.publisher
        options = {
            "proto_version": "4",
            "publication_names": f'"{s.publication_name}"',
            "streaming": s.streaming,
            "messages": "true",
        }
        if s.two_phase:
            options["two_phase"] = "on"
        with self._slot.racing(server.sql, session.sink):
            server.repl.start(s.slot_name, 0, options)
        # After START_REPLICATION: until then ``racing`` may ask Kafka with the sink.
        publisher.start()
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
                    poller.stop(STOP_GRACE_S)
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

    def _stop_cleanly(self, session: Session) -> None:
        """Let the publisher commit what it holds, then confirm it (and, once an
        ``initial_only`` snapshot is published, drop the slot)."""
        s = self.settings
        publisher, repl = session.publisher, session.server.repl
        publisher.stop()
        publisher.join(STOP_GRACE_S)
        if publisher.is_alive():
            log_event(
                log,
                logging.WARNING,
                "stopped before the publisher finished: its "
                "open batch is not committed and will be published at the next start",
                waited_s=2 * STOP_GRACE_S,
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
            reader.join(STOP_GRACE_S)
        self._readers = []
        self._health.streaming = False
        self.metrics.streaming.set(0)

    def _superseded(self, session: Session) -> FencedError | None:
        """After the stream broke: whether a successor fenced this bridge (it may have
        ended our walsender to take the slot over), once the publisher has stopped."""
        publisher = session.publisher
        publisher.stop()
        publisher.join(STOP_GRACE_S)
        if isinstance(publisher.error, FencedError):
            return publisher.error
        if publisher.is_alive():
            return None  # its batch is stuck in Kafka; the session ends as before
        return self._fenced(session.sink)

    def _fenced(self, sink: KafkaSink) -> FencedError | None:
        """Whether a successor fenced this bridge, asked with this session's producer: the
        one a successor fenced, where a new producer would fence the successor in turn.
        While Kafka cannot answer, it keeps asking rather than end the session, whose
        successor would start with a new producer; a known wait, so the bridge stays
        live meanwhile (a restart would register a new producer just the same). None once
        the bridge is told to stop."""
        backoff = Backoff()
        with ExitStack() as waiting:
            while not self._stop.is_set():
                try:
                    sink.prove_not_fenced()
                    return None
                except FencedError as exc:
                    return exc
                except ProducerStranded as exc:
                    # This producer can never ask. Should a successor have fenced it, the
                    # new session's producer fences the successor in turn, which stops at
                    # its next transaction: one bridge goes on, exactly once either way.
                    log_event(
                        log,
                        logging.WARNING,
                        "cannot ask Kafka whether another bridge took the slot over: this "
                        "session's producer knows no broker; the next session's producer "
                        "registers the transactional id again",
                        error=one_line(exc),
                    )
                    return None
                except SinkError as exc:
                    if not exc.retryable:
                        raise
                    if not backoff.failures:
                        waiting.enter_context(
                            self._known_wait(
                                "asking Kafka whether another bridge took the slot over, "
                                "before any new session"
                            )
                        )
                    wait_s = backoff.session_ended(False)
                    log_event(
                        log,
                        logging.WARNING,
                        "Kafka cannot say yet whether another bridge took the slot over; "
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

    def _loop(self, session: Session, poller: CatalogPoller) -> None:
        """The socket loop: receive, confirm, keep the other threads' work in view."""
        repl, tracker = session.server.repl, session.tracker
        position = StreamPosition()
        while not self._stop.is_set():
            now = time.monotonic()
            self._health.last_loop = now
            if self._housekeeping(session, poller):
                return  # the clean stop publishes the last chunk's batch, then drops the slot
            reply = self._receive(session.reader, session.queue, position)
            self._confirm(repl, session.reader, tracker, position, reply, now)
            in_flight = position.in_flight(tracker.published_lsn)
            self.metrics.lag_bytes.set(
                max(0, position.received - tracker.published_lsn) if in_flight else 0
            )
            self.metrics.lag_seconds.set(
                _lag_seconds(session.publisher.last_commit_ts) if in_flight else 0
            )

    def _housekeeping(self, session: Session, poller: CatalogPoller) -> bool:
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
        self, reader: TransactionReader, queue: TxnQueue, position: StreamPosition
    ) -> bool:
        """Hand what the server sent, sealed into transactions, to the publisher, until a
        keepalive, a pause or a full queue; True if the server asked for a reply."""
        if queue.full:
            self._stop.wait(0.05)  # back-pressure: the server waits, status goes on
            return False
        got = reader.read(0.1, _READ_BYTES)
        if got.transactions:
            queue.put_all(got.transactions)
            position.queued_end = got.transactions[-1].end_lsn
        if got.wal_end > position.received:
            position.received = got.wal_end
        if got.keepalive is None:
            return False
        position.idle_end, reply = got.keepalive
        return reply

    def _confirm(
        self,
        repl: ReplicationConnection,
        reader: TransactionReader,
        tracker: ConfirmTracker,
        position: StreamPosition,
        reply: bool,
        now: float,
    ) -> None:
        """Send a status update when one is due, confirming what ``feedback`` allows."""
        confirm = position.to_confirm(tracker.confirmable(), tracker.published_lsn, reader.idle)
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
