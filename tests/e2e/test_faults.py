"""Faults of real role processes: the attention role survives its FFN rank.

Also the exactness of the M:N topology 3A1F (tiny Qwen3-MoE): 16 prompts
against plain vLLM, before and after each fault (one FFN rank of 2A2F dying
is ``test_multi_host.py``'s fault). Three attention ranks: vLLM shards the
MoE width (64 here) over its data-parallel ranks and asserts that it
divides, and the attention role, which holds no experts, must start anyway.
One deployment per topology (1A1F, 3A1F), the launcher's own
supervision (``Deployment.supervise``) running beside it, and in that one
lifetime:

1. **FFN SIGKILL mid-stream** (after the first streamed token): the stream
   ends with an error within ``timeout_s``; ``/health`` and new requests get
   503 naming ``ffn rank 0``; the supervisor restarts the FFN rank while
   requests keep arriving (each one 503 or exact); the attention ranks rejoin
   it, a prompt served before the fault hits the prefix cache (1A1F: one
   engine, one cache), and the workload is token-identical to plain vLLM.
2. **FFN SIGSTOP**. 1A1F, idle: the heartbeat silence takes ``/health`` to
   503 within ``timeout_s``; the stopped rank is killed, an FFN rank with
   **other weights** starts in its place and the handshake refuses it naming
   ``model_digest`` while the attention role keeps waiting, and the right one
   rejoins. 3A1F, mid-stream: the stream ends with an error once the step's
   wait runs out, ``/health`` answers 503; the stopped rank is resumed
   (SIGCONT), finds its step failed, and the same process rejoins every
   attention rank in place. Output exact again.
3. **Attention SIGKILL**: the FFN server stops by itself, and the supervisor
   stops the deployment with an error that says an attention rank cannot
   rejoin.

No attention process restarts in 1 and 2 (same pids throughout).

An FFN rank of the ``async`` connector does not rejoin: test_families.py
(the last user of its Qwen3-MoE 1A2F deployment) kills one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from harness import (
    FAULT_RESULTS,
    Supervisor,
    assert_same_outputs,
    complete,
    health_down,
    http_get,
    kill_ffn_mid_stream,
    make_spec,
    plain_outputs,
    print_log_tail,
    prompts,
    run_workload,
    served_model,
    start,
    wait_for,
)

from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.alone,
    pytest.mark.usefixtures("quiet_host"),
]

TIMEOUT_S = 4.0  # connector timeout_s: the bound on detecting a hung FFN
HEARTBEAT_S = 0.5
RECOVER_S = 240.0  # an FFN restart on two busy cores, with the backoff
TEXTS = prompts(16)
#: logprob tolerance of merged batches (2+ attention ranks): see
#: test_scale_out.py; token ids must be identical in every case
ATOL = 1e-4
ARGS = ["--dtype", "float32", "--enforce-eager"]


def _start(model, a: int, f: int):
    """A started xAyF deployment (short connector timeout, 3 FFN restarts)."""
    spec = make_spec(
        model,
        ARGS,
        attention_ranks=a,
        ffn_ranks=f,
        connector_extra_config={
            "timeout_s": TIMEOUT_S,
            "heartbeat_interval_s": HEARTBEAT_S,
        },
        ffn_restarts=3,
    )
    return start(spec)


@pytest.fixture(scope="module")
def qwen3(family_models):
    """Tiny Qwen3-MoE (test_families.py's: plain vLLM runs once for both):
    no MLA, so vLLM's prefix cache is on (on CPU vLLM turns it off for MLA
    models such as DeepSeek-V2)."""
    return family_models["qwen3_moe"]


def _plain_of(model) -> list:
    """Plain vLLM's outputs of the workload (one server per model and session,
    ``harness.plain_outputs``)."""
    return plain_outputs(make_spec(model, ARGS), TEXTS)


def _requests_during(url: str, model: str, stop: threading.Event, seen: list):
    """Requests one after another until ``stop``: (status, completion)."""
    while not stop.is_set():
        try:
            seen.append((200, complete(url, model, TEXTS[0], 8, False, 60)))
        except urllib.error.HTTPError as err:
            seen.append((err.code, err.read().decode()))
            time.sleep(0.2)


@pytest.mark.parametrize("a", [1, 3], ids=["1A1F", "3A1F"])
def test_attention_survives_its_ffn_rank(qwen3, tmp_path, a):
    model = qwen3
    plain = _plain_of(model)
    afd, log = _start(model, a, 1)
    url, figures = afd.api_url, {}
    try:
        name = served_model(url)
        assert_same_outputs(run_workload(url, name, TEXTS), plain, atol=ATOL)
        attention_pid = afd.attention.proc.pid

        # 1. SIGKILL mid-stream, restarted by the supervisor under load.
        with Supervisor(afd) as supervisor:
            figures.update(kill_ffn_mid_stream(afd, name, TIMEOUT_S))
            stop, seen = threading.Event(), []
            load = threading.Thread(
                target=_requests_during, args=(url, name, stop, seen)
            )
            load.start()
            ffn_up = wait_for(afd.ffn.healthy, RECOVER_S, "the restarted FFN rank")
            rejoined = wait_for(
                lambda: http_get(f"{url}/health")[0] == 200, 30, "attention /health 200"
            )
            after = len(seen)
            wait_for(
                lambda: sum(s[0] == 200 for s in seen[after:]) >= 2,
                60,
                "two requests served after the rejoin",
            )
            stop.set()
            load.join(90)
            assert supervisor.error is None, supervisor.error
        figures["FFN restarted, healthy"] = ffn_up
        figures["rejoin after FFN healthy"] = rejoined
        refused = [s for s in seen if s[0] == 503]
        served = [s[1] for s in seen if s[0] == 200]
        assert refused and all("ffn rank 0" in s[1] for s in refused), seen[:3]
        assert all(s[0] in (200, 503) for s in seen), seen
        assert served, "no request was served after the rejoin"
        one = complete(url, name, TEXTS[0], 8, False)
        assert all(c.token_ids == one.token_ids for c in served)
        if a == 1:
            # The prefix cache outlived the fault: a prompt served only before
            # it hits the cache now (only the failed step's blocks were
            # evicted). With data parallelism each engine has a cache of its
            # own and vLLM routes by load, so a hit is not certain there.
            hits = _prefix_cache_hits(url)
            complete(url, name, TEXTS[13], 4, False)  # 180 words: full blocks
            assert _prefix_cache_hits(url) > hits, "the prefix cache was lost"
        assert_same_outputs(run_workload(url, name, TEXTS), plain, atol=ATOL)
        assert afd.attention.proc.pid == attention_pid
        assert afd.attention.exit_code() is None

        # 2. SIGSTOP. 1A1F: idle, only the heartbeat tells; killed, and a
        # rank on other weights is refused before the right one rejoins.
        # 3A1F: mid-stream, every attention rank gives up inside a step; once
        # resumed, the same FFN process finds its step failed and rejoins them
        # in place (no restart, no weights reloaded).
        ffn_pid = afd.ffn.proc.pid
        if a == 1:
            stopped = time.monotonic()
            os.killpg(ffn_pid, signal.SIGSTOP)
            figures["hung FFN detected"] = wait_for(
                lambda: health_down(url, "heartbeat"),
                TIMEOUT_S + 2,
                "/health 503 naming the missing heartbeat",
            )
            os.killpg(ffn_pid, signal.SIGKILL)
            afd.ffn.proc.wait(30)
            right_argv = list(afd.ffn.argv)
            # FFN rank 0 checks every endpoint's fingerprint alike: one
            # topology is enough for the refusal (an FFN start less in CI).
            other = write_tiny_checkpoint(
                tmp_path / "other", arch="qwen3_moe", num_layers=3, seed=1
            )
            afd.ffn.argv = [str(other) if x == str(model) else x for x in right_argv]
            afd.ffn.start(log)
            wait_for(
                lambda: afd.ffn.exit_code() is not None, RECOVER_S, "the refused FFN"
            )
            wait_for(lambda: "model_digest" in _attention_lines(log), 30, "the refusal")
            assert http_get(f"{url}/health")[0] == 503
            afd.ffn.argv = right_argv
            afd.ffn.start(log)
            wait_for(afd.ffn.healthy, RECOVER_S, "the right FFN rank")
        else:
            hung = kill_ffn_mid_stream(
                afd, name, TIMEOUT_S, sig=signal.SIGSTOP, heartbeat_s=HEARTBEAT_S
            )
            figures["hung FFN: loss recorded"] = hung["loss recorded"]
            figures["hung FFN: stream error"] = hung["stream error"]
            figures["hung FFN: /health 503"] = hung["/health 503"]
            stopped = time.monotonic()
            os.killpg(ffn_pid, signal.SIGCONT)
        wait_for(
            lambda: http_get(f"{url}/health")[0] == 200, 30, "attention /health 200"
        )
        figures["recovered after " + ("SIGSTOP" if a == 1 else "SIGCONT")] = (
            time.monotonic() - stopped
        )
        assert_same_outputs(run_workload(url, name, TEXTS), plain, atol=ATOL)
        if a > 1:
            assert afd.ffn.proc.pid == ffn_pid and afd.ffn.exit_code() is None
        assert afd.attention.proc.pid == attention_pid
        status = _status(url)
        assert status["ready"] and len(status["ranks"]) == a
        assert all(r["losses"] == 2 and r["rejoins"] == 2 for r in status["ranks"])

        # 3. Attention SIGKILL: the FFN server stops by itself (its peers are
        # gone without SHUTDOWN), the supervisor stops the rest, saying why.
        os.killpg(afd.attention.proc.pid, signal.SIGKILL)
        wait_for(lambda: afd.ffn.exit_code() is not None, 60, "the FFN to stop")
        with Supervisor(afd) as supervisor:
            wait_for(lambda: supervisor.error is not None, 60, "the supervisor to stop")
        assert "cannot rejoin" in str(supervisor.error)
        assert all(p.exit_code() is not None for p in afd.processes)
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        afd.stop()
    FAULT_RESULTS.append(
        f"{a}A1F: " + ", ".join(f"{k} {v:.2f}s" for k, v in figures.items())
    )


def _prefix_cache_hits(url: str) -> float:
    """vLLM's prefix-cache hits (tokens), summed over the engines."""
    text = http_get(f"{url}/metrics")[1]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def _attention_lines(log) -> str:
    return "\n".join(
        ln for ln in log.getvalue().splitlines() if ln.startswith("[attention]")
    )


def _status(url: str) -> dict:
    return json.loads(http_get(f"{url}/afd/status")[1])
