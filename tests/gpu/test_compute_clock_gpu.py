"""The FFN loop's compute clock on CUDA (``worker.compute_clock``): device
time from CUDA events, not the host time of launching the kernels, read
without synchronizing; spans inside a CUDA graph capture are not timed."""

from __future__ import annotations

import time

import pytest
import torch

from vllm_afd.worker.compute_clock import CudaEventClock, clock_for

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

#: GPU clock cycles each span spins (``torch.cuda._sleep``): ~10 ms at ~1.8 GHz
CYCLES = 18_000_000


def test_event_clock_counts_device_time_of_launched_work_once_it_finished():
    torch.cuda.set_device(0)
    clock = clock_for(torch.device("cuda", 0))
    assert isinstance(clock, CudaEventClock)
    ref_start, ref_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    # The first launch of a kernel loads its module (CUDA's lazy loading):
    # 15 ms of host time on one H100, which is not the launch cost measured
    # below. Load it, and make the events, before timing.
    torch.cuda._sleep(1)
    warm = torch.cuda.Event(enable_timing=True)
    warm.record()
    torch.cuda.synchronize()
    launch = time.perf_counter()
    ref_start.record()
    for _ in range(4):
        with clock.span():
            torch.cuda._sleep(CYCLES)
    ref_end.record()
    launch = time.perf_counter() - launch
    early = clock.seconds()  # the device is still spinning: not all counted
    torch.cuda.synchronize()
    device = ref_start.elapsed_time(ref_end) / 1e3
    counted = clock.seconds()
    ms = {k: f"{v * 1e3:.2f} ms" for k, v in locals().items() if isinstance(v, float)}
    print(f"launch {ms['launch']}, device {ms['device']}, clock {ms['counted']} "
          f"(read early: {ms['early']})")  # fmt: skip
    assert early < counted
    # the four spans are the reference window's work, less the gaps between
    assert 0.95 * device <= counted <= device
    assert launch < counted / 4


def test_a_span_inside_a_graph_capture_is_not_timed_and_capture_works():
    torch.cuda.set_device(0)
    clock = CudaEventClock()
    x = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.mul_(1.0)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph), clock.span():
        x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert clock.seconds() == 0.0
    assert x[0].item() == 2.0
