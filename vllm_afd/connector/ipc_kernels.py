"""Device-side flags of the ``cuda_ipc`` data plane (Triton, one program each).

::

    sender (after copying a payload into the peer's buffer)
      signal:  seq = ++sent[slot]
               release-store flag_peer[slot] = seq << SEQ_SHIFT | layer
               (| POISON when this endpoint already failed)
    receiver (before reading the payload out of the shared buffer)
      wait:    want = ++seen[slot]; spin (acquire loads) until the flag's seq
               reaches want, the abort word is set, or timeout_ns passed
               (%globaltimer); a flag other than want << SEQ_SHIFT | layer
               (another exchange count or layer, or POISON), abort or timeout
               -> the error record

Counters live in device memory, so a captured CUDA graph replays with the
right sequence numbers. A failed wait sets the endpoint's ``failed`` word
(device memory; later signals then poison their flags, so the peer fails
too) and the error record; the record and the abort word live in pinned host
memory: the host reads and writes them without a device sync, and a wait
that went well reads neither (a host read from the device costs about a
microsecond). Both kernels hold one SM while they run and none between
exchanges.

Error record (int64): [code, slot, flag found, flag expected]; codes below.
"""

from __future__ import annotations

import triton
import triton.language as tl

OK, TIMEOUT, MISMATCH, POISONED, ABORTED = 0, 1, 2, 3, 4
#: bit set in a flag by a sender whose endpoint already failed in this step
POISON = 1 << 62
#: the layer index takes the flag's low bits (protocol.MAX_LAYERS = 1024)
SEQ_SHIFT = 10


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize=["n", "layer"])
def copy_signal_kernel(
    src_ptr, dst_ptr, n, flag_ptr, sent_ptr, failed_ptr, ticket_ptr, layer,
    BLOCK: tl.constexpr, POISON_BIT: tl.constexpr, SEQ_SHIFT: tl.constexpr,
):  # fmt: skip
    """The ``sm`` copy: every program copies its block into the peer's
    buffer; the last one to finish (a ticket) stores the flag, as
    :func:`signal_kernel` does, and resets the ticket."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
        seq = tl.load(sent_ptr) + 1
        tl.store(sent_ptr, seq)
        failed = tl.load(failed_ptr, volatile=True)
        value = (seq << SEQ_SHIFT) | layer
        value = tl.where(failed != 0, value | POISON_BIT, value)
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["layer"])
def signal_kernel(
    flag_ptr, sent_ptr, failed_ptr, layer, POISON_BIT: tl.constexpr,
    SEQ_SHIFT: tl.constexpr,
):  # fmt: skip
    seq = tl.load(sent_ptr) + 1
    tl.store(sent_ptr, seq)
    failed = tl.load(failed_ptr, volatile=True)
    value = (seq << SEQ_SHIFT) | layer
    value = tl.where(failed != 0, value | POISON_BIT, value)
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["timeout_ns", "slot", "layer"])
def wait_kernel(
    flag_ptr,
    seen_ptr,
    failed_ptr,
    record_ptr,
    abort_ptr,
    timeout_ns,
    slot,
    layer,
    POISON_BIT: tl.constexpr,
    SEQ_SHIFT: tl.constexpr,
    ABORT_EVERY: tl.constexpr,
):
    want = tl.load(seen_ptr) + 1
    tl.store(seen_ptr, want)
    start = _now()
    got = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    aborted = (got * 0).to(tl.int32)  # read after ABORT_EVERY spins
    elapsed = start - start
    i = 0
    while (
        ((got & ~POISON_BIT) >> SEQ_SHIFT < want)
        & (aborted == 0)
        & (elapsed < timeout_ns)
    ):
        got = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        elapsed = _now() - start
        i += 1
        if i % ABORT_EVERY == 0:  # host memory: read it now and then
            aborted = tl.load(abort_ptr, volatile=True)
    expect = (want << SEQ_SHIFT) | layer
    arrived = (got & ~POISON_BIT) >> SEQ_SHIFT >= want
    code = tl.where(got == expect, 0, 2)
    code = tl.where((got & POISON_BIT) != 0, 3, code)
    code = tl.where(~arrived & (aborted != 0), 4, code)
    code = tl.where(~arrived & (aborted == 0), 1, code)
    bad = code != 0
    tl.store(failed_ptr, code.to(tl.int64), mask=bad)
    # masked: a wait that went well reads no host memory
    keep = bad & (tl.load(record_ptr, mask=bad, other=1, volatile=True) == 0)
    tl.store(record_ptr + 1, slot, mask=keep)
    tl.store(record_ptr + 2, got, mask=keep)
    tl.store(record_ptr + 3, expect, mask=keep)
    tl.store(record_ptr, code.to(tl.int64), mask=keep)
