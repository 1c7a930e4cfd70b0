"""``vllm-afd bench``: decode benchmark against a plain-vLLM baseline."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="decode benchmark against plain vLLM")
    p.set_defaults(func=lambda args: print("not implemented yet") or 2)
