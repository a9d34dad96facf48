"""The user-facing layer: CLI error handling, JSON config, and the vLLM-shaped API on the bundled model."""

from __future__ import annotations

import json

import pytest

from specdraft import LLM, ContextOverflowError, InvalidParameterError, SamplingParams, SpecdraftError
from specdraft.cli import main
from specdraft.config import SpecConfig


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--model", "/no/such/model"], "not found"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "   "], "empty prompt"),
    (["generate", "hi", "--draft", "quant:int3"], "int4 or int8"),
])
def test_cli_reports_user_errors_without_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


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
                                    dict(max_tokens=0), dict(seed="x"), dict(stop=[""])])
def test_nonsense_sampling_parameters(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


@pytest.mark.slow
def test_llm_api_end_to_end_and_bad_requests(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model": "smollm2-135m", "draft_model": "ngram", "speculation_length": 4,
                                  "max_model_len": 256}))
    llm = LLM(str(config), progress=False)
    params = SamplingParams(temperature=0, max_tokens=24)
    messages = [{"role": "user", "content": "List three colours, then list them again."}]
    out = llm.chat(messages, params)[0]
    assert out.outputs[0].finish_reason in ("stop", "length") and out.outputs[0].token_ids
    assert out.metrics.target_forwards > 0 and llm.metrics.generated_tokens == len(out.outputs[0].token_ids)
    streamed = "".join(chunk.text for chunk in llm.stream(messages[0]["content"], params, chat=True))
    assert streamed == out.text
    with pytest.raises(SpecdraftError, match="empty prompt"):
        llm.generate("", params)
    with pytest.raises(ContextOverflowError):
        llm.generate("word " * 300, params)
    with pytest.raises(ContextOverflowError):  # a bad request in a batch: nothing of the batch runs
        llm.generate(["fine", "word " * 300], params)
    assert llm.chat(messages, params)[0].outputs[0].token_ids == out.outputs[0].token_ids
