#!/usr/bin/env bash
# Run vllm-afd's GPU tests and GPU benchmarks on a host with CUDA GPUs where
# vLLM 0.32.0 (CUDA build) is importable: with one GPU the one-GPU tests run
# (both roles on it, cuda_ipc under MPS) and the 2-GPU ones skip. Writes JSON
# and logs to OUTDIR.
#
#   tools/gpu/run_gpu_tests.sh OUTDIR [--target DIR] [--no-bench | --bench-only]
#                              [-k EXPR] [--shard I/N] [--parallel N]
#                              [-- BENCH_ARGS...]
#
#   --target DIR   install the project into DIR (pip --target; DIR must be on
#                  PYTHONPATH) instead of the current environment
#   --no-bench     tests only;  --bench-only  benchmarks only
#   -k EXPR        run only the GPU tests pytest selects with -k EXPR
#   --shard I/N    run only shard I of N (tools/gpu/shard.py: even estimated
#                  time, so each shard fits one time-limited run)
#   --parallel N   N pytest-xdist workers, tests spread one at a time (the
#                  one-GPU tests share the GPU under one MPS daemon, which
#                  the script starts when none runs and stops at the end)
#   -- ARGS        passed to tools/gpu/bench_decode.py (e.g. --cuda-graphs)
#
# OUTDIR receives: pytest.log, junit.xml, results.json (tests), bench.json and
# bench_servers.log (benchmarks; with one GPU bench_connector_ce.json and
# bench_connector_sm.json, the cuda_ipc round trip), server_logs.tgz (every
# role's server log).
set -uo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
TARGET=""; RUN_TESTS=1; RUN_BENCH=1; SELECT=(); SHARD=""; PARALLEL=1
while [ $# -gt 0 ]; do
  case $1 in
    --target) TARGET=$2; shift 2 ;;
    --no-bench) RUN_BENCH=0; shift ;;
    --bench-only) RUN_TESTS=0; shift ;;
    -k) SELECT=(-k "$2"); shift 2 ;;
    --shard) SHARD=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1

python3 - <<'PY' || { echo "vLLM for CUDA and a GPU are required" >&2; exit 1; }
import torch, vllm
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
assert current_platform.is_cuda() and torch.cuda.device_count() >= 1
PY

PIP=(python3 -m pip install -q --no-deps --no-build-isolation)
[ -n "$TARGET" ] && PIP+=(--target "$TARGET" --upgrade)
"${PIP[@]}" . || { echo "installing vllm-afd failed" >&2; exit 1; }
python3 - <<'PY' || exit 1
from importlib.metadata import entry_points
names = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "vllm_afd:register" in names, f"plugin entry point not visible: {names}"
print("plugin entry point: vllm_afd:register")
PY

[[ $PARALLEL =~ ^[1-9][0-9]*$ ]] || { echo "--parallel $PARALLEL: expected a number of workers >= 1" >&2; exit 2; }
XDIST=()
if [ $RUN_TESTS = 1 ] && [ "$PARALLEL" -gt 1 ]; then
  python3 -c "import xdist" 2>/dev/null \
    || { echo "--parallel needs pytest-xdist (pip install pytest-xdist)" >&2; exit 2; }
  XDIST=(-n "$PARALLEL" --dist load)
fi

TMP=$(mktemp -d)
rc=0
MPS_STARTED=0
# Server logs reach OUTDIR even when a time limit stops the run part-way.
archive_logs() {
  (cd "$TMP" && find . -name '*.log' -print0 | tar czf "$OUT/server_logs.tgz" --null -T -)
  rm -rf "$TMP"
  [ $MPS_STARTED = 1 ] && echo quit | nvidia-cuda-mps-control
}
trap archive_logs EXIT
trap 'exit 143' TERM INT
if [ $RUN_TESTS = 1 ]; then
  TESTS=(tests/gpu tests/connector)
  if [ -n "$SHARD" ]; then
    mapfile -t TESTS < <(python3 tools/gpu/shard.py "$SHARD" "${SELECT[@]}") || exit 2
    [ ${#TESTS[@]} -gt 0 ] || { echo "shard $SHARD holds no test" >&2; exit 2; }
    echo "shard $SHARD: ${#TESTS[@]} tests"
  fi
  # Workers must not each start and stop the MPS daemon (tests/gpu/conftest.py
  # leaves one that runs alone): one for the whole run.
  if [ ${#XDIST[@]} -gt 0 ] && [ ! -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ] \
      && command -v nvidia-cuda-mps-control > /dev/null && [ "$(id -u)" = 0 ]; then
    nvidia-cuda-mps-control -d && MPS_STARTED=1
  fi
  python3 -m pytest "${TESTS[@]}" -m gpu -v -s -p no:cacheprovider --basetemp="$TMP/pytest" "${SELECT[@]}" "${XDIST[@]}" \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  python3 - "$OUT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
cases = []
for case in ET.parse(f"{out}/junit.xml").iter("testcase"):
    status = "passed"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            status = {"failure": "failed", "error": "error"}.get(tag, tag)
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                  "status": status, "seconds": float(case.get("time", 0))})
json.dump({"tests": cases}, open(f"{out}/results.json", "w"), indent=2)
PY
fi
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ $RUN_BENCH = 1 ] && [ "$GPUS" -ge 2 ]; then
  python3 tools/gpu/bench_decode.py --out "$OUT/bench.json" \
    --log "$OUT/bench_servers.log" "$@" || rc=1
elif [ $RUN_BENCH = 1 ]; then
  # One GPU: the decode benchmark needs two; measure the cuda_ipc round trip
  # (both copies) against the device-copy floor instead, under MPS.
  STARTED_MPS=0
  if [ ! -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ]; then
    nvidia-cuda-mps-control -d && STARTED_MPS=1
  fi
  for copy in ce sm; do
    python3 tools/bench_connector.py --device cuda --backend cuda_ipc \
      --ipc-copy $copy --tokens 1 16 64 256 --hidden 2048 7168 \
      --json "$OUT/bench_connector_$copy.json" || rc=1
  done
  [ $STARTED_MPS = 1 ] && echo quit | nvidia-cuda-mps-control
fi
exit $rc
