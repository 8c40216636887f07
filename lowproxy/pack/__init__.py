"""The one-file build: ``python -m lowproxy.pack -o dist/lowproxy.pyz``.

``build`` writes the zipapp, ``sources`` finds what goes in it (lowproxy and the
distributions its requirements need on each supported Python), ``markers``
evaluates requirement markers. Build-time only: nothing in lowproxy imports it, and
the archive leaves it out.
"""

from .build import DEFAULT_OUTPUT, main, size_kib

__all__ = ["DEFAULT_OUTPUT", "main", "size_kib"]
