"""Unit tests of the decode model behind ``vllm-afd plan`` (cli.plan_model,
cli.plan_profile.build_profile) and of its command line's pure parts."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_afd.cli import plan as plan_cli
from vllm_afd.cli import plan_format, plan_model
from vllm_afd.cli.main import build_parser
from vllm_afd.cli.plan_fit import Point, build_profile
from vllm_afd.cli.plan_model import (
    Bound,
    Candidate,
    Curve,
    Profile,
    best_batch,
    candidates,
    make_plan,
    predict,
    predict_colocated,
)
from vllm_afd.cli.plan_profile import LogWatch


def _profile(platform: str = "cuda", **kw) -> Profile:
    """Linear parts: T_a = 1 ms + 0.1 ms/seq, T_f = 2 ms + 0.01 ms/token,
    T_c = 0.05 ms, plain = 3 ms + 0.12 ms/seq."""
    parts = {
        "attention": {128: Curve(((1, 1.1e-3), (64, 7.4e-3)))},
        "colocated": {128: Curve(((1, 3.12e-3), (64, 10.68e-3)))},
        "ffn": Curve(((1, 2.01e-3), (64, 2.64e-3))),
        "comm": Curve(((1, 5e-5), (64, 5e-5))),
    }
    return Profile(
        platform=platform, remote_layers=4, decode_tokens=16, **{**parts, **kw}
    )


def test_curve_interpolates_extrapolates_and_clamps() -> None:
    c = Curve(((1, 1.0), (3, 3.0)))
    assert c(2) == pytest.approx(2.0)
    assert c(5) == pytest.approx(5.0)  # from the last two points
    assert Curve(((1, 1.0), (2, 0.2)))(10) == 0.0  # never below zero
    assert Curve(((1, 1.0), (2, 0.2)), signed=True)(3) == pytest.approx(-0.6)
    assert Curve(((4, -1.0),), signed=True)(8) == -1.0  # a flat correction
    assert Curve.of([(2, 1.0), (1, 3.0), (2, 3.0)]).points == ((1, 3.0), (2, 2.0))
    with pytest.raises(ValueError, match="distinct sorted"):
        Curve(((2, 1.0), (1, 1.0)))


def test_predict_one_ubatch_adds_the_parts_and_merges_peers() -> None:
    prof = _profile()
    p = predict(prof, Candidate(2, 1), 128, 8)
    t_a, t_f = prof.attention[128](8), prof.ffn(16)  # FFN sees both peers
    assert p.step_s == pytest.approx(t_a + 5e-5 + t_f)
    assert p.tokens_per_s_per_device == pytest.approx(2 * 8 / p.step_s / 3)
    assert p.bound is Bound.FFN


def test_predict_ubatches_overlap_but_pay_the_re_reads() -> None:
    prof = _profile()
    one = predict(prof, Candidate(1, 1, 1), 128, 32)
    two = predict(prof, Candidate(1, 1, 2), 128, 32)
    a, f = prof.attention[128](16), 5e-5 + prof.ffn(16)
    assert two.step_s == pytest.approx(2 * max(a, f) + min(a, f))
    assert two.ffn_s == pytest.approx(2 * prof.ffn(16))
    assert two.ffn_s > one.ffn_s  # each micro-batch reads the experts again


def test_predict_on_shared_cores_adds_concurrent_ranks() -> None:
    prof = _profile("cpu")
    p = predict(prof, Candidate(2, 2), 128, 4)
    expect = 2 * prof.attention[128](4) + 5e-5 + 2 * prof.ffn(4)
    assert p.step_s == pytest.approx(expect)
    assert p.tokens_per_s_per_device == pytest.approx(8 / expect)  # per host


def test_uneven_topology_is_paced_by_the_widest_block() -> None:
    prof = _profile()
    p = predict(prof, Candidate(3, 2), 128, 4)
    assert p.ffn_s == pytest.approx(prof.ffn(8))  # blocks [0, 1], [2]


def test_candidates_fit_the_device_budget() -> None:
    names = {c.name for c in candidates(4, max_ubatches=1)}
    assert names == {"1A1F", "2A1F", "3A1F", "2A2F"}
    assert {c.name for c in candidates(2)} == {"1A1F", "1A1F m=2"}


def test_best_batch_respects_kv_and_slo() -> None:
    prof = _profile(kv_tokens_attention=10 * 144, kv_tokens_colocated=10 * 144)
    choice = best_batch(prof, Candidate(1, 1), 128, [1, 4, 16], slo_s=None)
    assert choice.best.batch == 4
    assert "KV: 16 x 144 tokens > 1440" in choice.tried[2].why_not
    slo = predict(prof, Candidate(1, 1), 128, 1).step_s * 1.01
    choice = best_batch(prof, Candidate(1, 1), 128, [1, 4], slo_s=slo)
    assert choice.best.batch == 1 and "SLO" in choice.tried[1].why_not


def test_plan_recommends_the_most_tokens_per_device() -> None:
    prof = _profile()
    plan = make_plan(prof, 4, [128], [1, 16, 64], None, max_ubatches=1)
    best = max(plan.rows, key=lambda p: p.tokens_per_s_per_device)
    assert plan.recommended == best
    assert plan.baselines[128] == predict_colocated(prof, 128, 64)
    assert "x colocated per device" in plan.reason
    json.dumps(plan.to_json())  # serializable


def test_plan_without_a_fit_says_why() -> None:
    plan = make_plan(_profile(), 2, [128], [1], slo_s=1e-6)
    assert plan.recommended is None and "SLO" in plan.reason
    assert plan.unfit


def test_profile_round_trips_through_json() -> None:
    prof = _profile(kv_tokens_attention=100)
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof


def test_build_profile_derives_the_parts() -> None:
    afd = [Point(64, 1, 0.010, wait_s=0.006, ffn_s=0.004, ffn_tokens=1)]
    plain = [Point(64, 1, 0.008)]
    prof = build_profile(afd, plain, "cpu", 16, remote_layers=2,
                         kv_attention=50, kv_plain=40)  # fmt: skip
    assert prof.attention[64](1) == pytest.approx(0.004)  # TPOT - wait
    assert prof.ffn(1) == pytest.approx(0.004)
    assert prof.comm(1) == pytest.approx(0.002)  # wait - FFN compute
    assert prof.colocated[64](1) == pytest.approx(0.008)
    # A wait shorter than the FFN's compute: the step still adds up.
    early = [Point(64, 1, 0.010, wait_s=0.001, ffn_s=0.004, ffn_tokens=1)]
    prof = build_profile(early, plain, "cpu", 16, remote_layers=2,
                         kv_attention=None, kv_plain=None)  # fmt: skip
    assert prof.attention[64](1) == pytest.approx(0.006)
    assert prof.comm(1) == 0.0


def test_log_watch_reads_kv_capacity_per_role() -> None:
    log = LogWatch()
    log.write("[attention] INFO ... CPU KV cache size: 1,234 tokens, Maximum\n")
    log.write("[plain] INFO ... GPU KV cache size: 999 tokens\n")
    assert log.kv_of("attention") == 1234 and log.kv_of("plain") == 999
    assert log.kv_of("ffn") is None


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", "m", *argv])


def test_plan_flags_parse_and_reject_bad_lists() -> None:
    args = _args("--context-lens", "512,128", "--check-topologies", "2A1F,1A1F:2")
    assert args.context_lens == [128, 512]
    assert [c.name for c in args.check_topologies] == ["2A1F", "1A1F m=2"]
    with pytest.raises(SystemExit):
        _args("--batch-sizes", "0,4")
    with pytest.raises(argparse.ArgumentTypeError, match="e.g. 1A1F"):
        plan_cli._topologies("2x1")
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= afd.num_ffn"):
        plan_cli._topologies("1A2F")


def test_plan_refuses_bad_input(tmp_path, capsys) -> None:
    args = _args("--devices", "1")
    args.model = str(tmp_path)
    assert plan_cli.run_plan(args) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert plan_cli.run_plan(args) == 2
    assert "--devices=1 must be >= 2" in capsys.readouterr().err
    args = _args("--check-topologies", "1A1F:2")
    args.model = str(tmp_path)
    if plan_cli._gpus() == 0:
        assert plan_cli.run_plan(args) == 2
        assert "micro-batches need CUDA" in capsys.readouterr().err


def test_cache_key_changes_with_what_was_measured(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = _args()
    args.model = str(tmp_path)
    two, four = {"device": "cpu: x, 2 cores"}, {"device": "cpu: x, 4 cores"}
    key = plan_cli.cache_key(args, "cpu", two)
    assert key == plan_cli.cache_key(args, "cpu", two)
    assert key != plan_cli.cache_key(args, "cpu", four)
    assert key != plan_cli.cache_key(args, "cpu", {**two, "vllm": "0.33.0"})
    # a profile without 2A1F's S does not serve a budget that needs it
    assert key != plan_cli.cache_key(args, "cpu", two, ["shared2"])
    args.batch_sizes = [1, 2]
    assert key != plan_cli.cache_key(args, "cpu", two)


@pytest.mark.parametrize(
    ("platform", "devices", "extra", "phases"),
    [
        ("cpu", 2, [], []),
        ("cpu", 3, [], ["shared2"]),
        ("cpu", 4, [], ["shared2", "shared3"]),
        # S of at most MAX_SHARED_RANKS ranks is measured
        ("cpu", 9, [], ["shared2", "shared3", "shared4"]),
        ("cuda-shared", 2, [], ["ubatched"]),
        ("cuda-shared", 3, ["--max-ubatches", "1"], ["shared2"]),
        ("cuda-shared", 2, ["--max-ubatches", "1", "--check-topologies", "1A1F:2"],
         ["ubatched"]),
        ("cuda", 4, [], []),
    ],
)  # fmt: skip
def test_the_profile_measures_the_phases_its_predictions_need(
    platform, devices, extra, phases
) -> None:
    assert plan_cli.measured_phases(_args(*extra), platform, devices) == phases


def test_placed_gives_each_rank_its_gpus() -> None:
    spec = plan_cli._spec(_args(), 0)
    assert spec.attention_devices is None  # CPU: the environment's
    two = plan_cli._placed(spec, Candidate(2, 1), 4)
    assert (two.attention_devices, two.ffn_devices) == ("0,1", "2")
    one = plan_cli._placed(spec, Candidate(1, 1), 1)
    assert (one.attention_devices, one.ffn_devices) == ("0", "0")


def test_plan_and_check_tables_render() -> None:
    plan = make_plan(_profile(), 4, [128], [1, 16], None, max_ubatches=2)
    text = plan_format.format_plan(plan, "tok/s/device")
    assert "recommended:" in text and "colocated" in text
    rows = [{"deployment": "1A1F", "batch": 1, "predicted_step_ms": 3.0,
             "measured_step_ms": 4.0, "step_error": -0.25,
             "predicted_tokens_per_s_per_device": 1.0,
             "measured_tokens_per_s_per_device": 2.0}]  # fmt: skip
    assert "median |step error| 25%" in plan_format.format_check(rows, "x", plan)


def test_a_check_that_fails_is_a_row_of_its_own_and_the_others_are_checked(
    monkeypatch, capsys
) -> None:
    """--check: a deployment that cannot start (or serve) gets ``failed``
    and no measurement, is stopped, and the next one is still launched; the
    table's median and best are over the measured rows only."""
    stopped: list[str] = []

    class Dep:  # the launcher's Deployment as far as check() uses it
        api_url = "http://127.0.0.1:1/v1"

        def __init__(self, spec, log=None, log_dir=None) -> None:
            self.name = f"{spec.attention_ranks}A{spec.ffn_ranks}F"

        def start(self, timeout: float) -> None:
            if self.name == "2A1F":
                raise plan_cli.LaunchError("attention role exited with code 1")

        def stop(self) -> None:
            stopped.append(self.name)

    monkeypatch.setattr(plan_cli, "Deployment", Dep)
    monkeypatch.setattr(plan_cli, "_measured_step", lambda *a: 0.004)
    args = _args("--check", "--check-topologies", "2A1F,1A1F", "--devices", "2")
    prof = _profile(platform="cpu")
    plan = make_plan(prof, 2, args.context_lens, args.batch_sizes, None, 1)
    rows = plan_cli.check(args, plan_cli._spec(args, 0), prof, plan, 0, LogWatch())
    assert [r["deployment"] for r in rows] == ["2A1F", "1A1F"]
    assert stopped == ["2A1F", "1A1F"]  # the failed start is stopped too
    assert rows[0]["failed"] == "attention role exited with code 1"
    assert "measured_step_ms" not in rows[0]
    assert rows[1]["measured_step_ms"] == pytest.approx(4.0)
    assert "2A1F failed (attention role exited" in capsys.readouterr().err
    text = plan_format.format_check(rows, "tok/s", plan)
    assert "failed: attention role exited with code 1" in text
    assert "median |step error|" in text
    assert "of 1 measured; best measured: 1A1F" in text
    rows[1]["failed"] = ""
    assert "no checked deployment could be measured" in plan_format.format_check(
        rows, "tok/s", plan
    )


def test_sharing_is_fitted_on_2a1f_and_charged_per_extra_attention_rank() -> None:
    """Measured on 2A1F only, S_2 is charged to every rank beyond the first."""
    afd = [Point(64, b, 0.010 + 0.001 * b, wait_s=0.003, ffn_s=0.002) for b in (1, 4)]
    plain = [Point(64, b, 0.008) for b in (1, 4)]
    base = build_profile(afd, plain, "cpu", 16, remote_layers=2,
                         kv_attention=None, kv_plain=None)  # fmt: skip
    additive = predict(base, Candidate(2, 1), 64, 4).step_s
    shared = {2: [Point(64, 1, 1.0), Point(64, 4, additive + 0.005)]}
    prof = build_profile(afd, plain, "cpu", 16, shared=shared, remote_layers=2,
                         kv_attention=None, kv_plain=None)  # fmt: skip
    assert prof.sharing[2][64](4) == pytest.approx(0.005)
    assert predict(prof, Candidate(2, 1), 64, 4).step_s == pytest.approx(
        additive + 0.005
    )
    three = predict(prof, Candidate(3, 1), 64, 4).step_s
    assert three == pytest.approx(predict(base, Candidate(3, 1), 64, 4).step_s + 0.010)
    assert predict(prof, Candidate(1, 1), 64, 4) == predict(
        base, Candidate(1, 1), 64, 4
    )
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    # a 2A1F faster than the sum: the ranks overlapped, S is negative, but a
    # rank added never makes the step shorter than one rank's
    overlap = build_profile(afd, plain, "cuda-shared", 16,
                            shared={2: [Point(64, 4, additive - 0.002)]},
                            remote_layers=2, kv_attention=None,
                            kv_plain=None)  # fmt: skip
    assert overlap.sharing[2][64](4) == pytest.approx(-0.002)
    p = predict(overlap, Candidate(2, 1), 64, 4)
    assert p.step_s == pytest.approx(additive - 0.002)
    assert p.comm_s == pytest.approx(predict(base, Candidate(2, 1), 64, 4).comm_s)
    fast = build_profile(afd, plain, "cpu", 16, shared={2: [Point(64, 4, 0.0)]},
                         remote_layers=2, kv_attention=None, kv_plain=None)  # fmt: skip
    t_a = base.attention[64](4)
    assert fast.sharing[2][64](4) == pytest.approx(-t_a)
    one_rank = predict(base, Candidate(1, 1), 64, 4).step_s
    for x in (2, 3):
        assert predict(fast, Candidate(x, 1), 64, 4).step_s == pytest.approx(one_rank)
    assert Profile.from_json(json.loads(json.dumps(fast.to_json()))) == fast


def test_sharing_is_fitted_per_rank_count_where_measured() -> None:
    """On two cores a second attention rank may use the core the first left
    idle and a third finds none: S_k is fitted on kA1F, each on top of the S
    of fewer ranks, and a rank count beyond the measured ones takes the last
    measured S."""
    afd = [Point(64, b, 0.010 + 0.001 * b, wait_s=0.003, ffn_s=0.002) for b in (1, 4)]
    plain = [Point(64, b, 0.008) for b in (1, 4)]
    kw = {"remote_layers": 2, "kv_attention": None, "kv_plain": None}
    base = build_profile(afd, plain, "cpu", 16, **kw)

    def sum_of_parts(x: int) -> float:
        return predict(base, Candidate(x, 1), 64, 4).step_s

    shared = {
        2: [Point(64, 4, sum_of_parts(2) + 0.001)],
        3: [Point(64, 4, sum_of_parts(3) + 0.001 + 0.009)],
    }
    prof = build_profile(afd, plain, "cpu", 16, shared=shared, **kw)
    assert prof.sharing[2][64](4) == pytest.approx(0.001)
    assert prof.sharing[3][64](4) == pytest.approx(0.009)
    for x, extra in ((2, 0.001), (3, 0.010), (4, 0.019), (5, 0.028)):
        step = predict(prof, Candidate(x, 1), 64, 4).step_s
        assert step == pytest.approx(sum_of_parts(x) + extra), x
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    # what the table prints: a column per measured rank count
    text = plan_format.format_profile(prof, [{"context": 64, "batch": 4}])
    assert "S2 ms" in text and "S3 ms" in text


def test_ubatching_is_measured_on_one_gpu_and_charged_per_extra_ubatch() -> None:
    afd = [Point(64, b, 0.010 + 0.001 * b, wait_s=0.003, ffn_s=0.002) for b in (1, 8)]
    plain = [Point(64, b, 0.008) for b in (1, 8)]
    kw = {"remote_layers": 2, "kv_attention": None, "kv_plain": None}
    no_u = build_profile(afd, plain, "cuda-shared", 16, **kw)
    # without U no micro-batches are predicted on a shared device
    assert {
        r.candidate.ubatches for r in make_plan(no_u, 3, [64], [1, 8], None, 2).rows
    } == {1}
    with pytest.raises(ValueError, match="1A1F m=2: micro-batches on a shared"):
        predict(no_u, Candidate(1, 1, 2), 64, 8)
    # two micro-batches measured 1 ms faster at batch 8, as fast at batch 1
    two = [Point(64, 1, 0.011), Point(64, 8, 0.017)]
    prof = build_profile(afd, plain, "cuda-shared", 16, ubatched=two, **kw)
    assert prof.ubatching[64](8) == pytest.approx(-0.001)
    assert prof.ubatching[64](1) == pytest.approx(0.0)
    one = predict(prof, Candidate(1, 1), 64, 8)
    m2 = predict(prof, Candidate(1, 1, 2), 64, 8)
    assert one.step_s == pytest.approx(0.018)
    assert m2.step_s == pytest.approx(0.017)  # in sample
    assert m2.attention_s == pytest.approx(one.attention_s - 0.001)
    assert predict(prof, Candidate(1, 1, 3), 64, 8).step_s == pytest.approx(0.016)
    # the overlap hides at most the smaller side: never below the larger one
    big = build_profile(afd, plain, "cuda-shared", 16,
                        ubatched=[Point(64, 1, 0.011), Point(64, 8, 0.001)],
                        **kw)  # fmt: skip
    m4 = predict(big, Candidate(1, 1, 4), 64, 8)
    assert m4.step_s == pytest.approx(max(one.attention_s, one.comm_s + one.ffn_s))
    assert {
        r.candidate.ubatches for r in make_plan(prof, 3, [64], [1, 8], None, 2).rows
    } == {1, 2}
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof


def _tp2(platform: str = "cuda", step_s: float = 2e-3) -> Profile:
    """``_profile`` with a measured TP2 baseline of a flat ``step_s``."""
    return _profile(
        platform,
        colocated_tp={2: {128: Curve(((1, step_s), (64, step_s)))}},
        kv_tokens_colocated_tp={2: 10_000},
    )


def test_a_tp_baseline_counts_its_devices_except_on_shared_cores() -> None:
    gpu = predict_colocated(_tp2(), 128, 64, tp=2)
    assert gpu.name == "colocated TP2"
    assert gpu.tokens_per_s_per_device == pytest.approx(64 / 2e-3 / 2)
    host = predict_colocated(_tp2("cpu"), 128, 64, tp=2)
    assert host.tokens_per_s_per_device == pytest.approx(64 / 2e-3)  # per host
    assert best_batch(_tp2(), None, 128, [64], None, tp=2).best == gpu
    # its own KV capacity bounds its batch
    assert best_batch(_tp2(), None, 1000, [64], None, tp=2).best is None


def test_plan_takes_the_best_colocated_baseline_that_fits_the_devices() -> None:
    fast = _tp2(step_s=1e-3)  # TP2 beats one device per replica
    plan = make_plan(fast, 4, [128], [1, 16, 64], None, max_ubatches=1)
    assert plan.baselines[128].name == "colocated TP2"
    slow = make_plan(_tp2(step_s=1.0), 4, [128], [1, 16, 64], None, max_ubatches=1)
    assert slow.baselines[128].name == "colocated"
    four = _profile(colocated_tp={4: {128: Curve(((1, 1e-6), (64, 1e-6)))}})
    narrow = make_plan(four, 3, [128], [1, 64], None, max_ubatches=1)
    assert narrow.baselines[128].name == "colocated"  # TP4 needs 4 devices
    text = plan_format.format_plan(plan, "tok/s/device")
    assert "colocated TP2" in text
    assert Profile.from_json(json.loads(json.dumps(fast.to_json()))) == fast


def test_build_profile_keeps_tp_baselines_apart() -> None:
    afd = [Point(64, 1, 0.010, wait_s=0.006, ffn_s=0.004, ffn_tokens=1)]
    prof = build_profile(
        afd, [Point(64, 1, 0.008)], "cpu", 16, remote_layers=2, kv_attention=50,
        kv_plain=40, tp={2: [Point(64, 1, 0.005)]}, kv_tp={2: 30},
    )  # fmt: skip
    assert prof.colocated[64](1) == pytest.approx(0.008)
    assert prof.colocated_tp[2][64](1) == pytest.approx(0.005)
    assert prof.kv_tokens_colocated_tp == {2: 30}
    text = plan_format.format_profile(prof, [{"context": 64, "batch": 1}])
    assert "plain vLLM TP2 step: context 64 batch 1: 5.00 ms; KV capacity 30" in text


def test_tp_baselines_flag_is_checked(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(plan_cli, "_gpus", lambda: 0)
    monkeypatch.setattr(plan_cli.os, "sched_getaffinity", lambda pid: set(range(6)))
    for argv, error in [
        (("--tp-baselines", "1"), "sizes must be >= 2"),
        (("--tp-baselines", "8", "--devices", "9"), "needs 8 CPU cores, 6 are"),
        (("--tp-baselines", "6", "--devices", "4"), "needs 6 devices"),
    ]:
        args = _args(*argv)
        args.model = str(tmp_path)
        assert plan_cli.run_plan(args) == 2
        assert error in capsys.readouterr().err
    args = _args("--tp-baselines", "2")
    args.model, args.vllm_args = str(tmp_path), ["-tp", "2"]
    assert plan_cli.run_plan(args) == 2
    assert "those go to every role" in capsys.readouterr().err
    assert _args("--tp-baselines", "4,2").tp_baselines == [2, 4]
    plain = _args()
    plain.model = str(tmp_path)
    key = plan_cli.cache_key(plain, "cpu", {})
    plain.tp_baselines = [2]
    assert key != plan_cli.cache_key(plain, "cpu", {})


def test_log_watch_keeps_the_tp_servers_kv_apart() -> None:
    from vllm_afd.cli.plan_profile import _tp_name

    log = LogWatch()
    log.write("[plain] INFO ... KV cache size: 999 tokens\n")
    log.write(f"[{_tp_name(2)}] INFO ... KV cache size: 2,000 tokens\n")
    assert log.kv_of("plain") == 999 and log.kv_of(_tp_name(2)) == 2000


def test_balanced_routing_is_vllms_routing_simulation(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(plan_cli.ROUTING_ENV, raising=False)
    (tmp_path / "config.json").write_text("{}")
    args = _args()
    args.model = str(tmp_path)
    assert plan_cli.routing_strategy(args) == ""  # the model's router
    key = plan_cli.cache_key(args, "cpu", {})
    balanced = _args("--routing", "balanced")
    balanced.model = str(tmp_path)
    assert plan_cli.routing_strategy(balanced) == "uniform_random"
    assert plan_cli.cache_key(balanced, "cpu", {}) != key
    # a strategy set in the environment reaches every server: it is measured
    monkeypatch.setenv(plan_cli.ROUTING_ENV, "Normal_Routing")
    assert plan_cli.routing_strategy(args) == "normal_routing"
    assert plan_cli.cache_key(args, "cpu", {}) != key


def test_one_gpu_is_a_shared_device_like_one_hosts_cores() -> None:
    one = _profile("cuda-shared")
    assert one.shared_cores and one.unit == "tok/s/GPU"
    assert _profile("cpu").unit == "tok/s/host" and _profile().unit == "tok/s/device"
    p = predict(one, Candidate(1, 1), 128, 8)
    assert p.step_s == pytest.approx(one.attention[128](8) + 5e-5 + one.ffn(8))
    assert p.tokens_per_s_per_device == pytest.approx(8 / p.step_s)  # per GPU
    assert predict(one, Candidate(2, 1), 128, 8).step_s == pytest.approx(
        predict(_profile("cpu"), Candidate(2, 1), 128, 8).step_s
    )


def test_cpu_tp_workers_get_equal_shares_of_the_cores() -> None:
    from vllm_afd.cli.plan_profile import cpu_bind

    assert cpu_bind(2, [0, 1]) == "0|1"
    assert cpu_bind(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError, match="3 CPU workers need 3 cores, 2 here"):
        cpu_bind(3, [4, 5])


def test_a_stalled_short_run_is_measured_again_then_refused(monkeypatch) -> None:
    from vllm_afd.cli import plan_profile

    # the warm-up, then (short, long) wall seconds per attempt; the first
    # pair is a stall
    times = iter([9.0, 1.10, 0.79, 0.20, 0.64])
    asked: list[int] = []

    def timed(url, served, reqs, what):
        asked.append(reqs[0])  # the output length (see below)
        # the token gaps of a run: 20 ms steps, one stalled for 2 s
        return next(times), [0.02] * 10 + [2.0] + [0.021] * 10

    # no server here: a request is its output length
    monkeypatch.setattr(plan_profile, "_requests", lambda *a: [a[4]] * a[3])
    monkeypatch.setattr(plan_profile, "_timed", timed)
    notes: list[str] = []
    calls: list[int] = []
    step = plan_profile.decode_step(
        "u", "m", 1, 32, 24, 0, "AFD c=32 b=1", between=lambda: calls.append(1),
        note=notes.append,
    )  # fmt: skip
    assert step == pytest.approx(0.021)  # the median gap: the stall is left out
    # the warm-up is as long as the long run (it meets the same shapes)
    assert asked == [24, 2, 24, 2, 24] and len(calls) == 6
    assert notes == [
        "AFD c=32 b=1: 24 output tokens took no longer than 2 (0.790s vs "
        "1.100s); measuring again (2 of 3)"
    ]
    times = iter([1.0] + [1.0, 0.5] * plan_profile.ATTEMPTS)
    with pytest.raises(RuntimeError, match=r"no longer than 2 in 3 tries .*"
                       r"raise --decode-tokens$"):  # fmt: skip
        plan_profile.decode_step("u", "m", 1, 32, 24, 0, "x")


def test_every_measured_request_has_a_salt_of_its_own(monkeypatch) -> None:
    """A run must prefill all its prompts: a salt per request keeps vLLM's
    prefix cache from serving blocks of an earlier run (the same seed gives
    the same windows), which made a long run cheaper than its short one."""
    from vllm_afd.cli import bench_workload, plan_profile

    def build(url, served, ins, outs, seed):
        return [bench_workload.Request(i, (seed, 1, 2), o) for i, o in enumerate(outs)]

    monkeypatch.setattr(plan_profile, "build_requests", build)
    runs = [plan_profile._requests("u", "m", 3, 4, 8, seed=0) for _ in range(2)]
    salts = [r.salt for run in runs for r in run]
    assert len(set(salts)) == 8 and all(salts)
    body = json.loads(bench_workload._body("m", runs[0][0], stream=True))
    assert body["cache_salt"] == runs[0][0].salt
    assert "cache_salt" not in json.loads(
        bench_workload._body("m", bench_workload.Request(0, (1,), 2), stream=True)
    )


def test_a_prediction_beyond_what_the_shared_device_allows_is_never_picked() -> None:
    """One GPU: plain vLLM measured at 60 ms per step at batch 64 bounds what
    the same device can give 64 sequences of AFD; a 10 ms AFD step there
    breaks the bound, is shown as such and not recommended (the plan's
    first GPU profile recommended such a deployment at 2.68x plain)."""
    slow_plain = {128: Curve(((1, 3.12e-3), (64, 60e-3)))}
    prof = _profile("cuda-shared", colocated=slow_plain)
    p = plan_model.bounded(prof, predict(prof, Candidate(1, 1), 128, 64))
    assert not p.fits and p.over_bound == p.why_not
    assert "breaks the device bound" in p.over_bound
    assert "plain vLLM at batch 64 on this device, 0% measured overlap" in p.over_bound
    plan = make_plan(prof, 2, [128], [1, 64], None, max_ubatches=1)
    assert [(q.name, q.batch) for q in plan.over_bound] == [("1A1F", 64)]
    assert plan.recommended is not None and plan.recommended.batch == 1
    assert "not trusted: breaks the device bound" in plan_format.format_plan(
        plan, prof.unit
    )
    # separate devices: no such bound
    assert predict(_profile(colocated=slow_plain), Candidate(1, 1), 128, 64).fits


def test_the_device_bound_allows_the_overlap_that_was_measured() -> None:
    """S_2 measured at -40 % of the 2A1F parts: 2A1F may beat plain vLLM at
    twice the batch by up to 1 / (1 - 0.4), plus the slack."""
    prof = _profile("cuda-shared")
    t_a, t_c, t_f = prof.attention[128](8), 5e-5, prof.ffn(16)
    s2 = -0.4 * (2 * t_a + t_c + t_f)
    shared = _profile("cuda-shared", sharing={2: {128: Curve(((8, s2),), True)}})
    assert plan_model.measured_overlap(shared, 128, 8) == pytest.approx(0.4)
    limit, overlap = plan_model.device_limit(shared, Candidate(2, 1), 128, 8)
    plain_tps = 16 / prof.colocated[128](16)
    assert limit == pytest.approx(plain_tps / 0.6 * (1 + plan_model.BOUND_SLACK))
    assert overlap == pytest.approx(0.4)
    assert plan_model.measured_overlap(prof, 128, 8) == 0.0


def test_the_scale_model_charges_the_link_and_counts_separate_devices() -> None:
    """--target-devices: the measured parts on devices of their own, the
    round trip charged by the link, nothing of what sharing cost."""
    link = plan_model.Link(latency_s=5e-6, bytes_per_s=100e9, bytes_per_token=1024)
    assert link.step_s(64, 4) == pytest.approx(4 * (10e-6 + 64 * 1024 / 100e9))
    shared = _profile("cuda-shared", sharing={2: {128: Curve(((8, -1e-3),), True)}})
    scaled = plan_model.on_separate_devices(shared, link, max_tokens=64)
    assert scaled.platform == "separate" and not scaled.shared_cores
    assert scaled.sharing == {} and scaled.ubatching == {}
    assert scaled.comm(16) == pytest.approx(link.step_s(16, 4))
    assert scaled.comm(256) == pytest.approx(link.step_s(256, 4))  # linear beyond
    p = predict(scaled, Candidate(3, 1), 128, 8)
    t_a, t_f = shared.attention[128](8), shared.ffn(24)
    assert p.step_s == pytest.approx(t_a + link.step_s(8, 4) + t_f)
    assert p.tokens_per_s_per_device == pytest.approx(24 / p.step_s / 4)
    plan = make_plan(scaled, 8, [128], [1, 16, 64], None, max_ubatches=1)
    assert {q.name for q in plan.rows} >= {"7A1F", "4A4F", "1A1F"}
    text = plan_format.format_scaled(plan, 8, link)
    assert "predicted on 8 separate devices" in text
    assert "not checked on such hardware" in text and "1024 bytes per token" in text


def test_the_link_counts_what_the_model_moves_per_token(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 2048, "num_experts_per_tok": 8, "dtype": "bfloat16"})
    )
    args = argparse.Namespace(
        model=str(tmp_path), vllm_args=[], gate_on_attention=False,
        link_latency_us=5.0, link_gb_s=100.0,
    )  # fmt: skip
    assert plan_cli.model_link(args).bytes_per_token == 2048 * 2 * 2
    args.vllm_args, args.gate_on_attention = ["--dtype=float32"], True
    assert plan_cli.model_link(args).bytes_per_token == 2048 * 4 * 2 + 8 * 8
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 1024, "n_shared_experts": 1})
    )
    args.vllm_args, args.gate_on_attention = [], False
    link = plan_cli.model_link(args)
    assert link.bytes_per_token == 1024 * 2 * 3  # shared experts: F2A in 2 parts
    assert link.latency_s == pytest.approx(5e-6) and link.bytes_per_s == 100e9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-devices", "1"], "--target-devices=1 must be >= 2"),
        (["--target-devices", "8", "--link-gb-s", "0"], "--link-gb-s=0.0 positive"),
    ],
)
def test_target_devices_flags_are_checked(tmp_path, capsys, argv, message) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = build_parser().parse_args(["plan", str(tmp_path), *argv])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_a_point_whose_repeats_spread_is_measured_again_then_marked() -> None:
    from vllm_afd.cli.plan_fit import SPREAD_LIMIT, measure_point

    def steps(*values: float):
        return lambda k: Point(64, 4, values[k])

    steady = measure_point(steps(0.010, 0.011, 0.0105), 3)
    assert steady.samples == 3 and steady.tpot_s == pytest.approx(0.0105)
    assert steady.spread == pytest.approx(0.001 / 0.0105)
    # a stall in one of two repeats: two more, the median of four
    calmed = measure_point(steps(0.010, 0.030, 0.011, 0.010), 2)
    assert calmed.samples == 4 and calmed.tpot_s == pytest.approx(0.0105)
    assert calmed.spread > SPREAD_LIMIT  # still wide: marked in the table
    single = measure_point(steps(0.010), 1)
    assert single.samples == 1 and single.spread == 0.0
    prof = _profile("cpu")
    afd = [dict(context=128, batch=4, spread=calmed.spread, samples=4)]
    plain = [dict(context=128, batch=4, spread=0.05, samples=2)]
    text = plan_format.format_profile(prof, afd, plain)
    assert f"{calmed.spread:.0%}*" in text and " 5%" in text
    assert "spread" not in plan_format.format_profile(
        prof, [dict(context=128, batch=4)]
    )


def test_a_shared_device_is_compared_with_plain_vllm_holding_as_many_sequences() -> (
    None
):
    """The parts one H100 measured (tiny bf16 Qwen3-MoE, both roles under
    MPS, FULL decode graphs): plain vLLM 2.56 ms per step at batch 32, AFD
    1A1F 2.81 ms, 2A1F 2.95 ms and 3A1F 3.24 ms for 32 sequences per
    attention rank. Against plain vLLM at batch 32 alone 3A1F read 2.37x;
    plain vLLM holding the same 96 sequences (here 3.0 ms) is the fair
    reference, and the plan says both."""
    attention = Curve(((1, 1.78e-3), (8, 2.02e-3), (32, 2.81e-3)))
    plain = Curve(
        ((1, 1.6e-3), (8, 1.83e-3), (32, 2.56e-3), (64, 2.75e-3), (96, 3.0e-3))
    )
    prof = Profile(
        platform="cuda-shared", remote_layers=4, decode_tokens=32,
        attention={128: attention}, colocated={128: plain},
        ffn=Curve(((1, 0.0), (96, 0.0))), comm=Curve(((1, 0.0), (96, 0.0))),
        sharing={
            2: {128: Curve(((1, -1.26e-3), (8, -1.52e-3), (32, -2.68e-3)), True)},
            3: {128: Curve(((1, -1.55e-3), (8, -1.54e-3), (32, -2.52e-3)), True)},
        },
    )  # fmt: skip
    p3 = predict(prof, Candidate(3, 1), 128, 32)
    assert p3.step_s == pytest.approx(3.24e-3, rel=0.01)
    assert plan_model.equal_batch(prof, Candidate(3, 1), 32) == 96
    same = plan_model.at_equal_batch(prof, p3)
    assert same.batch == 96 and same.step_s == pytest.approx(3.0e-3)
    assert plan_model.colocated_batches(prof, 128, [1, 8, 32]) == [1, 8, 32, 64, 96]
    plan = make_plan(prof, 4, [128], [1, 8, 32], None, max_ubatches=1)
    assert plan.recommended.name == "3A1F"
    assert plan.baselines[128].batch == 96  # plain vLLM's best batch
    ratio = p3.tokens_per_s_per_device / same.tokens_per_s_per_device
    assert ratio == pytest.approx(0.926, abs=0.01)
    assert f"{ratio:.2f}x plain vLLM holding as many sequences (96)" in plan.reason
    assert "plain vLLM serves more per device here" in plan.reason
    table = plan_format.format_plan(plan, prof.unit)
    assert "0.93x (96)" in table and "same batch" in table
    assert len(plan.to_json()["equal_batch"]) == len(plan.rows)


def test_separate_devices_compare_the_sequences_each_device_holds() -> None:
    prof = _profile()
    assert plan_model.equal_batch(prof, Candidate(3, 1), 16) == 12
    assert plan_model.equal_batch(prof, Candidate(1, 1), 1) == 1


def test_plain_vllm_is_measured_where_the_shared_deployments_hold_sequences() -> None:
    from vllm_afd.cli.plan_profile import plain_batches

    assert plain_batches([1, 8, 32], [2, 3]) == [1, 2, 3, 8, 16, 24, 32, 64, 96]
    assert plain_batches([1, 4, 16]) == [1, 4, 16]  # separate devices


def test_a_kA1F_that_fails_in_the_profile_keeps_the_sharing_measured_before(
    monkeypatch, capsys
) -> None:
    """The profile on a shared device: 3A1F fails (its requests fail, as a
    stalled deployment's do), so S_3 and 4A1F are not measured, but the
    profile keeps 1A1F, plain vLLM and S_2 instead of losing them; a failing
    2A1F, with no sharing measured, still ends the profile."""
    import contextlib

    from vllm_afd.cli import plan_profile

    started: list[int] = []

    @contextlib.contextmanager
    def deployment(spec, ranks, log, contexts, decode_tokens, ubatches=1):
        started.append(ranks)
        if ranks in failing:
            raise RuntimeError(f"AFD {ranks}A1F: 24 request(s) failed: HTTP 503")
        yield "http://127.0.0.1:1", [], "m"

    @contextlib.contextmanager
    def plain(spec, tp, log):
        yield type("Plain", (), {"url": "http://127.0.0.1:2"})

    step = lambda ms: lambda *a: lambda c, b, seed: Point(c, b, ms / 1e3)  # noqa: E731
    monkeypatch.setattr(plan_profile, "_afd", deployment)
    monkeypatch.setattr(plan_profile, "_plain", plain)
    monkeypatch.setattr(plan_profile, "_check_lengths", lambda *a: "m")
    monkeypatch.setattr(plan_profile, "warm_up", lambda *a: None)
    monkeypatch.setattr(
        plan_profile, "measure_afd_point",
        lambda url, f, s, c, b, *a: Point(c, b, 0.010, wait_s=0.003, ffn_s=0.002),
    )  # fmt: skip
    monkeypatch.setattr(plan_profile, "_plain_measure", step(8))
    monkeypatch.setattr(plan_profile, "_step_measure", step(12))
    spec = plan_cli._spec(_args(), 0)

    def run():
        return plan_profile.profile(
            spec, [128], [1, 8], 16, "cpu", sharing_ranks=[2, 3, 4], log=LogWatch()
        )

    failing = {3}
    prof, points = run()
    assert started == [1, 2, 3]
    assert sorted(prof.sharing) == [2] and "shared3" not in points
    assert points["afd"] and points["plain"] and points["shared2"]
    err = capsys.readouterr().err
    assert "AFD 3A1F failed (AFD 3A1F: 24 request(s) failed: HTTP 503)" in err
    assert "keeps S_k of 2A1F" in err and "charged S_2 for each rank beyond" in err
    assert "AFD 4A1F not measured: a deployment of fewer attention ranks failed" in err
    failing, started[:] = {2}, []
    with pytest.raises(RuntimeError, match="AFD 2A1F"):
        run()
