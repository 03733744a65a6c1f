"""A TCP relay on loopback whose traffic can be frozen: a network cut that leaves the
connections half-open, as a lost node does (no FIN, no RST: the server's side of the
connection stays open until a timeout of its own ends it)."""

from __future__ import annotations

import selectors
import socket
import threading


class FreezableRelay:
    """Relays 127.0.0.1:<port> to ``upstream``; ``freeze()`` stops moving bytes either way
    while every connection stays open."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> FreezableRelay:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        with selectors.DefaultSelector() as sel, a, b:  # one side ended: end the other
            sel.register(a, selectors.EVENT_READ)
            sel.register(b, selectors.EVENT_READ)
            while not self._closed.is_set():
                if self._frozen.is_set():  # read nothing more: the peers' writes pile up
                    self._closed.wait(0.2)
                    continue
                for key, _ in sel.select(0.2):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = source.recv(65536)
                        if not data:
                            return
                        peer[source].sendall(data)
                    except OSError:
                        return
