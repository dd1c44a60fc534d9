"""``python -m transfer.vllm_pages ...``: see ``transfer.vllm_pages.serve``."""

from transfer.vllm_pages.serve import main

main()
