"""kube-proxy's job in userspace: each ClusterIP Service port is a listening socket on the Service's virtual
IP (on the host bridge), and every accepted connection is piped to one ready endpoint, round robin.

A connection with no ready endpoint is closed at once, as a Service without endpoints rejects it. Bytes are
copied as they come, so a streamed (SSE) reply streams through the proxy.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading

logger = logging.getLogger(__name__)


class _Listener:
    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.endpoints: list[tuple[str, int]] = []
        self._turn = itertools.count()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(128)
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name=f"svc-{address}:{port}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            endpoints = list(self.endpoints)
            if not endpoints:
                client.close()
                continue
            target = endpoints[next(self._turn) % len(endpoints)]
            threading.Thread(target=forward, args=(client, target, 5), daemon=True).start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def forward(client: socket.socket, target: tuple[str, int], connect_timeout_s: float) -> None:
    """Connect to `target` and copy bytes both ways until either side closes (kube-proxy's and
    port-forward's job); the client is closed if the target cannot be reached."""
    try:
        upstream = socket.create_connection(target, timeout=connect_timeout_s)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    request = threading.Thread(target=_pipe, args=(client, upstream), daemon=True)
    request.start()
    _pipe(upstream, client)
    request.join()
    client.close()
    upstream.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close the other way so that a request body's end reaches the server; then both close.
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            source.shutdown(socket.SHUT_RD)


class ServiceProxy:
    """Listeners keyed by (virtual IP, port); `set_endpoints` replaces where one forwards."""

    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], _Listener] = {}

    def set_endpoints(self, address: str, port: int, endpoints: list[tuple[str, int]]) -> None:
        listener = self._listeners.get((address, port))
        if listener is None:
            listener = self._listeners[(address, port)] = _Listener(address, port)
        listener.endpoints = sorted(endpoints)

    def remove(self, address: str, port: int) -> None:
        listener = self._listeners.pop((address, port), None)
        if listener is not None:
            listener.close()

    def close(self) -> None:
        for key in list(self._listeners):
            self.remove(*key)
