"""Errors raised for bad input.

Every class subclasses ``ValueError`` so ``except ValueError`` catches any
bad-input error jaxmamba raises; the message always names the offending field,
tensor, slot or request.
"""


class JaxMambaError(ValueError):
    """Base class of every bad-input error in jaxmamba."""


class ConfigError(JaxMambaError):
    """A model or engine configuration that cannot be served (names the field)."""


class CheckpointError(JaxMambaError):
    """A checkpoint that is missing, truncated, or has a missing/extra/mis-shaped tensor."""


class MetadataError(JaxMambaError):
    """Scheduler output that cannot be turned into valid step metadata."""


class SlotError(JaxMambaError):
    """A state slot or block id out of range, double-freed, or aliased."""


class RequestError(JaxMambaError):
    """A request that cannot be served (empty prompt, too long, bad token id, ...)."""


class TransferError(JaxMambaError):
    """A failed, timed-out or mismatched P/D state transfer."""
