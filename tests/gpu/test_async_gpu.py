"""The ``async`` connector on one GPU: every role on GPU 0 under MPS, eager
or with the attention role in piecewise CUDA graphs (the exchange a
splitting op between them, tests/unit/test_async_graphs.py), the experts
split over the FFN ranks, token-for-token against plain vLLM on the same GPU
and settings (16 prompts of 1-200 tokens). The 1A1F cases stage their rows
through host memory (``payload: socket``); the split case runs on both
planes, host-staged and device to device (``payload: cuda_ipc``), so that a
difference between them shows which plane it belongs to (on one H100 in
TF32 the ``cuda_ipc`` case failed on top-5 logprobs, greedy tokens
identical; in IEEE float32 both passed on one H200: docs/prefill.md). On CPU the same
topologies are checked in tests/e2e/test_families.py.

1A1F runs in bf16 (one FFN rank runs vLLM's kernel on exactly plain vLLM's
rows). With the experts split the FFN ranks' partial sums are added on the
attention rank, another order of roundings: in bf16 on one H200 Qwen3-MoE
1A2F gave 13 of 16 greedy requests identical (docs/prefill.md), so the split
case runs in float32 (vLLM's Triton attention takes it), where the sum
differs from plain vLLM's by float32 rounding only (as on CPU: top-5
logprobs within 1e-4). Triton rounds a float32 dot product's inputs to TF32
unless told otherwise, and vLLM's Triton attention picks its kernel by the
step's mix of prefills and decodes, so in float32 a request's logprobs move
by TF32 roundings (~1e-3) with the steps its neighbours happen to share:
every server of the float32 cases runs Triton's dots in IEEE float32
(``TRITON_F32_DEFAULT=ieee``, with a Triton cache of their own).
DeepSeek-V3 runs 1A1F: vLLM's MLA backends on a GPU take bf16 and fp16
only, where a split cannot be exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_harness import ONE_GPU_ARGS, afd_and_plain, same_count
from harness import assert_same_outputs, make_spec, prompts

from vllm_afd.models.exchange import SPLITTING_OP

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

#: logprob tolerance: bf16's resolution, or float32 sums in another order
ATOL = {"bfloat16": 1e-2, "float32": 1e-4}
#: (family, attention ranks, FFN ranks, the connector option payload, graphs)
CASES = [
    ("qwen3_moe", 1, 2, "cuda_ipc", "eager"),
    ("qwen3_moe", 1, 2, "socket", "eager"),
    ("deepseek_v3", 1, 1, "socket", "eager"),
    ("qwen3_moe", 1, 1, "socket", "eager"),
    ("qwen3_moe", 1, 1, "cuda_ipc", "piecewise"),
    ("qwen3_moe", 1, 2, "cuda_ipc", "piecewise"),
]
#: vLLM's compiled forward in piecewise CUDA graphs, on both servers
PIECEWISE = ["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}']


def _args(ffn_ranks: int, graphs: str) -> list[str]:
    """bf16 eager with one FFN rank; float32 with the experts split, and in
    piecewise graphs: compiled bf16 of a model without shared experts rounds
    the MoE output to bf16 at the exchange, which plain vLLM's compiled
    forward need not do, so greedy ids can part in near-ties (the attention
    role warns; on one H100 the 1A1F bf16 case differed from plain vLLM)."""
    args = list(ONE_GPU_ARGS)
    if ffn_ranks > 1 or graphs == "piecewise":
        args[args.index("--dtype") + 1] = "float32"
    if graphs == "piecewise":
        args = [a for a in args if a != "--enforce-eager"] + PIECEWISE
    return args


@pytest.mark.parametrize(
    "arch,ranks,ffn_ranks,payload,graphs",
    CASES,
    ids=[f"{a}-{n}A{f}F-{p}-{g}" for a, n, f, p, g in CASES],
)
def test_async_on_one_gpu_equals_plain_vllm(
    gpu_tiny_models: dict[str, Path],
    tmp_path: Path,
    arch: str,
    ranks: int,
    ffn_ranks: int,
    payload: str,
    graphs: str,
    mps: None,
) -> None:
    args = _args(ffn_ranks, graphs)
    env = {}
    if "float32" in args:
        cache = tmp_path.parent / "triton-f32-ieee"  # shared by these cases
        env = {"TRITON_F32_DEFAULT": "ieee", "TRITON_CACHE_DIR": str(cache)}
    spec = make_spec(
        gpu_tiny_models[arch],
        args,
        attention_ranks=ranks,
        ffn_ranks=ffn_ranks,
        connector="async",
        attention_devices="0",
        ffn_devices=",".join(["0"] * ffn_ranks),  # every FFN rank on GPU 0
        connector_extra_config={"payload": payload},
    )
    afd_out, plain_out, ffn = afd_and_plain(spec, prompts(16), tmp_path, env)
    same = same_count(afd_out, plain_out)
    print(f"{arch} {ranks}A{ffn_ranks}F async, payload {payload}, {graphs}: {same}/16")
    assert_same_outputs(afd_out, plain_out, ATOL[args[args.index("--dtype") + 1]])
    assert ffn[("afd_steps", "ffn", "0")] > 0
    if graphs == "piecewise":  # the attention role captured them, split at the op
        log = (tmp_path / "afd.log").read_text()
        assert SPLITTING_OP in log and "PIECEWISE" in log, log[-3000:]


def test_async_refuses_stages_on_cuda() -> None:
    """Request-boundary stages run on the CPU attention role only so far."""
    from types import SimpleNamespace

    from vllm_afd.compat.engine_config import check_ubatches_supported
    from vllm_afd.config import parse_afd_config
    from vllm_afd.errors import AFDConfigError

    afd = parse_afd_config(
        {"role": "attention", "connector": "async", "num_ubatches": 2}
    )
    with pytest.raises(AFDConfigError, match="on CPU only so far"):
        check_ubatches_supported(afd, SimpleNamespace(tensor_parallel_size=1))
