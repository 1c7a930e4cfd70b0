"""An attention rank's link to its FFN rank: lost, then rejoined, never fatal.

::

    up ──(connector error in a step, EOF, SHUTDOWN, no heartbeat, or the
          session re-forms because another member left)──▶ down
    down: steps run without exchanging (the exchange fills zeros) and fail
          their requests (AFDFFNUnavailable); a thread waits for the step in
          flight, closes the connector and runs the rendezvous again
    down ──(a new connector started: handshake passed)──▶ up

With data parallelism (``aligned``) every attention rank must go live in the
same forward: vLLM steps its DP ranks together (one collective per forward),
and an FFN rank merges its peers' plans of each step, so a rank that went
live one forward before the others would wait for the FFN while the FFN
waits for plans the others cannot send before that rank reaches their next
collective. An aligned link therefore stages the new connector (published up,
so the API admits requests again) and activates it at the first forward
whose DP coordination says that every rank is ready: each rank votes in
vLLM's own per-forward all-reduce (``compat.dp_vote``), so all ranks read the
same result.

A rank that comes back with another model or topology is refused by the
handshake (AFDProtocolError naming the fields); the link logs it and keeps
waiting for a right one, every :data:`RETRY_S`. Each change is published for
the API server (``serving.ffn_status``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple
from typing import Generic, Protocol, TypeVar

from vllm.logger import init_logger

from vllm_afd.connector.payloads import ConnectorStats
from vllm_afd.connector.protocol import REJOIN
from vllm_afd.errors import AFDError, AFDProtocolError
from vllm_afd.serving.ffn_status import LinkState

logger = init_logger(__name__)

#: seconds between two rendezvous attempts after a failed one
RETRY_S = 1.0


class AttentionEndpoint(Protocol):
    """What the link needs of an attention connector."""

    @property
    def stats(self) -> ConnectorStats: ...

    def watch_peers(self, on_lost: Callable[[str], None]) -> None: ...

    def resume(self) -> None: ...

    def close(self, reason: str | None = None) -> None: ...


C = TypeVar("C", bound=AttentionEndpoint)


class FFNLink(Generic[C]):
    """The current connector (a ``C``) of one attention rank, replaced when lost.

    Args:
        connector: the started connector.
        reconnect: builds and starts a new one (blocks up to
            ``connect_timeout_s``; raises AFDError when it cannot).
        attention_rank, ffn_rank: whose link this is.
        publish: called with every new :class:`LinkState`.
        aligned: a rejoined connector goes live at the first forward every
            data-parallel rank voted ready for (:meth:`vote`,
            :meth:`decided`, :meth:`begin_step`), not at once.
    """

    def __init__(
        self,
        connector: C,
        reconnect: Callable[[], C],
        *,
        attention_rank: int,
        ffn_rank: int,
        publish: Callable[[LinkState], None] | None = None,
        aligned: bool = False,
    ) -> None:
        self._connector: C | None = connector
        self._aligned = aligned
        # aligned: a rejoined connector waiting for the ranks' vote
        self._staged: C | None = None
        self._all_ready = False  # the vote of the current forward
        self._reconnect = reconnect
        self._publish = publish
        self._lock = threading.Lock()  # state
        self._steps = threading.RLock()  # held while a step uses the connector
        self._closed = False
        self._thread: threading.Thread | None = None
        self._old = ConnectorStats(0, 0, 0, 0.0, 0)  # of closed connectors
        self.state = LinkState(attention_rank, ffn_rank, True, since=time.time())
        self._changed(self.state)
        connector.watch_peers(self.lost)

    @property
    def connector(self) -> C | None:
        """The connector to exchange through; None while the FFN is away
        (or, aligned, while a rejoined one waits for the other ranks)."""
        return self._connector if self.state.up else None

    @property
    def waiting_for_ranks(self) -> bool:
        """Aligned: rejoined, waiting for every data-parallel rank's vote."""
        return self._staged is not None

    def unavailable_because(self) -> str:
        """Why a forward runs without exchanging now."""
        if self.state.up:
            return (
                f"ffn rank {self.state.ffn_rank} rejoined; the data-parallel "
                "ranks exchange again from the first forward all of them are back"
            )
        return self.state.why

    def vote(self) -> bool:
        """This rank's vote in a forward's DP coordination: ready to exchange
        (up, or a rejoined connector staged)."""
        return self.state.up

    def decided(self, all_ready: bool) -> None:
        """The vote of the forward about to run: every rank was ready."""
        self._all_ready = all_ready

    def begin_step(self) -> None:
        """A forward begins (the worker's thread, after the forward's DP
        coordination): activate a staged connector if every rank voted
        ready, so that all ranks go live in this same forward."""
        all_ready, self._all_ready = self._all_ready, False
        staged = self._staged
        if staged is None or not all_ready:
            return
        with self._lock:
            if self._staged is not staged or self._closed:
                return
            self._staged = None
        try:
            staged.resume()
        except AFDError as e:
            with self._lock:
                self._connector = staged  # closed by the rejoin
            self.lost(f"the rejoined connector failed before its first step: {e}")
            return
        with self._lock:
            if self._closed or not self.state.up:
                staged.close()
                return
            self._connector = staged
        logger.info(
            "AFD attention rank %d: every data-parallel rank rejoined; exchanging "
            "with ffn rank %d again",
            self.state.attention_rank, self.state.ffn_rank,
        )  # fmt: skip

    @property
    def stats(self) -> ConnectorStats:
        """Counters of every connector this link has had, summed."""
        c = self._connector
        return _added(self._old, c.stats) if c is not None else self._old

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the connector for one step: a lost one is closed after it."""
        with self._steps:
            yield

    def lost(self, why: str, ffn_rank: int | None = None) -> None:
        """The FFN rank is gone (``why`` names it): go down, then rejoin.
        ``ffn_rank``: the rank lost, where this link's connector talks to
        several (``async``); the state names it from then on. Idempotent
        while down; nothing happens after :meth:`close`."""
        with self._lock:
            if self._closed or not self.state.up:
                return
            s = self.state
            rank = s.ffn_rank if ffn_rank is None else ffn_rank
            self.state = LinkState(
                s.attention_rank, rank, False, why, time.time(),
                s.losses + 1, s.rejoins,
            )  # fmt: skip
            s = self.state
            self._thread = threading.Thread(
                target=self._rejoin, name="afd-ffn-rejoin", daemon=True
            )
        logger.error(
            "AFD attention rank %d lost ffn rank %d: %s. Its requests fail and "
            "new ones are refused (HTTP 503) until the FFN rank rejoins",
            s.attention_rank, s.ffn_rank, why,
        )  # fmt: skip
        self._changed(self.state)
        self._thread.start()

    def _rejoin(self) -> None:
        # The step in flight ends first (its waits are bounded).
        with self._steps, self._lock:
            old, self._connector = self._connector or self._staged, None
            self._staged = None
        s = self.state
        if old is not None:
            self._old = _added(self._old, old.stats)
            # The reason tells an FFN rank that is still there (it was cut
            # off, or others left) to rendezvous again rather than stop.
            old.close(
                f"{REJOIN}attention rank {s.attention_rank} lost ffn rank "
                f"{s.ffn_rank}: {s.why}"
            )
        logger.info(
            "AFD attention rank %d: waiting for ffn rank %d to rejoin (rendezvous "
            "at the same address)",
            s.attention_rank, s.ffn_rank,
        )  # fmt: skip
        while not self._closed:
            try:
                connector = self._reconnect()
            except AFDProtocolError as e:
                logger.error(
                    "AFD attention rank %d: the FFN role came back but the "
                    "handshake refused it, still waiting for a matching one: %s",
                    s.attention_rank, e,
                )  # fmt: skip
            except AFDError as e:
                logger.warning(
                    "AFD attention rank %d: rendezvous with ffn rank %d failed, "
                    "retrying: %s",
                    s.attention_rank, s.ffn_rank, e,
                )  # fmt: skip
            else:
                if self._install(connector):
                    return
            time.sleep(RETRY_S)

    def _install(self, connector: C) -> bool:
        """Serve through ``connector``: at once, or, aligned, staged for
        :meth:`begin_step` (which resumes and activates it in the first
        forward every rank voted ready for) while the link reports up, so
        that the API admits requests again. False when closed meanwhile or
        when it failed before its first step (the caller retries)."""
        if not self._aligned:
            with self._steps:  # no step runs while the data plane starts anew
                try:
                    connector.resume()
                except AFDError as e:
                    logger.warning(
                        "AFD attention rank %d: the new connector failed before "
                        "its first step, rendezvous again: %s",
                        self.state.attention_rank, e,
                    )  # fmt: skip
                    connector.close()
                    return False
        with self._lock:
            if self._closed:
                connector.close()
                return False
            s = self.state
            if self._aligned:
                self._staged = connector
            else:
                self._connector = connector
            self.state = LinkState(
                s.attention_rank, s.ffn_rank, True, "", time.time(),
                s.losses, s.rejoins + 1,
            )  # fmt: skip
        logger.info(
            "AFD attention rank %d: ffn rank %d rejoined after %.1fs; %s",
            s.attention_rank, s.ffn_rank, time.time() - s.since,
            "exchanging from the first forward every data-parallel rank is back "
            "for" if self._aligned else "serving again",
        )  # fmt: skip
        self._changed(self.state)
        connector.watch_peers(self.lost)
        return True

    def _changed(self, state: LinkState) -> None:
        if self._publish is not None:
            try:
                self._publish(state)
            except OSError as e:  # the API side then sees the last state
                logger.warning("AFD: cannot publish the FFN link state: %s", e)

    def close(self) -> None:
        """Close the connector; a rejoin in progress gives up. Idempotent."""
        with self._lock:
            self._closed = True
            connector, self._connector = self._connector or self._staged, None
            self._staged = None
        if connector is not None:
            connector.close()


def _added(a: ConnectorStats, b: ConnectorStats) -> ConnectorStats:
    return ConnectorStats(*(x + y for x, y in zip(astuple(a), astuple(b), strict=True)))
