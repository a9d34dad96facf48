"""`specdraft bench-draft`: what one draft step of each drafter costs against one target step.

A drafter pays only if drafting K tokens costs a small fraction of the K target steps it may save. For each
drafter this decodes the same prompts with a fixed draft length K (no adaptation, greedy), times every call
of the drafter's `propose` and `observe` (the first round of a request, which catches up on the prompt, is
left out: it is a per-request cost, not a per-step one), and divides the median round's drafting time by K
and by the median plain decoding step of the same target on the same prompts, run interleaved in the same
process. It also reports the measured verification cost of K + 1 tokens and each drafter's mean accepted
length, so the table says where each drafter's rounds go.

draft_cost.json (`schema_version` 1):

    {"schema_version": 1, "kind": "specdraft-draft-cost", "header": {...},
     "config": {"model": str, "k": int, "max_tokens": int, "prompts": int, "repeats": int},
     "plain_step_ms": float,
     "drafters": {SPEC: {"draft_round_ms": float, "draft_step_ms": float, "step_ratio": float,
                         "verify_ms": float, "verify_ratio": float, "mean_accepted_length": float,
                         "acceptance_rate": float}}}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA_VERSION = 1


class TimedDrafter:
    """Wraps a drafter: the wall time of each round's `propose` + `observe`, per request, first round of each
    request left out."""

    def __init__(self, drafter) -> None:
        self.inner = drafter
        self.name = drafter.name
        self.hidden_layers = drafter.hidden_layers
        self.rounds: list[float] = []
        self._seen: set[int] = set()
        self._pending: dict[int, float] = {}

    def add_request(self, request) -> None:
        self.inner.add_request(request)

    def remove_request(self, request_id: int) -> None:
        self._seen.discard(request_id)
        self.inner.remove_request(request_id)

    def propose(self, request_ids, contexts, max_ks, max_nodes=None):
        t0 = time.perf_counter()
        out = self.inner.propose(request_ids, contexts, max_ks, max_nodes)
        share = (time.perf_counter() - t0) / max(1, len(request_ids))
        for rid in request_ids:
            self._pending[rid] = share
        return out

    def observe(self, request_id: int, verified) -> None:
        t0 = time.perf_counter()
        self.inner.observe(request_id, verified)
        spent = self._pending.pop(request_id, None)
        if spent is None:
            return
        if request_id in self._seen:
            self.rounds.append(spent + time.perf_counter() - t0)
        self._seen.add(request_id)


def measure_draft_cost(target, tokenizer, prompts: list[list[int]], drafters: dict, k: int, max_tokens: int,
                       repeats: int, progress: bool = False) -> dict:
    """{"plain_step_ms", "drafters": {spec: {...}}} (the schema's fields) for drafters given by spec."""
    from specdraft.engine.adaptive import AdaptiveConfig
    from specdraft.engine.core import Engine
    from specdraft.verify.sampling import SamplingParams

    fixed = AdaptiveConfig(enabled=False)
    plain = Engine(target, tokenizer, None, 0, fixed)
    timed = {spec: TimedDrafter(d) for spec, d in drafters.items()}
    engines = {spec: Engine(target, tokenizer, d, k, fixed) for spec, d in timed.items()}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain_steps: list[float] = []
    verify: dict[str, list[float]] = {spec: [] for spec in engines}
    counts = {spec: [0, 0, 0, 0] for spec in engines}  # produced tokens, forwards, accepted, drafted
    for repeat in range(repeats):
        for ids in prompts:
            m = plain.generate(ids, params).metrics
            plain_steps.append(m.verify_time / max(1, m.target_forwards))
            for spec, engine in engines.items():
                m = engine.generate(ids, params).metrics
                verify[spec].append(m.verify_time / max(1, m.target_forwards))
                for i, v in enumerate((m.produced_tokens, m.target_forwards, m.accepted, m.drafted)):
                    counts[spec][i] += v
        if progress:
            print(f"repeat {repeat + 1}/{repeats} done", flush=True)
    plain_ms = statistics.median(plain_steps) * 1e3
    out: dict = {"plain_step_ms": plain_ms, "drafters": {}}
    for spec, drafter in timed.items():
        round_ms = statistics.median(drafter.rounds) * 1e3 if drafter.rounds else 0.0
        verify_ms = statistics.median(verify[spec]) * 1e3
        tokens, forwards, accepted, drafted = counts[spec]
        out["drafters"][spec] = {
            "draft_round_ms": round_ms, "draft_step_ms": round_ms / k, "step_ratio": round_ms / k / plain_ms,
            "verify_ms": verify_ms, "verify_ratio": verify_ms / plain_ms,
            "mean_accepted_length": tokens / max(1, forwards), "acceptance_rate": accepted / max(1, drafted)}
    return out


def run_draft_cost(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    from specdraft.bench.machine import header as machine_header
    from specdraft.bench.machine import header_lines
    from specdraft.bench.suite import load_suite, spread
    from specdraft.drafters import make_drafter, split_drafter_list
    from specdraft.runtime.loader import load_model, load_tokenizer

    target, tokenizer = load_model(args.model), load_tokenizer(args.model)
    prompts = [tokenizer.prompt_ids(q.turns[0], chat=tokenizer.has_chat_template)
               for q in spread(load_suite(args.suite), args.prompts)]
    drafters = {spec: make_drafter(spec, target, tokenizer) for spec in split_drafter_list(args.drafters)}
    measured = measure_draft_cost(target, tokenizer, prompts, drafters, args.k, args.max_tokens, args.repeats,
                                  progress=not args.no_progress)
    results = {"schema_version": SCHEMA_VERSION, "kind": "specdraft-draft-cost", "header": machine_header(argv),
               "config": {"model": args.model, "k": args.k, "max_tokens": args.max_tokens,
                          "prompts": len(prompts), "repeats": args.repeats}, **measured}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(header_lines(results["header"])))
    print(render_table(results))
    print(f"wrote {out / 'draft_cost.json'}")
    return results


def render_table(results: dict) -> str:
    k = results["config"]["k"]
    lines = [f"plain step: {results['plain_step_ms']:.2f} ms; drafts of K = {k}, greedy",
             "| drafter | draft step ms | x target step | verify K+1 ms | x target step | tokens/forward | acc. rate |",
             "| :--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for spec, d in results["drafters"].items():
        lines.append(f"| {spec} | {d['draft_step_ms']:.2f} | {d['step_ratio']:.3f} | {d['verify_ms']:.2f} | "
                     f"{d['verify_ratio']:.2f} | {d['mean_accepted_length']:.2f} | {d['acceptance_rate']:.2f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory or .gguf file")
    p.add_argument("--drafters", default="eagle,medusa,ngram", help="comma-separated drafter specs")
    p.add_argument("--suite", default=None, help="Spec-Bench JSONL (default: the bundled 12-prompt suite)")
    p.add_argument("--prompts", type=int, default=6, help="prompts, spread over the suite's categories")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per prompt (EOS ignored)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench-out", help="directory for draft_cost.json")
    p.add_argument("--no-progress", action="store_true")


__all__ = ["TimedDrafter", "measure_draft_cost", "render_table", "run_draft_cost"]
