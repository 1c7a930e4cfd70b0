"""The FFN links' vote in vLLM's per-forward DP all-reduce (compat.dp_vote):
two real processes, a real Gloo group, the table vLLM builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_RANK = """
import json, sys, torch, torch.distributed as dist
from vllm_afd.compat import dp_vote

rank, port, votes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                        rank=rank, world_size=2)

class Link:
    def __init__(self):
        self.answers = []
    def vote(self):
        return votes.pop(0)
    def decided(self, all_ready):
        self.answers.append(all_ready)

link = Link()
dp_vote.install(link)
from vllm.v1.worker import dp_utils
tables = []
for _ in range(3):
    table = torch.zeros(4, 2, dtype=torch.int32)  # as vLLM's _run_ar builds it
    table[0][rank] = 10 + rank
    table[3][rank] = 2
    dp_utils.dist.all_reduce(table)
    tables.append(table.tolist())
dp_vote.uninstall()
plain = torch.ones(2, 2, dtype=torch.int32)
dp_utils.dist.all_reduce(plain)  # no voter: passes through untouched
print(json.dumps({"answers": link.answers, "tables": tables,
                  "plain": plain.tolist()}), flush=True)
# Gloo's threads must be joined before exit; even then the C++ runtime's
# static teardown (torch's, vLLM's) sometimes aborts an interpreter exit
# ("terminate called without an active exception", 3 of 4 exits on a busy
# host): this script's work is done and printed, so it leaves at once
dist.barrier()
dist.destroy_process_group()
import os
os._exit(0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_rank_reads_the_same_vote_and_vllm_the_same_table():
    port = _free_port()
    votes = {0: [True, True, False], 1: [False, True, True]}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(port), json.dumps(votes[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for out in outs:
        # all ready only where both voted ready
        assert out["answers"] == [False, True, False], out
        assert out["tables"] == [[[10, 11], [0, 0], [0, 0], [2, 2]]] * 3, out
        assert out["plain"] == [[2, 2], [2, 2]], out
