"""vLLM on the other side of jaxmamba's P/D contract: pages a running vLLM wrote, read by jaxmamba, and back
(docs/architecture.md, "P/D across frameworks").

* ``caches``: ``VllmCaches``, a running vLLM's Mamba slots and KV blocks per request, through its own
  block table.
* ``prefill``: ``VllmPrefill``, vLLM as the prefill tier (``directories()``, ``prefill(prompts)``), for an
  unchanged jaxmamba ``DecodeEngine``.
* ``serve`` (``python -m transfer.vllm_pages``): a vLLM engine in its own venv, driven over JSON lines;
  ``process.VllmProcess`` starts and drives it from jaxmamba's venv.

vLLM is imported only by ``caches``, ``prefill`` and ``serve`` (in vLLM's venv); importing this package or
``process`` does not need it.
"""

from __future__ import annotations

__all__ = ["VllmCaches", "VllmPrefill"]


def __getattr__(name: str):
    if name == "VllmCaches":
        from transfer.vllm_pages.caches import VllmCaches

        return VllmCaches
    if name == "VllmPrefill":
        from transfer.vllm_pages.prefill import VllmPrefill

        return VllmPrefill
    raise AttributeError(name)
