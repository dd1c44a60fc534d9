"""Benchmarks: ``python -m jaxmamba.bench <subcommand> ...`` (``kernels``, ``serve``, ``transfer``, ...).

Each subcommand is a module ``jaxmamba.bench.<name>`` with ``main(argv) -> int``;
``python -m jaxmamba.bench`` lists the ones present.
"""
