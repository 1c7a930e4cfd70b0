"""Shared helpers for the end-to-end tests: real servers, real requests.

Each test module starts its vLLM servers once (module fixtures) and runs all
its checks in that lifetime. Outputs are compared as token ids
(``return_tokens_as_token_ids``) with their top-5 logprobs.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_afd import envs
from vllm_afd.deploy import Deployment, DeploymentSpec, LaunchError, PlainServer
from vllm_afd.deploy.cpu_mla import cpu_mla_args
from vllm_afd.deploy.process import RoleProcess


class Results:
    """Lines a test leaves for the summary at the end of the session, in a
    file of the session's directory (``AFD_TEST_SESSION_DIR``, see
    tests/conftest.py), so that the process that prints the summary sees
    every worker's."""

    def __init__(self, name: str) -> None:
        self.path = Path(os.environ["AFD_TEST_SESSION_DIR"]) / f"results-{name}"

    def append(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line.replace("\n", " ") + "\n")

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.exists() else []


#: one line per model-family case (test_families.py), printed at the end
FAMILY_RESULTS = Results("families")
#: one line per multi-host case (test_multi_host.py), printed at the end
HOST_RESULTS = Results("hosts")
#: one line per fault-tolerance case (test_faults.py), printed at the end
FAULT_RESULTS = Results("faults")
#: predicted vs measured of the plan check (test_plan.py), printed at the end
PLAN_RESULTS = Results("plan")

#: settings shared by AFD and the baseline: exactness is "same settings"
#: vLLM's legacy CPU KV cache size in GiB (``tests/e2e/conftest.py`` sets 1
#: for the servers tests start through the CLI); it wins over
#: ``--kv-cache-memory-bytes``, so :func:`server_env` drops it where
#: ``BASE_ARGS`` size the KV cache
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: every server the harness starts: 16 sequences of 512 tokens of a tiny
#: model need a few MiB of KV cache, and vLLM's CPU worker zeroes its KV cache
#: at start (~2.7 s per GiB on two cores)
BASE_ARGS = [
    "--max-model-len", "512", "--max-num-seqs", "16", "--seed", "0",
    "--kv-cache-memory-bytes", "64M",
]  # fmt: skip

#: what an API server started with ``--enable-log-requests`` logs once it
#: passed a request to its engine
ADDED = "Added request "
#: seconds a paused server may take to add one request (:func:`run_workload`)
ADD_TIMEOUT_S = 30.0

WORDS = (
    "experts route tokens through layers while attention keeps the cache and "
    "the scheduler batches requests for the next step of decoding in the server"
).split()


def prompts(n: int = 16) -> list[str]:
    """``n`` deterministic prompts from 1 to ~200 tokens."""
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 144, 160, 180, 200, 7]
    out = []
    for i in range(n):
        k = lengths[i % len(lengths)]
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)))
    return out


@dataclass(frozen=True)
class Chat:
    """A request of a workload sent to ``/v1/chat/completions``: one user
    message of an image (``image``, a data URL) and ``text``."""

    text: str
    image: str

    def messages(self) -> list[dict[str, Any]]:
        content = [
            {"type": "image_url", "image_url": {"url": self.image}},
            {"type": "text", "text": self.text},
        ]
        return [{"role": "user", "content": content}]


def png_data_url(seed: int, side: int = 8) -> str:
    """A ``side`` x ``side`` RGB PNG of a pattern drawn from ``seed``, as a
    data URL (the processor scales it to its image size)."""
    from PIL import Image

    image = Image.new("RGB", (side, side))
    image.putdata(
        [
            ((x * 37 + seed * 91) % 256, (y * 53 + seed * 17) % 256,
             (x * y * 11 + seed * 29) % 256)
            for y in range(side)
            for x in range(side)
        ]
    )  # fmt: skip
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def image_chats(n: int = 4) -> list[Chat]:
    """``n`` chat requests, each with an image of its own and a text of
    :func:`prompts` (1, 13, 89 and 180 words, then again)."""
    texts = prompts(16)
    return [Chat(texts[(0, 5, 9, 13)[i % 4]], png_data_url(i)) for i in range(n)]


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: own generator: a test seeding ``random`` must not replay the same ports
_PORTS = random.Random()


def bindable(port: int) -> bool:
    """Nothing listens on ``port`` of 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def xdist_workers() -> int:
    """How many pytest-xdist workers run the session (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _port_range() -> tuple[int, int]:
    """This test process's ports: below the kernel's ephemeral range, and a
    share of their own for each of pytest-xdist's workers (two workers
    choosing at once must not both pick a port that neither binds yet)."""
    low, high = 10000, _ephemeral_low() - 1
    count = xdist_workers()
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = (high - low) // count
    # room above the last choice for runs and ports derived by offsets
    return low + worker * share, low + (worker + 1) * share - 64


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports below the kernel's ephemeral range.

    The servers bind them a while later; a port from the ephemeral range
    could meanwhile be taken by any process's port-0 bind (vLLM makes many
    while it starts), and the server would fail at start-up.
    """
    found: list[int] = []
    low, high = _port_range()
    while len(found) < n:
        port = _PORTS.randrange(low, high)
        if port not in found and bindable(port):
            found.append(port)
    return found


def free_port() -> int:
    return free_ports(1)[0]


def free_run(n: int, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """The first of ``n`` consecutive free ports, none of them in ``avoid``."""
    while True:
        first = free_port()
        run = set(range(first, first + n))
        if not run & avoid and all(bindable(p) for p in run):
            return first


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    top_logprobs: tuple[dict[int, float], ...]


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a completion reply, or an error that quotes the
    reply (a stream that failed mid-way sends an error event, no choices)."""
    if "choices" not in reply:
        raise AssertionError(f"the server answered with no choices: {reply}")
    return reply["choices"][0]


def _parse_choice(choice: dict[str, Any]) -> Completion:
    lp = choice["logprobs"]
    return Completion(
        token_ids=tuple(_token_id(t) for t in lp["tokens"]),
        top_logprobs=tuple(
            {_token_id(t): v for t, v in top.items()} for top in lp["top_logprobs"]
        ),
    )


def _parse_chat_choice(choice: dict[str, Any]) -> Completion:
    """A chat reply's choice, or a streamed chunk's (the first and last carry
    no tokens)."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return Completion(
        token_ids=tuple(_token_id(t["token"]) for t in content),
        top_logprobs=tuple(
            {_token_id(e["token"]): e["logprob"] for e in t["top_logprobs"]}
            for t in content
        ),
    )


def _body(
    model: str, prompt: str | list[int] | Chat, max_tokens: int, stream: bool
) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }
    if isinstance(prompt, Chat):
        body |= {"messages": prompt.messages(), "logprobs": True, "top_logprobs": 5}
    else:
        body |= {"prompt": prompt, "logprobs": 5}
    return json.dumps(body).encode()


def complete(
    url: str,
    model: str,
    prompt: str | list[int] | Chat,
    max_tokens: int,
    stream: bool,
    timeout: float = 300.0,
) -> Completion:
    """One request: a completion, or a chat completion for a :class:`Chat`."""
    chat = isinstance(prompt, Chat)
    parse = _parse_chat_choice if chat else _parse_choice
    req = urllib.request.Request(
        f"{url}/v1/{'chat/completions' if chat else 'completions'}",
        data=_body(model, prompt, max_tokens, stream),
        headers={"Content-Type": "application/json"},
    )
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:  # its message shows the body: why
        body = e.read()
        text = body.decode(errors="replace")
        raise urllib.error.HTTPError(
            e.url, e.code, f"{e.reason}: {text}", e.headers, io.BytesIO(body)
        ) from None
    with resp:
        if not stream:
            return parse(_first_choice(json.loads(resp.read())))
        ids: list[int] = []
        tops: list[dict[int, float]] = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            part = parse(_first_choice(json.loads(line[5:])))
            ids += part.token_ids
            tops += part.top_logprobs
        return Completion(tuple(ids), tuple(tops))


def workload_jobs(texts: list[str | Chat]) -> list[tuple[str | Chat, int]]:
    """(prompt, new tokens) of each request of the workload: 32-64 new tokens."""
    return [(p, 32 + (i * 7) % 33) for i, p in enumerate(texts)]


def run_workload(
    url: str,
    model: str,
    texts: list[str | Chat],
    only: tuple[int, ...] | None = None,
    log: LogSink | None = None,
) -> list[Completion]:
    """All prompts at once (a :class:`Chat` as a chat request); even ones
    streamed; 32-64 new tokens. ``only``: these requests of the workload
    (each as the whole workload sends it). ``log``: the server's, when it
    takes a workload admitted together (:func:`admits_together`: the
    attention server of a :func:`start` deployment, a plain server of
    ``POOL.plain_server(together=True)``); one API server of one engine
    then admits the requests together (:func:`_admitted_together`)."""
    jobs = [(p, n, i % 2 == 0) for i, (p, n) in enumerate(workload_jobs(texts))]
    if only is not None:
        jobs = [jobs[i] for i in only]
    if log is not None:
        return _admitted_together(url, model, jobs, log)
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: complete(url, model, *j), jobs))


def admits_together(proc: RoleProcess) -> None:
    """Let the API server of ``proc`` (a ``RoleProcess`` not started yet)
    take a workload admitted together (:func:`_admitted_together`): vLLM's
    development endpoints on, and a log line for each request it adds."""
    proc.env["VLLM_SERVER_DEV_MODE"] = "1"
    proc.argv.append("--enable-log-requests")


def attention_admits_together(afd: Deployment) -> None:
    """:func:`admits_together` for the API server of ``afd``'s attention
    role (not started yet; a headless rank has none)."""
    for proc in afd.processes:
        if proc.name == "attention" and not proc.headless:
            admits_together(proc)


def one_engine(spec: DeploymentSpec) -> bool:
    """Whether ``spec``'s API server has one engine, which can admit a
    workload together (one attention rank): with several, the requests are
    spread over the ranks' engines by load."""
    return spec.attention_ranks == 1


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=b""), timeout=60).close()


def _admitted_together(
    url: str, model: str, jobs: list[tuple[str | Chat, int, bool]], log: LogSink
) -> list[Completion]:
    """``jobs`` sent to a paused engine one by one, each once the server
    logged the one before added, then all released at once: the engine's
    first step holds every request, in the workload's order, with an empty
    prefix cache, as plain vLLM's offline engine (the baseline) adds them
    all before it steps. Sent at once to a running engine, the requests
    fall into steps as they happen to arrive, which varies from run to run,
    and CPU GEMMs of another row count round otherwise (fp32 logprobs
    moved by up to 1.6e-5): only requests admitted together can be compared
    bit for bit.

    vLLM's ``/pause?mode=keep`` (its scheduler holds new requests, the
    prefix cache cleared) and ``/resume`` are development endpoints
    (``VLLM_SERVER_DEV_MODE=1``); ``--enable-log-requests`` makes the server
    log ``Added request`` once it passed a request to its engine, over the
    channel ``/resume`` then takes: :func:`admits_together` sets both
    (:func:`start` for the attention role)."""
    _post(f"{url}/pause?mode=keep")
    with ThreadPoolExecutor(len(jobs)) as pool:
        sent: list[Future[Completion]] = []
        try:
            for i, job in enumerate(jobs):
                added = log.added + 1
                sent.append(pool.submit(complete, url, model, *job))
                deadline = time.monotonic() + ADD_TIMEOUT_S
                while not log.wait_added(added, 0.05):
                    if sent[-1].done():
                        sent[-1].result()  # its error, when it failed
                        raise AssertionError(f"request {i} ended while paused")
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"the server at {url} did not log request {i} of "
                            f"{len(jobs)} added ({ADDED!r}) within "
                            f"{ADD_TIMEOUT_S:.0f}s of sending it"
                        )
        finally:
            _post(f"{url}/resume")
        return [f.result() for f in sent]


def warm_up(url: str, texts: list[str]) -> None:
    """The workload once, outputs dropped. On a GPU the first workload of a
    server lifetime runs while kernels compile, so its requests meet in other
    batches than in later runs, and batch composition changes bf16 results:
    plain vLLM's first run of tiny DeepSeek-V2 with FULL decode graphs differed
    from its next two in 5 of 16 requests, which agreed with each other (AFD
    matched plain run for run)."""
    run_workload(url, served_model(url), texts)


def plain_outputs(
    spec: DeploymentSpec,
    texts: list[str | Chat],
    log: Any = None,
    devices: str | None = None,
    ready_timeout: float = 600.0,
    env: dict[str, str] | None = None,
    warmup: bool = False,
    together: bool = False,
) -> list[Completion]:
    """The workload's outputs from plain vLLM with ``spec``'s settings
    (``devices`` sets its ``CUDA_VISIBLE_DEVICES``, ``env`` adds environment
    variables; ``warmup``: the workload once before, its outputs dropped, see
    :func:`warm_up`; ``together``: a plain server's requests admitted
    together, see :func:`run_workload`, as :data:`PLAIN_RUNNER`'s always are).

    Once per session for the same server command line (less its port),
    environment additions, prompts and warm-up: later calls get the first
    call's outputs. Plain vLLM answers a workload the same way each time it
    starts (the premise of every comparison here), so modules that compare
    against the same baseline share one run; the server itself stays in
    :data:`POOL` while later tests may want it running (``vllm-afd bench``
    against it)."""
    server = POOL.plain_server(spec, log, devices, env, together)
    key = (POOL.plain_key(server), tuple(texts), warmup)
    if key in _PLAIN_RUNS:
        return list(_PLAIN_RUNS[key])
    if devices is None and not env and PLAIN_RUNNER.serves(server):
        pending = _PLAIN_PENDING.pop(key, None)
        if pending is not None:
            out = pending.result(timeout=ready_timeout)
        else:
            out = PLAIN_RUNNER.outputs(server, workload_jobs(texts), ready_timeout)
        _PLAIN_RUNS[key] = out
        return list(out)
    plain = POOL.running(server, ready_timeout=ready_timeout)
    if warmup:
        warm_up(plain.url, texts)
    try:
        admitted = plain.log if together else None
        out = run_workload(plain.url, served_model(plain.url), texts, log=admitted)
    finally:
        POOL.trim()
    _PLAIN_RUNS[key] = out
    return list(out)


def prestart_plain(
    spec: DeploymentSpec, texts: list[str | Chat], together: bool = False
) -> None:
    """Begin what :func:`plain_outputs` will need for ``spec`` and ``texts``
    (nothing when their outputs are known): :data:`PLAIN_RUNNER` computes
    them on a thread, or the plain server starts (``POOL.prestart``), while
    the test starts its AFD deployment."""
    server = POOL.plain_server(spec, together=together)
    key = (POOL.plain_key(server), tuple(texts), False)
    if key in _PLAIN_RUNS or key in _PLAIN_PENDING:
        return
    if PLAIN_RUNNER.serves(server):
        _PLAIN_PENDING[key] = _BASELINES.submit(
            PLAIN_RUNNER.outputs, server, workload_jobs(texts), 600.0
        )
        return
    POOL.prestart(server)


class PlainRunner:
    """Plain vLLM baselines on CPU from one process of the session
    (``tests/e2e/plain_runner.py``): vLLM imported once, then for each
    (model, arguments) the pinned vLLM's offline engine built from the plain
    server's own command line, the workload generated greedily with top-5
    logprobs, the engine freed. It saves a server start per baseline (most of
    its cost on two cores). Outputs are those of a plain server: the same
    engine, settings and requests (``ignore_eos``, the same new-token counts).

    Serves CPU servers of one worker (no ``--tensor-parallel-size`` or
    ``--data-parallel-size`` above 1) with their KV cache sized by their
    arguments (``BASE_ARGS``), in any dtype; the others run as servers. The
    engine takes the server's token budget of a step (``plain_runner.py``),
    and its first step holds every request, so a server whose requests were
    admitted together (:func:`run_workload` with ``log``) answers bit for
    bit as it does, in fp32 and bf16, eager and compiled
    (``test_baseline.py``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._reply: Any = None
        self._log = Path(tempfile.mkdtemp(prefix="afd-plain-")) / "runner.log"

    @staticmethod
    def serves(server: PlainServer) -> bool:
        argv = server.process.argv
        many = ("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp")
        wide = any(a in many and argv[i + 1] != "1" for i, a in enumerate(argv[:-1]))
        sized = "--kv-cache-memory-bytes" in argv  # this process has no KV_ENV
        # Not a model with linear attention (Qwen3-Next): on a CPU with AMX
        # this engine answered the tiny bf16 one other than a plain server of
        # the same command line, greedy ids identical, logprobs up to 0.23
        # apart (in either worker layout), while AFD matched the server bit
        # for bit; cause not found.
        linear = has_linear_attention(argv[argv.index("serve") + 1])
        return sized and not wide and not cuda_visible() and not linear

    def _start(self) -> None:
        read, write = os.pipe()
        env = dict(os.environ)
        env.pop(KV_ENV, None)  # the servers it serves size their KV cache
        envs.note_server_start([sys.executable, "plain_runner.py"])  # a plain start
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("plain_runner.py")),
                 str(write)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(write,), env=env,
            )  # fmt: skip
        os.close(write)
        self._reply = os.fdopen(read)

    def outputs(
        self, server: PlainServer, jobs: list[tuple[str | Chat, int]], timeout: float
    ) -> list[Completion]:
        """The outputs of ``jobs`` on plain vLLM with ``server``'s model and
        arguments."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        argv = server.process.argv
        at = argv.index("serve") + 1
        model, args = argv[at], argv[at + 1 :]
        for flag in ("--host", "--port"):
            i = args.index(flag)
            del args[i : i + 2]
        # a server's logging (admits_together), no engine argument
        args = [a for a in args if a != "--enable-log-requests"]
        # a chat request as its messages (``plain_runner.py``: ``LLM.enqueue_chat``)
        sent = [(p.messages() if isinstance(p, Chat) else p, n) for p, n in jobs]
        request = {"model": model, "args": args, "jobs": sent}
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._reply], [], [], timeout)
        line = self._reply.readline() if ready else ""
        if not line:
            self.close()
            tail = self._log.read_text(errors="replace")[-4000:]
            why = "timed out" if not ready else "exited"
            raise AssertionError(
                f"plain vLLM baseline of {model} {why} after {timeout:.0f}s "
                f"(plain_runner.py, log {self._log}):\n{tail}"
            )
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise AssertionError(f"plain vLLM baseline of {model}: {answer['error']}")
        return [
            Completion(
                token_ids=tuple(o["token_ids"]),
                top_logprobs=tuple(
                    {int(t): lp for t, lp in step} for step in o["top_logprobs"]
                ),
            )
            for o in answer["outputs"]
        ]

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._reply is not None:
            self._reply.close()
            self._reply = None


def cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


#: the session's CPU plain baselines (``tests/e2e/conftest.py`` closes it)
PLAIN_RUNNER = PlainRunner()


#: :func:`plain_outputs` of this session, by what decides them
_PLAIN_RUNS: dict[tuple, list[Completion]] = {}
#: baselines :data:`PLAIN_RUNNER` computes on :data:`_BASELINES`' thread
_PLAIN_PENDING: dict[tuple, Future[list[Completion]]] = {}
_BASELINES = ThreadPoolExecutor(1, thread_name_prefix="plain-baseline")


class ServerPool:
    """The session's shared server lifetimes: AFD deployments keyed by what
    decides their outputs (model, vLLM arguments, topology, options: every
    field of the spec but its ports) and plain vLLM servers keyed by their
    command line (less the port) and environment. A test asking for one that
    runs gets it as it is (its counters carry earlier tests' steps); tests
    that break a deployment (faults) start their own with :func:`start`.

    At most :attr:`keep` servers run idle at once (a 2-core CI host): asking
    for another stops the least recently used. :meth:`close` stops them all
    (the session's end, and modules that time things or need the memory).
    ``keep`` is 0 (every server stopped after its use, as on a GPU whose
    memory the next server needs) unless the end-to-end session raises it
    (``tests/e2e/conftest.py``)."""

    def __init__(self) -> None:
        self._live: dict[tuple, tuple[Any, LogSink | None]] = {}
        self._starting: dict[tuple, threading.Thread] = {}
        self._lock = threading.Lock()  # prestart threads add servers
        self.keep = 0
        # the servers the running test asked for (its deployment, its plain
        # baseline): making room never stops them, though a server a prestart
        # thread adds later is more recent (``release`` between tests)
        self._in_use: set[tuple] = set()

    @staticmethod
    def deployment_key(spec: DeploymentSpec) -> tuple:
        """Every field of ``spec`` but its ports, and the variables of its
        servers' environment that change what vLLM does (``VLLM_*``,
        ``CUDA_*``: the worker layout among them)."""
        fields = dataclasses.asdict(spec)
        for port in ("port", "ffn_port", "afd_port", "dp_rpc_port"):
            fields.pop(port)
        env = server_env(spec, os.environ)
        env = {k: v for k, v in env.items() if k.startswith(("VLLM_", "CUDA_"))}
        return (
            "afd",
            json.dumps(fields, sort_keys=True, default=str),
            tuple(sorted(env.items())),
        )

    @staticmethod
    def plain_key(plain: PlainServer) -> tuple:
        """Its command line less the port, and the variables that change
        what vLLM does (``VLLM_*``, ``CUDA_*``)."""
        argv = plain.process.argv
        at = argv.index("--port")
        env = sorted(
            (k, v) for k, v in plain.process.env.items()
            if k.startswith(("VLLM_", "CUDA_"))
        )  # fmt: skip
        return ("plain", tuple(argv[:at] + argv[at + 2 :]), tuple(env))

    def deployment(
        self, spec: DeploymentSpec, **start_kw: Any
    ) -> tuple[Deployment, LogSink]:
        """A running deployment of ``spec``'s settings (started with
        ``start_kw`` if none runs; one :meth:`prestart_deployment` began is
        waited for) and its role logs."""
        key = self.deployment_key(spec)
        self._in_use.add(key)
        self._join(key)
        if key not in self._live:
            self._make_room()
            afd, log = start(spec, **start_kw)
            self._live[key] = (afd, log)
        self._live[key] = self._live.pop(key)  # most recently used last
        return self._live[key]

    def prestart_deployment(self, spec: DeploymentSpec) -> None:
        """Start a deployment of ``spec``'s settings on a thread, beside the
        one a test is starting or using (two start in about 1.5 times one on
        two cores: most of a start is single-threaded imports);
        :meth:`deployment` waits for it. Nothing when ``keep`` leaves no room
        for it, or one of its key runs or starts. A failed start is started
        again, in the open, by :meth:`deployment`."""
        self._start_beside(
            self.deployment_key(spec), "prestarted deployment", lambda: start(spec)
        )

    def _start_beside(
        self, key: tuple, what: str, starter: Callable[[], tuple[Any, LogSink | None]]
    ) -> None:
        """Run ``starter`` on a thread and add what it started under ``key``
        (nothing when ``keep`` leaves no room beside one more, or ``key`` runs
        or starts); a failed start is printed and left out."""
        if self.keep < 2 or key in self._live or key in self._starting:
            return
        self._make_room(free=2)

        def run() -> None:
            try:
                started = starter()
            except LaunchError as e:
                print(f"{what} did not start: {e}")
                return
            with self._lock:
                self._live[key] = started

        thread = threading.Thread(target=run, daemon=True)
        self._starting[key] = thread
        thread.start()

    def settle(self) -> None:
        """Wait for every start :meth:`_start_beside` began."""
        for thread in list(self._starting.values()):
            thread.join()

    def _join(self, key: tuple) -> bool:
        """Wait for a start :meth:`_start_beside` began under ``key``;
        whether there was one."""
        starting = self._starting.pop(key, None)
        if starting is not None:
            starting.join()
        return starting is not None

    def take(self, spec: DeploymentSpec, **start_kw: Any) -> tuple[Deployment, LogSink]:
        """The pool's deployment of ``spec``'s settings, out of the pool, for
        a test that breaks it (its last user; the caller stops it); started
        if none runs."""
        key = self.deployment_key(spec)
        self._join(key)
        if key in self._live:
            return self._live.pop(key)
        self._make_room()
        return start(spec, **start_kw)

    @staticmethod
    def plain_server(
        spec: DeploymentSpec,
        log: Any = None,
        devices: str | None = None,
        env: dict[str, str] | None = None,
        together: bool = False,
    ) -> PlainServer:
        """A plain vLLM server (not started) of ``spec``'s model and settings,
        ``env`` added to its environment, ``devices`` its GPUs; ``together``:
        it takes workloads admitted together (:func:`admits_together`; its
        ``log`` a :class:`LogSink` that passes lines on to ``log``)."""
        # a port of its own: it may start while the deployment of the same
        # spec (whose port the baseline takes otherwise) starts beside it
        server = PlainServer(spec, log=log, port=free_port())
        server.process.env = {**server_env(spec, server.process.env), **(env or {})}
        if devices is not None:
            server.process.env["CUDA_VISIBLE_DEVICES"] = devices
        if together:
            server.log = LogSink(tee=log)
            admits_together(server.process)
        return server

    def running(self, server: PlainServer, ready_timeout: float = 600.0) -> PlainServer:
        """The pool's running server of ``server``'s key (``server`` started
        if none runs; one :meth:`prestart` began is waited for)."""
        key = self.plain_key(server)
        self._in_use.add(key)
        if self._join(key) and key not in self._live:
            raise LaunchError("plain vLLM failed to start (see the log above)")
        if key not in self._live:
            self._make_room()
            server.start(ready_timeout=ready_timeout)
            self._live[key] = (server, None)
        self._live[key] = self._live.pop(key)
        return self._live[key][0]

    def prestart(self, server: PlainServer, ready_timeout: float = 600.0) -> None:
        """Start ``server`` on a thread, so that it starts while the test
        starts its AFD deployment (on two cores three servers start in about
        the time of two after another: most of a start is single-threaded
        imports); :meth:`running` waits for it. Nothing when ``keep`` leaves
        no room for it beside a deployment, or one of its key runs."""

        def starter() -> tuple[PlainServer, None]:
            server.start(ready_timeout=ready_timeout)
            return server, None

        self._in_use.add(self.plain_key(server))  # this test's baseline
        self._start_beside(self.plain_key(server), "plain vLLM", starter)

    def _make_room(self, free: int = 1) -> None:
        """Stop the least recently used servers until ``free`` more fit
        under :attr:`keep`; never the deployment in use."""
        while True:
            with self._lock:
                if len(self._live) <= self.keep - free:
                    return
                key = next((k for k in self._live if k not in self._in_use), None)
                if key is None:
                    return
            self._stop(key)

    def release(self) -> None:
        """The running test is done with its servers (they may be stopped
        to make room from now on)."""
        self._in_use.clear()

    def trim(self) -> None:
        """Stop the least recently used servers beyond :attr:`keep` (none
        the running test asked for)."""
        while len(self._live) > self.keep:
            key = next((k for k in self._live if k not in self._in_use), None)
            if key is None:
                return
            self._stop(key)

    def _stop(self, key: tuple) -> None:
        with self._lock:
            server, _ = self._live.pop(key)
        server.stop()

    def close(self) -> None:
        """Stop every server of the pool."""
        for thread in self._starting.values():
            thread.join()
        self._starting.clear()
        for key in list(self._live):
            self._stop(key)


#: the session's server pool (``tests/e2e/conftest.py`` closes it at the end)
POOL = ServerPool()


def _long_request(url: str, model: str, max_tokens: int, outcome: dict) -> None:
    start = time.monotonic()
    try:
        out = complete(url, model, "experts " * 50, max_tokens, True, timeout=120)
        n = len(out.token_ids)
        outcome["result"] = "completed" if n == max_tokens else f"failed: {n} tokens"
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        outcome["result"] = f"failed: {exc!r}"
    outcome["seconds"] = time.monotonic() - start


def assert_ffn_kill_fails_requests(
    afd: Deployment, max_tokens: int, after_s: float, join_s: float
) -> float:
    """SIGKILL the whole FFN server ``after_s`` into a streamed request of
    ``max_tokens``: the request must end in failure within ``join_s``, and a
    new request must fail too. Returns the seconds from the kill to the
    failed request's end."""
    import os
    import signal

    import pytest

    model = served_model(afd.api_url)
    complete(afd.api_url, model, "warm up", 4, stream=False)
    outcome: dict = {}
    worker = threading.Thread(
        target=_long_request, args=(afd.api_url, model, max_tokens, outcome)
    )
    worker.start()
    time.sleep(after_s)
    killed_at = time.monotonic()
    # The whole FFN server: API server, engine core and worker processes.
    os.killpg(afd.ffn.proc.pid, signal.SIGKILL)
    worker.join(join_s)
    assert not worker.is_alive(), "in-flight request hung after the FFN died"
    failed_after = time.monotonic() - killed_at
    assert failed_after < join_s
    assert outcome["result"].startswith("failed"), outcome
    # A new request fails too (error response or refused connection).
    with pytest.raises((urllib.error.URLError, OSError)):
        complete(afd.api_url, model, "after", 4, stream=False, timeout=60)
    return failed_after


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return True  # not Linux: nothing known against it


#: Compiled bf16 DeepSeek-V3 on a CPU without AVX-512: AFD's greedy tokens
#: differ from plain vLLM's (measured on an AVX2-only AMD EPYC host: 10 of
#: 16 requests, gate on either role, the same requests in both tests; eager
#: bf16 and compiled fp32 stay identical there; earlier hosts passed). Cause
#: not found yet: docs/architecture.md "Exactness". Skipped there, since the
#: compiled bf16 servers are also the slowest on such a host.
COMPILED_BF16_V3 = pytest.mark.skipif(
    not _cpu_has_avx512(),
    reason="known: compiled bf16 DeepSeek-V3 differs from plain vLLM on CPUs "
    "without AVX-512 (docs/architecture.md, Exactness)",
)


def _top_logprob_steps(
    afd: list[Completion], plain: list[Completion]
) -> Iterator[tuple[int, int, dict[int, float], dict[int, float]]]:
    """(request, step, AFD's top-5, plain's top-5) of every step of the
    requests whose token ids agree."""
    for i, (a, p) in enumerate(zip(afd, plain, strict=True)):
        if a.token_ids == p.token_ids:
            pairs = zip(a.top_logprobs, p.top_logprobs, strict=True)
            for step, (ta, tp) in enumerate(pairs):
                yield i, step, ta, tp


def largest_logprob_gap(afd: list[Completion], plain: list[Completion]) -> float:
    """The largest difference of a top-5 logprob both list, over the requests
    whose token ids agree (:func:`assert_same_outputs` checks them all)."""
    return max(
        (
            abs(ta[tok] - tp[tok])
            for _, _, ta, tp in _top_logprob_steps(afd, plain)
            for tok in ta.keys() & tp.keys()
        ),
        default=0.0,
    )


def assert_same_outputs(
    afd: list[Completion], plain: list[Completion], atol: float
) -> None:
    """Token ids identical; same top-5 tokens, logprobs within ``atol``.

    Every request is compared before anything fails, so the message gives
    all the requests whose greedy tokens differ, then the largest logprob
    gap (where, and how many exceed ``atol``)."""
    assert len(afd) == len(plain)
    differ = [
        i for i, (a, p) in enumerate(zip(afd, plain, strict=True))
        if a.token_ids != p.token_ids
    ]  # fmt: skip
    assert not differ, f"greedy tokens differ in requests {differ} of {len(plain)}"
    worst, where, over = 0.0, "", 0
    for i, step, ta, tp in _top_logprob_steps(afd, plain):
        assert set(ta) == set(tp), f"request {i} step {step}: top-5 differ"
        for tok in ta:
            gap = abs(ta[tok] - tp[tok])
            over += gap > atol
            if gap > worst:
                worst = gap
                where = (
                    f"request {i} step {step} token {tok}: logprob "
                    f"{ta[tok]} vs {tp[tok]}"
                )
    assert over == 0, (
        f"{over} logprob(s) differ by more than {atol}; the largest, {worst:.4g}: "
        f"{where}"
    )


def http_error(url: str, body: dict[str, Any], timeout: float) -> tuple[int, str]:
    """POST and return (status, body) of an expected HTTP error."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def free_port_pair() -> int:
    """A free port p with p + 1 also free (``afd.port`` and the data-plane
    store)."""
    while True:
        port = free_port()
        if bindable(port + 1):
            return port


#: vLLM's switch between its two worker layouts on CPU: "1" (its default) a
#: worker process per engine core, for OpenMP thread binding; "0" the worker
#: inside the engine-core process, as vLLM runs one GPU. The end-to-end
#: session defaults to "0" (``tests/e2e/conftest.py``): one process less to
#: import vLLM into per role, a server ready in about half the time on two
#: cores (AFD 1A1F: 18 s against 37 s).
LAYOUT_KEY = "VLLM_ENABLE_V1_MULTIPROCESSING"


def has_linear_attention(model: str) -> bool:
    """Whether ``model``'s layers mix in linear attention (Qwen3-Next). In
    the one-process layout its bf16 outputs moved with the KV cache size,
    for plain vLLM and AFD alike: with a 1 GiB cache 9 logprobs of the
    workload differed by up to 0.099 between the two (which one gave which
    value swapped between runs), with 64 MiB none; in vLLM's default layout
    they agree at either size."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    return "linear_attention" in json.loads(path.read_text()).get("layer_types", [])


def server_env(spec: DeploymentSpec, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a server of ``spec``: without :data:`KV_ENV` where the
    arguments size the KV cache, and in vLLM's default worker layout for a
    model with linear attention (:func:`has_linear_attention`)."""
    env = dict(env)
    if has_linear_attention(spec.model):
        env[LAYOUT_KEY] = "1"
    if "--kv-cache-memory-bytes" in spec.vllm_args:
        env.pop(KV_ENV, None)
    return env


def make_spec(model: Path, extra: list[str], **kw: Any) -> DeploymentSpec:
    afd_port = free_port_pair()
    others = [p for p in free_ports(4) if p not in (afd_port, afd_port + 1)]
    port, ffn_port = others[:2]
    return DeploymentSpec(
        model=str(model),
        port=port,
        ffn_port=ffn_port,
        afd_port=afd_port,
        # vLLM's reference CPU MLA on CPUs with AMX too (deploy.cpu_mla)
        vllm_args=[*BASE_ARGS, *extra, *cpu_mla_args(model, extra)],
        **kw,
    )


__all__ = ["Deployment", "PlainServer"]


class LogSink(io.StringIO):
    """Collects the launcher's prefixed role logs (thread-safe), and counts
    the requests an API server logged added (:data:`ADDED`; role pumps write
    whole lines)."""

    def __init__(self, tee: Any = None) -> None:
        """``tee``: where lines go too (a text sink; None: nowhere)."""
        super().__init__()
        self._lock = threading.Lock()
        self._wrote = threading.Condition(self._lock)
        self.added = 0
        self._tee = tee

    def write(self, s: str) -> int:
        if self._tee is not None:
            self._tee.write(s)
        with self._lock:
            self.added += s.count(ADDED)
            self._wrote.notify_all()
            return super().write(s)

    def wait_added(self, n: int, timeout: float) -> bool:
        """Whether :attr:`added` reached ``n`` within ``timeout`` s."""
        with self._wrote:
            return self._wrote.wait_for(lambda: self.added >= n, timeout)


def print_log_tail(log: LogSink, lines: int = 200) -> None:
    """Print the role logs' last ``lines`` (pytest shows them with a failure),
    without the API servers' access lines (polls of /health would fill it)."""
    kept = [ln for ln in log.getvalue().splitlines() if '" 200 OK' not in ln]
    kept = [ln for ln in kept if not ln.endswith('" 503 Service Unavailable')]
    print("\n".join(kept[-lines:]))


def start(spec: DeploymentSpec, **kw: Any) -> tuple[Deployment, LogSink]:
    """A started deployment and its role logs; when it fails to start, the
    error carries the logs' last lines (the cause is in them). Its attention
    API server can pause and logs the requests it adds
    (:func:`_admitted_together`)."""
    log = LogSink()
    afd = Deployment(spec, log=log)
    for proc in afd.processes:
        proc.env = server_env(spec, proc.env)
    attention_admits_together(afd)
    try:
        afd.start(**kw)
    except LaunchError as e:
        tail = "\n".join(log.getvalue().splitlines()[-80:])
        raise LaunchError(f"{e}; last log lines:\n{tail}") from None
    return afd, log


def model_lines(log_text: str) -> dict[str, tuple[dict, dict[str, int]]]:
    """``{role: (split, bytes by group)}`` from each role's start-up line."""
    from vllm_afd.models.layout import parse_model_line

    found: dict[str, tuple[dict, dict[str, int]]] = {}
    for line in log_text.splitlines():
        parsed = parse_model_line(line)
        if parsed is not None:
            found[parsed[0]] = (parsed[1], parsed[2])
    return found


def parameter_bytes(log_text: str) -> dict[str, dict[str, int]]:
    """``{role: {group: bytes}}`` from the AFD model's start-up log line."""
    return {role: groups for role, (_, groups) in model_lines(log_text).items()}


@dataclass
class Compared:
    """One AFD deployment and plain vLLM on the same workload."""

    afd: list[Completion]
    plain: list[Completion]
    log: str
    #: the AFD counters (``afd_vs_plain(metrics=...)``); empty when not asked
    metrics: dict


def afd_vs_plain(
    spec: DeploymentSpec,
    texts: list[str | Chat],
    plain: list[Completion] | None = None,
    metrics: str | None = None,
    then: DeploymentSpec | None = None,
    **start_kw: Any,
) -> Compared:
    """The workload on the pool's deployment of ``spec`` (started if none
    runs), the settled AFD counters of its ``metrics`` role ("attention", or
    "ffn": FFN rank 0; none when None: reading them waits over a second),
    and the same workload's outputs from plain vLLM with
    the same settings (unless ``plain`` already holds them). ``then``: the
    deployment the next test will ask for, started beside this one once this
    one runs (``POOL.prestart_deployment``; this one is then the most recently
    used, so making room for it never stops this one). Comparing is the
    caller's."""
    if plain is None:
        prestart_plain(spec, texts)
    afd, log = POOL.deployment(spec, **start_kw)
    if then is not None:
        POOL.prestart_deployment(then)
    try:
        admitted = log if one_engine(spec) else None
        afd_out = run_workload(
            afd.api_url, served_model(afd.api_url), texts, log=admitted
        )
        counters = {}
        if metrics is not None:
            url = afd.ffn.url if metrics == "ffn" else afd.api_url
            counters = settled_metrics(url)
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        POOL.trim()
    if plain is None:
        plain = plain_outputs(spec, texts)
    return Compared(afd_out, plain, log.getvalue(), counters)


def settled_metrics(url: str, timeout: float = 15.0) -> dict:
    """AFD counters of a server once three reads over two publish intervals
    (0.5 s each) agree; fails the test when they still move after
    ``timeout`` s. (Two reads one interval apart could both fall before a
    publisher thread that a loaded machine ran late.)"""
    from vllm_afd.cli.client import afd_metrics

    deadline = time.monotonic() + timeout
    reads = [afd_metrics(url)]
    while time.monotonic() < deadline:
        time.sleep(0.6)
        reads = [*reads[-2:], afd_metrics(url)]
        if len(reads) == 3 and reads[0] == reads[1] == reads[2]:
            return reads[-1]
    pytest.fail(f"the AFD counters of {url} still moved after {timeout:.0f}s")


class Collected:
    """A command in a session (process group) of its own, its output
    collected line by line: a launcher or a server started by hand."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_line(self, pattern: str, timeout: float) -> str:
        """The first output line matching ``pattern`` (a regex).

        Raises:
            AssertionError: none within ``timeout`` s, or the command ended
                first; with the output's last lines.
        """
        import re

        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        with self._new:
            while True:
                hit = next((x for x in self.lines if regex.search(x)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "".join(self.lines[-60:])
                    raise AssertionError(f"no line matching {pattern!r}:\n{tail}")
                self._new.wait(min(left, 1.0))

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the command, SIGKILL its process group after ``timeout``."""
        import os
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# ------------------------------------------------------------ processes
def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent, process group) of ``pid``, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def live_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def members(groups: set[int]) -> list[int]:
    """Live (not zombie) processes of the process groups ``groups``."""
    out = []
    for pid in live_pids():
        st = proc_stat(pid)
        if st is not None and st[2] in groups and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def children(pid: int) -> list[int]:
    return [p for p in live_pids() if (st := proc_stat(p)) and st[1] == pid]


# ------------------------------------------------------------ faults
def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def run_cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``vllm-afd ARGV`` in this process, its stdout and stderr kept: its
    servers start as the harness's do (from the fork servers on CPU). For
    commands under test as a library (bench, plan); the console script's own
    process is tested by the launcher and demo tests."""
    import contextlib

    from vllm_afd.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return subprocess.CompletedProcess(
        ["vllm-afd", *argv], code, out.getvalue(), err.getvalue()
    )


def wait_for(cond, timeout: float, what: str) -> float:
    """Poll ``cond`` until true; the seconds it took. Fails naming ``what``."""
    import pytest

    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


class Supervisor:
    """``Deployment.supervise`` every 0.5 s on a thread, as ``launch`` runs it."""

    def __init__(self, afd) -> None:
        self.afd = afd
        self.error: LaunchError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.afd.supervise()
            except LaunchError as e:
                self.error = e
                return

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def stream_until_error(
    url: str, model: str, first: threading.Event, out: dict, max_tokens: int = 400
) -> None:
    """Stream one long greedy completion; ``first`` is set at its first token,
    ``out`` gets ``events``, ``ended`` (monotonic) and any ``exception``."""
    body = json.dumps(
        {
            "model": model,
            "prompt": "experts " * 20,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    events = []
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    events.append(json.loads(line[5:]))
                    first.set()
    except urllib.error.HTTPError as e:
        out["exception"] = f"{e!r}: {e.read().decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        out["exception"] = repr(e)
    out["ended"] = time.monotonic()
    out["events"] = events


def kill_ffn_mid_stream(
    afd: Deployment,
    model: str,
    timeout_s: float,
    max_tokens: int = 400,
    sig: signal.Signals = signal.SIGKILL,
    heartbeat_s: float = 0.0,
    rank: int = 0,
) -> dict[str, float]:
    """Send ``sig`` to FFN rank ``rank``'s server after the first token of a
    long stream: the stream ends with an error and ``/health`` answers 503
    naming ``ffn rank <rank>``, within ``timeout_s`` of a SIGKILL (its
    sockets close). A
    SIGSTOP keeps them open: a step's wait ends once the FFN rank's last
    heartbeat, sent before the signal, is ``timeout_s`` old, also a wait begun
    late in that silence (data parallelism: the ranks step together); its
    heartbeat watch looks at the silence every ``heartbeat_s``: both within
    ``timeout_s + heartbeat_s`` (docs/faults.md), read from the time the
    attention rank recorded the loss (``/afd/status``), plus ``SLACK_S`` for
    a thread woken late on a loaded host. The error then still travels from
    the engine through the API server to the client: within ``DELIVERY_S``.
    Seconds from the signal to each."""
    import pytest

    url = afd.api_url
    first, outcome = threading.Event(), {}
    stream = threading.Thread(
        target=stream_until_error, args=(url, model, first, outcome, max_tokens)
    )
    stream.start()
    if not first.wait(60):
        stream.join(5)
        pytest.fail(f"no streamed token before the kill: {outcome}")
    killed, killed_wall = time.monotonic(), time.time()
    os.killpg(afd.ffns[rank].proc.pid, sig)
    bound = timeout_s if sig == signal.SIGKILL else timeout_s + heartbeat_s
    stream.join(bound + DELIVERY_S + 30)
    assert not stream.is_alive(), "the in-flight stream hung"
    last = outcome["events"][-1]
    assert "error" in last and len(outcome["events"]) < max_tokens, last
    named = f"ffn rank {rank} "
    wait_for(lambda: health_down(url, named), bound, "/health 503 naming it")
    figures = {"/health 503": time.monotonic() - killed}
    status = json.loads(http_get(f"{url}/afd/status")[1])
    lost = [r["since"] for r in status["ranks"] if not r["up"]]
    assert lost, status
    figures["loss recorded"] = min(lost) - killed_wall
    figures["stream error"] = outcome["ended"] - killed
    assert figures["loss recorded"] <= bound + SLACK_S, figures
    assert figures["stream error"] <= figures["loss recorded"] + DELIVERY_S, figures
    return figures


#: a fault's detection may run this late on a loaded host (a thread woken late)
SLACK_S = 0.5
#: from the attention rank's failed step to the client's stream error (engine,
#: API server, HTTP)
DELIVERY_S = 2.0


def health_down(url: str, why: str) -> bool:
    """``/health`` answers 503 with ``why`` in its body."""
    code, text = http_get(f"{url}/health")
    return code == 503 and why in text
