"""Benchmarks: ``python -m jaxmamba.bench <subcommand> ...`` (``kernels``, ``serve``, ``transfer``, ...).

Each subcommand is a module ``jaxmamba.bench.<name>`` with ``main(argv) -> int``;
``python -m jaxmamba.bench`` lists the ones present. A subcommand imports what it measures when it runs
(inside its functions), so listing them, ``--help`` and the CLI's dispatch load neither JAX nor the optional
torch, transformers and NIXL.
"""
