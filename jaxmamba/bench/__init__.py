"""Benchmarks: ``python -m jaxmamba.bench <subcommand> ...`` (``kernels``, ``serve``, ``transfer``, ...).

Each subcommand is a module ``jaxmamba.bench.<name>`` with ``main(argv) -> int``;
``python -m jaxmamba.bench`` lists the ones present without importing them. The subcommands import the
engine, torch, transformers and NIXL (the last three optional extras) inside the functions that use them, so
a subcommand's ``--help`` and its other modes do not pay for what they do not run.
"""
