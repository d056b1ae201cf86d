"""Progress bars on stderr (tqdm) that also show tokens and tokens/s; nothing when disabled."""

from __future__ import annotations

import sys

from .interrupts import boundary


class Progress:
    """A tqdm bar on stderr (or nothing, when disabled) that also shows tokens and tokens/s."""

    def __init__(self, enabled: bool, total, desc: str, unit: str):
        boundary(desc)  # a stage starts
        self._bar = None
        self._tokens = 0
        if enabled and sys.stderr is not None:  # closed (`2>&-`): no bar to draw
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)

    def update(self, n: int, tokens: int = 0) -> None:
        if self._bar is None:
            return
        self._tokens += tokens
        if self._tokens:
            rate = self._tokens / max(self._bar.format_dict["elapsed"], 1e-9)
            size = self._bar.format_sizeof
            self._bar.set_postfix_str(f"{size(self._tokens)} tokens, {size(rate)} tok/s", refresh=False)
        self._bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
