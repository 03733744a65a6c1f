"""A fault proxy in front of one Kafka broker: network cuts, and KAFKA-15591 on demand.

Test and chaos tooling, never imported by the product. It forwards bytes both ways and
understands just enough of the Kafka protocol to:

- keep clients on the proxy: the broker's address in Metadata and FindCoordinator
  answers is rewritten to the proxy's own, so every connection a client opens after
  bootstrapping comes back here;
- reproduce KAFKA-15591 deterministically (``fail_first_produce``): the first produce
  request that carries a partition gets, for that partition, the answer a broker gives
  while it is still applying the partition's creation, NOT_LEADER_OR_FOLLOWER, and its
  records are not written; the answer is held back ``hold_s`` so that a producer with
  more requests in flight sends its later batches first. A broker with no producer state
  for a partition accepts any first sequence, so those later batches are stored and the
  first one, retried, is acknowledged as a duplicate: lost without an error;
- answer an abort with an error the broker did not give (``refuse_aborts``): the broker
  aborts the transaction, the producer hears the given code (INVALID_TXN_STATE, which
  librdkafka takes as fatal, as a coordinator that lost track of the transaction answers);
- play a transaction coordinator whose metadata does not have a topic yet
  (``coordinator_lag``: a topic, and for how long after the first request naming it): in
  AddPartitionsToTxn requests the topic's name is masked (the same length, a topic that
  does not exist), so the broker answers as such a coordinator does,
  UNKNOWN_TOPIC_OR_PARTITION for it and OPERATION_NOT_ATTEMPTED for every other partition
  of the request, adding none; in the answer the name comes back, and the topics answered
  OPERATION_NOT_ATTEMPTED come first (the broker's order is that of a hash map).

To keep the parsing small and fixed-offset, the proxy lowers the versions the broker
advertises in its ApiVersions answer for Produce, Metadata and FindCoordinator to the
newest non-flexible ones (8, 8, 2), EndTxn to 2 when aborts are refused and
AddPartitionsToTxn to 2 when the coordinator lags. librdkafka
then speaks those, as it does with older brokers. The sabotaged partition's index is moved
out of range in the request (the broker refuses it as unknown and writes nothing) and moved
back in the answer.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PRODUCE, METADATA, FIND_COORDINATOR, API_VERSIONS = 0, 3, 10, 18
ADD_PARTITIONS_TO_TXN, END_TXN = 24, 26
_CAPS = {PRODUCE: 8, METADATA: 8, FIND_COORDINATOR: 2, ADD_PARTITIONS_TO_TXN: 2, END_TXN: 2}
NOT_LEADER_OR_FOLLOWER = 6
INVALID_TXN_STATE = 48
OPERATION_NOT_ATTEMPTED = 55
_OUT_OF_RANGE = 0x40000000  # or-ed into a sabotaged partition index


class _Reader:
    """A cursor over one frame; every read returns the value and where it started."""

    def __init__(self, buf: bytearray | bytes, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def fixed(self, fmt: str) -> tuple[int, int]:
        at = self.pos
        (value,) = struct.unpack_from(fmt, self.buf, at)
        self.pos += struct.calcsize(fmt)
        return int(value), at

    def int16(self) -> int:
        return self.fixed(">h")[0]

    def int32(self) -> int:
        return self.fixed(">i")[0]

    def string(self) -> str | None:
        size = self.int16()
        if size < 0:
            return None
        text = bytes(self.buf[self.pos : self.pos + size]).decode()
        self.pos += size
        return text

    def blob(self) -> None:
        size = self.int32()
        self.pos += max(size, 0)

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.buf[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


@dataclass
class _Pending:
    api_key: int
    version: int
    sabotaged: list[tuple[str, int]] = field(default_factory=list)
    refused_abort: bool = False
    masked: str | None = None  # the topic whose name this AddPartitionsToTxn request hid


@dataclass
class ProxyStats:
    connections: int = 0
    cuts: int = 0
    sabotaged: list[tuple[str, int]] = field(default_factory=list)
    refused_aborts: int = 0
    masked_requests: int = 0  # AddPartitionsToTxn requests answered as the lagging coordinator
    masked_with_others: int = 0  # of those, requests naming other topics too


class KafkaFaultProxy:
    """Listens on 127.0.0.1 (a free port unless given) and forwards to ``upstream``."""

    def __init__(
        self,
        upstream: str,
        *,
        port: int = 0,
        fail_first_produce: bool = False,
        hold_s: float = 0.5,
        sabotage: Callable[[str], bool] = lambda _t: True,
        latency_s: float = 0.0,
        refuse_aborts: int = 0,
        coordinator_lag: tuple[str, float] | None = None,
    ) -> None:
        host, _, up_port = upstream.rpartition(":")
        self._upstream = (host, int(up_port))
        self.fail_first_produce = fail_first_produce
        self.hold_s = hold_s
        self.latency_s = latency_s
        self.refuse_aborts = refuse_aborts  # an error code; 0: aborts answered as they are
        self.coordinator_lag = coordinator_lag
        self._lag_ends: float | None = None  # monotonic; set by the first request naming it
        self._caps = {
            k: v
            for k, v in _CAPS.items()
            if (k != END_TXN or refuse_aborts) and (k != ADD_PARTITIONS_TO_TXN or coordinator_lag)
        }
        self._sabotage = sabotage
        self._listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()
        self._sockets: set[socket.socket] = set()
        self._blocked = False
        self._closed = False
        self.stats = ProxyStats()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> KafkaFaultProxy:
        threading.Thread(target=self._accept, name="kafka-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()

    def cut(self) -> None:
        """Drop every open connection, as a network partition would."""
        with self._lock:
            doomed, self._sockets = self._sockets, set()
            self.stats.cuts += 1
        for sock in doomed:
            _close(sock)

    def block(self, blocked: bool = True) -> None:
        """While blocked, connections are cut and new ones refused at once."""
        self._blocked = blocked
        if blocked:
            self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            if self._blocked:
                _close(client)
                continue
            try:
                broker = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            broker.settimeout(None)
            for sock in (client, broker):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending: dict[int, _Pending] = {}
            with self._lock:
                self._sockets |= {client, broker}
                self.stats.connections += 1
            threading.Thread(
                target=self._pump, args=(client, broker, pending, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(broker, client, pending, False), daemon=True
            ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pending: dict[int, _Pending], requests: bool
    ) -> None:
        try:
            while True:
                frame = _read_frame(src)
                if frame is None:
                    break
                hold = self._request(frame, pending) if requests else self._response(frame, pending)
                if hold:
                    time.sleep(hold)
                if self.latency_s:
                    time.sleep(self.latency_s)
                dst.sendall(struct.pack(">i", len(frame)) + frame)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    # -- requests (client -> broker) --------------------------------------------------

    def _request(self, frame: bytearray, pending: dict[int, _Pending]) -> float:
        api_key, version, corr = struct.unpack_from(">hhi", frame, 0)
        entry = pending[corr] = _Pending(api_key, version)
        if api_key == PRODUCE and self.fail_first_produce:
            if version > _CAPS[PRODUCE]:
                raise AssertionError(f"Produce v{version} was not capped")
            reader = _Reader(frame, 8)
            reader.string()  # client id
            self._sabotage_produce(reader, entry)
        elif api_key == END_TXN and self.refuse_aborts:
            if version > _CAPS[END_TXN]:
                raise AssertionError(f"EndTxn v{version} was not capped")
            reader = _Reader(frame, 8)
            reader.string()  # client id
            reader.string()  # transactional id
            reader.fixed(">q")  # producer id
            reader.int16()  # producer epoch
            entry.refused_abort = reader.fixed(">b")[0] == 0  # committed: false
        elif api_key == ADD_PARTITIONS_TO_TXN and self.coordinator_lag:
            if version > _CAPS[ADD_PARTITIONS_TO_TXN]:
                raise AssertionError(f"AddPartitionsToTxn v{version} was not capped")
            self._mask_lagging_topic(frame, entry)
        return 0.0

    def _mask_lagging_topic(self, frame: bytearray, entry: _Pending) -> None:
        assert self.coordinator_lag is not None
        lagging, lag_s = self.coordinator_lag
        r = _Reader(frame, 8)
        r.string()  # client id
        r.string()  # transactional id
        r.fixed(">q")  # producer id
        r.int16()  # producer epoch
        names: list[tuple[str, int]] = []  # each topic's name and where its size starts
        for _ in range(r.int32()):
            at = r.pos
            names.append((r.string() or "", at))
            for _ in range(r.int32()):
                r.int32()
        where = next((at for name, at in names if name == lagging), None)
        if where is None:
            return
        now = time.monotonic()
        with self._lock:
            if self._lag_ends is None:
                self._lag_ends = now + lag_s
            if now >= self._lag_ends:
                return
            self.stats.masked_requests += 1
            self.stats.masked_with_others += len(names) > 1
        frame[where + 2 : where + 2 + len(lagging.encode())] = _masked(lagging)
        entry.masked = lagging

    def _sabotage_produce(self, r: _Reader, entry: _Pending) -> None:
        r.string()  # transactional id
        r.int16()  # acks
        r.int32()  # timeout
        for _ in range(r.int32()):
            topic = r.string() or ""
            for _ in range(r.int32()):
                index, at = r.fixed(">i")
                r.blob()
                with self._lock:
                    first = (topic, index) not in self._seen and self._sabotage(topic)
                    self._seen.add((topic, index))
                    if first:
                        self.stats.sabotaged.append((topic, index))
                if first:
                    struct.pack_into(">i", r.buf, at, index | _OUT_OF_RANGE)
                    entry.sabotaged.append((topic, index))

    # -- responses (broker -> client) -------------------------------------------------

    def _response(self, frame: bytearray, pending: dict[int, _Pending]) -> float:
        (corr,) = struct.unpack_from(">i", frame, 0)
        entry = pending.pop(corr, None)
        if entry is None:
            return 0.0
        if entry.api_key == API_VERSIONS:
            _cap_versions(frame, entry.version, self._caps)
        elif entry.api_key == METADATA:
            self._rewrite_brokers(frame, entry.version)
        elif entry.api_key == FIND_COORDINATOR:
            self._rewrite_coordinator(frame, entry.version)
        elif entry.api_key == PRODUCE and entry.sabotaged:
            _fail_partitions(frame, entry)
            return self.hold_s
        elif entry.api_key == END_TXN and entry.refused_abort:
            struct.pack_into(">h", frame, 8, self.refuse_aborts)  # after corr id, throttle
            with self._lock:
                self.stats.refused_aborts += 1
        elif entry.api_key == ADD_PARTITIONS_TO_TXN and entry.masked is not None:
            _unmask_not_attempted_first(frame, entry.masked)
        return 0.0

    def _rewrite_brokers(self, frame: bytearray, version: int) -> None:
        if version > _CAPS[METADATA]:
            raise AssertionError(f"Metadata v{version} was not capped")
        r = _Reader(frame, 4)
        if version >= 3:
            r.int32()  # throttle
        for _ in range(r.int32()):
            r.int32()  # node id
            r.string()  # host
            _port, at = r.fixed(">i")
            struct.pack_into(">i", frame, at, self.port)
            if version >= 1:
                r.string()  # rack

    def _rewrite_coordinator(self, frame: bytearray, version: int) -> None:
        if version > _CAPS[FIND_COORDINATOR]:
            raise AssertionError(f"FindCoordinator v{version} was not capped")
        r = _Reader(frame, 4)
        if version >= 1:
            r.int32()  # throttle
        error = r.int16()
        if version >= 1:
            r.string()  # error message
        r.int32()  # node id
        r.string()  # host
        _port, at = r.fixed(">i")
        if error == 0:
            struct.pack_into(">i", frame, at, self.port)


def _cap_versions(frame: bytearray, version: int, caps: dict[int, int]) -> None:
    r = _Reader(frame, 4)
    if r.int16() != 0:
        return  # an error answer (e.g. unsupported ApiVersions version): nothing to cap
    count = r.uvarint() - 1 if version >= 3 else r.int32()
    for _ in range(count):
        key = r.int16()
        low = r.int16()
        high, at = r.fixed(">h")
        cap = caps.get(key)
        if cap is not None:
            if low > cap:
                raise AssertionError(
                    f"the broker needs api {key} >= v{low}; the proxy parses up to v{cap}"
                )
            struct.pack_into(">h", frame, at, min(high, cap))
        if version >= 3:
            r.tags()


def _masked(topic: str) -> bytes:
    """A name of the same length as ``topic``'s that no topic has (the proxy's own)."""
    return b"_" * len(topic.encode())


def _unmask_not_attempted_first(frame: bytearray, topic: str) -> None:
    """An AddPartitionsToTxn v0-v2 answer: ``topic``'s name back in place of its mask,
    and the topics whose partitions were all OPERATION_NOT_ATTEMPTED moved first."""
    r = _Reader(frame, 8)  # after correlation id and throttle
    count = r.int32()
    body = r.pos
    blocks: list[tuple[bool, bytes]] = []  # (all not attempted, the topic's bytes)
    for _ in range(count):
        start = r.pos
        if r.string() == _masked(topic).decode():
            frame[start + 2 : r.pos] = topic.encode()
        errors = []
        for _ in range(r.int32()):
            r.int32()  # partition
            errors.append(r.int16())
        skipped = all(e == OPERATION_NOT_ATTEMPTED for e in errors)
        blocks.append((skipped, bytes(frame[start : r.pos])))
    ordered = [b for skipped, b in blocks if skipped] + [b for skipped, b in blocks if not skipped]
    frame[body : r.pos] = b"".join(ordered)


def _fail_partitions(frame: bytearray, entry: _Pending) -> None:
    """Answer the sabotaged partitions with NOT_LEADER_OR_FOLLOWER, at their real index."""
    r = _Reader(frame, 4)
    wanted = {(t, i | _OUT_OF_RANGE): i for t, i in entry.sabotaged}
    for _ in range(r.int32()):
        topic = r.string() or ""
        for _ in range(r.int32()):
            index, at = r.fixed(">i")
            real = wanted.get((topic, index))
            if real is not None:
                struct.pack_into(">ih", frame, at, real, NOT_LEADER_OR_FOLLOWER)
            r.pos = at + 4 + 2 + 8 + 8  # index, error, base offset, log append time
            if entry.version >= 5:
                r.pos += 8  # log start offset
            if entry.version >= 8:
                for _ in range(r.int32()):
                    r.int32()
                    r.string()
                r.string()  # error message


def _read_frame(sock: socket.socket) -> bytearray | None:
    head = _read_exact(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    return _read_exact(sock, size)


def _read_exact(sock: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buf


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
