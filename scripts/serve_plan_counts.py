"""`specdraft serve` with its batch plans counted: how often each (batch size, requests drafting, draft tokens)
plan was made and how many decode rounds ran at each batch size, written as JSON to OUT every 2 s. For seeing
what a server under load (`specdraft bench-serve --url ...`) decides, which the engine alone does not show.

    python scripts/serve_plan_counts.py OUT.json --model smollm2-135m --max-batch 16 --port 8731 \
        --speculative-model ngram
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from typing import Any

from specdraft.cli import main as cli_main
from specdraft.engine import adaptive, core


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv.pop(1)
    plans: Counter[str] = Counter()
    rounds: Counter[int] = Counter()
    plan, decode = adaptive.plan_batch_drafts, core.Engine._decode_round

    def counted_plan(*args: Any, **kwargs: Any) -> list[int]:
        planned = plan(*args, **kwargs)
        plans[f"{len(planned)},{sum(depth > 0 for depth in planned)},{sum(planned)}"] += 1
        return planned

    def counted_round(engine: core.Engine, requests: Any) -> Any:
        rounds[len(requests)] += 1
        return decode(engine, requests)

    adaptive.plan_batch_drafts = counted_plan
    core.Engine._decode_round = counted_round

    def write() -> None:
        while True:
            time.sleep(2)
            with open(out, "w") as f:
                json.dump({"plans": dict(plans.most_common()), "rounds": dict(sorted(rounds.items()))}, f)

    threading.Thread(target=write, daemon=True).start()
    sys.exit(cli_main(["serve", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
