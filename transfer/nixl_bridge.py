"""A thin bridge from ``TransferPlan`` byte ranges to real NIXL READs (UCX backend).

``PageExporter`` (P side) registers a rank's pages and publishes a ``PageDirectory``; ``PageImporter``
(D side) checks directories against its plan and posts the planned READs; ``ReadFailed`` names every
page a failed READ could have written. Memory layouts and faults: docs/architecture.md,
"The NIXL bridge". The agents and their pages live in ``transfer.nixl_agent``, the D side's reads in
``transfer.nixl_import``; this module names both.
"""

from transfer.nixl_agent import (
    Buffer,
    KVRegion,
    MambaRegion,
    PageDirectory,
    PageExporter,
    RequestPages,
    buffer_of,
    live_registrations,
    load_nixl,
    nixl_available,
)
from transfer.nixl_import import Pairs, PageImporter, ReadFailed, ReadResult  # noqa: F401 - Pairs: the old home

__all__ = [
    "Buffer",
    "KVRegion",
    "MambaRegion",
    "PageDirectory",
    "PageExporter",
    "PageImporter",
    "ReadFailed",
    "ReadResult",
    "RequestPages",
    "buffer_of",
    "live_registrations",
    "load_nixl",
    "nixl_available",
]
