"""Environment variables read by vllm-afd: debug switches only.

Configuration goes through ``additional_config["afd"]``; these variables
are set by vllm-afd itself between its processes, carry the one secret that
must not appear on a command line, or change diagnostics.

``AFD_SERVER_PID``
    Set by the plugin in the process that builds the vLLM config of an AFD
    run (the API server); inherited by its engine and worker processes. The
    FFN role signals it to stop the server when its attention peers shut down.
``AFD_LAUNCHER_PID``
    Set by ``vllm-afd launch`` in each role's environment: the role's server
    stops (with its engine and worker processes) when that launcher is gone,
    SIGKILL included (``vllm_afd.lifeline``).
``AFD_SECRET``
    The shared secret that authenticates the connector's rendezvous (HELLO
    and JOIN); the same on every role. See docs/connector.md.
``AFD_STOP_NOTE``
    Set by ``vllm-afd launch`` in each FFN role's environment: a file where
    the FFN role writes why, when it stops its server because its attention
    peers shut down for good (the deployment was stopped), or, beginning
    with ``peer died:``, because one of them died. The launcher then stops
    its node instead of restarting the rank (without an error after a stop,
    with one after a death).
``AFD_KEEP_FFN_ALIVE``
    ``1`` keeps an FFN server running after its attention peers shut down
    (default: it stops itself).
``AFD_SERVER_STARTS``
    A file where every ``vllm-afd serve`` process appends one line when it
    starts (its role and model), for counting what a run started; the test
    suite prints the count at the end.
``AFD_PROFILE_DIR``
    Directory for per-role ``torch.profiler`` traces (see docs/benchmarks.md).
``AFD_PROFILE_STEPS``
    Steps to trace when ``AFD_PROFILE_DIR`` is set (default 20).
``AFD_PROFILE_SKIP``
    Steps to let pass before tracing starts (default 0); start-up runs
    profile and warm-up forwards that count as steps.
``AFD_PROFILE_TOKENS``
    Start tracing at the first step (after the skipped ones) that plans this
    many tokens in all, in one of ``AFD_PROFILE_MODES``, e.g. the decode
    steps of a batch (default: any step).
``AFD_PROFILE_MODES``
    Comma-separated plan modes ``AFD_PROFILE_TOKENS`` accepts (default
    ``EAGER,REPLAY``; ``REPLAY`` alone skips start-up runs, which never
    replay graphs).
"""

from __future__ import annotations

import os

AFD_SERVER_PID = "AFD_SERVER_PID"
AFD_LAUNCHER_PID = "AFD_LAUNCHER_PID"
AFD_SECRET = "AFD_SECRET"
AFD_KEEP_FFN_ALIVE = "AFD_KEEP_FFN_ALIVE"
AFD_STOP_NOTE = "AFD_STOP_NOTE"
AFD_SERVER_STARTS = "AFD_SERVER_STARTS"
AFD_PROFILE_DIR = "AFD_PROFILE_DIR"
AFD_PROFILE_STEPS = "AFD_PROFILE_STEPS"
AFD_PROFILE_SKIP = "AFD_PROFILE_SKIP"
AFD_PROFILE_TOKENS = "AFD_PROFILE_TOKENS"
AFD_PROFILE_MODES = "AFD_PROFILE_MODES"


def server_pid() -> int | None:
    value = os.environ.get(AFD_SERVER_PID)
    return int(value) if value and value.isdigit() else None


def launcher_pid() -> int | None:
    value = os.environ.get(AFD_LAUNCHER_PID)
    return int(value) if value and value.isdigit() else None


def secret() -> str | None:
    return os.environ.get(AFD_SECRET) or None


def mark_server_process() -> None:
    """Record this process as the server's root (inherited by its children)."""
    os.environ[AFD_SERVER_PID] = str(os.getpid())


#: how ``AFD_STOP_NOTE`` begins when an attention peer died (not a stop)
PEER_DIED = "peer died: "


def note_stop(why: str, *, peer_died: bool = False) -> None:
    """Write ``why`` to ``AFD_STOP_NOTE``, where it is set (best effort);
    ``peer_died``: an attention peer died, the deployment was not stopped."""
    path = os.environ.get(AFD_STOP_NOTE)
    if path:
        try:
            with open(path, "w") as f:
                f.write((PEER_DIED if peer_died else "") + why)
        except OSError:
            pass


def keep_ffn_alive() -> bool:
    return os.environ.get(AFD_KEEP_FFN_ALIVE, "0") == "1"


def profile_dir() -> str | None:
    return os.environ.get(AFD_PROFILE_DIR) or None


def profile_steps() -> int:
    return int(os.environ.get(AFD_PROFILE_STEPS, "20"))


def profile_skip() -> int:
    return int(os.environ.get(AFD_PROFILE_SKIP, "0"))


def profile_tokens() -> int | None:
    value = os.environ.get(AFD_PROFILE_TOKENS)
    return int(value) if value else None


def profile_modes() -> tuple[str, ...]:
    value = os.environ.get(AFD_PROFILE_MODES) or "EAGER,REPLAY"
    return tuple(m.strip().upper() for m in value.split(",") if m.strip())


def note_server_start(argv: list[str]) -> None:
    """Append this server's start to ``AFD_SERVER_STARTS`` when it is set:
    one line, ``ROLE MODEL`` (``plain`` for a server without AFD)."""
    path = os.environ.get(AFD_SERVER_STARTS)
    if not path:
        return
    role = "plain"
    for name in ("attention", "ffn"):
        if any(f'"role": "{name}"' in a for a in argv):
            role = name
    model = argv[1] if len(argv) > 1 else "?"
    with open(path, "a") as f:
        f.write(f"{role} {model}\n")
