"""The one measuring loop every benchmark shares: item -> repeat -> method, so slow drifts of a noisy machine
(another process, heat, frequency) hit every method alike, and ratios taken within one run stay honest."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

Item = TypeVar("Item")


def interleaved(items: Sequence[Item], methods: Mapping[str, Callable[[Item, int], Any]], repeats: int,
                desc: str, progress: bool = True, label: Callable[[Item], str] = str) -> list[dict[str, list]]:
    """Run `methods[name](item, repeat)` for every item, `repeats` times each, interleaved; returns per item
    {method name: [result of each repeat]}. A method that returns None for an item (a peer that broke) is
    left out of that item's results. Progress bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=len(items) * repeats * len(methods), desc=desc, unit="run", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    out: list[dict[str, list]] = []
    try:
        for item in items:
            results: dict[str, list] = {}
            for repeat in range(repeats):
                for name, run in methods.items():
                    bar.set_postfix_str(f"{label(item)} {name}", refresh=False)
                    result = run(item, repeat)
                    if result is not None:
                        results.setdefault(name, []).append(result)
                    bar.update()
            out.append(results)
    finally:
        bar.close()
    return out
