"""A TCP proxy in front of one member's peer port, to cut it off from the others.

Every other member reaches the member through the proxy (its advertised peer URL is
the proxy's), so `cut()` drops every connection and refuses new ones: nothing
reaches the member (no appends, no votes, no answers to its own requests) until
`heal()`. Threads and plain sockets; loopback only.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class PeerProxy:
    """Forwards 127.0.0.1:`listen_port` to 127.0.0.1:`target_port`."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", listen_port))
        self._server.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> PeerProxy:
        self._thread.start()
        return self

    def cut(self) -> None:
        """Drop every connection through the proxy and refuse new ones."""
        self._cut.set()
        self._close_all()

    def heal(self) -> None:
        self._cut.clear()

    def stop(self) -> None:
        self._closed.set()
        self._close_all()
        self._thread.join(timeout=5)
        self._server.close()

    def _close_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                # no Nagle: a small raft message would wait out the peer's delayed
                # ACK (about 40 ms) behind the previous one
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
