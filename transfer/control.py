"""The control channel between a prefill and a decode engine on different hosts: addresses, and JSON messages
over one TCP connection per decode engine (stdlib only, no JAX, as ``transfer.staging``).

The decode side dials the prefill side, as vLLM's NIXL connector does (its decode workers fetch the prefill
workers' agent metadata from their side channel); the page bytes themselves go over NIXL/UCX, never over
this channel. Why TCP with length-prefixed JSON rather than HTTP: one long-lived connection per decode
engine, whose end is the signal that this decode engine is gone (``ControlServer.on_disconnect``); JSON,
never pickle, because the peer is another host. docs/architecture.md, "P/D across hosts".

A message is a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an object). A request
carries ``op``; a reply is an object, or ``{"error": class name, "message": text}`` for a failure.
"""

from __future__ import annotations

import ipaddress
import json
import selectors
import socket
import struct
from typing import Any, Callable

from jaxmamba import errors
from jaxmamba.errors import ConfigError, TransferError

#: A message larger than this is refused (a peer speaking another protocol sends garbage lengths).
MAX_MESSAGE_BYTES = 256 << 20
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_HEADER = struct.Struct(">I")


# ============================================================================ addresses
def parse_address(text: str, *, what: str = "address", allow_port_zero: bool = False) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6 address]:port"``) -> ``(host, port)``; ``ConfigError`` naming ``what`` if malformed.

    ``port`` must be in [1, 65535], or [0, 65535] with ``allow_port_zero`` (a listen address: 0 picks a
    free port). The host is not resolved here.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} {text!r} must be HOST:PORT")
    text = text.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"{what} {text!r} must be [IPv6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{what} {text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{what} {text!r} must be HOST:PORT")
        if any(c.isspace() or c in "/@?#" for c in host):
            raise ConfigError(f"{what} {text!r}: {host!r} is not a host name")
        if ":" in host:
            raise ConfigError(f"{what} {text!r}: write an IPv6 host in brackets, [{host}]:{port_text}")
    lowest = 0 if allow_port_zero else 1
    if not port_text.isdigit() or not lowest <= int(port_text) <= 65535:
        raise ConfigError(f"{what} {text!r}: the port must be an integer in [{lowest}, 65535]")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_address(listen_host: str, port: int, advertise_host: str | None = None) -> str:
    """What a peer should dial: ``advertise_host`` (default: ``listen_host``) and the bound ``port``.

    A wildcard (``0.0.0.0``, ``::``) listens on every interface but names none, so it is refused as an
    advertised host (``ConfigError``): pass the address the peer reaches this host at.
    """
    host = listen_host if advertise_host is None else advertise_host
    if host.strip("[]") in _WILDCARD_HOSTS:
        raise ConfigError(f"cannot advertise {host!r} to a peer (it listens everywhere but names no host): "
                          f"pass the address the peer dials (--kv-advertise HOST)")
    return format_address(host.strip("[]"), port)


# ============================================================================ messages
def send_message(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> dict:
    """One message (blocking, under the socket's own timeout); ``TransferError`` for a malformed one."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise TransferError(f"a control message of {size} bytes (> {MAX_MESSAGE_BYTES}): not a jaxmamba peer?")
    try:
        message = json.loads(_recv_exactly(sock, size))
    except (UnicodeDecodeError, ValueError) as err:
        raise TransferError(f"malformed control message: {err}") from None
    if not isinstance(message, dict):
        raise TransferError(f"malformed control message: a JSON {type(message).__name__}, not an object")
    return message


# ============================================================================ client
class ControlClient:
    """The dialling side: one connection to ``address``; ``call(op, **fields)`` -> the reply object.

    Every failure is a ``TransferError`` naming the address: unreachable within ``connect_timeout_s``,
    no reply within ``timeout_s`` (per call, overridable), a closed connection. A failed call closes
    the connection (the stream may be mid-message); a failure the peer reports is re-raised as its
    ``jaxmamba.errors`` class and leaves the connection open.
    """

    def __init__(self, address: str, *, connect_timeout_s: float = 10.0, timeout_s: float = 600.0):
        self.host, self.port = parse_address(address, what="peer address")
        self.address, self.timeout_s = format_address(self.host, self.port), timeout_s
        try:
            self._sock: socket.socket | None = socket.create_connection((self.host, self.port),
                                                                        timeout=connect_timeout_s)
        except OSError as err:  # refused, unreachable, unknown host, timed out
            raise TransferError(f"cannot reach the peer at {self.address} within {connect_timeout_s:g} s: "
                                f"{err}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict:
        if self._sock is None:
            raise TransferError(f"the connection to the peer at {self.address} is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._sock.settimeout(timeout_s)
            send_message(self._sock, {"op": op, **fields})
            reply = recv_message(self._sock)
        except socket.timeout:
            self.close()
            raise TransferError(f"the peer at {self.address} did not answer {op!r} within {timeout_s:g} s") from None
        except (OSError, TransferError) as err:  # ConnectionError is an OSError
            self.close()
            raise TransferError(f"the connection to the peer at {self.address} failed during {op!r}: {err}") from None
        if "error" in reply:
            cls = getattr(errors, str(reply["error"]), None)
            cls = cls if isinstance(cls, type) and issubclass(cls, Exception) else TransferError
            raise cls(f"the peer at {self.address} failed {op!r}: {reply.get('message', '')}")
        return reply

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


# ============================================================================ server
class ControlServer:
    """The listening side, driven by its owner's loop: ``poll(timeout_s)`` accepts connections and answers
    every complete request with ``handler(connection id, message) -> reply``.

    ``listen``: ``"host:port"`` (port 0: a free one); ``advertise_host``: what peers dial (default the
    listen host; a wildcard listen host needs one). ``address`` is the advertised ``host:port``.
    ``on_disconnect(connection id)`` runs once a peer's connection ends. A handler's exception is sent
    back as ``{"error", "message"}``. Single-threaded: handlers run on the caller's thread, one at a
    time, so they may drive an engine; a request is read whole before its handler runs.
    """

    def __init__(self, listen: str, handler: Callable[[int, dict], dict], *, advertise_host: str | None = None,
                 on_disconnect: Callable[[int], None] | None = None):
        host, port = parse_address(listen, what="listen address", allow_port_zero=True)
        self.handler, self.on_disconnect = handler, on_disconnect
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as err:
            self._listener.close()
            raise ConfigError(f"cannot listen on {format_address(host, port)}: {err}") from None
        self._listener.listen(16)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        try:
            self.address = advertised_address(host, self.port, advertise_host)
        except ConfigError:
            self._listener.close()
            raise
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._connections: dict[int, socket.socket] = {}
        self._next_id = 0

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Accept and answer what has arrived within ``timeout_s``; returns the number of requests answered."""
        answered = 0
        for key, _ in self._selector.select(timeout_s):
            if key.data is None:
                self._accept()
            elif self._answer(key.data):
                answered += 1
        return answered

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn_id, self._next_id = self._next_id, self._next_id + 1
        self._connections[conn_id] = sock
        self._selector.register(sock, selectors.EVENT_READ, conn_id)

    def _answer(self, conn_id: int) -> bool:
        sock = self._connections[conn_id]
        sock.settimeout(30.0)  # the rest of a request whose first bytes arrived
        try:
            message = recv_message(sock)
        except (OSError, TransferError):  # closed, reset, or garbage: this peer is gone
            self.drop(conn_id)
            return False
        try:
            reply = self.handler(conn_id, message)
        except Exception as err:  # reported to the peer, which re-raises it by class name
            reply = {"error": type(err).__name__, "message": str(err)}
        try:
            send_message(sock, reply)
        except OSError:
            self.drop(conn_id)
        return True

    def drop(self, conn_id: int) -> None:
        """Close one connection (if still open) and report it to ``on_disconnect``."""
        sock = self._connections.pop(conn_id, None)
        if sock is None:
            return
        self._selector.unregister(sock)
        sock.close()
        if self.on_disconnect is not None:
            self.on_disconnect(conn_id)

    def close(self) -> None:
        for conn_id in list(self._connections):
            self.drop(conn_id)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()

