#!/usr/bin/env bash
# Create (or reuse) .venv with the CPU stack and the project installed. Idempotent and quiet.
#   torch 2.13.0 (CPU build), fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0 installed with --no-deps
#   (a plain `pip install torchrec` pulls the CUDA fbgemm-gpu, which breaks `import fbgemm_gpu`
#   on a machine without a GPU), torchrec's other requirements, then this project with [dev]
#   (editable; tests/test_wheel.py checks the wheel a user installs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.loka-env-v4"
if [ -f "$stamp" ] && "$venv/bin/python" -c "import torchrec, loka_torchrec, loka_job.recipes" 2>/dev/null; then
  exit 0
fi
echo "setting up $venv (first run only; a few minutes)" >&2
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# The build backend as pyproject.toml asks for it: tests/test_wheel.py builds the wheel without build isolation.
"${pip[@]}" "setuptools>=77" wheel
"${pip[@]}" torch==2.13.0
"${pip[@]}" fbgemm-gpu-cpu==1.8.0
"${pip[@]}" --no-deps torchrec==1.8.0
"${pip[@]}" tensordict pyre-extensions torchmetrics==1.0.3 iopath tqdm
# The project's other requirements and [dev] extras, then the project itself with --no-deps:
# letting pip resolve `torchrec` again would pull the CUDA fbgemm-gpu back in.
"${pip[@]}" "hydra-core>=1.3,<1.4" "omegaconf>=2.3" rich numpy pytest pytest-xdist hypothesis scipy matplotlib triton
"${pip[@]}" --no-deps -e "$root"
touch "$stamp"
