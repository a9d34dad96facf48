"""The user-facing layer: CLI error handling, JSON config, and the vLLM-shaped API on the bundled model."""

from __future__ import annotations

import json
import re

import pytest

from specdraft import LLM, ContextOverflowError, InvalidParameterError, SamplingParams, SpecdraftError
from specdraft.cli import main
from specdraft.config import SpecConfig
from specdraft.engine.core import Engine
from specdraft.runtime import cpu_kernels


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--model", "/no/such/model"], "not found"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["generate", "hi", "--logit-bias", "5=101"], "logit_bias must map token ids"),
    (["generate", "hi", "--logit-bias", "99999999=1"], "logit_bias token ids must be in [0, 49152)"),
    (["generate", "   "], "empty prompt"),
    (["generate", "hi", "--draft", "quant:int3"], "int4 or int8"),
    (["generate", "hi", "--speculative-model", "quant:int3"], "int4 or int8"),
    (["generate", "\udcff\udcfe bad"], "prompt is not valid UTF-8 text (byte 0xff at character 0)"),
])
def test_cli_reports_user_errors_without_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "-k", "-3"], "argument --num-speculative-tokens/-k: must be an integer in [0, 64], got -3"),
    (["generate", "hi", "--num-speculative-tokens", "x"], "expected an integer, got 'x'"),
    (["generate", "hi", "--max-batch", "0"], "argument --max-batch: must be an integer in [1, 256], got 0"),
    (["generate", "hi", "--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 1, got -5"),
    (["demo", "-k", "99"], "must be an integer in [0, 64], got 99"),
    (["bench", "-k", "-1"], "must be an integer in [0, 64], got -1"),
    (["generate", "hi", "--tree", "32"], "argument --tree: must be an integer in [0, 31], got 32"),
    (["demo", "--tree", "-1"], "argument --tree: must be an integer in [0, 31], got -1"),
    (["bench", "--tree", "x"], "argument --tree: expected an integer, got 'x'"),
    (["generate", "hi", "--logprobs", "21"], "argument --logprobs: must be an integer in [0, 20], got 21"),
    (["generate", "hi", "--logit-bias", "x"], "argument --logit-bias: expected TOKEN_ID=BIAS (e.g. 42=-100), got 'x'"),
])
def test_cli_names_the_flag_the_user_typed(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "speculation_length" not in err and "Traceback" not in err


@pytest.mark.slow
def test_generate_prints_each_tokens_logprobs_after_the_text(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "5", "--logprobs", "2", "--draft",
                 "ngram"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()  # the table, after whatever loading the model printed (a fresh machine converts it)
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["#", "token", "logprob", "rank"])
    assert out.strip() and lines[header + 6].startswith("[length]")
    for i, line in enumerate(lines[header + 1:header + 6]):
        row = re.fullmatch(r"\s*(\d+)  (.+?) +(-?\d+\.\d{3}) +(\d+)  (.*)", line)
        assert row and row[1] == str(i) and float(row[3]) <= 0 and row[4] == "1", line  # greedy: the most likely
        alternatives = [float(v) for v in re.findall(r" (-?\d+\.\d{3})(?=  |$)", row[5])]
        assert len(alternatives) == 2 and alternatives[0] == float(row[3]) >= alternatives[1]


def test_one_name_per_concept_with_the_old_spellings_accepted():
    new = SpecConfig.from_dict({"model": "m", "speculative_model": "ngram", "num_speculative_tokens": 3})
    old = SpecConfig.from_dict({"model": "m", "draft_model": "ngram", "speculation_length": 3})
    assert (new.speculative_model, new.num_speculative_tokens) == (old.speculative_model, old.num_speculative_tokens)
    with pytest.raises(SpecdraftError, match="twice"):
        SpecConfig.from_dict({"model": "m", "draft_model": "ngram", "speculative_model": "ngram"})
    # The error names the key as the user wrote it.
    with pytest.raises(InvalidParameterError, match="config: 'speculation_length' must be an integer in"):
        SpecConfig.from_dict({"model": "m", "speculation_length": -3})
    with pytest.raises(InvalidParameterError, match="^num_speculative_tokens must be an integer in"):
        SpecConfig(model="m", num_speculative_tokens=-3)
    with pytest.raises(InvalidParameterError, match="max_batch"):
        SpecConfig(model="m", max_batch=0)
    with pytest.raises(InvalidParameterError, match=r"config: 'tree' must be an integer in \[0, 31\]"):
        SpecConfig.from_dict({"model": "m", "tree": 64})
    assert SpecConfig.from_dict({"model": "m", "tree": 16}).tree == 16
    assert issubclass(InvalidParameterError, SpecdraftError)


def test_prompts_that_are_not_valid_text_get_a_clear_error():
    from specdraft.runtime.tokenizer import check_text

    with pytest.raises(SpecdraftError, match="byte 0xff at character 3"):
        check_text("ok \udcff", "prompt")
    with pytest.raises(SpecdraftError, match="lone surrogate U\\+D800"):
        check_text("\ud800", "prompt")
    with pytest.raises(SpecdraftError, match="empty prompt"):
        check_text(" \n", "prompt")
    check_text("naïve ✓", "prompt")


def test_config_rejects_unknown_keys(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "draft_mdoel": "ngram"}))
    with pytest.raises(SpecdraftError, match="unknown config key"):
        SpecConfig.load(path)
    assert main(["generate", "hi", "--config", str(path)]) == 2
    assert "draft_mdoel" in capsys.readouterr().err
    with pytest.raises(SpecdraftError, match="not valid JSON"):
        path.write_text("{oops")
        SpecConfig.load(path)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-2), dict(min_p=2.0),
                                    dict(max_tokens=0), dict(seed="x"), dict(stop=[""]), dict(logprobs=-1),
                                    dict(logprobs=21), dict(repetition_penalty=0), dict(frequency_penalty=-2.1)])
def test_nonsense_sampling_parameters(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


@pytest.mark.slow
def test_llm_api_end_to_end_and_bad_requests(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model": "smollm2-135m", "draft_model": "ngram", "speculation_length": 4,
                                  "max_model_len": 256, "max_batch": 2, "tree": 8}))
    llm = LLM(str(config), progress=False)
    params = SamplingParams(temperature=0, max_tokens=24)
    messages = [{"role": "user", "content": "List three colours, then list them again."}]
    out = llm.chat(messages, params)[0]
    assert out.outputs[0].finish_reason in ("stop", "length") and out.outputs[0].token_ids
    assert llm.engine.tree == 8
    assert out.metrics.target_forwards > 0 and llm.metrics.generated_tokens == len(out.outputs[0].token_ids)
    streamed = "".join(chunk.text for chunk in llm.stream(messages[0]["content"], params, chat=True))
    assert streamed == out.text
    # Logprobs in vLLM's shape: per token {token id: Logprob}, the token chosen first, then the most likely.
    assert out.outputs[0].logprobs is None
    scored_request = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, logprobs=2))[0]
    scored = scored_request.outputs[0]
    assert scored.token_ids == out.outputs[0].token_ids and len(scored.logprobs) == len(scored.token_ids)
    for token, entries in zip(scored.token_ids, scored.logprobs, strict=True):
        assert next(iter(entries)) == token and entries[token].rank == 1 and len(entries) == 2  # greedy: the top
        assert entries[token].decoded_token == llm.tokenizer.token_piece(token)
        assert all(e.logprob <= 0 for e in entries.values())
    # ... the same as plain decoding reports them (the drafts were scored in blocks of the verification forward)
    plain = Engine(llm.target, llm.tokenizer, None, 0, max_model_len=256)
    alone = plain.generate(out.prompt_token_ids, SamplingParams(temperature=0, max_tokens=24, logprobs=2)).logprobs
    got = [[(token, e.logprob) for token, e in entries.items()] for entries in scored.logprobs]
    want = [[(e.token_id, e.logprob), *(pair for pair in e.top if pair[0] != e.token_id)] for e in alone]
    assert [g[0][0] for g in got] == [w[0][0] for w in want]
    if cpu_kernels.available():  # row-invariant kernels: the same bits
        assert scored_request.metrics.accepted > 0 and got == want
    # Penalties: speculation (ngram trees here) gives what plain decoding gives with them.
    repeated = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.1, presence_penalty=0.1)
    penalized = llm.chat(messages, repeated)[0]
    assert penalized.outputs[0].token_ids != out.outputs[0].token_ids and penalized.metrics.drafted > 0
    alone = plain.generate(out.prompt_token_ids, repeated).token_ids
    if cpu_kernels.available():
        assert penalized.outputs[0].token_ids == alone
    prompt = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert prompt.prompt_logprobs[0] is None and len(prompt.prompt_logprobs) == len(prompt.prompt_token_ids)
    for token, entries in zip(prompt.prompt_token_ids[1:], prompt.prompt_logprobs[1:], strict=True):
        assert next(iter(entries)) == token and entries[token].rank >= 1 and len(entries) <= 2
    with pytest.raises(SpecdraftError, match="empty prompt"):
        llm.generate("", params)
    with pytest.raises(SpecdraftError, match="not valid UTF-8"):
        llm.chat([{"role": "user", "content": "\udcff"}], params)
    with pytest.raises(SpecdraftError, match="not valid UTF-8"):
        llm.generate("bad \udcfe", params)
    with pytest.raises(ContextOverflowError):
        llm.generate("word " * 300, params)
    with pytest.raises(ContextOverflowError):  # a bad request in a batch: nothing of the batch runs
        llm.generate(["fine", "word " * 300], params)
    assert llm.chat(messages, params)[0].outputs[0].token_ids == out.outputs[0].token_ids
    # Several prompts run together (max_batch 2, three prompts: continuous batching), each as it runs alone.
    prompts = ["Count from one to five.", "Name a fruit.", "Say hello in French."]
    together = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == [llm.generate(p, params)[0].outputs[0].token_ids
                                                          for p in prompts]
    assert [o.prompt for o in together] == prompts and llm.engine.free_slots == 2
