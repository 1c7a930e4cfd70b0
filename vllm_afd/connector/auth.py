"""The shared secret of the p2p rendezvous: challenge and response.

Every listener of the rendezvous (ffn rank 0's, and each ffn rank k's for
the second leg) greets a new connection with WELCOME carrying a fresh nonce;
the endpoint answers with HELLO or JOIN carrying
``HMAC-SHA256(secret, nonce | role | rank)``. The secret itself never
travels. It authenticates who joins; it does not encrypt: control messages
and activations cross the network in the clear, so keep the roles on a
private network.

The secret comes from the ``AFD_SECRET`` environment variable or from the
file named by ``connector_extra_config.secret_file`` (one of them; a file
keeps it off command lines, which every user of a host can read).

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from pathlib import Path

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError

#: how to set the secret, for messages
HOW = f"{envs.AFD_SECRET} or afd.connector_extra_config.secret_file"


def check_secret_file(path: str) -> str | None:
    """Why ``path`` cannot hold the secret, or None when it can ("" is no file)."""
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not data.strip():
        return "is empty"
    return None


def load_secret(secret_file: str) -> bytes | None:
    """The rendezvous secret of this process, or None when none is set.

    Raises:
        AFDConfigError: both sources are set, or the file is unusable.
    """
    env = envs.secret()
    if secret_file and env:
        raise AFDConfigError(
            f"both {envs.AFD_SECRET} and afd.connector_extra_config.secret_file "
            "are set; set one of them"
        )
    if secret_file:
        why = check_secret_file(secret_file)
        if why is not None:
            raise AFDConfigError(
                f"afd.connector_extra_config.secret_file={secret_file!r} {why}"
            )
        return Path(secret_file).read_bytes().strip()
    return env.encode() if env else None


def new_nonce() -> str:
    return secrets.token_hex(16)


def tag(secret: bytes, nonce: str, role: str, rank: int) -> str:
    """The response to ``nonce`` of endpoint ``role`` rank ``rank``."""
    msg = f"{nonce}|{role}|{rank}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def verify(secret: bytes, nonce: str, role: str, rank: int, got: object) -> bool:
    """Whether ``got`` is the right response (constant-time comparison)."""
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(tag(secret, nonce, role, rank), got)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (names count only as
    ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
