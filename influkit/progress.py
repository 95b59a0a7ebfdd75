"""Progress bars: one tqdm bar per long phase (curvature passes, Lanczos, solves, scoring), off with ``progress=False``.

A bar is drawn only once its phase has run ``DELAY`` seconds (tqdm's ``delay``), so quick phases print nothing even
with ``progress=True``; it goes to stderr and is removed when its phase ends.
"""

from __future__ import annotations

from tqdm.auto import tqdm

DELAY = 2.0  # seconds a phase runs before its bar appears


def bar(total: int | None, desc: str, enabled: bool) -> tqdm:
    """A tqdm bar of ``total`` steps named ``desc``; ``enabled=False`` gives a silent one."""
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, delay=DELAY)


def steps(iterable, desc: str, enabled: bool, total: int | None = None):
    """``iterable`` with a bar (:func:`bar`)."""
    return tqdm(iterable, desc=desc, disable=not enabled, leave=False, delay=DELAY, total=total)
