"""A TCP relay in front of a redis-server that counts round trips (tests only).

Per connection, a flight is the client's bytes from its first command after a reply (or after
connecting) up to the next reply: one round trip, a pipeline included. Each flight's commands
(RESP arrays of bulk strings) are parsed, so a test can tell what the round trip was for.
Threads, one per connection; `stop()` closes every socket (the context manager always does)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from tests.helpers import free_port


def parse_commands(buf: bytearray) -> list[list[bytes]]:
    """Take the complete commands (argv) off the front of `buf`; an incomplete one stays."""
    out: list[list[bytes]] = []
    while buf:
        if buf[:1] != b"*":  # an inline command (PING\r\n)
            end = buf.find(b"\r\n")
            if end < 0:
                break
            out.append(bytes(buf[:end]).split())
            del buf[: end + 2]
            continue
        pos, argv = 0, []
        end = buf.find(b"\r\n", pos)
        if end < 0:
            break
        count, pos = int(buf[1:end]), end + 2
        for _ in range(count):
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            size = int(buf[pos + 1 : end])
            if len(buf) < end + 2 + size + 2:
                break
            argv.append(bytes(buf[end + 2 : end + 2 + size]))
            pos = end + 2 + size + 2
        if len(argv) < count:
            break
        out.append(argv)
        del buf[:pos]
    return out


class RedisRelay:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.flights: list[list[list[bytes]]] = []  # each: the commands (argv) of one round trip
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisRelay:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._spawn(self._accept)
        return self

    def snapshot(self) -> int:
        with self._lock:
            return len(self.flights)

    def since(self, mark: int) -> list[list[list[bytes]]]:
        with self._lock:
            return [list(f) for f in self.flights[mark:]]

    def stop(self) -> None:
        self._stopped.set()
        for s in [self._listener, *self._sockets]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        for t in self._threads:
            t.join(timeout=5)

    def _spawn(self, fn, *args) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            self._spawn(self._pipe, client, upstream)

    def _pipe(self, client: socket.socket, upstream: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ)
        sel.register(upstream, selectors.EVENT_READ)
        buf, flight, replied = bytearray(), None, True
        try:
            while not self._stopped.is_set():
                for key, _ in sel.select(timeout=0.5):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    if key.fileobj is client:
                        if replied and not buf:  # a new command after a reply: a new round trip
                            flight, replied = [], False
                            with self._lock:
                                self.flights.append(flight)
                        buf += data
                        commands = parse_commands(buf)
                        with self._lock:
                            flight.extend(commands)
                        upstream.sendall(data)
                    else:
                        replied = True
                        client.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()


@contextlib.contextmanager
def redis_relay(upstream_port: int):
    relay = RedisRelay(upstream_port)
    try:
        yield relay.start()
    finally:
        relay.stop()
