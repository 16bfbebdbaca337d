"""Flag choices that come from backend registries, without importing those registries to build the parser.

The registries live in modules that import torch; `pdserve router`, `bench` and `healthcheck` never need them, so
their names are looked up only when a value is checked or help is printed.
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterable, Iterator


class LazyChoices:
    """argparse `choices` computed on first use (`in` or iteration), so building the parser imports nothing heavy.
    Give the argument a `metavar`: argparse iterates choices to build a default one."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names, self._cache = names, None

    def _all(self) -> list[str]:
        if self._cache is None:
            self._cache = list(self._names())
        return self._cache

    def __contains__(self, item: object) -> bool:
        return item in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())


class HelpFormatter(argparse.HelpFormatter):
    """Shows `{a,b,c}` for lazy choices in help, but does not load them for argparse's own check at
    `add_argument` time (the one call that passes no default metavar)."""

    def _metavar_formatter(self, action, default_metavar):
        if isinstance(action.choices, LazyChoices) and action.metavar is None and default_metavar is None:
            return lambda tuple_size: ("CHOICE",) * tuple_size
        return super()._metavar_formatter(action, default_metavar)


class ArgumentParser(argparse.ArgumentParser):
    """The CLI's parser class; its subparsers inherit it, and with it the formatter above."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
