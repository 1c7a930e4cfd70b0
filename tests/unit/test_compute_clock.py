"""The FFN loop's compute clock on CPU: host time around each span (the work
runs inside the call); CUDA's event clock is checked in
tests/gpu/test_compute_clock_gpu.py."""

from __future__ import annotations

import time

import torch

from vllm_afd.worker.compute_clock import HostClock, clock_for
from vllm_afd.worker.ffn_loop import FFNLoopStats


def test_a_cpu_device_gets_the_host_clock_and_it_adds_up_its_spans():
    clock = clock_for(torch.device("cpu"))
    assert isinstance(clock, HostClock)
    for _ in range(2):
        with clock.span():
            time.sleep(0.01)
    assert clock.seconds() >= 0.02


def test_the_loop_counter_reads_its_clock_and_a_failed_span_still_counts():
    stats = FFNLoopStats()
    try:
        with stats.clock.span():
            time.sleep(0.01)
            raise RuntimeError("compute failed")
    except RuntimeError:
        pass
    assert stats.compute_s == stats.clock.seconds() >= 0.01
