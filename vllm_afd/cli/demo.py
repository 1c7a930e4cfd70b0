"""``vllm-afd demo``: AFD answering requests, checked against plain vLLM.

Makes a tiny DeepSeek model if missing, launches it 1A1F with AFD, sends
prompts through the OpenAI API (completions, chat, streaming), reads the AFD
counters from ``/metrics`` and stops it; plain vLLM on the same model and
settings, started beside the deployment, answers the same prompts. Prints
both outputs, ``identical: yes/no`` and the per-step AFD figures. Exits 0
only when the outputs are identical.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_afd.cli.client import (
    DEMO_PROMPTS,
    Answers,
    afd_metrics,
    collect_answers,
    per_step_figures,
)
from vllm_afd.cli.launch import add_log_flags, console_and_logs
from vllm_afd.deploy import Deployment, DeploymentSpec, PlainServer

DEFAULT_DIR = Path.home() / ".cache" / "vllm-afd" / "tiny"
DEMO_VLLM_ARGS = [
    # A KV cache the tiny model fits in many times over; without it vLLM
    # sizes the cache by --gpu-memory-utilization (on CPU: of the RAM).
    "--kv-cache-memory-bytes",
    "256M",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--dtype",
    "float32",
    "--seed",
    "0",
    # Eager: torch.compile would spend minutes compiling the tiny model on a
    # CPU before the first answer (compiled AFD is as exact; see
    # docs/architecture.md, Exactness).
    "--enforce-eager",
]


def demo_vllm_args(arch: str) -> list[str]:
    """:data:`DEMO_VLLM_ARGS`, in the dtype plain vLLM serves ``arch`` in on
    CPU (``tiny_hf.CPU_DTYPES``: bf16 for Qwen3-Next), with
    ``--trust-remote-code`` for a family whose config class is code in the
    checkpoint (``tiny_remote.REMOTE_FAMILIES``: Ling, Ling 2.0, DeepSeek-MoE,
    Sarvam, Param2, openPangu)."""
    from vllm_afd.models.tiny_hf import CPU_DTYPES
    from vllm_afd.models.tiny_remote import REMOTE_FAMILIES

    args = list(DEMO_VLLM_ARGS)
    args[args.index("--dtype") + 1] = CPU_DTYPES.get(arch, "float32")
    if arch in REMOTE_FAMILIES:
        args.append("--trust-remote-code")
    return args


def demo_archs() -> list[str]:
    """The ``--arch`` values ``demo`` serves: the tiny families plain vLLM
    serves on CPU that a family record covers."""
    from vllm_afd.models.tiny_checkpoint import TINY_ARCHS
    from vllm_afd.models.tiny_hf import GPU_ONLY_ARCHS, UNSERVED_ARCHS

    return [a for a in TINY_ARCHS if a not in GPU_ONLY_ARCHS + UNSERVED_ARCHS]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve a tiny model with AFD and compare")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"tiny model directory (default {DEFAULT_DIR}-<arch>)",
    )
    p.add_argument(
        "--arch",
        choices=demo_archs(),
        default="deepseek_v2",
        help="model family of the tiny model (default deepseek_v2)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--afd-port", type=int, default=29650)
    p.add_argument(
        "--plain-port",
        type=int,
        default=None,
        help="plain vLLM's API port (default --port + 2: the FFN role has --port + 1)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    add_log_flags(p)
    p.set_defaults(func=run_demo)


def _print_answers(title: str, answers: Answers) -> None:
    print(f"\n== {title}")
    pairs = zip(DEMO_PROMPTS, answers.completions, strict=True)
    for i, (prompt, text) in enumerate(pairs):
        print(f"  [{i}] {prompt!r} -> {text!r}")
    print(f"  chat      -> {answers.chat!r}")
    print(f"  streaming -> {answers.stream!r}")


def run_demo(args: argparse.Namespace) -> int:
    from vllm_afd.deploy.cpu_mla import cpu_mla_args
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint
    from vllm_afd.models.tiny_hf import GATE_ON_ATTENTION_ARCHS, lacks_processor

    model_dir = args.model_dir or Path(f"{DEFAULT_DIR}-{args.arch}")
    if not (model_dir / "config.json").exists() or lacks_processor(
        args.arch, model_dir
    ):
        print(f"writing tiny {args.arch} model to {model_dir}", flush=True)
        write_tiny_checkpoint(model_dir, arch=args.arch, num_layers=4)
    log, log_dir = console_and_logs(args, "demo")
    vllm_args = demo_vllm_args(args.arch)
    spec = DeploymentSpec(
        model=str(model_dir),
        port=args.port,
        afd_port=args.afd_port,
        vllm_args=[*vllm_args, *cpu_mla_args(model_dir, vllm_args)],
        # families served with the gate on attention only (tiny_hf says why)
        gate_on_attention=args.arch in GATE_ON_ATTENTION_ARCHS,
    )
    plain_port = args.plain_port or args.port + 2
    plain = PlainServer(spec, log=log, port=plain_port, log_dir=log_dir)
    print(
        "starting AFD 1A1F (attention + FFN), and plain vLLM on the same model "
        f"and settings beside it (port {plain_port}) ...",
        flush=True,
    )
    # Both start at once: most of a start is one core importing vLLM, so
    # three servers start in little more than the time of two.
    plain.begin()
    try:
        with Deployment(spec, log=log, log_dir=log_dir) as afd:
            print(f"AFD ready: {afd.api_url}/v1", flush=True)
            afd_answers = collect_answers(afd.api_url, args.max_tokens)
            metrics = _published_metrics(afd.api_url)
        plain.wait_ready()
        print(f"plain vLLM ready: {plain.url}/v1", flush=True)
        plain_answers = collect_answers(plain.url, args.max_tokens)
    finally:
        plain.stop()

    _print_answers("AFD 1A1F", afd_answers)
    _print_answers("plain vLLM", plain_answers)
    identical = afd_answers == plain_answers
    print(f"\nidentical: {'yes' if identical else 'no'}")
    print("\nAFD per step (attention rank 0):")
    for key, value in per_step_figures(metrics).items():
        print(f"  {key:28s} {value}")
    return 0 if identical else 1


def _published_metrics(url: str, timeout_s: float = 10.0) -> dict:
    """The AFD counters once the worker's publisher (every 0.5 s) has put the
    served steps on ``/metrics``; what is there after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    metrics = afd_metrics(url)
    while time.monotonic() < deadline:
        if any(key[0] == "afd_steps" and v > 0 for key, v in metrics.items()):
            return metrics
        time.sleep(0.25)
        metrics = afd_metrics(url)
    return metrics
