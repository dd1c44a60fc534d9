"""A progress bar over the step programs an engine or a plan builds (``CompiledSteps(progress=...)``)."""

from __future__ import annotations

import sys


class CompileProgress:
    """A tqdm bar that counts programs, with a total and an ETA. Its label says what the start does: "loading
    N programs from the cache" while every program so far came from a cache (the executable cache, or JAX's
    persistent one answering the compile), else "compiling N programs" (and how many come from the cache).
    JAX's cache can only be asked by compiling, so a start that may find its programs there says "building N
    programs" until the first is in. ``begin`` may be called more than once (a plan builds its largest bucket
    first): the totals add up. ``file``: where the bar goes (default stderr)."""

    def __init__(self, file=None, desc_prefix: str = ""):
        self.file = file if file is not None else sys.stderr
        self.prefix = desc_prefix
        self.total = 0
        self.cached = 0  # known beforehand to be in the executable cache
        self.loaded = 0  # came from a cache (either), as reported by ``update``
        self.compiled = 0  # compiled by XLA, as reported by ``update``
        self.may_hit_jax_cache = False
        self._bar = None

    def label(self) -> str:
        from_cache = max(self.cached, self.loaded)
        if self.compiled == 0 and (self.loaded > 0 or from_cache == self.total):
            text = f"loading {self.total} programs from the cache"
        elif self.compiled == 0 and self.may_hit_jax_cache:
            text = f"building {self.total} programs"
        else:
            text = f"compiling {self.total - from_cache} programs" + (f" ({from_cache} from the cache)"
                                                                       if from_cache else "")
        return self.prefix + text

    def begin(self, total: int, cached: int = 0, may_hit_jax_cache: bool = False) -> None:
        from tqdm import tqdm

        self.total += total
        self.cached += cached
        self.may_hit_jax_cache = self.may_hit_jax_cache or may_hit_jax_cache
        if self._bar is None:
            self._bar = tqdm(total=self.total, desc=self.label(), unit="program", file=self.file, dynamic_ncols=True)
        else:
            self._bar.total = self.total
            self._bar.set_description(self.label())

    def update(self, from_cache: bool = False) -> None:
        """One program is ready; ``from_cache``: it was loaded, not compiled."""
        if from_cache:
            self.loaded += 1
        else:
            self.compiled += 1
        if self._bar is not None:
            self._bar.set_description(self.label(), refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def attached_to_terminal() -> bool:
    """Whether progress is worth drawing by default: stderr is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
