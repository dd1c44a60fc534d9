"""A progress bar over the step programs an engine or a plan builds (``CompiledSteps(progress=...)``)."""

from __future__ import annotations

import sys


class CompileProgress:
    """A tqdm bar that counts programs, with a total and an ETA. Its label says what the start does: "loading
    N programs from the cache" when every program is cached, else "compiling N programs" (and how many come
    from the cache). ``begin`` may be called more than once (a plan builds its largest bucket first): the
    totals add up. ``file``: where the bar goes (default stderr)."""

    def __init__(self, file=None, desc_prefix: str = ""):
        self.file = file if file is not None else sys.stderr
        self.prefix = desc_prefix
        self.total = 0
        self.cached = 0
        self._bar = None

    def label(self) -> str:
        compiled = self.total - self.cached
        if compiled == 0:
            text = f"loading {self.total} programs from the cache"
        else:
            text = f"compiling {compiled} programs" + (f" ({self.cached} from the cache)" if self.cached else "")
        return self.prefix + text

    def begin(self, total: int, cached: int = 0) -> None:
        from tqdm import tqdm

        self.total += total
        self.cached += cached
        if self._bar is None:
            self._bar = tqdm(total=self.total, desc=self.label(), unit="program", file=self.file, dynamic_ncols=True)
        else:
            self._bar.total = self.total
            self._bar.set_description(self.label())

    def update(self) -> None:
        if self._bar is not None:
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
