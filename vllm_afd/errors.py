"""Error taxonomy for vllm-afd.

Every error the plugin raises on purpose is an :class:`AFDError`. Messages name
the field or peer, the value, and the fix::

    AFDError
    ├── AFDConfigError (also ValueError)   bad additional_config["afd"]
    ├── AFDCompatError                      vLLM version / worker / runner mismatch
    └── AFDConnectorError                   transport failures
        ├── AFDProtocolError                handshake or message mismatch
        ├── AFDTimeoutError                 a blocking wait ran out (also TimeoutError)
        ├── AFDPeerError                    the peer closed, died or shut down
        │   └── AFDPeerStopped              … shut down for good mid-step (a stop)
        └── AFDFFNUnavailable               an attention step ran without its FFN rank

This module imports nothing from vLLM or torch.
"""

from __future__ import annotations

#: what the FFN role answers to anything that asks it to serve a request
FFN_SERVES_NO_REQUESTS = (
    "this is the AFD FFN role: it serves no requests. Send them to the "
    "attention role's API server"
)


class AFDError(RuntimeError):
    """Base class of every error raised by vllm-afd on purpose."""


class AFDConfigError(AFDError, ValueError):
    """``additional_config["afd"]`` is invalid or contradicts the vLLM config."""


class AFDCompatError(AFDError):
    """The installed vLLM, the chosen worker or model runner cannot run AFD."""


class AFDConnectorError(AFDError):
    """A connector operation failed."""


class AFDProtocolError(AFDConnectorError):
    """The peers disagree: protocol version, fingerprint, or message identity."""


class AFDTimeoutError(AFDConnectorError, TimeoutError):
    """A blocking connector wait exceeded its timeout."""


class AFDPeerError(AFDConnectorError):
    """The peer closed the connection, died, or sent SHUTDOWN."""


class AFDPeerStopped(AFDPeerError):
    """A peer shut down for good (SHUTDOWN whose reason is no rejoin) while
    this endpoint exchanged with it inside a step: a stop, not a crash. The
    FFN loop ends on it as on a SHUTDOWN between steps; the attention side
    handles it as any :class:`AFDPeerError` (its FFN rank is gone)."""


#: how every AFDFFNUnavailable message begins (it survives the string an
#: executor makes of a worker's exception)
FFN_UNAVAILABLE = "AFD: the FFN role is unavailable"


class AFDFFNUnavailable(AFDConnectorError):
    """An attention step could not exchange with its FFN rank (gone, hung, or
    not rejoined yet): the step's requests fail, the engine keeps running."""

    def __init__(self, why: str) -> None:
        super().__init__(f"{FFN_UNAVAILABLE}: {why}")
        self.why = why
