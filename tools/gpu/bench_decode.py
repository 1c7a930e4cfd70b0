"""Decode throughput: AFD 1A1F on two GPUs vs plain vLLM TP2 on the same two.

DeepSeek-V2-Lite shapes (27 layers, hidden 2048, 64 routed experts top-6,
2 shared) with ``--load-format dummy``: a config-only model directory (plus
the tiny local tokenizer, whose small vocabulary replaces V2-Lite's 102400:
a smaller lm_head), no weights. For each batch size B, B concurrent
requests of ``--input-len`` prompt tokens and ``--output-len`` greedy new
tokens (``ignore_eos``). Each batch runs once untimed, then ``--repeats``
times timed; reported: the median's output tokens/s and mean time per step
(all wall times kept), for AFD the FFN's steps, micro-batched steps and graph
replays over the timed rounds, and per batch the ratio of AFD to the best
baseline. Both run ``--enforce-eager`` unless ``--cuda-graphs`` (vLLM's
default compilation and CUDA graphs on both) or ``--compilation-config``.

    python tools/gpu/bench_decode.py --out bench.json [--batches 16,32,...] \
        [--repeats 3] [--cuda-graphs] [--baselines tp2,dp2ep2] \
        [--afd-ubatches 1,2]

``--afd-ubatches 1,2`` runs AFD once per value of ``afd.num_ubatches``
(setups ``afd-1a1f`` and ``afd-1a1f-ub2``); every AFD setup gets its ratio to
the best baseline, and ``afd-1a1f-ub2`` also its ratio to ``afd-1a1f`` at
the same batch and to ``afd-1a1f`` at half the batch ("B/2 twice": two half
steps back to back, which is what a split step costs without overlap).

``--profile-batch B`` (B one of ``--batches``) records 20 decode steps of
batch B on both AFD roles during B's untimed round (``AFD_PROFILE_TOKENS``)
and reports each AFD setup's GPU time per role and overlap efficiency from
the traces (``overlap_report.py``), under ``overlap`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_afd import envs
from vllm_afd.cli.bench import settled_counters
from vllm_afd.cli.client import post_json, served_model
from vllm_afd.deploy import Deployment, DeploymentSpec, PlainServer
from vllm_afd.models.tiny_checkpoint import write_tiny_checkpoint

#: DeepSeek-V2-Lite's published shapes
V2_LITE = {
    "num_hidden_layers": 27,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 4096,
}


def write_v2_lite_config(out: Path) -> Path:
    """A DeepSeek-V2-Lite-shaped model directory for ``--load-format dummy``."""
    write_tiny_checkpoint(
        out, arch="deepseek_v2", num_layers=2, gpu_dims=True, dtype="bfloat16"
    )
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    config.update(V2_LITE)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


#: attention on GPU 0, FFN on GPU 1; a baseline gets both
DEVICES = {"attention_devices": "0", "ffn_devices": "1"}


def one_request_each(url: str, model: str, batch: int, args: argparse.Namespace):
    """B separate requests in flight (the scheduler batches them), timed as one:
    output tokens and wall seconds."""

    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": [5 + (i * 7 + j) % 200 for j in range(args.input_len)],
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        return post_json(f"{url}/v1/completions", body, timeout=600)["usage"][
            "completion_tokens"
        ]

    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(one, range(batch)))
    return tokens, time.perf_counter() - start


#: FFN-side counters read around every timed batch (``afd_*_total``)
STEP_COUNTERS = ("afd_steps", "afd_ffn_ubatched_steps", "afd_ffn_graph_replays")


def step_counts(ffn_url: str | None) -> dict[str, float]:
    if ffn_url is None:
        return {}
    found = settled_counters(ffn_url, [])
    return {
        name: sum(v for (n, role, _), v in found.items() if n == name and role == "ffn")
        for name in STEP_COUNTERS
    }


def batch_row(
    batch: int, samples: list[tuple[int, float]], output_len: int
) -> dict[str, object]:
    """One batch's figures from its timed repeats: the median wall time."""
    walls = sorted(wall for _, wall in samples)
    wall = statistics.median(walls)
    tokens = samples[0][0]
    return {
        "batch": batch,
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_per_s": tokens / wall,
        "ms_per_step": 1e3 * wall / output_len,
        "wall_s_samples": [round(w, 4) for w in walls],
    }


def measure(
    url: str, args: argparse.Namespace, label: str, ffn_url: str | None = None
) -> Iterator[dict]:
    """Per batch: one untimed round at that batch, then ``--repeats`` timed."""
    model = served_model(url)
    for batch in args.batches:
        one_request_each(url, model, batch, args)
        before = step_counts(ffn_url)
        samples = [
            one_request_each(url, model, batch, args) for _ in range(args.repeats)
        ]
        after = step_counts(ffn_url)
        row = batch_row(batch, samples, args.output_len)
        row["setup"] = label
        row.update({k: after[k] - before[k] for k in after})
        print(json.dumps(row), flush=True)
        yield row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--log", help="servers' logs")
    p.add_argument("--batches", default="16,32,64,128,256")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds per batch after one untimed round; the median counts",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="drop --enforce-eager")
    p.add_argument(
        "--compilation-config",
        help="vLLM --compilation-config JSON for AFD and baselines alike "
        "(implies --cuda-graphs)",
    )
    p.add_argument("--skip-afd", action="store_true")
    p.add_argument(
        "--profile-batch",
        type=int,
        help="trace 20 decode steps of this batch on both AFD roles (its "
        "untimed round) and report GPU time per role and overlap efficiency",
    )
    p.add_argument(
        "--afd-ubatches",
        default="1",
        help="afd.num_ubatches values to run AFD with, comma-separated",
    )
    p.add_argument(
        "--baselines",
        default="tp2",
        help="plain vLLM set-ups on the same 2 GPUs, comma-separated: tp2 "
        "(--tensor-parallel-size 2), dp2ep2 (--data-parallel-size 2 "
        "--enable-expert-parallel); empty for none",
    )
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.profile_batch is not None and args.profile_batch not in args.batches:
        p.error(f"--profile-batch {args.profile_batch} is not one of --batches")
    model_dir = write_v2_lite_config(Path(tempfile.mkdtemp()) / "v2-lite")
    common = [
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.input_len + args.output_len + 16),
        "--max-num-seqs",
        str(max(args.batches)),
        "--gpu-memory-utilization",
        "0.5",
    ]
    if args.compilation_config:
        common += ["--compilation-config", args.compilation_config]
    elif not args.cuda_graphs:
        common.append("--enforce-eager")
    log = open(args.log, "w") if args.log else sys.stdout  # noqa: SIM115
    report = {
        "model": "DeepSeek-V2-Lite shapes, dummy weights",
        "args": common,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rows": [],
        "overlap": {},
    }
    port = 8600
    spec = DeploymentSpec(
        model=str(model_dir),
        port=port,
        ffn_port=port + 1,
        afd_port=port + 10,
        vllm_args=common,
        **DEVICES,
    )

    def save() -> None:
        report["ratios"] = ratios(report["rows"])
        Path(args.out).write_text(json.dumps(report, indent=2))

    def record(rows: Iterator[dict]) -> None:
        for row in rows:  # saved row by row: a run cut short keeps its rows
            report["rows"].append(row)
            save()

    for ubatches in [] if args.skip_afd else map(int, args.afd_ubatches.split(",")):
        spec.ubatches = ubatches
        setup = afd_setup(ubatches)
        traces = Path(args.out).with_name(f"traces-{setup}")
        graphs = bool(args.compilation_config or args.cuda_graphs)
        profiling = _profile_env(traces, args.profile_batch, graphs)
        afd = Deployment(spec, log=log)
        try:
            afd.start(ready_timeout=400)
            record(measure(afd.api_url, args, setup, afd.ffn.url))
        finally:
            afd.stop()
            for name in profiling:
                os.environ.pop(name, None)
        if profiling:
            report["overlap"][setup] = overlap(traces, V2_LITE["num_hidden_layers"])
            save()
    for name in filter(None, args.baselines.split(",")):
        baseline = DeploymentSpec(
            model=str(model_dir),
            port=port,
            vllm_args=[*common, *BASELINES[name]],
            **DEVICES,
        )
        plain = PlainServer(baseline, log=log)
        try:
            plain.start(ready_timeout=400)
            record(measure(plain.url, args, f"plain-{name}"))
        finally:
            plain.stop()
    save()
    for row in report["rows"]:
        steps = "".join(
            f" {name.removeprefix('afd_')} {row[name]:.0f}"
            for name in STEP_COUNTERS
            if name in row
        )
        print(
            f"{row['setup']:>13} B={row['batch']:>4} {row['tok_per_s']:9.1f} tok/s "
            f"{row['ms_per_step']:7.2f} ms/step{steps}"
        )
    for row in report["ratios"]:
        print(
            f"B={row['batch']:>4} {row['setup']} / {row['best']} = {row['ratio']:.3f}"
        )
    return 0


def _profile_env(traces: Path, batch: int | None, graphs: bool) -> dict[str, str]:
    """Set (and return) the step profiler's variables for the AFD roles,
    which inherit this process's environment; none without a batch. With
    graphs only replayed steps count (start-up runs a batch of B eagerly)."""
    if batch is None:
        return {}
    env = {
        envs.AFD_PROFILE_DIR: str(traces),
        envs.AFD_PROFILE_TOKENS: str(batch),
        envs.AFD_PROFILE_MODES: "REPLAY" if graphs else "EAGER",
        envs.AFD_PROFILE_STEPS: "20",
    }
    os.environ.update(env)
    return env


def overlap(traces: Path, layers: int) -> dict:
    """``overlap_report`` on one setup's traces: printed, and its groups."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import overlap_report

    try:
        rows, groups, _, _ = overlap_report.report_traces(directory=traces)
    except (ValueError, OSError) as e:
        print(f"overlap: {e}", flush=True)
        return {"error": str(e)}
    print(overlap_report.table(groups, layers), flush=True)
    return {"groups": groups, "steps": rows}


def afd_setup(ubatches: int) -> str:
    return "afd-1a1f" if ubatches == 1 else f"afd-1a1f-ub{ubatches}"


#: plain vLLM baselines on the same two GPUs
BASELINES = {
    "tp2": ["--tensor-parallel-size", "2"],
    "dp2ep2": ["--data-parallel-size", "2", "--enable-expert-parallel"],
}


def ratios(rows: list[dict]) -> list[dict]:
    """Per batch and AFD setup: throughput over the best plain baseline's; for
    micro-batched AFD also over AFD without micro-batches, and over the two
    halves run back to back (``afd-1a1f`` at B/2, whose throughput is exactly
    that of two B/2 steps in a row): above 1 only if the halves overlap."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        here = [r for r in rows if r["batch"] == batch]
        afd = [r for r in here if r["setup"].startswith("afd-")]
        plain = [r for r in here if not r["setup"].startswith("afd-")]
        one = [r for r in afd if r["setup"] == "afd-1a1f"]
        halves = [
            r for r in rows if r["setup"] == "afd-1a1f" and 2 * r["batch"] == batch
        ]
        for row in afd:
            against = []
            if plain:
                best = max(plain, key=lambda r: r["tok_per_s"])
                against.append((best["setup"], best))
            if one and row is not one[0]:
                against.append(("afd-1a1f", one[0]))
            if halves and row["setup"] != "afd-1a1f":
                against.append(("afd-1a1f B/2 twice", halves[0]))
            for name, base in against:
                out.append(
                    {
                        "batch": batch,
                        "setup": row["setup"],
                        "best": name,
                        "ratio": row["tok_per_s"] / base["tok_per_s"],
                    }
                )
    return out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("NCCL_DEBUG", "INFO")  # the log shows the NCCL transport
    raise SystemExit(main())
