"""Whether the ``reference`` extra (torch + transformers) can be imported, for the tests that
run the torch reference live: one reason string for their ``skipif``, or None."""

from __future__ import annotations


def missing_reference_extra(modules: tuple[str, ...] = ("torch", "transformers")) -> str | None:
    """None when every module imports; else why not (the import error), naming the extra."""
    for name in modules:
        try:
            __import__(name)
        except ImportError as e:
            return f"the reference extra ({' + '.join(modules)}) is not installed: {e}"
    return None
