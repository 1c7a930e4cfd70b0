"""Rendezvous and handshake of the p2p connector.

::

    leg 1 (everyone <-> ffn 0 at afd.host:afd.port)
      ffn 0 --WELCOME(magic, version, nonce)--> endpoint, on connect
      endpoint --HELLO(version, role, rank, fingerprint, listen, auth)--> ffn 0
      ffn 0 waits for all A+F-1 endpoints, checks each HELLO, then
      ffn 0 --ACCEPT(session, ffn control addresses)--> every endpoint
      (or REJECT(reason, fields) to every endpoint, and raises itself)

    leg 2 (attention a <-> ffn k, only for k > 0)
      ffn k --WELCOME--> attention a --JOIN(rank, session, auth)--> ffn k
      ffn k --ACCEPT--> attention a
      (the ffn k of a's block; every k > 0 in an all-to-all topology, the
      ``async`` connector's)

    data-plane setup (every control channel: attention a <-> its ffn rank)
      attention a --SETUP(offer)--> ffn k --SETUP(answer) | REJECT--> a

Attention ranks served by ffn 0 keep their leg-1 connection as control
channel; every other endpoint keeps its leg-1 connection as the session's
membership: ffn 0 watches them all, and whoever leaves (SHUTDOWN or EOF)
ends the session for everyone, who then rendezvous again (``p2p_control``).
Everyone retries its connects until the deadline, so roles may start in
either order.

An endpoint that gets no WELCOME within :data:`GREETING_S`, or bytes that
are not the protocol, fails at once: what listens there is not vllm-afd. A
listener drops a connection that speaks something else, and refuses (only)
an endpoint whose ``auth`` does not answer its nonce with the shared secret
(``connector.auth``), logging both; neither stops the rendezvous.

(Over 500 lines on purpose: both legs, the hub and the joiners, are one
protocol whose every message is answered a few functions away.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import select
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vllm_afd.connector import auth, protocol
from vllm_afd.connector.control import SetupFn
from vllm_afd.connector.p2p_wire import (
    RENDEZVOUS_HINT,
    Channel,
    Progress,
    connect,
    listen,
)
from vllm_afd.connector.protocol import PROTOCOL_VERSION, Fingerprint, MsgType
from vllm_afd.errors import (
    AFDConnectorError,
    AFDError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

logger = logging.getLogger(__name__)

#: seconds an endpoint waits for a listener's WELCOME once connected
GREETING_S = 10.0

#: what to check when afd.host:afd.port is not ffn rank 0's rendezvous
NOT_RENDEZVOUS_HINT = (
    "afd.host:afd.port must be ffn rank 0's rendezvous, not an API server or "
    "another program: check afd.port, and that ffn rank 0 runs the same "
    "vllm-afd version"
)


@dataclass
class Joined:
    """Outcome of the handshake for one endpoint.

    Attributes:
        session: id of this rendezvous, chosen by ffn 0.
        local_host: this endpoint's address as its peers reach it.
        channels: control channels to the peers, in peer order.
    """

    session: str
    local_host: str
    channels: list[Channel]
    #: leg-1 connections kept for the session's membership: on ffn rank 0
    #: those of every endpoint it does not serve, elsewhere the one to ffn
    #: rank 0 (when it is not the control channel)
    members: list[Channel] = dataclasses.field(default_factory=list)


def _name(role: AFDRole | str, rank: int) -> str:
    return f"{AFDRole(role).value} rank {rank}"


def _reject_all(chans: list[Channel], reason: str, fields: list[str]) -> None:
    for ch in chans:
        with contextlib.suppress(AFDPeerError):
            ch.send(protocol.reject(reason, fields))
        ch.close()


def _check_hello(
    msg: dict[str, Any], topo: Topology, fp: Fingerprint, seen: dict
) -> tuple[tuple[AFDRole, int], str | None, list[str]]:
    """(endpoint, reason to reject or None, differing fields)."""
    # unchecked wire values: AFDRole() and int() below refuse bad ones
    role: Any = msg.get("role")
    rank: Any = msg.get("role_rank")
    if msg.get("version") != PROTOCOL_VERSION:
        who = f"{role} rank {rank}"
        return (
            (AFDRole.FFN, 0),
            (
                f"{who} speaks connector protocol version {msg.get('version')}, ffn "
                f"rank 0 speaks {PROTOCOL_VERSION}; install the same vllm-afd version "
                "on both roles"
            ),
            ["protocol_version"],
        )
    try:
        key = (AFDRole(role), int(rank))
        topo.global_rank(*key)
    except (ValueError, TypeError):
        return (
            (AFDRole.FFN, 0),
            (f"{role} rank {rank} does not exist in topology {topo.name}"),
            [],
        )
    if key in seen or key == (AFDRole.FFN, 0):
        return key, f"{_name(*key)} joined twice; check the ranks of each process", []
    try:
        theirs = Fingerprint.from_wire(msg["fingerprint"])
    except (AFDProtocolError, KeyError, TypeError) as e:
        # Another vllm-afd version with the same protocol version: reject it
        # like a mismatch, so every endpoint learns why.
        return key, f"{_name(*key)} sent an unreadable fingerprint ({e})", []
    fields = fp.diff(theirs)
    if fields:
        detail = fp.describe_diff(theirs, "ffn rank 0", _name(*key))
        return (
            key,
            (
                f"fingerprint mismatch between ffn rank 0 and {_name(*key)}: "
                f"{', '.join(fields)} differ ({detail})"
            ),
            fields,
        )
    return key, None, []


def _auth_failure(msg: dict, nonce: str, secret: bytes | None) -> str | None:
    """Why the HELLO/JOIN ``msg`` does not authenticate, or None."""
    role, rank, got = (
        msg.get("role", "attention"),
        msg.get("role_rank"),
        msg.get("auth"),
    )
    who = f"{role} rank {rank}"
    if secret is None:
        if got:
            return (
                f"{who} has a shared secret but this listener has none: set the "
                f"same secret ({auth.HOW}) on every role, or on none"
            )
        return None
    if msg.get("version") != PROTOCOL_VERSION:
        return (
            f"{who} speaks connector protocol version {msg.get('version')}, this "
            f"listener {PROTOCOL_VERSION}; install the same vllm-afd version on "
            "every role"
        )
    if not got:
        return (
            f"{who} has no shared secret, but this listener requires one ({auth.HOW})"
        )
    if not isinstance(rank, int) or not auth.verify(secret, nonce, role, rank, got):
        return (
            f"{who} answered with another shared secret than this listener's: set "
            f"the same secret ({auth.HOW}) on every role"
        )
    return None


def _welcome(ch: Channel, secret: bytes | None) -> bool:
    """Greet a new connection; False when it is already gone."""
    ch.nonce = auth.new_nonce()
    try:
        ch.send(protocol.welcome(ch.nonce, secret is not None))
    except AFDPeerError:
        ch.close()
        return False
    return True


def _drop(ch: Channel, why: str) -> None:
    logger.warning("AFD rendezvous: dropped %s: %s", ch.peer, why)
    ch.close()


def _refuse(ch: Channel, reason: str) -> None:
    logger.warning("AFD rendezvous: refused %s: %s", ch.peer, reason)
    with contextlib.suppress(AFDPeerError):
        ch.send(protocol.reject(reason, ["secret"]))
    ch.close()


def _greeting(ch: Channel, host: str, port: int, deadline: float) -> dict:
    """The WELCOME of the listener at ``host:port``.

    Raises:
        AFDProtocolError: it sent none within :data:`GREETING_S`, or bytes
            that are not the protocol: it is not a vllm-afd listener.
    """
    where = f"{host}:{port}"
    wait = min(deadline, time.monotonic() + GREETING_S)
    try:
        msg = ch.recv(wait, "WELCOME", GREETING_S)
    except AFDProtocolError:
        raise AFDProtocolError(
            f"{where} does not speak the vllm-afd protocol (it sent "
            f"{ch.head!r}). {NOT_RENDEZVOUS_HINT}"
        ) from None
    except AFDTimeoutError:
        raise AFDProtocolError(
            f"{where} accepted the connection but sent no vllm-afd greeting within "
            f"{GREETING_S:.0f}s: it is not a vllm-afd rendezvous of protocol "
            f"{PROTOCOL_VERSION}. {NOT_RENDEZVOUS_HINT}"
        ) from None
    except AFDPeerError:
        raise AFDProtocolError(
            f"{where} closed the connection without a vllm-afd greeting "
            f"(it sent {ch.head!r}). {NOT_RENDEZVOUS_HINT}"
        ) from None
    if msg.get("type") != MsgType.WELCOME.value or msg.get("magic") != protocol.MAGIC:
        raise AFDProtocolError(
            f"{where} sent {msg.get('type')} before any WELCOME: it is not a "
            f"vllm-afd listener. {NOT_RENDEZVOUS_HINT}"
        )
    return msg


def _answer(
    welcome: dict, secret: bytes | None, role: AFDRole, rank: int
) -> str | None:
    if secret is None:
        return None
    return auth.tag(secret, str(welcome.get("nonce", "")), role.value, rank)


def serve(
    host: str,
    port: int,
    topo: Topology,
    fp: Fingerprint,
    connect_timeout_s: float,
    secret: bytes | None = None,
) -> Joined:
    """FFN rank 0: run leg 1 as the hub."""
    listener = listen(host, port)
    logger.info(
        "AFD rendezvous: ffn rank 0 listening on %s:%d for %d endpoints "
        "(connect_timeout_s=%.0f, shared secret: %s)",
        host, port, topo.world_size - 1, connect_timeout_s,
        "yes" if secret is not None else "no",
    )  # fmt: skip
    deadline = time.monotonic() + connect_timeout_s
    expected = {topo.role_of(g) for g in range(1, topo.world_size)}
    seen: dict[tuple[AFDRole, int], Channel] = {}
    listens: dict[int, tuple[str, int]] = {}
    fresh: list[Channel] = []
    progress = Progress(connect_timeout_s)
    try:
        while set(seen) != expected:
            missing = ", ".join(_name(*k) for k in sorted(expected - set(seen)))
            progress.tick(f"listening on {host}:{port}, waiting for {missing}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(_name(*k) for k in sorted(expected - set(seen)))
                timed_out = (
                    f"timed out after {connect_timeout_s}s waiting for {names} "
                    f"to connect to {host}:{port}"
                )
                _reject_all(list(seen.values()) + fresh, timed_out, [])
                raise AFDTimeoutError(timed_out)
            wait = min(remaining, progress.due() or remaining)
            watched: list[socket.socket | Channel] = [listener, *fresh]
            ready, _, _ = select.select(watched, [], [], wait)
            for r in ready:
                if not isinstance(r, Channel):  # the listener
                    sock, addr = listener.accept()
                    new = Channel(sock, f"the connection from {addr[0]}:{addr[1]}")
                    if _welcome(new, secret):
                        fresh.append(new)
                    continue
                ch = r
                try:
                    ch.fill()
                except AFDProtocolError:
                    fresh.remove(ch)
                    _drop(ch, f"it does not speak the vllm-afd protocol ({ch.head!r})")
                    continue
                if ch.inbox and ch.inbox[0].get("type") == MsgType.HELLO.value:
                    msg = ch.inbox.popleft()
                    fresh.remove(ch)
                    why = _auth_failure(msg, ch.nonce, secret)
                    if why is not None:
                        _refuse(ch, why)
                        continue
                    key, reason, fields = _check_hello(msg, topo, fp, seen)
                    if reason is not None:
                        _reject_all([ch, *seen.values(), *fresh], reason, fields)
                        raise AFDProtocolError(reason)
                    ch.peer = _name(*key)
                    seen[key] = ch
                    if key[0] is AFDRole.FFN:
                        lhost, lport = msg["listen"]
                        listens[key[1]] = (lhost or ch.sock.getpeername()[0], lport)
                elif ch.inbox:
                    fresh.remove(ch)
                    kind = ch.inbox[0].get("type")
                    _drop(ch, f"it sent {kind} where a HELLO belongs")
                elif ch.eof:
                    fresh.remove(ch)
                    ch.close()
        session = uuid.uuid4().hex[:12]
        addrs = [(host, port)] + [listens[k] for k in range(1, topo.num_ffn_ranks)]
        for ch in seen.values():
            ch.send(protocol.accept(session, addrs))
    finally:
        listener.close()
        for ch in fresh:
            ch.close()
    mine = [seen[(AFDRole.ATTENTION, a)] for a in topo.attention_peers(0)]
    members = [ch for ch in seen.values() if ch not in mine]
    return Joined(session, _local_host(host), mine, members)


def _local_host(host: str) -> str:
    return "" if host in ("", "0.0.0.0") else host


def _await_reply(ch: Channel, deadline: float, timeout_s: float, what: str) -> dict:
    msg = ch.recv(deadline, what, timeout_s)
    if msg["type"] == MsgType.REJECT.value:
        raise AFDProtocolError(str(msg.get("reason")))
    if msg["type"] != MsgType.ACCEPT.value:
        raise AFDProtocolError(f"expected ACCEPT from {ch.peer}, got {msg['type']}")
    return msg


def join(
    host: str,
    port: int,
    topo: Topology,
    role: AFDRole,
    rank: int,
    fp: Fingerprint,
    connect_timeout_s: float,
    secret: bytes | None = None,
) -> Joined:
    """Every endpoint but ffn rank 0: legs 1 and 2."""
    deadline = time.monotonic() + connect_timeout_s
    sock = connect(host, port, deadline, connect_timeout_s, RENDEZVOUS_HINT)
    hub = Channel(sock, "ffn rank 0")
    local_host = hub.sock.getsockname()[0]
    own: socket.socket | None = None
    try:
        welcome = _greeting(hub, host, port, deadline)
        listen_addr = None
        if role is AFDRole.FFN:
            own = listen(local_host, 0)
            listen_addr = (local_host, own.getsockname()[1])
        answer = _answer(welcome, secret, role, rank)
        hub.send(protocol.hello(role.value, rank, fp, listen_addr, answer))
        logger.info(
            "AFD rendezvous: %s connected to ffn rank 0 at %s:%d; waiting for "
            "ACCEPT (sent once all %d endpoints have joined)",
            _name(role, rank),
            host,
            port,
            topo.world_size,
        )
        what = "the handshake reply (ACCEPT)"
        accept = _await_reply(hub, deadline, connect_timeout_s, what)
        session = accept["session"]
        if role is AFDRole.FFN:
            assert own is not None
            chans = _accept_joins(
                own, topo, rank, session, deadline, connect_timeout_s, secret
            )
            return Joined(session, local_host, chans, [hub])
        ks = topo.ffn_peers(rank)
        to_ffn: list[Channel] = []
        try:
            for k in ks:
                if k == 0:
                    to_ffn.append(hub)
                    continue
                addr = accept["ffn_addrs"][k]
                to_ffn.append(
                    _join_ffn(
                        k, addr, rank, session, deadline, connect_timeout_s, secret
                    )
                )
        except BaseException:
            for ch in to_ffn:
                if ch is not hub:
                    ch.close()
            raise
        if 0 in ks:
            return Joined(session, local_host, to_ffn)
        return Joined(session, to_ffn[0].sock.getsockname()[0], to_ffn, [hub])
    except BaseException:
        hub.close()
        raise
    finally:
        if own is not None:
            own.close()


def _join_ffn(
    k: int,
    addr: list,
    rank: int,
    session: str,
    deadline: float,
    connect_timeout_s: float,
    secret: bytes | None,
) -> Channel:
    """Attention rank ``rank``: leg 2 to FFN rank ``k > 0`` at ``addr``."""
    fhost, fport = addr
    hint = (
        f"It is the address ffn rank {k} announced: check that ffn rank {k} "
        "is running and reachable from this host on any port"
    )
    sock = connect(fhost, fport, deadline, connect_timeout_s, hint)
    ch = Channel(sock, f"ffn rank {k}")
    try:
        welcome = _greeting(ch, fhost, fport, deadline)
        role = AFDRole.ATTENTION
        ch.send(protocol.join(rank, session, _answer(welcome, secret, role, rank)))
        _await_reply(ch, deadline, connect_timeout_s, "the JOIN reply")
    except BaseException:
        ch.close()
        raise
    return ch


def _accept_joins(
    own: socket.socket,
    topo: Topology,
    rank: int,
    session: str,
    deadline: float,
    timeout_s: float,
    secret: bytes | None = None,
) -> list[Channel]:
    """FFN rank k > 0: leg 2, one JOIN per attention peer."""
    peers = list(topo.attention_peers(rank))
    got: dict[int, Channel] = {}
    while len(got) < len(peers):
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([own], [], [], max(remaining, 0))
        if not ready:
            missing = [a for a in peers if a not in got]
            _reject_all(list(got.values()), f"ffn rank {rank} timed out", [])
            raise AFDTimeoutError(
                f"timed out after {timeout_s}s waiting for attention ranks "
                f"{missing} to join ffn rank {rank}"
            )
        sock, addr = own.accept()
        ch = Channel(sock, f"the connection from {addr[0]}:{addr[1]}")
        if not _welcome(ch, secret):
            continue
        try:
            msg = ch.recv(min(deadline, time.monotonic() + 10), "JOIN", timeout_s)
        except AFDProtocolError:
            _drop(ch, f"it does not speak the vllm-afd protocol ({ch.head!r})")
            continue
        except (AFDPeerError, AFDTimeoutError):
            ch.close()
            continue
        a = msg.get("role_rank")
        if msg["type"] != MsgType.JOIN.value or msg.get("session") != session:
            _drop(ch, f"it sent {msg['type']} without this rendezvous' session")
            continue
        why = _auth_failure(msg, ch.nonce, secret)
        if why is not None:
            _refuse(ch, why)
            continue
        if a not in peers or a in got:
            reason = f"attention rank {a} may not join ffn rank {rank} (peers {peers})"
            _reject_all([ch, *got.values()], reason, [])
            raise AFDConnectorError(reason)
        ch.peer = _name(AFDRole.ATTENTION, a)
        ch.send(protocol.accept(session, []))
        got[a] = ch
    return [got[a] for a in peers]


def swap_setup(
    chans: list[Channel],
    role: AFDRole,
    setup: SetupFn,
    deadline: float,
    timeout_s: float,
) -> tuple[dict, ...]:
    """After ACCEPT/JOIN: the data plane's SETUP records over every channel
    (the attention side offers, the FFN side answers each offer or REJECTs
    every peer with why); the peers' records in channel order."""
    what = "the data-plane setup (SETUP)"
    if role is AFDRole.ATTENTION:
        (ch,) = chans
        ch.send(protocol.setup(setup(0, None)))
        msg = ch.recv(deadline, what, timeout_s)
        if msg["type"] == MsgType.REJECT.value:
            raise AFDProtocolError(str(msg.get("reason")))
        if msg["type"] != MsgType.SETUP.value:
            raise AFDProtocolError(f"expected SETUP from {ch.peer}, got {msg['type']}")
        return (msg.get("blob") or {},)
    offers = []
    for i, ch in enumerate(chans):
        msg = ch.recv(deadline, what, timeout_s)
        try:
            if msg["type"] != MsgType.SETUP.value:
                raise AFDProtocolError(
                    f"expected SETUP from {ch.peer}, got {msg['type']}"
                )
            offer = msg.get("blob") or {}
            answer = setup(i, offer)
        except AFDError as e:
            _reject_all(chans, str(e), [])
            raise
        ch.send(protocol.setup(answer))
        offers.append(offer)
    return tuple(offers)
