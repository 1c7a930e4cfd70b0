"""Shared state and checks behind the connector facade (see ``connector``).

Dimensions: T tokens of one attention rank's ubatch, ΣT merged tokens of an
FFN rank's ubatch, H hidden size, K top-k.

Holds the step plan, the reusable buffers, the counters, and the error path:
after the first transport error the endpoint is unusable and every later call
says why.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence

import torch

from vllm_afd.connector.control import ControlPlane
from vllm_afd.connector.data import DataPlane
from vllm_afd.connector.payloads import (
    A2FBatch,
    ConnectorStats,
    Pending,
    RecvHandle,
    SendHandle,
)
from vllm_afd.connector.plan import MergedPlan
from vllm_afd.connector.protocol import (
    MAX_LAYERS,
    ExchangeKey,
    ExecMode,
    Fingerprint,
    StepPlan,
    step_tag,
    ubatches,
)
from vllm_afd.errors import (
    AFDConnectorError,
    AFDError,
    AFDPeerError,
    AFDPeerStopped,
    AFDProtocolError,
    AFDTimeoutError,
)
from vllm_afd.roles import AFDRole
from vllm_afd.topology import Topology

ATT, FFN = AFDRole.ATTENTION, AFDRole.FFN
_SETTLE_S, _SETTLE_POLLS = 0.05, 6
#: a wait cut short by the peer's heartbeat silence lasts this much longer,
#: so that the silence has passed its limit when the wait's error says why
_SILENCE_MARGIN_S = 0.01


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; AFDConnectorError if unknown."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise AFDConnectorError(f"fingerprint dtype={name!r} is not a torch dtype")
    return dtype


def release_frames(error: BaseException) -> None:
    """Free the local variables of the finished frames in ``error``'s
    traceback and those of its causes (the error itself is kept, with its
    message): a failed transfer's frames hold its work and process group."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


class ConnectorCore:
    """State, checks and waits of one endpoint; the API is in ``AFDConnector``."""

    def __init__(
        self,
        *,
        name: str,
        role: AFDRole,
        role_rank: int,
        topology: Topology,
        fingerprint: Fingerprint,
        control: ControlPlane,
        data: DataPlane,
        device: torch.device,
        timeout_s: float,
        warmup_timeout_s: float | None = None,
    ) -> None:
        self.name, self.role, self.role_rank = name, role, role_rank
        self._warmup_timeout_s = max(timeout_s, warmup_timeout_s or timeout_s)
        self._served_a_step = False  # an EAGER or graph step was planned
        self.topology, self.fingerprint, self.device = topology, fingerprint, device
        self._control, self._data, self._timeout_s = control, data, timeout_s
        self._dtype = torch_dtype(fingerprint.dtype)
        self._hidden = fingerprint.hidden_size
        self._top_k = fingerprint.top_k
        self._gate = fingerprint.compute_gate_on_attention
        self._moe_layers = frozenset(fingerprint.moe_layers)
        # F2A columns by layer: H, or H * moe_output_parts for MoE layers.
        self._f2a_cols = {
            layer: self._hidden * fingerprint.moe_output_parts
            for layer in fingerprint.moe_layers
        }
        self._peer_ranks = topology.peers(role, role_rank)
        self._peers = topology.peer_global_ranks(role, role_rank)
        self._started = self._closed = False
        # The role while usable (started, not closed, not failed), else None.
        self._live: AFDRole | None = None
        self._tokens: tuple[int, ...] | None = None  # ubatch sizes of the step
        n_layers = min(fingerprint.num_layers, MAX_LAYERS)
        self._layers = (
            frozenset(fingerprint.moe_layers) & frozenset(range(n_layers))
            if fingerprint.compute_gate_on_attention
            else frozenset(range(n_layers))
        )
        self._on_cuda = device.type == "cuda"
        self._wait_timeout_s = timeout_s  # of the current step (_begin_step)
        self._failure: BaseException | None = None
        self._plan: StepPlan | None = None
        self._merged: MergedPlan | None = None
        self._step_id = 0  # of the current plan
        self._step_bits = 0  # its tag bits (protocol.step_tag)
        self._pending_sends: list[SendHandle] = []
        self._pool: dict[tuple[str, int], torch.Tensor] = {}
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        # ubatch -> (batch, [(peer, [(slice, kind)])], A2F bytes) of the
        # current FFN step.
        self._a2f_plan: dict[int, tuple[A2FBatch, list, int]] = {}
        # ubatch -> [(peer, offset, tokens)] of the current FFN step's F2A.
        self._f2a_plan: dict[int, list[tuple[int, int, int]]] = {}
        self._itemsize = self._dtype.itemsize
        # A2F bytes per token: hidden, plus topk weights and ids with the gate.
        self._a2f_row_bytes = self._hidden * self._itemsize + (
            2 * 4 * self._top_k if self._gate else 0
        )
        # (layer, ubatch) -> F2A receive posted by send_a2f (prepost_recv).
        self._preposted: dict[tuple[int, int], RecvHandle] = {}
        self._steps = self._a2f_bytes = self._f2a_bytes = self._errors = 0
        self._wait_s = 0.0

    @property
    def stats(self) -> ConnectorStats:
        return ConnectorStats(
            self._steps, self._a2f_bytes, self._f2a_bytes, self._wait_s, self._errors
        )

    def _check(self, role: AFDRole, method: str) -> None:
        if role is self._live:  # started, not closed, not failed: hot path
            return
        if role is not self.role:
            raise AFDConnectorError(
                f"{method}() is a {role.value}-role call, but this connector is "
                f"{self.role.value} rank {self.role_rank}"
            )
        if self._failure is not None:  # also after a failed start()
            raise AFDConnectorError(
                f"{method}(): the connector failed earlier and cannot be used: "
                f"{self._failure}"
            )
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started; call start() first"
            raise AFDConnectorError(f"{method}(): the connector is {state}")

    def _planned(self, layer_idx: int, ubatch_idx: int) -> int:
        """Tokens of (this rank | the merged batch) in ``ubatch_idx``."""
        tokens = self._tokens
        if (
            tokens is not None
            and layer_idx in self._layers
            and 0 <= ubatch_idx < len(tokens)
        ):
            return tokens[ubatch_idx]
        if tokens is None:
            what = "send_plan()" if self.role is ATT else "recv_plan()"
            raise AFDConnectorError(f"no step plan yet: call {what} first")
        if not 0 <= layer_idx < min(self.fingerprint.num_layers, MAX_LAYERS):
            raise AFDConnectorError(
                f"layer_idx={layer_idx} outside 0..{self.fingerprint.num_layers - 1}"
            )
        if self._gate and layer_idx not in self._moe_layers:
            raise AFDConnectorError(
                f"layer {layer_idx} is a dense layer: with compute_gate_on_attention "
                "it runs on attention and is not exchanged"
            )
        if not 0 <= ubatch_idx < len(tokens):
            if not any(tokens):
                return 0  # a rank with no work may send an empty plan
            raise AFDConnectorError(
                f"ubatch_idx={ubatch_idx} but the step plans {ubatches(len(tokens))}"
            )
        return tokens[ubatch_idx]

    def _check_tensor(
        self, name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
    ) -> None:
        on_device = t.is_cuda if self._on_cuda else t.is_cpu  # t.device is slow
        if t.shape == shape and t.dtype is dtype and on_device:
            return
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise AFDProtocolError(
                f"{name} is {tuple(t.shape)} {t.dtype}, but the step plan and "
                f"fingerprint expect {shape} {dtype}"
            )
        if t.device != self.device and t.device.type != self.device.type:
            raise AFDConnectorError(
                f"{name} is on {t.device}; this connector moves {self.device} tensors"
            )

    def _buffer(
        self, slot: str, index: int, shape: tuple[int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        view = self._views.get((slot, index))
        if view is not None and view.shape == shape:
            return view  # same size as last time: no tensor op at all
        need = shape[0] * shape[1]
        flat = self._pool.get((slot, index))
        if flat is None or flat.numel() < need:
            if flat is not None:
                # A captured CUDA graph may hold this buffer's address: it
                # must outlive the connector's use of it (sizes only grow).
                self._retired.append(flat)
            flat = torch.empty(need, dtype=dtype, device=self.device)
            self._pool[(slot, index)] = flat
        view = self._views[(slot, index)] = flat[:need].view(shape)
        return view

    def _begin_step(self, step_id: int, mode: ExecMode) -> None:
        """A new plan: its tag bits, and its waits' timeout (``warmup_timeout_s``
        in CAPTURE steps, in WARMUP steps until this endpoint served a step,
        and in its first served step, whose shapes run for the first time:
        lazily built kernels, first-touch allocations; ``timeout_s``
        otherwise). A WARMUP step after a served one is an idle
        data-parallel rank's dummy forward: at ``timeout_s`` a hung FFN rank
        does not hold it, nor, through vLLM's DP synchronisation, the ranks
        that serve requests. Both sides see the same plans, so they agree on
        each step's limit."""
        self._step_id, self._step_bits = step_id, step_tag(step_id)
        start_up = mode in (ExecMode.WARMUP, ExecMode.CAPTURE)
        slow = mode is ExecMode.CAPTURE or not self._served_a_step
        self._served_a_step = self._served_a_step or not start_up
        self._wait_timeout_s = self._warmup_timeout_s if slow else self._timeout_s
        self._steps += 1

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        try:
            return (self._data.isend(tensor, peer, tag), peer, tag, True)
        except AFDError as e:
            raise self._fail(e, peer, tag, True) from e

    def _recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        try:
            return (self._data.irecv(tensor, peer, tag), peer, tag, False)
        except AFDError as e:
            raise self._fail(e, peer, tag, False) from e

    def _drain_sends(self) -> None:
        handles, self._pending_sends = self._pending_sends, []
        for handle in handles:
            handle.wait()
        preposted, self._preposted = self._preposted, {}
        for recv in preposted.values():
            recv.wait()

    def _account_graph_step(self, ubatch_tokens: Sequence[int]) -> None:
        """Count the bytes of a step replayed from a CUDA graph, whose
        exchanges never reach Python."""
        tokens, size = sum(ubatch_tokens), self._dtype.itemsize
        routing = 2 * 4 * self._top_k if self._gate else 0
        self._a2f_bytes += len(self._layers) * tokens * (self._hidden * size + routing)
        self._f2a_bytes += tokens * size * sum(map(self.f2a_cols, self._layers))

    def f2a_cols(self, layer_idx: int) -> int:
        """Columns of layer ``layer_idx``'s F2A tensor (H or H * parts)."""
        return self._f2a_cols.get(layer_idx, self._hidden)

    def _wait_all(self, pending: Sequence[Pending]) -> None:
        t0 = time.perf_counter()
        timeout_s = self._wait_timeout_s
        for work, peer, tag, is_send in pending:
            # A wait ends, at the latest, when the peer counts as lost for its
            # heartbeat silence: a wait begun just before that (a data-parallel
            # rank that starts its next step as its peer's fails) does not
            # wait its whole timeout on top of the silence.
            lost_in = self._control.lost_in() + _SILENCE_MARGIN_S
            try:
                work.wait(min(timeout_s, max(lost_in, _SILENCE_MARGIN_S)))
            except AFDError as e:
                self._wait_s += time.perf_counter() - t0
                raise self._fail(e, peer, tag, is_send) from e
        self._wait_s += time.perf_counter() - t0

    def _peer_name(self, peer: int) -> str:
        role, rank = self.topology.role_of(peer)
        return f"{role.value} rank {rank}"

    def _fail(
        self,
        err: AFDError,
        peer: int | None = None,
        tag: int | None = None,
        is_send: bool = False,
    ) -> AFDError:
        """Record ``err`` (the connector is unusable after it), add context."""
        self._errors += 1
        if peer is not None and tag is not None:
            key = ExchangeKey.from_tag(tag, self._step_id)
            name = self._peer_name(peer)
            what = key.describe(f"{'to' if is_send else 'from'} {name}")
            verb = "sending" if is_send else "waiting for"
            why = self._control.peer_failure(peer)
            if why is None and isinstance(err, AFDPeerError):
                # The data connection dropped first; give the control channel
                # a moment to tell a SHUTDOWN from a crash.
                for _ in range(_SETTLE_POLLS):
                    time.sleep(_SETTLE_S)
                    if (why := self._control.peer_failure(peer)) is not None:
                        break
            if why is not None:
                # a peer that stopped for good ends the step as a stop does
                cls = (
                    AFDPeerStopped if self._control.peer_stopped(peer) else AFDPeerError
                )
                err = cls(f"{name} {why} while {verb} {what}")
            elif isinstance(err, AFDTimeoutError):
                err = AFDTimeoutError(
                    f"timed out after {self._wait_timeout_s}s {verb} {what}"
                )
            elif isinstance(err, AFDPeerError):
                err = AFDPeerError(f"{name} is gone ({err}) while {verb} {what}")
        self._failure = err
        self._live = None
        return err
