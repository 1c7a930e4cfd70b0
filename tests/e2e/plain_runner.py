"""Plain vLLM baselines of many models in one process (``harness.PlainRunner``).

A plain ``vllm serve`` costs a process start, vLLM's imports and an engine
core start on top of loading the model; on two cores that is most of the
30-45 s a baseline took. This process imports vLLM once and, for each request
it reads (one JSON line on stdin), builds the pinned vLLM's own offline engine
(``vllm.LLM``, the engine core in this process) from the same command-line
arguments the plain server would get, generates every prompt greedily with
top-5 logprobs, frees the engine and answers (one JSON line on the file
descriptor given as its argument; vLLM's log goes to stdout). A request that
fails is answered with the error and ends the process (vLLM's process-wide
state is then half built); the harness starts a new one for the next.

Request: ``{"model": str, "args": [vLLM CLI args], "jobs": [[prompt,
max_tokens], ...]}``, a prompt being a text or a chat request's messages
(``LLM.enqueue_chat``, as the server's ``/v1/chat/completions`` renders and
processes them), every request queued in the workload's order before the
engine steps. Answer:
``{"outputs": [{"token_ids": [...], "top_logprobs": [[[id, logprob], ...],
...]}, ...]}`` or ``{"error": str}``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process


def _engine_kwargs(model: str, args: list[str]) -> dict:
    """``LLM`` keyword arguments of ``vllm serve MODEL ARGS``: the fields of
    vLLM's own parse of that command line that differ from their defaults,
    and the server's token budget of a step where the command line leaves
    it to vLLM: vLLM's default depends on who builds the engine (on CPU 2048
    for a server, 4096 for ``LLM``), and a step of another budget holds
    other rows, which fp32 GEMMs round otherwise."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *args]))
    default = EngineArgs(model=model)
    kwargs = {
        f.name: getattr(parsed, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.init and getattr(parsed, f.name) != getattr(default, f.name)
    } | {"model": model}
    if parsed.max_num_batched_tokens is None:
        world = parsed.pipeline_parallel_size * parsed.tensor_parallel_size
        budgets, _ = EngineArgs.get_batch_defaults(world)
        kwargs["max_num_batched_tokens"] = budgets[UsageContext.OPENAI_API_SERVER]
    return kwargs


def _run(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm = LLM(**_engine_kwargs(request["model"], request["args"]))
    try:
        jobs = request["jobs"]
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
            for _, n in jobs
        ]
        # every request queued, in the workload's order, before the engine
        # steps (the engine is in this process: nothing steps until asked)
        for (prompt, _), param in zip(jobs, params, strict=True):
            enqueue = llm.enqueue if isinstance(prompt, str) else llm.enqueue_chat
            enqueue([prompt], [param], use_tqdm=False)
        # in the order queued (vLLM sorts them by request number)
        done = llm.wait_for_completion(use_tqdm=False)
        assert len(done) == len(jobs), (len(done), len(jobs))
        outputs = []
        for i in range(len(jobs)):
            sample = done[i].outputs[0]
            outputs.append(
                {
                    "token_ids": list(sample.token_ids),
                    "top_logprobs": [
                        [
                            [tok, lp.logprob]
                            for tok, lp in step.items()
                            if lp.rank is not None and lp.rank <= 5
                        ]
                        for step in sample.logprobs
                    ],
                }
            )
        return {"outputs": outputs}
    finally:
        del llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()


def main() -> None:
    reply = os.fdopen(int(sys.argv[1]), "w")
    for line in sys.stdin:
        try:
            answer = _run(json.loads(line))
        except Exception:
            # vLLM's process-wide state (its distributed groups) is left half
            # built: answer, and end; the next request starts a new process
            reply.write(json.dumps({"error": traceback.format_exc()}) + "\n")
            reply.flush()
            sys.exit(1)
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
