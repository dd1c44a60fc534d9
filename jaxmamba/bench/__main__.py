"""``python -m jaxmamba.bench <subcommand> [args]``: dispatch to ``jaxmamba.bench.<subcommand>.main``.

A subcommand is any module of this package (not starting with ``_``) that
defines ``main(argv) -> int``; adding ``serve.py`` or ``transfer.py`` adds the
subcommand, nothing here needs to change. A module name's underscores are
hyphens on the command line (``host_inputs.py``: ``host-inputs``; the
underscore spelling is accepted too).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import jaxmamba.bench as _pkg


def subcommands() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def _usage() -> str:
    names = ",".join(subcommands())
    return f"usage: python -m jaxmamba.bench {{{names}}} [args ...]  (-h after a subcommand for its help)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0].replace("_", "-"), argv[1:]
    if name not in subcommands():
        print(f"unknown benchmark {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    module_name = f"jaxmamba.bench.{name.replace('-', '_')}"
    module = importlib.import_module(module_name)
    if not hasattr(module, "main"):
        print(f"{module_name} has no main(argv)", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
