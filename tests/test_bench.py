"""`specdraft bench` / `bench-runtime`: report math, suites, results schema, plots and peers, on synthetic
data.

Only the test marked slow loads a real model (smollm2-135m, a few tokens)."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch

from specdraft.bench import llamacpp_worker, report, stats
from specdraft.bench.machine import header, header_lines
from specdraft.bench.peers import (
    LlamaCppMethod,
    LlamaCppWorker,
    PeerFailed,
    PeerUnavailable,
    describe_exit,
    gguf_path,
    load_llamacpp,
    load_peers,
    parse_peers,
)
from specdraft.bench.runtime_bench import (
    aggregate_runtime,
    build_runtime_results,
    floor_ms,
    render_table,
    summarize_runs,
    weight_bytes_per_token,
)
from specdraft.bench.specbench import (
    PromptBuilder,
    build_results,
    method_dtype,
    method_tree,
    parse_methods,
    run_suite,
    shared_cache,
    warm_up,
)
from specdraft.bench.suite import (
    DEFAULT_SUITE,
    GROUPS,
    MULTI_TURN,
    OVERALL,
    Question,
    SuiteError,
    first_turns,
    group_of,
    load_suite,
    order_groups,
    parse_suite,
    select_per_group,
    spread,
)
from specdraft.errors import SpecdraftError
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.sampling import SamplingParams

# ----------------------------------------------------------------------------------------- report math


def test_speedup_and_ratios():
    assert stats.speedup(30.0, 10.0) == 3.0
    assert stats.speedup(10.0, None) is None
    assert stats.speedup(None, 10.0) is None
    assert stats.speedup(10.0, 0.0) is None
    assert stats.throughput(100, 4.0) == 25.0
    assert stats.mean_accepted_length(30, 10) == 3.0
    assert stats.mean_accepted_length(10, 10) == 1.0  # plain decoding
    assert stats.mean_accepted_length(0, 0) is None
    assert stats.acceptance_rate(3, 4) == 0.75
    assert stats.acceptance_rate(0, 0) is None


def test_per_position():
    assert stats.add_positions([[1, 2], [3], None, [], [1, 1, 1]]) == [5, 3, 1]
    assert stats.per_position_rates([4, 2, 0], [8, 4, 0]) == [0.5, 0.5, 0.0]
    assert stats.per_position_rates([1], [2, 2]) == [0.5, 0.0]  # shorter accepted list is padded


def test_first_divergence():
    assert stats.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert stats.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert stats.first_divergence([1, 2, 3], [1, 2]) == 2
    assert stats.first_divergence([], [7]) == 0


def _run(tokens, time_s, ttft=0.1, forwards=None, drafted=0, accepted=0, dpp=(), app=()):
    r = {"tokens": tokens, "time_s": time_s, "ttft_s": ttft, "token_ids": list(range(tokens)), "text": "x"}
    if forwards is not None:
        r.update(target_forwards=forwards, produced_tokens=tokens - 1, drafted=drafted, accepted=accepted,
                 drafted_per_position=list(dpp), accepted_per_position=list(app))
    return r


def test_summarize_repeats_medians_and_sums():
    runs = [_run(10, 3.0, 0.3, 9, 4, 2, [2, 2], [1, 1]), _run(10, 1.0, 0.1, 9, 4, 2, [2, 2], [1, 1]),
            _run(10, 2.0, 0.2, 9, 4, 2, [2, 2], [1, 1])]
    s = stats.summarize_repeats(runs)
    assert s["time_s"] == 2.0 and s["ttft_s"] == 0.2 and s["tokens"] == 10
    assert s["times_s"] == [3.0, 1.0, 2.0]
    assert s["drafted"] == 12 and s["accepted"] == 6 and s["target_forwards"] == 27
    assert s["drafted_per_position"] == [6, 6] and s["accepted_per_position"] == [3, 3]
    peer = stats.summarize_repeats([_run(5, 1.0), _run(5, 2.0)])
    assert peer["time_s"] == 1.5 and peer["drafted"] is None and peer["drafted_per_position"] is None
    with pytest.raises(ValueError):
        stats.summarize_repeats([])


def test_aggregate_is_total_tokens_over_total_time():
    a = stats.summarize_repeats([_run(100, 10.0, 0.5, 40, 80, 60, [40, 40], [35, 25])])
    b = stats.summarize_repeats([_run(10, 5.0, 0.1, 5, 10, 5, [5, 5, 2], [4, 1, 0])])
    agg = stats.aggregate([a, b])
    assert agg["tokens_per_s"] == pytest.approx(110 / 15.0)  # not the mean of 10 and 2 tok/s
    assert agg["samples"] == 2
    assert agg["ttft_s"] == pytest.approx(0.3)
    assert agg["mean_accepted_length"] == pytest.approx((99 + 9) / 45)
    assert agg["acceptance_rate"] == pytest.approx(65 / 90)
    assert agg["drafted_per_position"] == [45, 45, 2]
    assert agg["per_position_acceptance"] == pytest.approx([39 / 45, 26 / 45, 0.0])
    peers = stats.aggregate([stats.summarize_repeats([_run(10, 1.0)])])
    assert peers["mean_accepted_length"] is None and peers["acceptance_rate"] is None


# ---------------------------------------------------------------------------------------------- suites


def test_category_grouping():
    for cat in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"):
        assert group_of(cat) == MULTI_TURN
    for cat in ("translation", "summarization", "qa", "math_reasoning", "rag", "other"):
        assert group_of(cat) == cat
    assert order_groups({"rag", "zzz", MULTI_TURN, "qa"}) == [MULTI_TURN, "qa", "rag", "zzz"]


def _q(qid, cat, turns=1):
    return Question(qid, cat, tuple(f"turn {i} of {qid}" for i in range(turns)))


def test_select_per_group_takes_first_n_of_each_group():
    qs = [_q(1, "writing", 2), _q(2, "math", 2), _q(3, "coding", 2), _q(4, "qa"), _q(5, "qa"), _q(6, "qa"),
          _q(7, "rag")]
    assert [q.question_id for q in select_per_group(qs, 2)] == [1, 2, 4, 5, 7]
    assert [q.question_id for q in select_per_group(qs, None)] == [1, 2, 3, 4, 5, 6, 7]
    assert [q.question_id for q in select_per_group(qs, 1, ["qa", "rag"])] == [4, 7]
    with pytest.raises(SuiteError, match="translation"):
        select_per_group(qs, 1, ["translation"])
    with pytest.raises(SuiteError):
        select_per_group(qs, 0)


def test_spread_round_robin():
    qs = [_q(1, "a"), _q(2, "a"), _q(3, "b"), _q(4, "c"), _q(5, "c")]
    assert [q.question_id for q in spread(qs, 4)] == [1, 3, 4, 2]
    assert len(spread(qs, 50)) == 5
    mt = [_q(1, "writing"), _q(2, "roleplay"), _q(3, "math"), _q(4, "qa"), _q(5, "qa")]
    assert [q.question_id for q in spread(mt, 4)] == [1, 4, 2, 5]  # by group: MT-bench counts as one


def test_bench_serve_takes_its_prompts_over_every_category():
    """`bench-serve --prompts spread` (the default): the first requests already cover each group; `first` keeps
    the file's order (on the dev suite its first 32 prompts were MT-bench and translation only)."""
    qs = [_q(1, "writing"), _q(2, "writing"), _q(3, "translation"), _q(4, "translation"), _q(5, "rag")]
    assert first_turns(qs, "spread") == [f"turn 0 of {i}" for i in (1, 3, 5, 2, 4)]
    assert first_turns(qs, "first") == [f"turn 0 of {i}" for i in range(1, 6)]


def test_parse_suite_ok():
    text = ('{"question_id": 1, "category": "writing", "turns": ["a", "b"]}\n\n'
            '{"question_id": "x2", "category": "qa", "turns": ["c"]}\n')
    qs = parse_suite(text)
    assert qs == [Question(1, "writing", ("a", "b")), Question("x2", "qa", ("c",))]
    assert qs[0].group == MULTI_TURN


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"question_id": 1, "turns": ["a"]}', "missing field"),
    ('{"question_id": 1, "category": "qa", "turns": "a"}', "turns must be"),
    ('{"question_id": 1, "category": "qa", "turns": []}', "turns must be"),
    ('{"question_id": 1, "category": "", "turns": ["a"]}', "category"),
    ('{"question_id": true, "category": "qa", "turns": ["a"]}', "question_id"),
])
def test_parse_suite_bad_line_names_the_line(line, message):
    good = '{"question_id": 0, "category": "qa", "turns": ["ok"]}'
    with pytest.raises(SuiteError, match=rf"s\.jsonl:2: .*{message}"):
        parse_suite(f"{good}\n{line}\n", "s.jsonl")


def test_parse_suite_duplicates_and_empty(tmp_path):
    line = '{"question_id": 1, "category": "qa", "turns": ["a"]}'
    with pytest.raises(SuiteError, match="duplicate"):
        parse_suite(f"{line}\n{line}\n")
    with pytest.raises(SuiteError, match="no prompts"):
        parse_suite("\n\n")
    with pytest.raises(SuiteError, match="cannot read"):
        load_suite(tmp_path / "missing.jsonl")


def test_bundled_mini_suite_covers_the_six_groups():
    qs = load_suite(None)
    assert DEFAULT_SUITE.exists()
    counts = {g: sum(q.group == g for q in qs) for g in GROUPS}
    assert counts == {g: 2 for g in GROUPS}
    assert all(len(q.turns) == 2 for q in qs if q.group == MULTI_TURN)


# -------------------------------------------------------------------------------------- prompts & loop


class FakeTokenizer:
    eos_token_ids = frozenset({0})
    prompt_ids = Tokenizer.prompt_ids  # the real prompt building over the fake encoding below

    def __init__(self, chat: bool) -> None:
        self.has_chat_template = chat

    def apply_chat_template(self, messages):
        text = "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"
        return [ord(c) for c in text]

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _text(ids):
    return "".join(chr(i) for i in ids)


def test_prompt_builder_chat_and_plain():
    chat = PromptBuilder(FakeTokenizer(True))
    assert _text(chat(["hi"], [])) == "user:hi|assistant:"
    assert _text(chat(["hi", "more"], ["hello"])) == "user:hi|assistant:hello|user:more|assistant:"
    plain = PromptBuilder(FakeTokenizer(False))
    assert not plain.chat
    assert _text(plain(["hi", "more"], ["hello"])) == "hi\n\nhello\n\nmore\n\n"


class FakeMethod:
    """Answers with a fixed text; records calls. Ours-like when `drafts`, else a peer."""

    def __init__(self, name, calls, answer="ok", drafts=True, kind="ours", baseline="plain", tokens=None,
                 seconds=1.0):
        self.name, self.calls, self.answer, self.drafts = name, calls, answer, drafts
        self.kind, self.baseline, self.tokens, self.seconds = kind, baseline, tokens, seconds

    def run(self, prompt_ids, params):
        self.calls.append((self.name, _text(prompt_ids)))
        ids = list(self.tokens) if self.tokens is not None else [ord(c) for c in self.answer]
        run = {"token_ids": ids, "text": self.answer, "tokens": len(ids), "time_s": self.seconds,
               "ttft_s": 0.01, "finish_reason": "length"}
        if self.drafts:
            run.update(target_forwards=len(ids) // 2, produced_tokens=len(ids) - 1, drafted=len(ids),
                       accepted=len(ids) // 2, drafted_per_position=[2, 1], accepted_per_position=[1, 1])
        return run


def test_run_suite_interleaves_and_feeds_each_methods_own_answer():
    calls: list = []
    methods = [FakeMethod("plain", calls, "P"), FakeMethod("ngram", calls, "N")]
    qs = [_q(1, "writing", 2), _q(2, "qa")]
    params = SamplingParams(temperature=0, max_tokens=4)
    runs = run_suite(methods, qs, PromptBuilder(FakeTokenizer(True)), params, repeats=2, progress=False)
    # prompt -> repeat -> method -> turns
    assert [c[0] for c in calls] == ["plain", "plain", "ngram", "ngram"] * 2 + ["plain", "ngram"] * 2
    assert calls[1][1] == "user:turn 0 of 1|assistant:P|user:turn 1 of 1|assistant:"
    assert calls[3][1] == "user:turn 0 of 1|assistant:N|user:turn 1 of 1|assistant:"
    assert set(runs) == {(0, 0), (0, 1), (1, 0)}
    assert len(runs[(0, 1)]["ngram"]) == 2
    assert runs[(1, 0)]["plain"][0]["prompt_ids"] == [ord(c) for c in "user:turn 0 of 2|assistant:"]


# ---------------------------------------------------------------------------------------- results.json


def _synthetic_results(temperature=0.0, diverge=True):
    calls: list = []
    qs = [_q(1, "writing", 2), _q(2, "qa"), _q(3, "rag")]
    methods = [FakeMethod("plain", calls, "abcdefgh", seconds=2.0),
               FakeMethod("ngram", calls, "abcdefgh", seconds=1.0),
               FakeMethod("quant:int8", calls, "abcXefgh" if diverge else "abcdefgh", seconds=1.6),
               FakeMethod("hf-bf16", calls, "abcdefgh", drafts=False, kind="peer", baseline="hf-bf16",
                          seconds=4.0),
               FakeMethod("hf-bf16-pld", calls, "abcdefgX", drafts=False, kind="peer", baseline="hf-bf16",
                          seconds=3.0)]
    params = SamplingParams(temperature=temperature, max_tokens=8)
    runs = run_suite(methods, qs, PromptBuilder(FakeTokenizer(True)), params, repeats=3, progress=False)
    gaps = []

    def gap_fn(prompt_ids, prefix):
        gaps.append((len(prompt_ids), list(prefix)))
        return {"logit_gap": 0.125, "top1": 1, "top2": 2}

    info = [{"name": m.name, "kind": m.kind, "baseline": m.baseline} for m in methods]
    hdr = header(["specdraft", "bench", "--max-tokens", "8"])
    hdr.update(model="fake", dtype="bf16")
    config = {"suite": "synthetic", "per_category": None, "groups": None, "methods": ["plain", "ngram"],
              "peers": ["hf-bf16"], "k": 5, "adaptive": True, "temperature": temperature, "max_tokens": 8,
              "repeats": 3, "seed": 0, "max_model_len": 4096, "chat_template": True}
    results = build_results(hdr, config, qs, info, runs, params.greedy,
                            [{"peer": "llamacpp", "reason": "llama-cpp-python is not installed"}],
                            gap_fn=gap_fn, piece_fn=chr)
    return results, gaps


def test_results_schema_and_numbers():
    results, gaps = _synthetic_results()
    json.loads(json.dumps(results))  # serializable
    assert results["schema_version"] == 1 and results["kind"] == "specdraft-bench"
    for key in ("header", "config", "greedy", "methods", "skipped_peers", "groups", "summary", "samples",
                "divergences"):
        assert key in results
    for key in ("machine", "versions", "model", "dtype", "date", "command"):
        assert key in results["header"]
    for key in ("cpu", "logical_cores", "torch_threads"):
        assert key in results["header"]["machine"]
    assert results["header"]["command"] == "specdraft bench --max-tokens 8"
    assert results["groups"] == [MULTI_TURN, "qa", "rag"]
    assert set(results["summary"]) == {MULTI_TURN, "qa", "rag", OVERALL}
    assert [m["name"] for m in results["methods"]] == ["plain", "ngram", "quant:int8", "hf-bf16",
                                                       "hf-bf16-pld"]

    overall = results["summary"][OVERALL]
    fields = {"samples": int, "tokens": (int, float), "time_s": float, "tokens_per_s": float,
              "speedup": float, "ttft_s": float}
    for name, agg in overall.items():
        for key, typ in fields.items():
            assert isinstance(agg[key], typ), (name, key)
        for key in ("mean_accepted_length", "acceptance_rate", "per_position_acceptance", "identical",
                    "compared", "identical_to_baseline", "compared_to_baseline", "drafted_per_position"):
            assert key in agg
    assert overall["plain"]["speedup"] == 1.0
    assert overall["ngram"]["speedup"] == pytest.approx(2.0)
    assert overall["hf-bf16"]["speedup"] == pytest.approx(0.5)
    assert overall["ngram"]["samples"] == 4  # the two-turn prompt counts twice
    assert overall["ngram"]["tokens_per_s"] == pytest.approx(8.0)
    assert overall["ngram"]["mean_accepted_length"] == pytest.approx(7 / 4)
    assert overall["ngram"]["acceptance_rate"] == pytest.approx(0.5)
    assert overall["ngram"]["per_position_acceptance"] == pytest.approx([0.5, 1.0])
    assert overall["hf-bf16"]["mean_accepted_length"] is None
    assert overall["hf-bf16"]["acceptance_rate"] is None

    # identity (greedy): ngram identical; quant diverges at position 3 (turn 2 of the MT prompt then has a
    # different prompt); hf-bf16-pld differs from plain and from its own plain at the last position.
    assert (overall["ngram"]["identical"], overall["ngram"]["compared"]) == (4, 4)
    assert overall["quant:int8"]["identical"] == 0
    assert overall["plain"]["identical"] is None
    assert (overall["hf-bf16"]["identical"], overall["hf-bf16"]["identical_to_baseline"]) == (4, None)
    assert overall["hf-bf16-pld"]["identical_to_baseline"] == 0
    assert overall["hf-bf16-pld"]["compared_to_baseline"] == 4
    quant = [d for d in results["divergences"] if d["method"] == "quant:int8"]
    assert len(quant) == 4
    first = quant[0]
    assert (first["position"], first["reference_token"], first["method_token"]) == (3, ord("d"), ord("X"))
    assert first["reference_piece"] == "d" and first["logit_gap"] == 0.125 and not first["prompt_differs"]
    assert any(d["prompt_differs"] and d["position"] is None and d["turn"] == 2 for d in quant)
    pld = [d for d in results["divergences"] if d["method"] == "hf-bf16-pld"]
    assert {d["reference"] for d in pld} == {"plain", "hf-bf16"}
    assert all(d["logit_gap"] is None for d in pld if d["reference"] == "hf-bf16")
    assert {"".join(map(chr, prefix)) for _, prefix in gaps} == {"abc", "abcdefg"}

    sample = results["samples"][0]
    assert (sample["question_id"], sample["turn"], sample["group"]) == (1, 1, MULTI_TURN)
    m = sample["methods"]["ngram"]
    assert m["times_s"] == [1.0, 1.0, 1.0] and m["identical_to_plain"] is True
    assert isinstance(m["prompt_tokens"], int) and m["text"] == "abcdefgh"


def test_results_at_temperature_say_identity_is_not_applicable():
    results, gaps = _synthetic_results(temperature=0.7)
    assert results["greedy"] is False
    assert results["divergences"] == [] and gaps == []
    for agg in results["summary"][OVERALL].values():
        assert agg["identical"] is None and agg["compared"] is None
    md = report.render_markdown(results)
    assert "n/a" in md


def test_report_files_are_written(tmp_path):
    results, _ = _synthetic_results()
    files = report.write_all(results, tmp_path / "out")
    names = sorted(p.name for p in files)
    assert names == ["acceptance.png", "report.md", "results.json", "speedup.png"]
    for png in ("speedup.png", "acceptance.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["summary"][OVERALL]["plain"]["speedup"] == 1
    md = (tmp_path / "out" / "report.md").read_text()
    for text in ("## Speedup over plain", "| ngram |", "2.00x", "## Acceptance by draft position",
                 "## Divergences from plain", "peer llamacpp skipped", "command: specdraft bench",
                 "4/4", "own plain 0/4"):
        assert text in md, text
    assert "speedup" in report.console_summary(results).lower()


def test_plots_without_drafting_methods(tmp_path):
    results, _ = _synthetic_results()
    for agg in results["summary"][OVERALL].values():
        agg["per_position_acceptance"] = None
    assert report.plot_acceptance(results, tmp_path / "a.png").exists()


# ------------------------------------------------------------------------------------- methods & peers


def test_parse_methods_and_peers():
    assert parse_methods("ngram,quant:int8") == ["plain", "ngram", "quant:int8"]
    assert parse_methods("ngram,plain") == ["plain", "ngram"]
    with pytest.raises(SpecdraftError, match="duplicate"):
        parse_methods("ngram,ngram")
    # A method may carry its own tree size; others take --tree.
    assert method_tree("ngram+tree16", 0) == ("ngram", 16)
    assert method_tree("quant:int8+tree0", 8) == ("quant:int8", 0)
    assert method_tree("ngram", 8) == ("ngram", 8)
    with pytest.raises(SpecdraftError, match=r"'ngram\+tree99': \+tree takes a tree size"):
        method_tree("ngram+tree99", 0)
    assert parse_peers("hf,llamacpp") == ["hf-bf16", "hf-fp32", "llamacpp"]
    assert parse_peers("hf-fp32,hf") == ["hf-fp32", "hf-bf16"]
    assert parse_peers("") == [] and parse_peers(None) == []
    with pytest.raises(SpecdraftError, match="unknown peer"):
        parse_peers("vllm")


def test_the_drafters_that_remember_across_requests_say_so():
    """The benchmark rewinds what a drafter remembers across requests through its `memory`: the real
    drafters must expose it (and the others nothing), or a repeat would be drafted from its own answer."""
    from types import SimpleNamespace

    from tiny_models import recycle_drafter

    from specdraft.drafters.ngram import NgramDrafter
    from specdraft.drafters.suffix import SuffixDrafter

    def method(drafter):
        return SimpleNamespace(engine=SimpleNamespace(drafter=drafter))

    suffix, recycle = SuffixDrafter(), recycle_drafter()
    assert shared_cache(method(suffix)) is suffix.cache
    assert shared_cache(method(recycle)) is recycle.recycled
    assert shared_cache(method(NgramDrafter())) is None and shared_cache(method(None)) is None


def test_repeats_of_a_prompt_start_from_the_same_suffix_cache():
    """A suffix-cache method must not draft a repeat from its own earlier answer to the same prompt: every
    repeat of a question sees the cache as the first repeat did, and later questions see all earlier ones."""
    from types import SimpleNamespace

    from specdraft.drafters.suffix import SuffixCache

    class CachingMethod(FakeMethod):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cache = SuffixCache()
            self.engine = SimpleNamespace(drafter=SimpleNamespace(cache=cache, memory=cache))
            self.seen: list[int] = []

        def run(self, prompt_ids, params):
            cache = self.engine.drafter.cache
            self.seen.append(cache.num_requests)
            cache.add(list(prompt_ids) + [7, 8, 9])
            return super().run(prompt_ids, params)

    calls: list = []
    method = CachingMethod("suffix", calls, "S")
    run_suite([FakeMethod("plain", calls, "P"), method], [_q(1, "qa"), _q(2, "qa")],
              PromptBuilder(FakeTokenizer(True)), SamplingParams(temperature=0, max_tokens=4), repeats=3,
              progress=False)
    assert method.seen == [0, 0, 0, 1, 1, 1]


def test_recycled_predictions_reset_for_repeats_and_after_the_warm_up():
    """`recycle` remembers the target's predictions across requests: neither the warm-up nor a question's
    earlier repeat may leave its own predictions for the measured run of the same prompt."""
    from types import SimpleNamespace

    from specdraft.bench.specbench import warm_up
    from specdraft.drafters.recycle import RecycledPredictions

    class RecyclingMethod(FakeMethod):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recycled = RecycledPredictions()
            self.engine = SimpleNamespace(drafter=SimpleNamespace(recycled=recycled, memory=recycled))
            self.seen: list[int] = []

        def run(self, prompt_ids, params):
            recycled = self.engine.drafter.recycled
            self.seen.append(len(recycled))
            recycled.record([100 + len(self.seen)], [1, 2])
            return super().run(prompt_ids, params)

    calls: list = []
    method = RecyclingMethod("recycle", calls, "R")
    questions = [_q(1, "qa"), _q(2, "qa")]
    build = PromptBuilder(FakeTokenizer(True))
    params = SamplingParams(temperature=0, max_tokens=4)
    warm_up([method], questions, build, params)
    assert method.seen == [0] and len(method.engine.drafter.recycled) == 0
    method.seen.clear()
    run_suite([FakeMethod("plain", calls, "P"), method], questions, build, params, repeats=3, progress=False)
    assert method.seen == [0, 0, 0, 1, 1, 1]


def test_methods_on_the_target_in_another_dtype():
    """`NAME@gguf` runs NAME on the GGUF-native target; its plain baseline `plain@gguf` is added before it."""
    assert parse_methods("ngram,ngram@gguf,eagle+tree8@gguf") == [
        "plain", "ngram", "plain@gguf", "ngram@gguf", "eagle+tree8@gguf"]
    assert method_dtype("eagle+tree8@gguf") == ("eagle+tree8", "gguf")
    assert method_dtype("ngram") == ("ngram", None)
    with pytest.raises(SpecdraftError, match="@ takes one of"):
        method_dtype("ngram@fp8")
    # Lossless against its own plain decoding (other weights give other text than bf16 plain): a method
    # on other weights is compared with its baseline only.
    calls: list = []
    ours = [FakeMethod("plain", calls, "ab"), FakeMethod("plain@gguf", calls, "xy"),
            FakeMethod("ngram@gguf", calls, "xy", baseline="plain@gguf"),
            FakeMethod("eagle@gguf", calls, "xz", baseline="plain@gguf")]
    qs = [_q(1, "qa")]
    runs = run_suite(ours, qs, PromptBuilder(FakeTokenizer(True)), SamplingParams(temperature=0), 1,
                     progress=False)
    info = [{"name": m.name, "kind": m.kind, "baseline": m.baseline} for m in ours]
    overall = build_results(header([]), {}, qs, info, runs, True)["summary"]["overall"]
    assert overall["plain@gguf"]["identical"] is None
    assert (overall["ngram@gguf"]["identical_to_baseline"], overall["ngram@gguf"]["identical"]) == (1, None)
    assert overall["eagle@gguf"]["identical_to_baseline"] == 0


def test_missing_peers_are_skipped_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    messages: list[str] = []
    methods, skipped = load_peers(["hf-bf16", "llamacpp"], "smollm2-135m", FakeTokenizer(True), 512,
                                  log=messages.append)
    assert methods == []
    assert [s["peer"] for s in skipped] == ["hf-bf16", "llamacpp"]
    assert "llama-cpp-python is not installed" in skipped[1]["reason"]
    assert "transformers" in skipped[0]["reason"]
    assert messages == [f"peer {s['peer']} skipped: {s['reason']}" for s in skipped]

    # ... and the run goes on with the remaining methods; the report says what was skipped.
    calls: list = []
    ours = [FakeMethod("plain", calls, "ab"), FakeMethod("ngram", calls, "ab")] + methods
    qs = [_q(1, "qa")]
    runs = run_suite(ours, qs, PromptBuilder(FakeTokenizer(True)), SamplingParams(temperature=0), 1,
                     progress=False)
    info = [{"name": m.name, "kind": m.kind, "baseline": m.baseline} for m in ours]
    hdr = header([])
    results = build_results(hdr, {}, qs, info, runs, True, skipped)
    assert results["skipped_peers"] == skipped
    assert "peer llamacpp skipped: llama-cpp-python is not installed" in report.render_markdown(results)


def test_llamacpp_needs_a_gguf(tmp_path):
    with pytest.raises(PeerUnavailable, match="not a GGUF"):
        gguf_path(str(tmp_path))


# ------------------------------------------------------------------------------- llama.cpp worker process

FAKE_WORKER = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("llamacpp_worker", sys.argv[2])
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
mode = sys.argv[1]

class Backend:
    def __init__(self, config):
        if mode == "exit-on-load":
            os._exit(3)
        if mode == "segv-unless-no-extra" and config.get("extra_bufts") is not False:
            os.kill(os.getpid(), signal.SIGSEGV)
        self.models = {"llamacpp": None, "llamacpp-pld": None}
        self.info = {"extra_bufts": config.get("extra_bufts"), "n_threads": config["n_threads"]}
        self.runs = 0

    def run(self, method, prompt_ids, params, eos):
        self.runs += 1
        if mode.startswith("segv-on-run=") and self.runs == int(mode.split("=")[1]):
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == "hang":
            time.sleep(60)
        if mode == "error-on-run":
            raise ValueError("Requested tokens exceed context window")
        print("python noise on stdout")
        os.write(1, b"native noise on fd 1\\n")
        tokens = [ord(c) for c in method][: params["max_tokens"]]
        return {"token_ids": tokens, "time_s": 0.25, "ttft_s": 0.05, "finish_reason": "length"}

sys.exit(worker.main(Backend))
"""

WORKER_CONFIG = {"model_path": "x.gguf", "n_ctx": 64, "n_threads": 1, "pld_tokens": 10, "extra_bufts": None}


@pytest.fixture
def fake_worker(tmp_path):
    """fake_worker(mode) -> the command line of a worker that speaks the real protocol (the real `serve`,
    stdout redirection and faulthandler) around a fake backend that misbehaves as `mode` says."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return lambda mode: [sys.executable, str(script), mode, llamacpp_worker.__file__]


def _llamacpp_methods(worker):
    tok = FakeTokenizer(True)
    return [LlamaCppMethod("llamacpp", worker, tok, "llamacpp"), LlamaCppMethod("llamacpp-pld", worker, tok,
                                                                               "llamacpp")]


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-11) == "was killed by signal 11 (SIGSEGV)"
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"


def test_worker_round_trip_times_come_from_the_worker(fake_worker):
    worker = LlamaCppWorker(WORKER_CONFIG, fake_worker("ok"))
    try:
        assert worker.methods == ["llamacpp", "llamacpp-pld"] and worker.info["n_threads"] == 1
        plain, pld = _llamacpp_methods(worker)
        run = pld.run([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
        # noise printed on the worker's stdout (Python or native) does not reach the protocol
        assert run["token_ids"] == [ord(c) for c in "llama"] and run["text"] == "llama" and run["tokens"] == 5
        assert (run["time_s"], run["ttft_s"], run["finish_reason"]) == (0.25, 0.05, "length")
        assert plain.run([1], SamplingParams(temperature=0, max_tokens=3))["text"] == "lla"
    finally:
        worker.close()
    assert not worker.alive and worker.proc.returncode == 0
    with pytest.raises(PeerFailed, match="closed"):
        plain.run([1], SamplingParams(temperature=0, max_tokens=3))


def test_crashing_worker_is_a_failed_peer_and_the_bench_goes_on(fake_worker):
    worker = LlamaCppWorker(WORKER_CONFIG, fake_worker("segv-on-run=5"))
    calls: list = []
    methods = [FakeMethod("plain", calls, "ab"), FakeMethod("ngram", calls, "ab"), *_llamacpp_methods(worker)]
    qs = [_q(1, "writing", 2), _q(2, "qa"), _q(3, "rag")]
    params = SamplingParams(temperature=0, max_tokens=4)
    build = PromptBuilder(FakeTokenizer(True))
    failed: list[dict] = []
    warm_up(methods, qs, build, params, failed)  # runs 1 and 2
    assert failed == []
    runs = run_suite(methods, qs, build, params, repeats=2, progress=False, failed=failed)  # dies in run 5
    assert len(failed) == 1
    f = failed[0]
    assert (f["peer"], f["methods"], f["stage"]) == ("llamacpp", ["llamacpp", "llamacpp-pld"], "run")
    assert "killed by signal 11 (SIGSEGV) while generating (llamacpp-pld)" in f["reason"]
    assert worker.proc.returncode == -11 and not worker.alive
    # the other methods ran everything; no partial peer figures are kept
    assert set(runs) == {(0, 0), (0, 1), (1, 0), (2, 0)}
    for by_method in runs.values():
        assert set(by_method) == {"plain", "ngram"} and all(len(v) == 2 for v in by_method.values())
    assert [c[0] for c in calls].count("plain") == 1 + 2 * 4
    info = [{"name": m.name, "kind": m.kind, "baseline": m.baseline} for m in methods]
    results = build_results(header([]), {}, qs, info, runs, True, failed_peers=failed)
    assert [m["name"] for m in results["methods"]] == ["plain", "ngram"]
    assert set(results["summary"][OVERALL]) == {"plain", "ngram"}
    assert results["failed_peers"] == failed and results["peer_notes"] == []
    json.dumps(results)
    for text in (report.render_markdown(results), report.console_summary(results)):
        assert "peer llamacpp failed during run (no figures for llamacpp, llamacpp-pld)" in text
        assert "SIGSEGV" in text


def test_worker_dying_in_warm_up_is_never_run_again(fake_worker):
    worker = LlamaCppWorker(WORKER_CONFIG, fake_worker("segv-on-run=1"))
    calls: list = []
    methods = [FakeMethod("plain", calls, "ab"), *_llamacpp_methods(worker)]
    qs = [_q(1, "qa")]
    build = PromptBuilder(FakeTokenizer(True))
    params = SamplingParams(temperature=0, max_tokens=4)
    failed: list[dict] = []
    warm_up(methods, qs, build, params, failed)
    assert [(f["peer"], f["stage"]) for f in failed] == [("llamacpp", "warm-up")]
    runs = run_suite(methods, qs, build, params, repeats=1, progress=False, failed=failed)
    assert set(runs[(0, 0)]) == {"plain"} and len(failed) == 1
    # without a list to collect failures the error is not swallowed
    with pytest.raises(PeerFailed, match="SIGSEGV"):
        run_suite(methods, qs, build, params, repeats=1, progress=False)


def test_worker_exit_code_error_and_hang_are_reported(fake_worker):
    with pytest.raises(PeerFailed, match="exited with code 3 while loading the model") as info:
        LlamaCppWorker(WORKER_CONFIG, fake_worker("exit-on-load"))
    assert info.value.signal is None
    worker = LlamaCppWorker(WORKER_CONFIG, fake_worker("error-on-run"))
    with pytest.raises(PeerFailed, match="ValueError: Requested tokens exceed context window"):
        _llamacpp_methods(worker)[0].run([1], SamplingParams(temperature=0, max_tokens=3))
    assert worker.proc.poll() is not None  # stopped: the peer is given up
    worker = LlamaCppWorker(WORKER_CONFIG, fake_worker("hang"), run_timeout=1.0)
    with pytest.raises(PeerFailed, match="no answer within 1 s"):
        _llamacpp_methods(worker)[0].run([1], SamplingParams(temperature=0, max_tokens=3))
    assert worker.proc.returncode == -9


def test_load_llamacpp_retries_without_extra_buffer_types(fake_worker, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    notes: list[dict] = []
    logged: list[str] = []
    methods = load_llamacpp(str(gguf), FakeTokenizer(True), 64, command=fake_worker("segv-unless-no-extra"),
                            log=logged.append, notes=notes)
    try:
        assert [m.name for m in methods] == ["llamacpp", "llamacpp-pld"]
        assert methods[0].worker is methods[1].worker
        assert methods[0].worker.info["extra_bufts"] is False
        assert methods[1].run([5], SamplingParams(temperature=0, max_tokens=2))["tokens"] == 2
    finally:
        methods[0].close()
    assert len(notes) == 1 and notes[0]["peer"] == "llamacpp"
    assert "SIGSEGV" in notes[0]["note"] and "use_extra_bufts=False" in notes[0]["note"]
    assert "starting it again with use_extra_bufts=False" in logged[0]
    # a worker that cannot load at all is a skipped peer, with the reason
    with pytest.raises(PeerUnavailable, match="exited with code 3"):
        load_llamacpp(str(gguf), FakeTokenizer(True), 64, command=fake_worker("exit-on-load"))


def test_worker_protocol_errors_are_replies():
    import io

    class Broken:
        def __init__(self, config):
            raise ImportError("No module named 'llama_cpp'")

    out = io.StringIO()
    lines = ['{"cmd": "run", "method": "llamacpp", "prompt_ids": [1], "params": {}}', "",
             '{"cmd": "nope"}', '{"cmd": "load", "config": {}}', '{"cmd": "exit"}', '{"cmd": "nope"}']
    assert llamacpp_worker.serve(Broken, io.StringIO("\n".join(lines) + "\n"), out) == 0
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["ok"] for r in replies] == [False, False, False]  # nothing after exit
    assert "run before load" in replies[0]["error"] and "unknown command" in replies[1]["error"]
    assert replies[2]["kind"] == "import"


def _llamacpp_ready() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("llama_cpp") is not None and gguf_path("smollm2-135m").exists()
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _llamacpp_ready(), reason="llama-cpp-python or the smollm2-135m GGUF is not installed")
def test_llamacpp_peer_real_tiny_run():
    from specdraft.runtime.loader import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    notes: list[dict] = []
    methods, skipped = load_peers(["llamacpp"], "smollm2-135m", tokenizer, 256, log=lambda m: None,
                                  notes=notes)
    assert skipped == []
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
        for m in methods:
            run = m.run(ids, SamplingParams(temperature=0, max_tokens=6))
            assert 1 <= run["tokens"] <= 6 and run["tokens"] == len(run["token_ids"])
            assert run["time_s"] > 0 and 0 < run["ttft_s"] <= run["time_s"]
            assert run["text"].strip() and run["finish_reason"] in ("stop", "length")
        assert methods[0].worker.alive
    finally:
        methods[0].close()


# --------------------------------------------------------------------------------------------- machine


def test_header_lines():
    h = header(["specdraft", "bench-runtime", "--prompts", "2"])
    h["model"] = "m"
    lines = header_lines(h)
    assert lines[0].startswith("machine: ") and "torch threads" in lines[0]
    assert any(line.startswith("versions: python") and "torch" in line for line in lines)
    assert lines[-1] == "command: specdraft bench-runtime --prompts 2"
    assert isinstance(h["machine"]["logical_cores"], int)


# --------------------------------------------------------------------------------------- runtime bench


def test_weight_bytes_tied_and_untied():
    emb = torch.zeros(10, 4, dtype=torch.bfloat16)
    lin = torch.zeros(3, 4, dtype=torch.bfloat16)
    head = torch.zeros(10, 4, dtype=torch.bfloat16)
    # tied: the embedding table is the LM head, counted once
    tied = [("embed.weight", emb), ("layer.weight", lin), ("lm_head.weight", emb)]
    assert weight_bytes_per_token(tied, emb, emb) == (40 + 12) * 2
    # untied: the lookup table is not read per token, the head is
    untied = [("embed.weight", emb), ("layer.weight", lin), ("lm_head.weight", head)]
    assert weight_bytes_per_token(untied, emb, head) == (12 + 40) * 2
    assert weight_bytes_per_token(untied, emb, head, dtype_bytes=4) == (12 + 40) * 4
    assert floor_ms(2_000_000, 1e9) == pytest.approx(2.0)


def test_runtime_aggregation_and_results():
    s1 = summarize_runs([{"tokens": 11, "total_s": 1.2, "prefill_s": 0.2}, {"tokens": 11, "total_s": 1.1,
                                                                             "prefill_s": 0.1},
                         {"tokens": 11, "total_s": 1.0, "prefill_s": 0.3}])
    assert s1["total_s"] == 1.1 and s1["prefill_s"] == 0.2 and s1["decode_s"] == pytest.approx(0.9)
    agg = aggregate_runtime([dict(s1, prompt_tokens=50), dict(s1, prompt_tokens=30)])
    assert agg["decode_tokens"] == 20 and agg["decode_tokens_per_s"] == pytest.approx(20 / 1.8)
    assert agg["ms_per_token"] == pytest.approx(1000 * 1.8 / 20)
    assert agg["prefill_tokens_per_s"] == pytest.approx(80 / 0.4)

    def sample(ours_total, hf_total):
        return {"question_id": 1, "category": "qa", "prompt_tokens": 40, "methods": {
            "ours-bf16": summarize_runs([{"tokens": 11, "total_s": ours_total, "prefill_s": 0.1}]),
            "hf-bf16": summarize_runs([{"tokens": 11, "total_s": hf_total, "prefill_s": 0.1}])}}

    results = build_runtime_results(
        {"machine": {}, "versions": {}}, {"prompts": 2},
        {"fp32_gb_s": 10.0, "bf16_gb_s": 8.0, "used_gb_s": 10.0, "tensor_bytes": 1 << 30},
        {"bf16_bytes": 10_000_000, "fp32_bytes": 20_000_000, "parameters": 5_000_000,
         "tied_embeddings": True},
        {"ours-bf16": ("specdraft", "bf16"), "hf-bf16": ("transformers", "bf16")},
        [sample(0.6, 1.1), sample(0.6, 1.1)])
    ours, hf = results["methods"]["ours-bf16"], results["methods"]["hf-bf16"]
    assert ours["decode_tokens_per_s"] == pytest.approx(20.0)
    assert hf["decode_tokens_per_s"] == pytest.approx(10.0)
    assert ours["vs_hf_bf16"] == pytest.approx(2.0) and hf["vs_hf_bf16"] == pytest.approx(1.0)
    assert ours["floor_ms_per_token"] == pytest.approx(1.0)
    assert ours["x_of_floor"] == pytest.approx(50.0)
    json.dumps(results)
    table = render_table(results)
    assert "ours-bf16" in table and "2.00x" in table and "50.0x" in table


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_registers_both_commands():
    from specdraft.bench.cli import add_bench_commands

    parser = argparse.ArgumentParser()
    add_bench_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench"])
    assert (args.max_tokens, args.temperature, args.num_speculative_tokens, args.repeats) == (128, 0.0, 5, 1)
    assert args.out == "bench-out"
    assert args.suite is None and args.per_category is None and not args.no_adaptive
    args = parser.parse_args(["bench", "--methods", "plain,ngram", "--peers", "hf", "--per-category", "2",
                              "--no-adaptive", "-k", "3"])
    assert (args.methods, args.peers, args.per_category, args.no_adaptive, args.num_speculative_tokens) == (
        "plain,ngram", "hf", 2, True, 3)
    args = parser.parse_args(["bench-runtime", "--prompts", "3", "--no-hf"])
    assert (args.prompts, args.no_hf, args.max_tokens, args.model) == (3, True, 128, "smollm2-135m")


# ------------------------------------------------------------------------------------------ end to end


def _have_smollm2() -> bool:
    try:
        from specdraft.runtime.loader import CATALOG

        CATALOG["smollm2-135m"].locate()
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _have_smollm2(), reason="smollm2-135m is not installed")
def test_bench_end_to_end_tiny(tmp_path):
    from specdraft.cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "--per-category", "1", "--groups", "qa,translation", "--max-tokens", "8",
               "--methods", "plain,ngram", "--out", str(out), "--no-progress"])
    assert rc == 0
    for name in ("results.json", "report.md", "speedup.png", "acceptance.png"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    assert results["groups"] == ["translation", "qa"]
    overall = results["summary"][OVERALL]
    assert overall["plain"]["mean_accepted_length"] == 1.0
    assert overall["ngram"]["identical"] == overall["ngram"]["compared"] == 2  # lossless
    assert not math.isnan(overall["ngram"]["speedup"])


def test_verify_curve_math_report_and_plot(tmp_path):
    """Ratios to the one-token forward, and the machine bound max(floor, flops / peak): flat while reading
    the weights dominates, then linear in M."""
    from specdraft.bench.verify_curve import curve_points, plot_curve, render_curve

    times = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.020}
    points = curve_points(times, floor_s=0.008, flops_per_token=1e9, peak_flop_s=2e11)
    assert [p["tokens"] for p in points] == [1, 2, 4, 8]
    assert [round(p["ratio"], 3) for p in points] == [1.0, 1.1, 1.2, 2.0]
    # bound: max(8 ms, M * 5 ms) -> 8, 10, 20, 40 ms
    assert [round(p["bound_ms"], 6) for p in points] == [8.0, 10.0, 20.0, 40.0]
    assert [round(p["bound_ratio"], 3) for p in points] == [1.0, 1.25, 2.5, 5.0]
    results = {"machine": {"bandwidth_gb_s": 30.0, "peak_gflop_s": 200.0, "peak_dtype": "fp32"},
               "config": {"simd_path": "avx2"}, "models": {"m": {"points": points}}}
    table = render_curve(results)
    assert "| m | 8 | 20.00 | 2.00 | 40.00 | 5.00 |" in table and "avx2" in table
    plot_curve(results, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_bench_runtime_takes_the_verify_curve_flags():
    from specdraft.bench.cli import add_bench_commands

    parser = argparse.ArgumentParser()
    add_bench_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench-runtime", "--verify-curve", "--model", "a,b", "--prefix", "64"])
    assert args.verify_curve and args.model == "a,b" and args.prefix == 64
    assert not parser.parse_args(["bench-runtime"]).verify_curve


def test_draft_cost_times_rounds_after_the_first_and_reports_ratios():
    """bench-draft: every round but each request's first is timed, and the table holds one row per drafter
    with its draft step, verification cost and acceptance (ngram on a tiny model)."""
    from tiny_models import ToyTokenizer, tiny_model

    from specdraft.bench.draft_cost import TimedDrafter, measure_draft_cost, render_table
    from specdraft.drafters.ngram import NgramDrafter

    target = tiny_model(seed=0, vocab=16)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]
    measured = measure_draft_cost(target, ToyTokenizer(16), prompts, {"ngram": NgramDrafter()}, k=3,
                                  max_tokens=12, repeats=1)
    row = measured["drafters"]["ngram"]
    assert measured["plain_step_ms"] > 0 and row["verify_ms"] > 0 and row["draft_step_ms"] >= 0
    assert 1.0 <= row["mean_accepted_length"] <= 4.0 and 0.0 <= row["acceptance_rate"] <= 1.0
    assert row["step_ratio"] == pytest.approx(row["draft_step_ms"] / measured["plain_step_ms"])
    table = render_table({"config": {"k": 3}, **measured})
    assert "| ngram |" in table and "drafts of K = 3" in table

    timed = TimedDrafter(NgramDrafter())
    from specdraft.engine.adaptive import AdaptiveConfig
    from specdraft.engine.core import Engine
    from specdraft.verify.sampling import SamplingParams

    engine = Engine(target, ToyTokenizer(16), timed, 2, AdaptiveConfig(enabled=False))
    result = engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    # Each request's first round is left out, and its last is never observed (the request ended).
    assert len(timed.rounds) == result.metrics.target_forwards - 2


def test_bench_fallback_drafter_runs_through_the_engine():
    """The always-wrong drafter of `bench-fallback` speaks the drafter interface the engine calls."""
    from tiny_models import ToyTokenizer, tiny_model

    from specdraft.bench.fallback_bench import AlwaysWrongDrafter
    from specdraft.engine.adaptive import AdaptiveConfig
    from specdraft.engine.core import Engine

    target = tiny_model(seed=0, vocab=16)
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = Engine(target, ToyTokenizer(16), None, 0, max_model_len=64).generate([1, 2, 3], params)
    engine = Engine(target, ToyTokenizer(16), AlwaysWrongDrafter(15), 3, AdaptiveConfig(enabled=False),
                    max_model_len=64)
    result = engine.generate([1, 2, 3], params)
    assert result.token_ids == plain.token_ids and engine.totals.drafted > 0
