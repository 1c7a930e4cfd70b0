"""TCP plumbing of the p2p control plane: listen, connect with retry, frames.

Messages are the framed JSON records of ``protocol``; no tensors travel here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import time
from collections import deque
from typing import Any

from vllm_afd.connector import protocol
from vllm_afd.errors import (
    AFDConnectorError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)

_RETRY_S = 0.2
#: seconds a control message may wait for room in the socket's send buffer
SEND_S = 10.0
#: how often a rendezvous wait logs who it is still waiting for
PROGRESS_S = 10.0

logger = logging.getLogger(__name__)


class Progress:
    """Logs ``what`` at INFO every :data:`PROGRESS_S` while a wait lasts."""

    def __init__(self, timeout_s: float) -> None:
        self.start = self.last = time.monotonic()
        self.timeout_s = timeout_s

    def due(self) -> float:
        """Seconds until the next line is due (for a bounded wait)."""
        return max(self.last + PROGRESS_S - time.monotonic(), 0.0)

    def tick(self, what: str) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_S:
            self.last = now
            logger.info(
                "AFD rendezvous: %s (%.0fs of connect_timeout_s=%.0f)",
                what,
                now - self.start,
                self.timeout_s,
            )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port).

    Raises:
        AFDConnectorError: the address is in use or not local; names the fix.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise AFDConnectorError(
                f"cannot listen on {host}:{port}: address already in use. Another "
                "vllm-afd deployment or program holds it; stop it or choose a free "
                "afd.port (the p2p connector uses afd.port and afd.port+1)"
            ) from None
        raise AFDConnectorError(
            f"cannot listen on {host}:{port}: {e.strerror or e}. afd.host must be "
            "an address of the machine that runs ffn rank 0"
        ) from None
    return sock


#: what to check when ffn rank 0's rendezvous cannot be reached
RENDEZVOUS_HINT = (
    "Check afd.host and afd.port, and that ffn rank 0 is running (raise "
    "connect_timeout_s if it starts slowly)"
)


def connect(
    host: str, port: int, deadline: float, timeout_s: float, hint: str
) -> socket.socket:
    """Connect to ``host:port``, retrying until ``deadline`` (monotonic).

    Raises:
        AFDTimeoutError: nobody accepted before the deadline; ``hint`` says
            what to check.
    """
    last: OSError | None = None
    progress = Progress(timeout_s)
    while True:
        progress.tick(f"still trying to reach {host}:{port} (last error: {last})")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AFDTimeoutError(
                f"could not reach {host}:{port} within {timeout_s}s (last error: "
                f"{last}). {hint}"
            )
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as e:
            last = e
            time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
            continue
        sock.settimeout(None)
        return sock


class Channel:
    """One control connection: framed JSON messages, an inbox, EOF tracking."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock, self.peer = sock, peer
        self.inbox: deque[dict[str, Any]] = deque()
        #: the peer closed its side and everything it sent has been read
        self.eof = False
        #: a send failed (the peer closed or reset the connection); what the
        #: peer sent before is still read until ``eof``: a SHUTDOWN queued
        #: there must not pass for a crash
        self.broken = False
        #: the nonce this side sent in its WELCOME (listeners only)
        self.nonce = ""
        #: the first bytes the peer sent, for "does not speak the protocol"
        self.head = b""
        self._buf = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def writable(self) -> bool:
        """Neither closed by the peer nor broken by a failed send."""
        return not (self.eof or self.broken)

    def send(self, msg: dict[str, Any]) -> None:
        """Send one message, waiting until the kernel took all of it (at most
        :data:`SEND_S`). The socket stays non-blocking: another thread may
        be reading it (``fill``) at the same time.

        Raises:
            AFDPeerError: the connection is gone, or the peer has not read
                what was sent before for :data:`SEND_S` seconds.
        """
        data = memoryview(protocol.encode(msg))
        deadline = time.monotonic() + SEND_S
        try:
            while data:
                try:
                    data = data[self.sock.send(data) :]
                except (BlockingIOError, InterruptedError):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AFDPeerError(
                            f"{self.peer} has read nothing for {SEND_S:.0f}s "
                            "(hung or stopped)"
                        ) from None
                    select.select([], [self.sock], [], remaining)
        except OSError as e:
            self.broken = True
            raise AFDPeerError(f"{self.peer} is unreachable ({e})") from None

    def fill(self) -> None:
        """Read whatever is available now, never blocking; decode frames."""
        while not self.eof:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                return
            if len(self.head) < 48:
                self.head += chunk[: 48 - len(self.head)]
            self._buf += chunk
            self.inbox.extend(protocol.decode_frames(self._buf))

    def recv(self, deadline: float, waiting_for: str, timeout_s: float) -> dict:
        """The next message, waiting at most until ``deadline`` (monotonic).

        Raises:
            AFDPeerError: the connection closed first.
            AFDTimeoutError: nothing arrived in time.
        """
        while True:
            self.fill()
            if self.inbox:
                return self.inbox.popleft()
            if self.eof:
                raise AFDPeerError(
                    f"{self.peer} closed the connection while waiting for {waiting_for}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AFDTimeoutError(
                    f"timed out after {timeout_s}s waiting for {waiting_for} from "
                    f"{self.peer}"
                )
            select.select([self.sock], [], [], remaining)

    def detach(self) -> tuple[socket.socket, bytes]:
        """Hand the connection to another framing (the async connector's
        frames after the rendezvous): the socket and the bytes read past the
        last JSON frame.

        Raises:
            AFDProtocolError: a JSON message is still unread.
        """
        if self.inbox:
            raise AFDProtocolError(
                f"{self.peer} sent {self.inbox[0].get('type')} where a work "
                "item belongs"
            )
        pending, self._buf = bytes(self._buf), bytearray()
        return self.sock, pending

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
