"""The one measuring loop every benchmark shares: item -> repeat -> method, so slow drifts of a noisy machine
(another process, heat, frequency) hit every method alike, and ratios taken within one run stay honest."""

from __future__ import annotations

import statistics
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


def alternated_medians(ways: Mapping[str, Callable[[], float]], passes: int, desc: str) -> dict[str, float]:
    """Each way's median result (a rate) over `passes`, the ways taking turns within each pass."""
    runs = interleaved([desc], {name: lambda _item, _repeat, way=way: way() for name, way in ways.items()}, passes,
                       desc)[0]
    return {name: statistics.median(values) for name, values in runs.items()}


def print_rates(title: str, rates: Mapping[str, float], unit: str) -> None:
    """One line: each rate and its ratio to the first."""
    base = next(iter(rates.values()))
    print(title + ": " + ", ".join(f"{name} {rate:.1f} {unit} ({rate / base:.3f}x)" for name, rate in rates.items()),
          flush=True)
