"""`specdraft bench`: Spec-Bench style comparison of decoding methods on one target model.

Every method runs on the same prompts, after a warm-up, interleaved per prompt (for each prompt, for each
repeat, every method in turn) so that machine noise hits all methods alike. Multi-turn prompts run both turns;
the second turn's prompt is the conversation so far, with the method's own first answer. Our methods and the
transformers peer run in this process; the llama.cpp peer runs in a worker process of its own, and if it
breaks (`PeerFailed`: the worker crashed, hung or reported an error) the peer is dropped, with all its runs so
that every method's figures cover the same prompts, and listed under `failed_peers`.

results.json schema (`schema_version` 1; times in seconds; rates in [0, 1]; null = not applicable):

    {
      "schema_version": 1,
      "kind": "specdraft-bench",
      "header": {
        "machine": {"cpu": str, "logical_cores": int, "usable_cores": int, "physical_cores": int|null,
                    "torch_threads": int, "platform": str, "cuda": str|null},
        "versions": {"python": str, "torch": str, "transformers": str, "specdraft": str,
                     "llama_cpp_python": str (only when installed)},
        "model": str, "dtype": str, "date": ISO-8601 str, "command": str
      },
      "config": {"suite": str, "per_category": int|null, "groups": [str]|null, "methods": [str],
                 "peers": [str], "k": int, "tree": int, "adaptive": bool, "temperature": float, "max_tokens": int,
                 "repeats": int, "seed": int, "max_model_len": int, "chat_template": bool},
      "greedy": bool,                      # temperature == 0: identity with plain is checked
      "methods": [{"name": str, "kind": "ours"|"peer", "baseline": str}],   # baseline: the method's own
                                           # plain decoding ("plain" for ours, "hf-bf16" for "hf-bf16-pld"...)
      "skipped_peers": [{"peer": str, "reason": str}],   # could not be loaded
      "failed_peers": [{"peer": str, "methods": [str], "stage": "warm-up"|"run", "reason": str}],
                                           # broke while running (e.g. the llama.cpp worker was killed by
                                           # SIGSEGV): no figures for its methods
      "peer_notes": [{"peer": str, "note": str}],   # how a peer was run, when it departs from its defaults
      "groups": [str],                     # category groups present, in Spec-Bench order
      "summary": {                         # one entry per group and "overall"
        GROUP: {METHOD: {
          "samples": int,                  # turns measured (a two-turn prompt counts 2)
          "tokens": int, "time_s": float,  # sums over samples of per-sample medians over repeats
          "tokens_per_s": float|null,      # tokens / time_s (prefill included)
          "speedup": float|null,           # tokens_per_s / plain's tokens_per_s in the same group
          "ttft_s": float|null,            # median over samples of the per-sample median time to first token
          "mean_accepted_length": float|null,  # tokens per target decode forward, bonus included (plain 1.0);
                                               # null for peers
          "acceptance_rate": float|null, "drafted": int|null, "accepted": int|null,
          "per_position_acceptance": [float]|null,  # index i = draft position i+1
          "drafted_per_position": [int]|null, "accepted_per_position": [int]|null,
          "identical": int|null,           # samples whose output equals plain's (null unless greedy)
          "compared": int|null,            # samples compared for identity
          "identical_to_baseline": int|null, "compared_to_baseline": int|null  # peers: vs their own plain
        }}
      },
      "samples": [{
        "question_id": int|str, "category": str, "group": str, "turn": int (1-based),
        "methods": {METHOD: {
          "prompt_tokens": int, "tokens": float, "time_s": float, "times_s": [float] (one per repeat),
          "ttft_s": float|null, "target_forwards": int|null, "produced_tokens": int|null,
          "drafted": int|null, "accepted": int|null,           # counters summed over repeats
          "drafted_per_position": [int]|null, "accepted_per_position": [int]|null,
          "finish_reason": str, "text": str (first repeat),
          "identical_to_plain": bool|null, "identical_to_baseline": bool|null
        }}
      }],
      "divergences": [{                    # greedy only: outputs that differ from their reference
        "question_id": int|str, "category": str, "group": str, "turn": int, "method": str,
        "reference": str ("plain" or the peer's baseline), "repeat": int,
        "prompt_differs": bool,            # turn 2 after a turn-1 divergence: the prompts already differ
        "position": int|null,              # first differing output token
        "reference_token": int|null, "method_token": int|null,
        "reference_piece": str|null, "method_piece": str|null,
        "logit_gap": float|null            # target's top1 - top2 logit at that position (fresh forward over
                                           # prompt + reference prefix); null when not computed
      }]
    }
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdraft.bench import stats
from specdraft.bench.suite import OVERALL, Question, group_of, order_groups
from specdraft.config import TRANSFORMERS, arg_draft_length, arg_tree_size
from specdraft.verify.sampling import SamplingParams

SCHEMA_VERSION = 1
WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------------------------- methods


class OurMethod:
    """One of our decoding methods: an `Engine` (plain = no drafter, K = 0)."""

    kind = "ours"

    def __init__(self, name: str, engine, baseline: str = "plain") -> None:
        """baseline: the plain decoding of the same weights ("plain", or "plain@gguf" for a method run on
        the target loaded with another dtype)."""
        self.name = name
        self.engine = engine
        self.baseline = baseline

    def run(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        t0 = time.perf_counter()
        result = self.engine.generate(prompt_ids, params)
        wall = time.perf_counter() - t0
        m = result.metrics
        return {
            "token_ids": list(result.token_ids), "text": result.text, "tokens": len(result.token_ids),
            "time_s": wall, "ttft_s": m.prefill_time, "finish_reason": result.finish_reason,
            "target_forwards": m.target_forwards, "produced_tokens": m.produced_tokens, "drafted": m.drafted,
            "accepted": m.accepted, "drafted_per_position": list(m.drafted_per_position),
            "accepted_per_position": list(m.accepted_per_position),
        }


def parse_methods(spec: str) -> list[str]:
    """Comma list of methods; `plain` (the speedup baseline) is always run, first, and `plain@DTYPE` (the
    baseline of methods run on the target in another dtype) before the first method with that suffix."""
    from specdraft.drafters import split_drafter_list
    from specdraft.errors import SpecdraftError

    names = split_drafter_list(spec)
    if len(set(names)) != len(names):
        raise SpecdraftError(f"duplicate method in {spec!r}")
    ordered = ["plain"]
    for name in names:
        dtype = method_dtype(name)[1]
        if dtype is not None and f"plain@{dtype}" not in ordered:
            ordered.append(f"plain@{dtype}")
        if name not in ordered:
            ordered.append(name)
    return ordered


def method_dtype(name: str) -> tuple[str, str | None]:
    """A method name may end in `@DTYPE` (`plain@gguf`, `ngram+tree8@gguf`): the method runs on the target
    loaded with that dtype (`--dtype` otherwise), or `@transformers`: on the target loaded by transformers (fp32,
    the transformers backend); returns (name without it, that suffix or None)."""
    from specdraft.errors import SpecdraftError

    base, at, dtype = name.rpartition("@")
    if not at:
        return name, None
    if dtype not in TARGET_VARIANTS or not base:
        raise SpecdraftError(f"method {name!r}: @ takes one of {', '.join(TARGET_VARIANTS)}")
    return base, dtype


DTYPES = ("bf16", "fp32", "gguf")
TARGET_VARIANTS = (*DTYPES, TRANSFORMERS)  # `@transformers`: the target run by transformers (runtime/hf_backend.py)


def method_tree(name: str, default_tree: int) -> tuple[str, int]:
    """A method name is a drafter spec, optionally with `+treeN` (trees of up to N tokens; `+tree0`: chains);
    without it the method drafts `default_tree` (`--tree`)."""
    from specdraft.config import arg_tree_size
    from specdraft.errors import SpecdraftError

    drafter, plus, tree = name.rpartition("+tree")
    if not plus:
        return name, default_tree
    try:
        return drafter, arg_tree_size(tree)
    except Exception as exc:
        raise SpecdraftError(f"method {name!r}: +tree takes a tree size, {exc}") from None


def build_our_methods(names: Sequence[str], target, tokenizer, k: int, adaptive: bool, max_len: int,
                      tree: int = 0, targets: dict | None = None) -> list:
    """targets: dtype -> the target loaded in it, for methods named `...@DTYPE`."""
    from specdraft.engine.core import build_engine

    methods = []
    for name in names:
        base, dtype = method_dtype(name)
        drafter, size = method_tree(base, tree)
        model = target if dtype is None else targets[dtype]
        engine = build_engine(model, tokenizer, None if drafter == "plain" else drafter, k,
                              adaptive and drafter != "plain", max_len, tree=size)
        baseline = "plain" if dtype is None or name == f"plain@{dtype}" else f"plain@{dtype}"
        methods.append(OurMethod(name, engine, baseline))
    return methods


# ---------------------------------------------------------------------------------------------- prompts


class PromptBuilder:
    """Token ids of turn n's prompt: the chat template over [user 1, assistant 1, ..., user n] when the
    tokenizer has one, else the turns and answers joined by blank lines."""

    def __init__(self, tokenizer, use_chat: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = tokenizer.has_chat_template if use_chat is None else use_chat

    def __call__(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        if self.chat:
            messages = []
            for i, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn})
                if i < len(answers):
                    messages.append({"role": "assistant", "content": answers[i]})
            return self.tokenizer.prompt_ids(messages)
        parts = []
        for i, turn in enumerate(turns):
            parts.append(turn)
            if i < len(answers):
                parts.append(answers[i])
        return self.tokenizer.prompt_ids("\n\n".join(parts) + "\n\n")


# ---------------------------------------------------------------------------------------------- running


# (question index, turn index) -> method -> one run dict per repeat
Runs = dict[tuple[int, int], dict[str, list[dict]]]


def params_for(base: SamplingParams, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=base.temperature, top_p=base.top_p, top_k=base.top_k, min_p=base.min_p,
                          seed=seed, max_tokens=base.max_tokens, stop=base.stop, ignore_eos=base.ignore_eos)


def peer_of(method) -> str:
    """The peer a method belongs to (methods that share a worker fail together); its own name otherwise."""
    return getattr(method, "peer", None) or method.name


def _peer_failed(exc, method, methods: Sequence, stage: str, failed: list[dict] | None) -> None:
    """Record that `method`'s peer broke (`exc`: a `PeerFailed`); re-raise when nobody collects failures."""
    if failed is None:
        raise exc
    peer = peer_of(method)
    if any(f["peer"] == peer for f in failed):
        return
    names = [m.name for m in methods if peer_of(m) == peer]
    failed.append({"peer": peer, "methods": names, "stage": stage, "reason": str(exc)})
    print(f"peer {peer} failed during {stage}: {exc}; going on without {', '.join(names)}", file=sys.stderr,
          flush=True)


def failed_names(failed: Sequence[dict]) -> set[str]:
    return {name for f in failed for name in f["methods"]}


def warm_up(methods: Sequence, questions: Sequence[Question], build: PromptBuilder,
            params: SamplingParams, failed: list[dict] | None = None) -> None:
    """One short generation per method (first use pays for allocations, kernel selection, lazy imports).

    A peer that breaks (`PeerFailed`) is appended to `failed` (re-raised when `failed` is None)."""
    from specdraft.bench.peers import PeerFailed

    ids = build(questions[0].turns[:1], [])
    short = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           min_p=params.min_p, seed=0, max_tokens=min(WARMUP_TOKENS, params.max_tokens))
    for m in methods:
        if failed and m.name in failed_names(failed):
            continue
        cache = shared_cache(m)
        before = cache.snapshot() if cache is not None else None
        try:
            m.run(ids, short)
            if cache is not None:  # the warm-up's text and predictions must not help the first question
                cache.restore(before)
        except PeerFailed as exc:
            _peer_failed(exc, m, methods, "warm-up", failed)


def shared_cache(method):
    """What a method's drafter remembers across requests (`suffix`'s cache of earlier requests, `recycle`'s
    recycled predictions), if anything: its `memory` (see `Drafter`), with `snapshot()` and `restore()`."""
    drafter = getattr(getattr(method, "engine", None), "drafter", None)
    return getattr(drafter, "memory", None)


def run_suite(methods: Sequence, questions: Sequence[Question], build: Callable, params: SamplingParams,
              repeats: int, seed: int = 0, progress: bool = True, failed: list[dict] | None = None) -> Runs:
    """Run every method on every turn of every question, `repeats` times, interleaved per question.

    Methods of peers already in `failed` are not run. A peer that breaks (`PeerFailed`) is appended to
    `failed` (re-raised when `failed` is None), is not run again, and its runs are left out of the result."""
    from specdraft.bench.interleave import interleaved
    from specdraft.bench.peers import PeerFailed

    def conversation(m) -> Callable:
        cache = shared_cache(m)
        engine = getattr(m, "engine", None)  # ours: an Engine that keeps prompt prefixes for reuse
        engine = engine if hasattr(engine, "prefix_snapshot") else None
        before: list = []

        def run(q: Question, repeat: int) -> list[dict] | None:
            """All turns of one question; each turn's prompt carries the method's own earlier answers. A
            drafter's cache of earlier requests, and the prompt prefixes the engine keeps for reuse, are reset
            to their state before the question's first repeat, so a repeat is never drafted from its own
            earlier answer, nor spared the prefill of its own earlier prompt."""
            if failed and m.name in failed_names(failed):
                return None
            if repeat == 0:
                before[:] = [cache.snapshot() if cache is not None else None,
                             engine.prefix_snapshot() if engine is not None else None]
            else:
                if cache is not None:
                    cache.restore(before[0])
                if engine is not None:
                    engine.restore_prefixes(before[1])
            answers: list[str] = []
            turns = []
            for ti in range(len(q.turns)):
                ids = build(q.turns[:ti + 1], answers)
                try:
                    result = m.run(ids, params_for(params, None if params.greedy else seed + repeat))
                except PeerFailed as exc:
                    _peer_failed(exc, m, methods, "run", failed)
                    return None
                result["prompt_ids"] = list(ids)
                turns.append(result)
                answers.append(result["text"].strip())
            return turns

        return run

    per_question = interleaved(questions, {m.name: conversation(m) for m in methods}, repeats, "bench",
                               progress=progress, label=lambda q: f"{q.category} #{q.question_id}")
    runs: Runs = {}
    for qi, by_method in enumerate(per_question):
        for name, repeats_runs in by_method.items():
            for turns in repeats_runs:
                for ti, result in enumerate(turns):
                    runs.setdefault((qi, ti), {}).setdefault(name, []).append(result)
    dropped = failed_names(failed or [])
    for by_method in runs.values():
        for name in dropped:
            by_method.pop(name, None)
    return runs


def logit_gap_fn(target) -> Callable[[Sequence[int], Sequence[int]], dict]:
    """gap(prompt_ids, prefix) -> the target's top-2 logits after prompt + prefix (one forward, fresh
    cache)."""
    import torch

    def gap(prompt_ids: Sequence[int], prefix: Sequence[int]) -> dict:
        ids = [*prompt_ids, *prefix]
        cache = target.new_cache(len(ids))
        logits = target(torch.tensor([ids]), cache, logits_from=len(ids) - 1)
        top = logits[0, -1].float().topk(2)
        return {"logit_gap": float(top.values[0] - top.values[1]), "top1": int(top.indices[0]),
                "top2": int(top.indices[1])}

    return gap


# ---------------------------------------------------------------------------------------------- results


def _compare(method_runs: list[dict], ref_runs: list[dict]) -> tuple[bool, int | None, int | None]:
    """(identical over all repeats, first differing repeat, first differing position or None when the prompts
    differ)."""
    for r, (mine, ref) in enumerate(zip(method_runs, ref_runs, strict=False)):
        if mine.get("prompt_ids") != ref.get("prompt_ids"):
            return False, r, None
        pos = stats.first_divergence(ref["token_ids"], mine["token_ids"])
        if pos is not None:
            return False, r, pos
    return True, None, None


def build_results(header: dict, config: dict, questions: Sequence[Question], methods: Sequence[dict],
                  runs: Runs, greedy: bool, skipped_peers: Sequence[dict] = (),
                  gap_fn: Callable[[Sequence[int], Sequence[int]], dict] | None = None,
                  piece_fn: Callable[[int], str] | None = None, failed_peers: Sequence[dict] = (),
                  peer_notes: Sequence[dict] = ()) -> dict:
    """Turn raw runs into the results.json dict (schema in the module docstring).

    methods: [{"name", "kind", "baseline"}], `plain` first. runs: from `run_suite`. Methods of
    `failed_peers` are left out.
    gap_fn: computes the target's top-2 logit gap at a divergence (None: leave null).
    piece_fn: token id -> its text, for the divergence listing.
    """
    dropped = failed_names(failed_peers)
    methods = [m for m in methods if m["name"] not in dropped]
    names = [m["name"] for m in methods]
    baseline = {m["name"]: m.get("baseline", "plain") for m in methods}
    samples_out: list[dict] = []
    divergences: list[dict] = []
    per_group: dict[str, dict[str, list[dict]]] = {}  # group -> method -> per-sample summaries

    for (qi, ti), by_method in sorted(runs.items()):
        q = questions[qi]
        group = group_of(q.category)
        entry = {"question_id": q.question_id, "category": q.category, "group": group, "turn": ti + 1,
                 "methods": {}}
        for name in names:
            method_runs = by_method.get(name)
            if not method_runs:
                continue
            s = stats.summarize_repeats(method_runs)
            s["prompt_tokens"] = len(method_runs[0].get("prompt_ids", []))
            s["finish_reason"] = method_runs[0].get("finish_reason")
            s["text"] = method_runs[0]["text"]
            s["identical_to_plain"] = None
            s["identical_to_baseline"] = None
            if greedy:
                # a method on other weights (`@DTYPE`) is lossless against its own plain decoding, not plain's
                refs = [] if _other_weights(name) else [("plain", "identical_to_plain")]
                if baseline[name] not in ("plain", name):
                    refs.append((baseline[name], "identical_to_baseline"))
                for ref_name, key in refs:
                    ref_runs = by_method.get(ref_name)
                    if not ref_runs or ref_name == name:
                        continue
                    same, rep, pos = _compare(method_runs, ref_runs)
                    s[key] = same
                    if not same:
                        divergences.append(_divergence(q, group, ti, name, ref_name, rep, pos, method_runs,
                                                       ref_runs, gap_fn if ref_name == "plain" else None,
                                                       piece_fn))
            entry["methods"][name] = s
            per_group.setdefault(group, {}).setdefault(name, []).append(s)
            per_group.setdefault(OVERALL, {}).setdefault(name, []).append(s)
        samples_out.append(entry)

    groups = order_groups(g for g in per_group if g != OVERALL)
    summary: dict[str, dict[str, dict]] = {}
    for group in [*groups, OVERALL]:
        summary[group] = {}
        base = None
        for name in names:
            samples = per_group.get(group, {}).get(name)
            if not samples:
                continue
            agg = stats.aggregate(samples)
            if name == "plain":
                base = agg["tokens_per_s"]
            agg["speedup"] = stats.speedup(agg["tokens_per_s"], base)
            checks = (("identical", "compared", "identical_to_plain"),
                      ("identical_to_baseline", "compared_to_baseline", "identical_to_baseline"))
            for key, count_key, flag in checks:
                compared = [s[flag] for s in samples if s[flag] is not None]
                have = greedy and bool(compared)
                agg[key] = sum(compared) if have else None
                agg[count_key] = len(compared) if have else None
            summary[group][name] = agg
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "specdraft-bench",
        "header": header,
        "config": config,
        "greedy": greedy,
        "methods": [{"name": m["name"], "kind": m["kind"], "baseline": baseline[m["name"]]} for m in methods],
        "skipped_peers": list(skipped_peers),
        "failed_peers": list(failed_peers),
        "peer_notes": list(peer_notes),
        "groups": groups,
        "summary": summary,
        "samples": samples_out,
        "divergences": divergences,
    }


def _other_weights(name: str) -> bool:
    return "@" in name


def _divergence(q: Question, group: str, ti: int, name: str, ref_name: str, rep: int, pos: int | None,
                method_runs: list[dict], ref_runs: list[dict], gap_fn, piece_fn) -> dict:
    ref, mine = ref_runs[rep], method_runs[rep]
    out = {"question_id": q.question_id, "category": q.category, "group": group, "turn": ti + 1,
           "method": name, "reference": ref_name, "repeat": rep, "prompt_differs": pos is None,
           "position": pos, "reference_token": None, "method_token": None, "reference_piece": None,
           "method_piece": None, "logit_gap": None}
    if pos is None:
        return out
    ref_tok = ref["token_ids"][pos] if pos < len(ref["token_ids"]) else None
    my_tok = mine["token_ids"][pos] if pos < len(mine["token_ids"]) else None
    out.update(reference_token=ref_tok, method_token=my_tok)
    if piece_fn is not None:
        out.update(reference_piece=piece_fn(ref_tok) if ref_tok is not None else None,
                   method_piece=piece_fn(my_tok) if my_tok is not None else None)
    if gap_fn is not None:
        out["logit_gap"] = gap_fn(ref["prompt_ids"], ref["token_ids"][:pos])["logit_gap"]
    return out


# ---------------------------------------------------------------------------------------------- command


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    import torch

    from specdraft.bench import report
    from specdraft.bench.machine import header as machine_header
    from specdraft.bench.machine import header_lines
    from specdraft.bench.peers import load_peers, parse_peers
    from specdraft.bench.suite import load_suite, select_per_group
    from specdraft.engine.core import context_limit
    from specdraft.errors import SpecdraftError
    from specdraft.runtime.hf_backend import load_hf_target
    from specdraft.runtime.loader import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise SpecdraftError("--repeats must be >= 1")
    k = args.num_speculative_tokens
    if k < 1:
        raise SpecdraftError("--num-speculative-tokens must be >= 1 for a speculative benchmark")
    method_names = parse_methods(args.methods)
    peer_names = parse_peers(args.peers)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()] if args.groups else None
    questions = select_per_group(load_suite(args.suite), args.per_category, groups)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)  # validates the numbers
    out_dir = Path(args.out)

    header = machine_header(argv)
    header.update(model=args.model, dtype=args.dtype)
    for line in header_lines(header):
        print(line, file=sys.stderr)
    n_turns = sum(len(q.turns) for q in questions)
    print(f"suite: {args.suite or 'specbench-mini (bundled)'}: {len(questions)} prompts, {n_turns} turns in "
          f"{len({q.group for q in questions})} groups", file=sys.stderr)

    target = load_model(args.model, dtype=args.dtype, progress=True)
    tokenizer = load_tokenizer(args.model)
    max_len = context_limit(target, args.max_model_len)
    targets = {args.dtype: target}
    for dtype in dict.fromkeys(d for d in (method_dtype(n)[1] for n in method_names) if d is not None):
        if dtype not in targets:
            print(f"loading {args.model} in {dtype} for the @{dtype} methods", file=sys.stderr)
            targets[dtype] = load_hf_target(args.model, "fp32") if dtype == TRANSFORMERS else \
                load_model(args.model, dtype=dtype, progress=True)
    methods = build_our_methods(method_names, target, tokenizer, k, not args.no_adaptive, max_len, args.tree,
                                targets)
    notes: list[dict] = []
    peers, skipped = load_peers(peer_names, args.model, tokenizer, max_len, notes=notes)
    methods += peers
    build = PromptBuilder(tokenizer)
    if not build.chat:
        print("note: the tokenizer has no chat template; prompts are the plain turns", file=sys.stderr)

    print(f"methods: {', '.join(m.name for m in methods)}; warming up", file=sys.stderr)
    failed: list[dict] = []
    try:
        warm_up(methods, questions, build, params, failed)
        runs = run_suite(methods, questions, build, params, args.repeats, seed=args.seed,
                         progress=not args.no_progress, failed=failed)
    finally:
        for m in peers:
            if hasattr(m, "close"):
                m.close()

    config = {"suite": str(args.suite) if args.suite else "specbench-mini (bundled)",
              "per_category": args.per_category, "groups": groups, "methods": method_names,
              "peers": peer_names, "k": k, "tree": args.tree, "adaptive": not args.no_adaptive,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
              "max_model_len": max_len, "chat_template": build.chat}
    method_info = [{"name": m.name, "kind": m.kind, "baseline": m.baseline} for m in methods]
    results = build_results(header, config, questions, method_info, runs, params.greedy, skipped,
                            gap_fn=logit_gap_fn(target) if params.greedy else None,
                            piece_fn=lambda t: tokenizer.decode([t]), failed_peers=failed, peer_notes=notes)
    files = report.write_all(results, out_dir)
    print(report.console_summary(results))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdraft.drafters import DRAFTER_HELP

    p.add_argument("--suite", default=None,
                   help="JSONL suite (question_id, category, turns); default: the bundled specbench-mini")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory or .gguf file")
    p.add_argument("--methods", default="plain,ngram,quant:int8",
                   help=f"comma list of plain and drafters ({DRAFTER_HELP}); plain is always run")
    p.add_argument("--peers", default="", help="comma list of other engines: hf, hf-bf16, hf-fp32, llamacpp")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="first N prompts of each category group (default: all)")
    p.add_argument("--groups", default=None, help="comma list of category groups to run (default: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of repeat r is seed + r (temperature > 0)")
    p.add_argument("--repeats", type=int, default=1, help="runs per prompt; times are medians over them")
    p.add_argument("--num-speculative-tokens", "-k", "--k", dest="num_speculative_tokens", type=arg_draft_length,
                   default=5, help="draft tokens per round (the maximum, when adaptive)")
    p.add_argument("--tree", type=arg_tree_size, default=0, metavar="N",
                   help="methods draft token trees of up to N tokens (0: chains); one method can say its own "
                        "with +treeN, e.g. --methods ngram,ngram+tree16")
    p.add_argument("--no-adaptive", action="store_true", help="fixed K, no fallback to plain decoding")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                   help="the target's weights: bf16, fp32, or gguf (a GGUF model's own quantization); methods "
                        "named NAME@DTYPE run on the target in another dtype in the same run")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="bench-out", help="output directory (default: bench-out/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
