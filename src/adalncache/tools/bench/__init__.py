"""``adalncache bench``: side-by-side measurements of the rebuild pass, serving and memory.

A package, one module per job: :mod:`.command` (the command line and the order of the sections),
:mod:`.results` (comparisons, values, notes) and :mod:`.report` (JSON, Markdown, chart),
:mod:`.workload` (the generated checkpoint, the request, its inputs), :mod:`.primitives` (what is
timed side by side), and one module per section: :mod:`.passes` (``pass``), :mod:`.forward`,
:mod:`.hitpath` (``build``, with SGLang's cache from :mod:`.sglang` beside it), :mod:`.store`,
:mod:`.memory`, :mod:`.first_request` (``first-request``), :mod:`.deploy` (with the released
geometry's arithmetic in :mod:`.released`) and :mod:`.tables`. Process and page-cache
measurements are :mod:`adalncache.tools.measure`'s.
"""

from __future__ import annotations

from .command import SECTIONS, register, run

__all__ = ["SECTIONS", "register", "run"]
