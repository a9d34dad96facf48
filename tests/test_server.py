"""The OpenAI-compatible server (`specdraft serve`), tested over real HTTP: uvicorn on a free loopback port in
a thread, the official `openai` client and raw httpx. A tiny random model with a one-character-per-token
tokenizer keeps it fast; one test runs the bundled SmolLM2 through its chat template."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_cpu_kernels import kernel_model, needs_kernels

from specdraft.cli import main
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.runtime import cpu_kernels
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.server import ServedModel, create_app, create_app_lazy, serve_in_thread
from specdraft.server.protocol import MAX_BATCH_PROMPTS
from specdraft.verify.sampling import SamplingParams

VOCAB = 101  # kernel_model's vocabulary
NAME = "tiny"
CONTEXT = 256


class CharHF:
    """A stand-in for a Hugging Face tokenizer: token i is the character chr(97 + i); the chat template
    concatenates the contents and appends "|" (a generation prompt). No EOS, so lengths are exact."""

    eos_token_id = None
    chat_template = "concatenate"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(i)) for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return chr(97 + token_id)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages) + "|"


class SlowEngine:
    """The engine with a pause in every round: long enough requests to disconnect from mid-stream."""

    def __init__(self, engine: Engine, delay: float) -> None:
        self._engine, self._delay = engine, delay

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self, requests):
        time.sleep(self._delay)
        return self._engine.step(requests)


@pytest.fixture(scope="module")
def target():
    return kernel_model("llama")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(CharHF())


def make_engine(target, tokenizer, max_batch: int = 8, drafter: bool = True) -> Engine:
    return Engine(target, tokenizer, NgramDrafter() if drafter else None, 3 if drafter else 0,
                  AdaptiveConfig(enabled=False), max_model_len=CONTEXT, max_batch=max_batch)


@pytest.fixture(scope="module")
def server(target, tokenizer):
    """The shared server: ngram drafter, K=3, 8 slots."""
    engine = make_engine(target, tokenizer)
    with serve_in_thread(create_app(engine, tokenizer, NAME)) as url:
        yield url, engine


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(target, tokenizer, prompt_ids: list[int], max_tokens: int) -> str:
    """What plain greedy decoding gives alone (no server, no drafter, no batch)."""
    engine = make_engine(target, tokenizer, max_batch=1, drafter=False)
    return engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens)).text


def assert_greedy(got: str, expected: str) -> None:
    """Greedy output equal to the engine alone, bit for bit: that needs the fused kernels, whose rows do not
    depend on the batch or block they are scored in (the torch fallback may round a near-tie differently)."""
    if cpu_kernels.available():
        assert got == expected
    else:
        assert len(got) == len(expected)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def chat_text(url: str, content: str, max_tokens: int, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, **extra})


def first_delta_text(line: str) -> str:
    """The text of a streamed chunk's first choice ('' for blank lines, [DONE] and the role-only chunk)."""
    if not line.startswith("data: {"):
        return ""
    return json.loads(line[len("data: "):])["choices"][0].get("delta", {}).get("content") or ""


def stream_chat(url: str, content: str, max_tokens: int) -> tuple[str, str | None]:
    """(text, finish reason) of a streamed chat completion, read with raw httpx."""
    text, finish = [], None
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


# ---------------------------------------------------------------------------------------- the OpenAI client


def test_openai_client_chat_and_completions_stream_or_not_match_the_engine_alone(server, target, tokenizer):
    url, engine = server
    oa = client(url)
    assert [m.id for m in oa.models.list().data] == [NAME]
    expected_chat = reference(target, tokenizer, tokenizer.encode("abcabcabc|"), 24)

    chat = oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "abcabcabc"}],
                                      max_tokens=24, temperature=0)
    assert_greedy(chat.choices[0].message.content, expected_chat)
    assert chat.choices[0].finish_reason == "length"
    usage = chat.usage.model_dump()
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 24, 34)
    assert "acceptance_rate" in usage and usage["mean_accepted_length"] >= 1.0

    pieces, usages, finish = [], [], None
    for chunk in oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "abcabcabc"}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage.model_dump())
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content and finish == "length"
    assert len(usages) == 1 and usages[0]["completion_tokens"] == 24 and "acceptance_rate" in usages[0]
    # The same prompt again: its cache entries are still in a slot, all but the last token's reused (usage says
    # so as OpenAI's prompt caching does), with the same text.
    reused = engine.target.reuses_cache_entries(engine.cache, 10)  # the fused kernels (a compiler) are here
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == (9 if reused else 0)

    # /reset_prefix_cache (vLLM's): the next one computes its whole prompt again, to the same text.
    assert httpx.post(url + "/reset_prefix_cache").json() == {"status": "ok"}
    again = oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "abcabcabc"}],
                                       max_tokens=24, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == chat.choices[0].message.content

    expected = reference(target, tokenizer, tokenizer.encode("hello"), 12)
    done = oa.completions.create(model=NAME, prompt="hello", max_tokens=12, temperature=0)
    assert_greedy(done.choices[0].text, expected)
    assert done.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        model=NAME, prompt="hello", max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text
    # token ids as the prompt give the same as the text they spell
    by_ids = oa.completions.create(model=NAME, prompt=tokenizer.encode("hello"), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == done.choices[0].text


def test_stop_strings_and_seeded_sampling(server):
    url, _ = server
    oa = client(url)
    full = oa.completions.create(model=NAME, prompt="abcd", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    cut = oa.completions.create(model=NAME, prompt="abcd", max_tokens=20, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    args = dict(model=NAME, prompt="abcd", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                extra_body={"top_k": 20, "min_p": 0.01})
    assert oa.completions.create(**args).choices[0].text == oa.completions.create(**args).choices[0].text


def test_penalties_through_the_openai_client_are_the_engine_alones(server, target, tokenizer):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty (an extra field), streamed or
    not, then OpenAI's logit_bias: the tokens plain decoding with them gives alone."""
    url, _ = server
    oa = client(url)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    ids = tokenizer.encode("abcabcabc")
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.4, **penalties)
    expected = make_engine(target, tokenizer, max_batch=1, drafter=False).generate(ids, params).text
    assert expected != reference(target, tokenizer, ids, 24)  # the penalties change this output
    args = dict(model=NAME, prompt="abcabcabc", max_tokens=24, temperature=0, **penalties,
                extra_body={"repetition_penalty": 1.4})
    assert_greedy(oa.completions.create(**args).choices[0].text, expected)
    streamed = "".join(c.choices[0].text for c in oa.completions.create(**args, stream=True) if c.choices)
    assert_greedy(streamed, expected)
    banned = make_engine(target, tokenizer, max_batch=1, drafter=False).generate(
        ids, SamplingParams(temperature=0, max_tokens=24)).token_ids[0]
    biased = SamplingParams(temperature=0, max_tokens=24, logit_bias={banned: -100.0, 7: 3.0})
    expected = make_engine(target, tokenizer, max_batch=1, drafter=False).generate(ids, biased)
    assert expected.token_ids[0] != banned
    got = oa.completions.create(model=NAME, prompt="abcabcabc", max_tokens=24, temperature=0,
                                logit_bias={str(banned): -100, "7": 3})
    assert_greedy(got.choices[0].text, expected.text)


def test_logprobs_through_the_openai_client_are_the_engine_alones_streamed_or_not(server, target, tokenizer):
    """Chat's `logprobs` / `top_logprobs` and the completions API's `logprobs`: each token's entry is what plain
    decoding alone reports (the server drafts with ngram), the same streamed as not, in OpenAI's shapes."""
    url, _ = server
    oa = client(url)
    plain = make_engine(target, tokenizer, max_batch=1, drafter=False)
    expected = plain.generate(tokenizer.encode("abcabcabc|"), SamplingParams(temperature=0, max_tokens=16, logprobs=3))
    exact = cpu_kernels.available()

    def check(entries: list, want: list) -> None:
        assert [e.token for e in entries] == [tokenizer.token_piece(w.token_id) for w in want]
        assert [e.bytes for e in entries] == [list(e.token.encode()) for e in entries]
        assert [e.logprob for e in entries] == pytest.approx([w.logprob for w in want], abs=0 if exact else 1e-3)
        for entry, w in zip(entries, want, strict=True):
            assert [t.token for t in entry.top_logprobs] == [tokenizer.token_piece(t) for t, _ in w.top]
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob

    args = dict(model=NAME, messages=[{"role": "user", "content": "abcabcabc"}], max_tokens=16, temperature=0,
                logprobs=True, top_logprobs=3)
    chat = oa.chat.completions.create(**args)
    assert_greedy(chat.choices[0].message.content, expected.text)
    if exact:
        check(chat.choices[0].logprobs.content, expected.logprobs)
    streamed = [e for c in oa.chat.completions.create(**args, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == chat.choices[0].logprobs.content
    assert len(streamed) == chat.usage.completion_tokens == 16
    bare = oa.chat.completions.create(**{**args, "top_logprobs": None})
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * 16
    assert oa.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None

    done = oa.completions.create(model=NAME, prompt="hello", max_tokens=12, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.tokens) == 12  # one character a token here
    assert lp.text_offset == list(range(12))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and len(top) in (2, 3) and max(top.values()) >= value
    parts = [c.choices[0].logprobs for c in oa.completions.create(model=NAME, prompt="hello", max_tokens=12,
                                                                   temperature=0, logprobs=2, stream=True)
             if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_asks(server, target, tokenizer):
    """lm-evaluation-harness's loglikelihood request: the prompt as a batch of one list of token ids, `echo`,
    `logprobs=1`, `max_tokens=1`. Every prompt token after the first gets the target's logprob of it (the first
    null), the generated token its own; the text is the prompt's then the completion's; streamed the same."""
    url, _ = server
    prompt = tokenizer.encode("abcabcabd")
    body = {"model": NAME, "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    alone = make_engine(target, tokenizer, max_batch=1, drafter=False).generate(
        prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))
    assert choice["text"] == "abcabcabd" + alone.text and lp["tokens"] == list(choice["text"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"] == list(range(10))
    expected = [e.logprob for e in alone.prompt_logprobs[1:] + alone.logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=0 if cpu_kernels.available() else 1e-3)
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[token] == value and max(top.values()) >= value
    # what the harness reads: the continuation's tokens are greedy when each is its position's most likely
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    assert answer["usage"]["prompt_tokens"] == 9 and answer["usage"]["completion_tokens"] == 1

    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    parts = [e["choices"][0] for e in events if e["choices"]]
    assert parts[0]["text"] == "abcabcabd" and "".join(p["text"] for p in parts) == choice["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts if p["logprobs"] for v in p["logprobs"][key]] == lp[key]
    bare = client(url).completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0, echo=True)
    assert bare.choices[0].text.startswith("hello") and len(bare.choices[0].text) == 8
    assert bare.choices[0].logprobs is None


def test_a_batch_of_prompts_gets_a_choice_each_as_if_sent_alone(server, target, tokenizer):
    """A completions request with a list of prompts (strings, or lists of token ids): one choice per prompt,
    `index` its place, each the text its prompt gets alone, streamed or not; the usage sums the prompts'."""
    url, engine = server
    texts = ["abcabc", "hello", "zz", "abcabcabd"]
    alone = [reference(target, tokenizer, tokenizer.encode(t), 9) for t in texts]
    oa = client(url)
    for prompt in (texts, [tokenizer.encode(t) for t in texts]):
        done = oa.completions.create(model=NAME, prompt=prompt, max_tokens=9, temperature=0)
        assert [c.index for c in done.choices] == [0, 1, 2, 3]
        for choice, expected in zip(done.choices, alone, strict=True):
            assert_greedy(choice.text, expected)
        assert done.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
        assert done.usage.completion_tokens == 4 * 9
    pieces: dict[int, list[str]] = {i: [] for i in range(4)}
    finished, usages, ids = set(), [], set()
    for chunk in oa.completions.create(model=NAME, prompt=texts, max_tokens=9, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.usage is not None and not chunk.choices:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3} and len(ids) == 1 and len(usages) == 1
    assert ["".join(pieces[i]) for i in range(4)] == [c.text for c in done.choices]
    assert usages[0].completion_tokens == 36 and usages[0].prompt_tokens == done.usage.prompt_tokens
    # one prompt too long for the context: a 400 that names it, and nothing of the batch keeps running
    response = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": ["abc", "a" * CONTEXT], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("prompt 1: ")
    deadline = time.monotonic() + 10
    while engine.free_slots != engine.max_batch and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.free_slots == engine.max_batch


def test_vllms_tokenizer_endpoints_use_the_servers_tokenizer(server, tokenizer):
    """`/tokenize` (a prompt, or messages through the chat template), `/detokenize` and `/tokenizer_info`, as
    vLLM serves them and lm-evaluation-harness's remote tokenizer reads them."""
    url, engine = server
    made = httpx.post(url + TOKENIZE, json={"prompt": "hello", "model": NAME}).json()
    assert made == {"count": 5, "max_model_len": engine.max_model_len, "tokens": tokenizer.encode("hello")}
    chat = httpx.post(url + TOKENIZE, json={"messages": MSG}).json()
    assert chat["tokens"] == tokenizer.prompt_ids(MSG) == tokenizer.encode("abc|")
    assert httpx.post(url + DETOKENIZE, json={"tokens": made["tokens"]}).json() == {"prompt": "hello"}
    info = httpx.get(url + "/tokenizer_info").json()
    assert "eos_token" in info and info["chat_template"] == "concatenate"
    assert info["model_max_length"] == engine.max_model_len
    # the engine goes on serving while they are asked
    with ThreadPoolExecutor(4) as pool:
        texts = pool.map(lambda i: chat_text(url, "abc", 8).json()["choices"][0]["message"]["content"], range(4))
        ids = [httpx.post(url + TOKENIZE, json={"prompt": "xyz" * i}).json()["tokens"] for i in range(20)]
    assert len(set(texts)) == 1 and ids == [tokenizer.encode("xyz" * i) for i in range(20)]


def test_engine_thread_calls_give_their_result_or_error_and_503_once_stopped(target, tokenizer):
    import asyncio

    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.protocol import APIError
    from specdraft.server.worker import EngineWorker

    worker = EngineWorker(make_engine(target, tokenizer, max_batch=1), tokenizer, ServerMetrics(NAME))
    worker.start()

    async def calls() -> None:
        loop = asyncio.get_running_loop()
        assert await worker.call(lambda: threading.current_thread().name, loop) == "specdraft-engine"
        with pytest.raises(ZeroDivisionError):
            await worker.call(lambda: 1 / 0, loop)
        assert await worker.call(lambda: 6 * 7, loop) == 42  # the engine thread goes on

    asyncio.run(calls())
    worker.stop()
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(APIError, match="shutting down"):
            worker.call(lambda: 1, loop)
    finally:
        loop.close()


@needs_kernels
def test_greedy_outputs_under_8_way_concurrency_equal_the_engine_alone(server, target, tokenizer):
    """Eight clients at once share the batched rounds; each gets exactly what the engine gives it alone."""
    url, _ = server
    prompts = ["abcabc", "hello", "xyzxyzxyz", "a", "kkkkkkkk", "thequickbrownfox", "ababab", "mnop"]
    lengths = [20, 9, 17, 24, 5, 13, 20, 11]
    expected = [reference(target, tokenizer, tokenizer.encode(p + "|"), n) for p, n in zip(prompts, lengths)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda a: chat_text(url, *a).json()["choices"][0]["message"]["content"],
                            zip(prompts, lengths)))
    assert got == expected


def test_32_concurrent_streaming_clients_all_complete(server):
    """32 streams against 8 slots: 24 wait their turn; none fails, none is cut short."""
    url, engine = server
    prompts = [("abcdefgh"[i % 8:] + "xyz")[: 3 + i % 5] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: stream_chat(url, p, 12), prompts))
    assert all(finish == "length" and len(text) == 12 for text, finish in results), results
    # the same prompt gives the same greedy text, whichever slot and batch it ran in
    by_prompt: dict[str, set[str]] = {}
    for p, (text, _) in zip(prompts, results):
        by_prompt.setdefault(p, set()).add(text)
    if cpu_kernels.available():  # row invariance, as above
        assert all(len(texts) == 1 for texts in by_prompt.values())
    assert engine.free_slots == engine.max_batch
    assert metric(url, "specdraft:num_requests_running") == 0


# ---------------------------------------------------------------------------------------- bad requests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "abc"}]


def _malformed() -> list[tuple[str, bytes, str]]:
    """(path, raw body, a word the error message must contain)."""
    def chat(**fields) -> bytes:
        return json.dumps({"model": NAME, "messages": MSG, **fields}).encode()

    def comp(**fields) -> bytes:
        return json.dumps({"model": NAME, "prompt": "abc", **fields}).encode()

    cases = [
        (CHAT, b"{", "JSON"), (CHAT, b"", "JSON"), (CHAT, b"not json", "JSON"), (CHAT, b"[]", "object"),
        (CHAT, b"null", "object"), (COMPLETIONS, b'"abc"', "object"), (CHAT, b'{"messages": [}', "JSON"),
        (CHAT, b'{"model": "\xff\xfe", "messages": []}', "UTF-8"), (COMPLETIONS, b"\xc3\x28", "UTF-8"),
        (CHAT, b'{"messages": [{"role": "user", "content": "ab\xe2\x82"}]}', "UTF-8"),
        (CHAT, json.dumps({"messages": "hi"}).encode(), "messages"),
        (CHAT, json.dumps({"messages": [1]}).encode(), "messages"),
        (CHAT, json.dumps({"messages": [{"role": "user"}]}).encode(), "content"),
        (CHAT, json.dumps({"messages": [{"role": "robot", "content": "a"}]}).encode(), "role"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": "a", "mood": "x"}]}).encode(), "unknown field"),
        (CHAT, json.dumps({"messages": []}).encode(), "messages"), (CHAT, json.dumps({}).encode(), "messages"),
        (CHAT, chat(temperature="0.5"), "temperature"), (CHAT, chat(max_tokens=1.5), "max_tokens"),
        (CHAT, chat(max_tokens=True), "max_tokens"), (CHAT, chat(stream="yes"), "stream"),
        (CHAT, chat(stop=5), "stop"), (CHAT, chat(seed="1"), "seed"), (CHAT, chat(top_k=1.0), "top_k"),
        (CHAT, chat(n="1"), "n"), (CHAT, chat(temperature=-1), "temperature"), (CHAT, chat(top_p=0), "top_p"),
        (CHAT, chat(top_p=1.5), "top_p"), (CHAT, chat(top_k=-2), "top_k"), (CHAT, chat(min_p=2), "min_p"),
        (CHAT, chat(max_tokens=0), "max_tokens"), (CHAT, chat(max_tokens=-5), "max_tokens"),
        (CHAT, chat(seed=-1), "seed"), (CHAT, chat(seed=2**70), "seed"), (CHAT, chat(n=2), "n=2"),
        (CHAT, chat(presence_penalty=2.5), "presence_penalty"), (CHAT, chat(top_logprobs=2), "logprobs=true"),
        (CHAT, chat(frequency_penalty="1"), "frequency_penalty"),
        (COMPLETIONS, comp(repetition_penalty=0), "repetition_penalty"),
        (COMPLETIONS, comp(logit_bias={"x": 1}), "logit_bias keys"), (CHAT, chat(logit_bias={"1": 101}), "logit_bias"),
        (CHAT, chat(logit_bias={str(VOCAB): 1}), f"[0, {VOCAB})"), (CHAT, chat(logit_bias=[1]), "logit_bias"),
        (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"), (CHAT, chat(logprobs=1), "logprobs"),
        (COMPLETIONS, comp(logprobs=-1), "logprobs"), (COMPLETIONS, comp(logprobs=True), "logprobs"),
        (CHAT, chat(max_tokens=10**9), "context"), (CHAT, chat(max_tokens=10**30), "context"),
        (CHAT, chat(max_completion_tokens=10**6), "context"), (CHAT, chat(foo=1), "unknown field"),
        (CHAT, chat(stream=True, stream_options={"bogus": True}), "unknown field"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream"),
        (CHAT, chat(stop=[""]), "stop"), (CHAT, chat(stop=["x"] * 17), "stop"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', "temperature"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": "ABC"}]}).encode(), "token ids"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": "a" * 300}]}).encode(), "context"),
        (CHAT, json.dumps({"model": "gpt-4", "messages": MSG}).encode(), "does not exist"),
        (COMPLETIONS, json.dumps({"prompt": ""}).encode(), "empty"), (COMPLETIONS, comp(prompt=[]), "prompt"),
        (COMPLETIONS, comp(prompt=[-1]), "token ids"), (COMPLETIONS, comp(prompt=[10**6]), "token ids"),
        (COMPLETIONS, comp(prompt=["a", [1]]), "prompt"), (COMPLETIONS, comp(prompt=5), "prompt"),
        (COMPLETIONS, comp(prompt=[1.5]), "prompt"), (COMPLETIONS, comp(suffix="x"), "suffix"),
        (COMPLETIONS, comp(prompt=["a"] * (MAX_BATCH_PROMPTS + 1)), "prompt"),
        (COMPLETIONS, comp(prompt=[[1], []]), "prompt"), (COMPLETIONS, comp(prompt=[[]]), "prompt"),
        (COMPLETIONS, comp(best_of=3), "best_of"), (CHAT, chat(response_format={"type": "json_object"}), "json_object"),
        (CHAT, chat(response_format={"type": "yaml"}), "response_format"),
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (CHAT, chat(tool_choice="required"), "tool_choice"),
        (COMPLETIONS, comp(echo=1), "echo"),
        (COMPLETIONS, comp(max_tokens=10**9), "context"), (COMPLETIONS, comp(bogus=None), "unknown field"),
        (COMPLETIONS, json.dumps({"model": NAME}).encode(), "prompt"),
        (COMPLETIONS, comp(model="nope"), "does not exist"), (COMPLETIONS, comp(temperature="hot"), "temperature"),
        (TOKENIZE, b"{}", "one of them"), (TOKENIZE, json.dumps({"prompt": "a", "messages": MSG}).encode(), "one of"),
        (TOKENIZE, json.dumps({"prompt": 5}).encode(), "prompt"), (TOKENIZE, b'{"prompt": "\\udcff"}', "UTF-8"),
        (TOKENIZE, json.dumps({"messages": []}).encode(), "messages"), (TOKENIZE, b"[", "JSON"),
        (TOKENIZE, json.dumps({"prompt": "a", "bogus": 1}).encode(), "unknown field"),
        (DETOKENIZE, json.dumps({"tokens": [VOCAB]}).encode(), "token ids"), (DETOKENIZE, b"{}", "tokens"),
        (DETOKENIZE, json.dumps({"tokens": ["a"]}).encode(), "tokens"),
        (DETOKENIZE, json.dumps({"tokens": [1], "model": "gpt-4"}).encode(), "does not exist"),
    ]
    return cases


def test_200_malformed_requests_get_4xx_with_a_message_and_the_server_stays_correct(server, target, tokenizer):
    url, engine = server
    cases = _malformed()
    sent = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        while sent < 200:
            path, body, word = cases[sent % len(cases)]
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], body
            assert word.lower() in error["message"].lower(), (body, error)
            sent += 1
        assert http.get("/v1/chat/completions").status_code == 405  # wrong method: still OpenAI's shape
        assert "error" in http.get("/v1/nothing").json()
        assert http.get("/health").status_code == 200
    assert engine.free_slots == engine.max_batch
    got = chat_text(url, "abcabc", 10).json()["choices"][0]["message"]["content"]
    assert_greedy(got, reference(target, tokenizer, tokenizer.encode("abcabc|"), 10))


def test_openai_fields_at_their_neutral_values_are_accepted(server):
    """Clients that send OpenAI's defaults explicitly (a text response format, no tools, best_of 1) get the
    answer they would get without them."""
    url, _ = server
    plain = chat_text(url, "abcabc", 6).json()["choices"][0]["message"]["content"]
    response = chat_text(url, "abcabc", 6, response_format={"type": "text"}, tools=[], tool_choice="none",
                         parallel_tool_calls=True)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == plain
    done = client(url).completions.create(model=NAME, prompt="abc", max_tokens=3, temperature=0, best_of=1)
    assert len(done.choices[0].text) == 3


def test_a_prediction_gives_the_same_text_and_is_drafted_from(server, target, tokenizer):
    """OpenAI's Predicted Outputs (`prediction`): the answer is the one without it, token for token; with the
    answer itself predicted, the ngram drafter's drafts come from it (more tokens per forward)."""
    url, _ = server
    expected = reference(target, tokenizer, tokenizer.encode("xyzq|"), 30)
    alone = chat_text(url, "xyzq", 30).json()
    predicted = chat_text(url, "xyzq", 30, prediction={"type": "content", "content": expected}).json()
    parts = chat_text(url, "xyzq", 30, prediction={"type": "content",
                                                    "content": [{"type": "text", "text": expected[:9]},
                                                                {"type": "text", "text": expected[9:]}]}).json()
    for answer in (alone, predicted, parts):
        assert_greedy(answer["choices"][0]["message"]["content"], expected)
    assert predicted["usage"]["mean_accepted_length"] > alone["usage"]["mean_accepted_length"]
    # OpenAI's counts of the prediction's tokens: none without one; with the answer, most of it accepted
    assert alone["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0}
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= predicted["usage"]["completion_tokens"] // 2
    assert details["rejected_prediction_tokens"] >= 0
    streamed, _ = stream_chat(url, "xyzq", 30)
    assert_greedy(streamed, expected)
    done = client(url).completions.create(model=NAME, prompt="xyz", max_tokens=5, temperature=0,
                                          extra_body={"prediction": {"type": "content", "content": "hello"}})
    assert len(done.choices[0].text) == 5
    counted = done.usage.completion_tokens_details  # the official client reads the field
    assert counted.accepted_prediction_tokens + counted.rejected_prediction_tokens <= 5 * 4
    bad = chat_text(url, "xyzq", 3, prediction={"type": "file", "content": "x"})
    assert bad.status_code == 400 and "prediction" in bad.json()["error"]["message"]


def test_context_overflow_and_unknown_model_errors(server):
    url, _ = server
    response = chat_text(url, "abc", 10**6)
    assert response.status_code == 400
    error = response.json()["error"]
    assert f"context of {CONTEXT} tokens" in error["message"] and error["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(url).chat.completions.create(model="gpt-4", messages=MSG, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client(url).chat.completions.create(model=NAME, messages=MSG, max_tokens=2, n=3)


# ---------------------------------------------------------------------------------------- auth, health, metrics


def test_api_key_is_required_when_set(target, tokenizer):
    app = create_app(make_engine(target, tokenizer, max_batch=2), tokenizer, NAME, api_key="s3cret")
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        wrong = httpx.post(url + CHAT, json={"messages": MSG}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").chat.completions.create(model=NAME, messages=MSG, max_tokens=2)
        ok = client(url, "s3cret").chat.completions.create(model=NAME, messages=MSG, max_tokens=3, temperature=0)
        assert len(ok.choices[0].message.content) == 3
        assert httpx.post(url + "/reset_prefix_cache").status_code == 401
        assert httpx.post(url + "/reset_prefix_cache", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.post(url + TOKENIZE, json={"prompt": "abc"}).status_code == 401
        assert httpx.get(url + "/tokenizer_info").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # probes need no key
        assert httpx.get(url + "/metrics").status_code == 200
        # bench-serve's load generator sends the key (`--api-key`), and counts a refusal as an error
        from specdraft.bench.serve_bench import _run_level

        keyed, _ = _run_level(url, NAME, ["abc"], 1, 3, "s3cret")
        refused, _ = _run_level(url, NAME, ["abc"], 1, 3, "nope")
        assert keyed[0]["tokens"] == 3 and refused[0]["error"].startswith("HTTP 401")
    # and without a key, any or no Authorization header is fine (the shared server has none)


def test_health_is_503_until_the_model_is_loaded(target, tokenizer):
    loaded = threading.Event()

    def load() -> ServedModel:
        loaded.wait(20)
        return ServedModel(make_engine(target, tokenizer, max_batch=1), tokenizer, NAME)

    with serve_in_thread(create_app_lazy(load, NAME)) as url:
        assert httpx.get(url + "/health").status_code == 503
        early = httpx.post(url + CHAT, json={"messages": MSG})
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        loaded.set()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert chat_text(url, "abc", 4).status_code == 200


def test_metrics_use_vllm_names_with_a_specdraft_prefix(server):
    url, engine = server
    assert chat_text(url, "abcabcabcabc", 30).status_code == 200
    for name in ["specdraft:spec_decode_num_drafts_total", "specdraft:spec_decode_num_draft_tokens_total",
                 "specdraft:spec_decode_num_accepted_tokens_total", "specdraft:num_requests_running",
                 "specdraft:num_requests_waiting", "specdraft:kv_cache_usage_perc",
                 "specdraft:prompt_tokens_total", "specdraft:generation_tokens_total",
                 "specdraft:time_to_first_token_seconds_count", "specdraft:inter_token_latency_seconds_count",
                 "specdraft:e2e_request_latency_seconds_count"]:
        metric(url, name)
    assert metric(url, "specdraft:spec_decode_num_drafts_total") > 0
    queries = metric(url, "specdraft:prefix_cache_queries_total")
    assert chat_text(url, "abcabcabcabc", 30).status_code == 200  # the same prompt: all but its last token cached
    assert metric(url, "specdraft:prefix_cache_queries_total") == queries + 13
    reused = engine.target.reuses_cache_entries(engine.cache, 13)  # the fused kernels (a compiler) are here
    assert metric(url, "specdraft:prefix_cache_hits_total") >= (12 if reused else 0)
    accepted = metric(url, "specdraft:spec_decode_num_accepted_tokens_total")
    assert metric(url, "specdraft:spec_decode_num_accepted_tokens_per_pos_total") == accepted > 0
    assert 'position="0"' in httpx.get(url + "/metrics").text


# ---------------------------------------------------------------------------------------- disconnects, shutdown


def test_a_client_that_disconnects_mid_stream_frees_its_slot_at_once(target, tokenizer):
    engine = make_engine(target, tokenizer, max_batch=2)
    with serve_in_thread(create_app(SlowEngine(engine, 0.02), tokenizer, NAME)) as url:
        body = {"model": NAME, "messages": MSG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as response:
            lines = response.iter_lines()
            while not first_delta_text(next(lines)):  # a generated token, not just the role chunk
                pass
            assert metric(url, "specdraft:num_requests_running") == 1
            assert metric(url, "specdraft:kv_cache_usage_perc") == 0.5
        started = time.monotonic()  # the connection is closed here, 200 tokens (>= 4 s) from the end
        while metric(url, "specdraft:num_requests_running") != 0:
            assert time.monotonic() - started < 2, "the slot was not released"
            time.sleep(0.02)
        assert metric(url, "specdraft:request_aborted_total") == 1
        assert metric(url, "specdraft:kv_cache_usage_perc") == 0
        assert engine.free_slots == 2
        assert chat_text(url, "abc", 3).status_code == 200


def test_a_non_streaming_client_that_gives_up_frees_its_slot(target, tokenizer):
    """Without a stream there is nothing to write to: the handler notices the disconnect by polling."""
    engine = make_engine(target, tokenizer, max_batch=1)
    with serve_in_thread(create_app(SlowEngine(engine, 0.02), tokenizer, NAME)) as url:
        with pytest.raises(httpx.ReadTimeout):
            chat_text(url, "abc", 200, timeout=0.5)
        started = time.monotonic()
        while metric(url, "specdraft:num_requests_running") != 0:
            assert time.monotonic() - started < 2, "the slot was not released"
            time.sleep(0.02)
        assert engine.free_slots == 1 and metric(url, "specdraft:request_aborted_total") == 1


def test_only_streaming_tickets_get_an_event_per_round(target, tokenizer):
    """A non-streaming request hears from the engine thread twice (accepted, result): every event wakes the
    event loop, which then competes with the engine thread for the GIL. A stream gets a chunk per round."""
    import asyncio

    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.worker import EngineWorker, Ticket

    engine = make_engine(target, tokenizer, max_batch=2, drafter=False)
    worker = EngineWorker(engine, tokenizer, ServerMetrics(NAME))

    async def events(stream: bool) -> list:
        ticket = Ticket(prompt="abc", chat=False, params=SamplingParams(temperature=0, max_tokens=12),
                        loop=asyncio.get_running_loop(), stream=stream)
        worker.submit(ticket)
        received = [await ticket.events.get()]
        while not received[-1].final:
            received.append(await ticket.events.get())
        return received

    worker.start()
    try:
        quiet, streamed = asyncio.run(events(False)), asyncio.run(events(True))
    finally:
        worker.stop()
    assert [e.kind for e in quiet] == ["accepted", "chunk"] and quiet[-1].result is not None
    assert len(streamed) == 1 + 12  # accepted, then one chunk per token of plain decoding
    assert "".join(e.text for e in streamed) == quiet[-1].result.text == streamed[-1].result.text


def test_a_stream_interval_groups_a_streams_tokens_and_keeps_its_text(target, tokenizer):
    """`stream_interval=3`: the first text at once, then chunks of at least 3 tokens, the rest with the result;
    the same text as every round's chunk (interval 1). A bad interval is refused."""
    import asyncio

    from specdraft.server.metrics import ServerMetrics
    from specdraft.server.worker import EngineWorker, Ticket

    def chunks(interval: int, params: SamplingParams) -> list:
        engine = make_engine(target, tokenizer, max_batch=2, drafter=True)
        worker = EngineWorker(engine, tokenizer, ServerMetrics(NAME), stream_interval=interval)

        async def events() -> list:
            ticket = Ticket(prompt="abcabcabc", chat=False, params=params, loop=asyncio.get_running_loop())
            worker.submit(ticket)
            received = [await ticket.events.get()]
            while not received[-1].final:
                received.append(await ticket.events.get())
            return received[1:]

        worker.start()
        try:
            return asyncio.run(events())
        finally:
            worker.stop()

    for params in (SamplingParams(temperature=0, max_tokens=23, logprobs=2),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=23)):
        every, grouped = chunks(1, params), chunks(3, params)
        assert "".join(e.text for e in grouped) == "".join(e.text for e in every) == grouped[-1].result.text
        for events in (every, grouped):  # logprobs go with their tokens, held back with them
            assert [p for e in events for p in e.logprobs or ()] == (events[-1].result.logprobs or [])
            assert all(e.logprobs is None or len(e.logprobs) == len(e.token_ids) for e in events)
        assert sum(len(e.token_ids) for e in grouped) == 23 == sum(len(e.token_ids) for e in every)
        assert len(grouped[0].token_ids) == len(every[0].token_ids)  # the first text is not held back
        assert all(len(e.token_ids) >= 3 for e in grouped[1:-1]) and grouped[-1].result is not None
        assert len(grouped) <= 2 + (23 - len(grouped[0].token_ids)) // 3 < len(every)
    with pytest.raises(ValueError, match="stream_interval"):
        EngineWorker(make_engine(target, tokenizer, max_batch=1, drafter=False), tokenizer, ServerMetrics(NAME),
                     stream_interval=0)


def test_a_server_with_a_stream_interval_streams_the_same_text(target, tokenizer):
    """Through HTTP and the openai client: fewer events, the same text as the answer not streamed."""
    engine = make_engine(target, tokenizer, max_batch=2)
    with serve_in_thread(create_app(engine, tokenizer, NAME, stream_interval=4)) as url:
        oa = client(url)
        done = oa.completions.create(model=NAME, prompt="hello", max_tokens=17, temperature=0)
        pieces = [c.choices[0].text for c in oa.completions.create(
            model=NAME, prompt="hello", max_tokens=17, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == done.choices[0].text and len(done.choices[0].text) == 17
    assert len([p for p in pieces if p]) <= 1 + 4  # the first token, then 16 in fours


@pytest.mark.parametrize("stack", [("h11", "asyncio"), ("httptools", "uvloop")],
                         ids=["h11-asyncio", "httptools-uvloop"])
def test_each_http_stack_streams_the_same_text_and_answers_bad_requests_alike(target, tokenizer, stack):
    """`specdraft serve --http/--loop`: uvicorn's pure-Python protocol and loop, and the C ones `auto` picks
    where installed, give the same streamed text and the same 4xx answers (a bad body, bad JSON)."""
    http, loop = stack
    for module in stack:
        if module != "asyncio":
            pytest.importorskip(module)
    engine = make_engine(target, tokenizer, max_batch=2)
    with serve_in_thread(create_app(engine, tokenizer, NAME), http=http, loop=loop) as url:
        text, finish = stream_chat(url, "abcabc", 12)
        bad_json = httpx.post(url + "/v1/chat/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        bad_value = chat_text(url, "abc", 4, temperature=-1)
    assert_greedy(text, reference(target, tokenizer, tokenizer.encode("abcabc|"), 12))
    assert finish == "length"
    for response in (bad_json, bad_value):
        assert response.status_code == 400 and response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "temperature"


def test_serve_passes_uvicorns_http_and_loop_choices(monkeypatch):
    from specdraft.server import app as server_app

    configs = []
    monkeypatch.setattr(server_app.uvicorn, "Config", lambda app, **config: configs.append(config))
    monkeypatch.setattr(server_app.uvicorn.Server, "__init__", lambda self, config: None)
    server_app.make_server(create_app_lazy(lambda: None, NAME), http="h11", loop="asyncio")
    assert configs[-1]["http"] == "h11" and configs[-1]["loop"] == "asyncio"
    with pytest.raises(SystemExit):
        main(["serve", "--http", "gopher"])


def test_a_streamed_text_event_is_the_chunk_serialized_in_full():
    """`Reply.text_event` fills a serialized template: the same characters as serializing the whole chunk,
    for chat and text completions, with and without the usage field, whatever the text holds."""
    import json

    from specdraft.server.app import Reply, _sse_line

    # a round's text (never empty)
    texts = [" hello", 'a "quoted" \\ back', "two\nlines\r", "caf\u00e9 \u2028 \U0001f600", "\0", "}]{"]
    for chat in (True, False):
        reply = Reply(NAME, chat, [0] * 7, str)
        for with_usage in (True, False):
            for text in texts:
                event = reply.text_event(text, with_usage)
                assert event == _sse_line(reply.chunk(text, with_usage=with_usage))
                assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
                body = json.loads(event[6:])
                assert (body["choices"][0]["delta"].get("content", "") if chat else body["choices"][0]["text"]) == text
                assert ("usage" in body) == with_usage


def test_shutdown_ends_requests_in_flight_at_once(target, tokenizer):
    """Stopping the server ends a long stream with an error event and [DONE] (not a cut connection after the
    grace period) and a waiting non-streaming request with a 503; every slot is free afterwards."""
    engine = make_engine(target, tokenizer, max_batch=1)
    events: list[str] = []
    waiting: dict[str, httpx.Response] = {}

    def long_stream(url: str) -> None:
        body = {"model": NAME, "messages": MSG, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + CHAT, json=body, timeout=30) as response:
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    def queued(url: str) -> None:
        waiting["response"] = chat_text(url, "abc", 50)

    with serve_in_thread(create_app(SlowEngine(engine, 0.02), tokenizer, NAME)) as url:
        readers = [threading.Thread(target=long_stream, args=(url,)), threading.Thread(target=queued, args=(url,))]
        readers[0].start()
        deadline = time.monotonic() + 10
        while metric(url, "specdraft:num_requests_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        readers[1].start()
        while metric(url, "specdraft:num_requests_waiting") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 1.5  # the grace period (2 s) was not needed
    for reader in readers:
        reader.join(10)
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert waiting["response"].status_code == 503
    assert engine.free_slots == 1


def test_serve_command_exits_with_a_message_when_the_model_cannot_load(capsys):
    assert main(["serve", "--model", "/no/such/model", "--port", "0", "--log-level", "error"]) == 2
    assert "could not load the model" in capsys.readouterr().err


def test_bench_serve_client_measures_a_live_server(server, monkeypatch):
    """`bench-serve`'s load generator and statistics, against the tiny server (no model load)."""
    import socket

    from specdraft.bench import http_client
    from specdraft.bench.serve_bench import _health_status, _percentile, _run_level, summarize

    url, _ = server
    # How `bench-serve` waits for the servers it starts: 200 once up, None where nothing listens.
    assert _health_status(url) == 200
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert _health_status(closed) is None
    results, wall = _run_level(url, NAME, ["abc", "hello", "xyz"], 2, 6, None)
    row = summarize("ngram", 2, results, wall)
    assert row["errors"] == 0 and row["output_tokens"] == 18 and row["throughput_tok_s"] > 0
    assert row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["tpot_ms_p50"] is not None
    # the load generator's own CPU, per request and per output token of the level
    assert all(0 < r["client_cpu_s"] < r["e2e_s"] + 0.05 for r in results)
    assert row["client_cpu_us_per_token"] == pytest.approx(1e6 * sum(r["client_cpu_s"] for r in results) / 18)
    assert _percentile([1, 2, 3, 4], 50) == 2.5 and _percentile([], 99) is None
    # Events split over reads (7 bytes at a time) are put back together: the same tokens and events.
    monkeypatch.setattr(http_client, "READ_SIZE", 7)
    split, _ = _run_level(url, NAME, ["abc", "hello", "xyz"], 2, 6, None)
    assert [r["tokens"] for r in split] == [r["tokens"] for r in results] == [6, 6, 6]
    assert [len(r["itl_s"]) for r in split] == [len(r["itl_s"]) for r in results]
    monkeypatch.undo()
    # Every run starts with no prompt cached (`/reset_prefix_cache`): a repeat times the prefill again.
    for _ in range(2):
        results, wall = _run_level(url, NAME, ["abcabcabcabc"], 1, 6, None)
        assert summarize("ngram", 1, results, wall)["prompt_tokens_cached"] == 0
    # Not streamed (the server's cost against LLM.generate): the same tokens, no per-token timings.
    quiet, _ = _run_level(url, NAME, ["abc", "hello"], 1, 6, None, stream=False)
    assert [r["tokens"] for r in quiet] == [6, 6] and all(r["ttft_s"] is None for r in quiet)
    # A server that answers with an error is counted, not crashed on; the connection goes on serving.
    failed, _ = _run_level(url, "no-such-model", ["abc"], 1, 6, None)
    assert failed[0]["error"].startswith("HTTP 404")
    mixed, _ = _run_level(url, NAME, ["abc", "abc"], 1, 4, None, stream=True)
    assert [r["tokens"] for r in mixed] == [4, 4]
    # bench-serve runs its clients in a worker process, out of the server's GIL
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results, _ = pool.submit(_run_level, url, NAME, ["abc"], 1, 4, None).result()
    assert [r["tokens"] for r in results] == [4]


def test_bench_serve_rows_are_the_median_of_alternated_repeats():
    from specdraft.bench.serve_bench import median_run

    runs = [{"mode": "plain", "throughput_tok_s": v} for v in (300.0, 100.0, 200.0)]
    assert median_run(runs) == {"mode": "plain", "throughput_tok_s": 200.0, "throughput_runs": [300.0, 100.0, 200.0]}
    assert median_run(runs[:2])["throughput_tok_s"] == 100.0  # the slower middle run of an even count
    assert median_run(runs[:1]) == runs[0]


def test_bench_serve_passes_alternate_which_mode_runs_first():
    from specdraft.bench.serve_bench import pass_order

    modes = [("plain", "url1"), ("ngram", "url2")]
    assert [pass_order(modes, r)[0][0] for r in range(4)] == ["plain", "ngram", "plain", "ngram"]
    assert sorted(pass_order(modes, 1)) == sorted(modes) and pass_order(modes[:1], 1) == modes[:1]


def test_bench_serve_scaling_is_the_median_of_each_passes_ratio():
    from specdraft.bench.serve_bench import _scaling

    tput = {(1, "plain"): [100.0, 200.0, 150.0], (8, "plain"): [300.0, 560.0, 480.0],
            (1, "ngram"): [100.0, 100.0, 100.0], (8, "ngram"): [250.0, 350.0, 300.0]}
    runs = {key: [{"throughput_tok_s": v} for v in values] for key, values in tput.items()}
    # ratios per pass 3.0 / 2.8 / 3.2 (not 480 / 150 = 3.2 from the medians' ratio)
    assert _scaling(runs, [1, 8], ["plain", "ngram"]) == {"plain": {8: 3.0}, "ngram": {8: 3.0}}
    assert _scaling(runs, [8], ["plain"]) == {}


def test_bench_serve_speculation_and_server_cost_are_medians_of_paired_ratios():
    from specdraft.bench.serve_bench import _median_ratio, _speculative_over_plain

    tput = {(8, "plain"): [600.0, 520.0, 640.0, 500.0], (8, "ngram"): [594.0, 530.0, 512.0, 505.0]}
    runs = {key: [{"throughput_tok_s": v} for v in values] for key, values in tput.items()}
    # passes 0.99 / 1.019 / 0.8 / 1.01 -> 1.0 (the medians' ratio, 521 / 560 = 0.93, blames the drafter for
    # the VM's slow pass)
    assert _speculative_over_plain(runs, [8], ["plain", "ngram"]) == {"ngram": {8: pytest.approx(1.0)}}
    assert _speculative_over_plain(runs, [8], ["ngram"]) == {}
    assert _median_ratio([11.0, 30.0, 9.9], [10.0, 20.0, 9.0]) == pytest.approx(1.1)
    assert _median_ratio([None, 5.0], [1.0, 0.0]) is None  # no pair to compare
    with pytest.raises(ValueError):
        _median_ratio([1.0], [1.0, 2.0])  # unpaired runs are a bug, not a figure


def test_bench_serve_plot_shows_the_levels_and_the_paired_ratios(tmp_path):
    from PIL import Image

    from specdraft.bench.serve_bench import _plot

    rows = [{"mode": mode, "concurrency": c, "throughput_tok_s": 100.0 * c, "ttft_ms_p50": 5.0 * c,
             "tpot_ms_p50": 4.0 + c} for c in (1, 2, 8) for mode in ("plain", "ngram")]
    _plot(rows, {"ngram": {1: 1.25, 2: 1.1, 8: None}}, tmp_path / "serve.png")  # a level with no ratio: skipped
    with Image.open(tmp_path / "serve.png") as image:
        assert image.size[0] > 3 * image.size[1]  # four panels side by side


def test_bench_serve_server_cost_pairs_each_request_with_the_engine_alone(server, target, tokenizer, monkeypatch):
    """The concurrency-1 reference of `bench-serve`: each request on an engine called directly and through the
    server, streamed and not, one after another in rotating order; the cost is the median of the ratios."""
    import argparse

    from specdraft.bench import serve_bench

    url, _ = server
    engine = make_engine(target, tokenizer, max_batch=1, drafter=False)
    seconds, tokens = serve_bench._direct_request(engine, tokenizer, "abc", 6)
    assert seconds > 0 and tokens == 6
    # one request at a time on the client process's kept connection (two in a row reuse it)
    for _ in range(2):
        seconds, tokens = serve_bench._timed_request(url, NAME, "abcabc", 5, None, True)
        assert seconds > 0 and tokens == 5
    assert serve_bench._timed_request(url, NAME, "abc", 3, None, False)[1] == 3
    with pytest.raises(SpecdraftError, match="404"):
        serve_bench._timed_request(url, "no-such-model", "abc", 3, None, True)

    order = []

    def direct(prompt, max_tokens):
        order.append("direct")
        return serve_bench._direct_request(engine, tokenizer, prompt, max_tokens)

    timed = serve_bench._timed_request
    monkeypatch.setattr(serve_bench, "_timed_request",
                        lambda *a: order.append("stream" if a[-1] else "non_streaming") or timed(*a))
    monkeypatch.setattr(serve_bench, "OVERHEAD_REPEATS", 2)
    rows = []
    args = argparse.Namespace(model=NAME, max_tokens=4, api_key=None)
    with ThreadPoolExecutor(1) as clients:
        overhead = serve_bench._server_overhead(clients, url, direct, ["abc", "hello", "xyz"], args, rows)
    assert set(overhead) == {"stream", "non_streaming"} and all(v > -1 for v in overhead.values())
    assert rows[0]["mode"] == "direct" and rows[0]["output_tokens"] == 12 and rows[0]["throughput_tok_s"] > 0
    assert all(len(v) == 6 for v in rows[0]["request_s"].values())  # 2 passes x 3 requests, each way
    firsts = order[::3]  # the way asked first for each request rotates, so none always runs first
    assert len(order) == 18 and firsts == ["direct", "stream", "non_streaming"] * 2


# ---------------------------------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_bundled_smollm2_chat_template_through_the_openai_client():
    """The real chat template and tokenizer, ngram drafting, two slots: the server answers what `LLM.chat`
    answers, streamed or not."""
    from specdraft import LLM

    llm = LLM(model="smollm2-135m", speculative_model="ngram", num_speculative_tokens=3, max_batch=2,
              progress=False)
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    text = "The capital of France is Paris, and the capital of Italy is"
    scored = llm.generate(text, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    with serve_in_thread(create_app(llm.engine, llm.tokenizer, "smollm2-135m")) as url:
        oa = client(url)
        reply = oa.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
        # lm-evaluation-harness's loglikelihood request, on the real tokenizer: the text's tokens' logprobs
        echoed = oa.completions.create(model="smollm2-135m", prompt=[scored.prompt_token_ids], echo=True,
                                       logprobs=1, max_tokens=1, temperature=0).choices[0]
    assert reply.choices[0].message.content == expected.text == streamed
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert echoed.text == text + scored.text
    generated = scored.outputs[0]
    want = [None] + [p[t].logprob for t, p in zip(scored.prompt_token_ids[1:], scored.prompt_logprobs[1:])]
    assert echoed.logprobs.token_logprobs == want + [generated.logprobs[0][generated.token_ids[0]].logprob]
    paris = echoed.logprobs.tokens.index(" Paris")  # the model's first choice after "The capital of France is"
    assert echoed.logprobs.token_logprobs[paris] == max(echoed.logprobs.top_logprobs[paris].values()) > -1
