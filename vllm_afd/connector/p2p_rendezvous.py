"""Rendezvous and handshake of the p2p connector.

::

    leg 1 (everyone <-> ffn 0 at afd.host:afd.port)
      endpoint --HELLO(version, role, rank, fingerprint, listen)--> ffn 0
      ffn 0 waits for all A+F-1 endpoints, checks each HELLO, then
      ffn 0 --ACCEPT(session, ffn control addresses)--> every endpoint
      (or REJECT(reason, fields) to every endpoint, and raises itself)

    leg 2 (attention a <-> ffn k, only for k > 0)
      attention a --JOIN(rank, session)--> ffn k --ACCEPT--> attention a

Attention ranks served by ffn 0 keep their leg-1 connection as control
channel. Everyone retries its connects until the deadline, so roles may start
in either order.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
import uuid
from dataclasses import dataclass

from vllm_afd.connector import protocol
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
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

logger = logging.getLogger(__name__)


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


def _name(role: AFDRole | str, rank: int) -> str:
    return f"{AFDRole(role).value} rank {rank}"


def _reject_all(chans: list[Channel], reason: str, fields: list[str]) -> None:
    for ch in chans:
        with contextlib.suppress(AFDPeerError):
            ch.send(protocol.reject(reason, fields))
        ch.close()


def _check_hello(
    msg: dict, topo: Topology, fp: Fingerprint, seen: dict
) -> tuple[tuple[AFDRole, int], str | None, list[str]]:
    """(endpoint, reason to reject or None, differing fields)."""
    role, rank = msg.get("role"), msg.get("role_rank")
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


def serve(
    host: str, port: int, topo: Topology, fp: Fingerprint, connect_timeout_s: float
) -> Joined:
    """FFN rank 0: run leg 1 as the hub."""
    listener = listen(host, port)
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
                missing = sorted(expected - set(seen))
                names = ", ".join(_name(*k) for k in missing)
                reason = (
                    f"timed out after {connect_timeout_s}s waiting for {names} "
                    f"to connect to {host}:{port}"
                )
                _reject_all(list(seen.values()) + fresh, reason, [])
                raise AFDTimeoutError(reason)
            wait = min(remaining, progress.due() or remaining)
            ready, _, _ = select.select([listener, *fresh], [], [], wait)
            for r in ready:
                if r is listener:
                    sock, _addr = listener.accept()
                    fresh.append(Channel(sock, "a connecting endpoint"))
                    continue
                ch: Channel = r  # type: ignore[assignment]
                try:
                    ch.fill()
                except AFDProtocolError:
                    ch.eof = True  # not a vllm-afd peer: drop it
                if ch.inbox and ch.inbox[0].get("type") == MsgType.HELLO.value:
                    msg = ch.inbox.popleft()
                    fresh.remove(ch)
                    key, reason, fields = _check_hello(msg, topo, fp, seen)
                    if reason is not None:
                        _reject_all([ch, *seen.values(), *fresh], reason, fields)
                        raise AFDProtocolError(reason)
                    ch.peer = _name(*key)
                    seen[key] = ch
                    if key[0] is AFDRole.FFN:
                        lhost, lport = msg["listen"]
                        listens[key[1]] = (lhost or ch.sock.getpeername()[0], lport)
                elif ch.eof or ch.inbox:
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
    for ch in seen.values():
        if ch not in mine:
            ch.close()
    return Joined(session, _local_host(host), mine)


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
) -> Joined:
    """Every endpoint but ffn rank 0: legs 1 and 2."""
    deadline = time.monotonic() + connect_timeout_s
    sock = connect(host, port, deadline, connect_timeout_s, RENDEZVOUS_HINT)
    hub = Channel(sock, "ffn rank 0")
    local_host = hub.sock.getsockname()[0]
    own: socket.socket | None = None
    try:
        listen_addr = None
        if role is AFDRole.FFN:
            own = listen(local_host, 0)
            listen_addr = (local_host, own.getsockname()[1])
        hub.send(protocol.hello(role.value, rank, fp, listen_addr))
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
            hub.close()
            assert own is not None
            chans = _accept_joins(own, topo, rank, session, deadline, connect_timeout_s)
            return Joined(session, local_host, chans)
        k = topo.ffn_peer(rank)
        if k == 0:
            return Joined(session, local_host, [hub])
        hub.close()
        fhost, fport = accept["ffn_addrs"][k]
        hint = (
            f"It is the address ffn rank {k} announced: check that ffn rank {k} "
            "is running and reachable from this host on any port"
        )
        sock = connect(fhost, fport, deadline, connect_timeout_s, hint)
        ch = Channel(sock, f"ffn rank {k}")
        ch.send(protocol.join(rank, session))
        _await_reply(ch, deadline, connect_timeout_s, "the JOIN reply")
        return Joined(session, ch.sock.getsockname()[0], [ch])
    except BaseException:
        hub.close()
        raise
    finally:
        if own is not None:
            own.close()


def _accept_joins(
    own: socket.socket,
    topo: Topology,
    rank: int,
    session: str,
    deadline: float,
    timeout_s: float,
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
        sock, _ = own.accept()
        ch = Channel(sock, "a joining endpoint")
        try:
            msg = ch.recv(min(deadline, time.monotonic() + 10), "JOIN", timeout_s)
        except (AFDPeerError, AFDTimeoutError, AFDProtocolError):
            ch.close()
            continue
        a = msg.get("role_rank")
        if msg["type"] != MsgType.JOIN.value or msg.get("session") != session:
            ch.close()
            continue
        if a not in peers or a in got:
            reason = f"attention rank {a} may not join ffn rank {rank} (peers {peers})"
            _reject_all([ch, *got.values()], reason, [])
            raise AFDConnectorError(reason)
        ch.peer = _name(AFDRole.ATTENTION, a)
        ch.send(protocol.accept(session, []))
        got[a] = ch
    return [got[a] for a in peers]
