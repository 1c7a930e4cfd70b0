"""Endpoint processes of the ``async`` connector's GPU tests
(``test_async.test_async_round_trip_on_a_gpu``)."""

from __future__ import annotations

import traceback
from typing import Any

import torch


def main(role: str, rank: int, a: int, f: int, port: int, payload: str, q: Any) -> None:
    """Run endpoint ``role`` ``rank`` of ``aAfF`` on GPU 0 and put its
    outcome on ``q``: the FFN rank's items seen, the attention rank's worst
    error against the reference."""
    import test_async as T

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    try:
        ep = T._endpoint(role, a, f, port, rank, payload=payload, device=device)
        if role == "ffn":
            seen: list = []
            devices: list[str] = []
            ep.start()
            while (item := ep.next_item()) is not None:
                seen.append(
                    (item.source, item.layer, item.hidden.shape[0], item.counts,
                     item.in_slot)
                )  # fmt: skip
                devices.append(item.hidden.device.type)
                routing = item.routing.to(device)
                ep.reply(item, T._expert_sum(item.hidden.to(device), routing))
            ep.close()
            result: dict[str, Any] = {"ok": True, "seen": seen, "devices": devices}
        else:
            worst = T._drive(ep, rank, 1, False, device=device)
            result = {"ok": True, "worst": worst}
    except BaseException:
        result = {"ok": False, "message": traceback.format_exc()}
    q.put(((role, rank), result))
