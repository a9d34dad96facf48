"""Other engines on the same weights, run as extra methods in `specdraft bench`.

- `hf`: transformers `generate` on the converted checkpoint (`resolve(model)`), bf16 and fp32, plain and with
  prompt-lookup decoding (`prompt_lookup_num_tokens=10`): methods `hf-bf16`, `hf-bf16-pld`, `hf-fp32`,
  `hf-fp32-pld`. `hf-bf16` / `hf-fp32` alone select one dtype.
- `llamacpp`: llama-cpp-python on the GGUF file itself (its own quantized weights), plain and with its
  prompt-lookup draft (`LlamaPromptLookupDecoding`): methods `llamacpp`, `llamacpp-pld`. It runs in a worker
  process (`llamacpp_worker.py`, JSON lines over pipes), so that a crash in llama.cpp's native code only
  costs the benchmark that peer (`PeerFailed`, reported with the exit code or signal).

A peer that cannot run (library not installed, no GGUF for the model) is skipped with a printed reason; the
benchmark goes on without it.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import queue
import signal as signal_module
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.sampling import SamplingParams

PLD_TOKENS = 10
PEER_NAMES = ("hf", "hf-bf16", "hf-fp32", "llamacpp")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first generated token arrives (the first `put`
    is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFMethod:
    kind = "peer"

    def __init__(self, name: str, model, tokenizer: Tokenizer, pld_tokens: int | None, baseline: str) -> None:
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.pld_tokens = pld_tokens
        self.baseline = baseline
        self.eos = sorted(tokenizer.eos_token_ids)

    def run(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        ids = torch.tensor([list(prompt_ids)])
        kwargs: dict = dict(max_new_tokens=params.max_tokens, attention_mask=torch.ones_like(ids))
        if self.eos and not params.ignore_eos:
            kwargs.update(eos_token_id=self.eos, pad_token_id=self.eos[0])
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None,
                          min_p=params.min_p if params.min_p > 0 else None)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if self.pld_tokens:
            kwargs["prompt_lookup_num_tokens"] = self.pld_tokens
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, streamer=timer, **kwargs)
        wall = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        return {
            "token_ids": tokens, "text": self.tokenizer.decode(tokens), "tokens": len(tokens), "time_s": wall,
            "ttft_s": timer.first_token_at - t0 if timer.first_token_at is not None else None,
            "finish_reason": "stop" if tokens and tokens[-1] in self.eos else "length",
        }


class PeerFailed(Exception):
    """A peer that broke while the benchmark ran (its worker process died, hung or reported an error): the
    benchmark drops it and goes on with the other methods."""

    def __init__(self, peer: str, reason: str, signal: int | None = None, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.peer = peer
        self.reason = reason
        self.signal = signal  # the signal that killed the worker, if one did
        self.unavailable = unavailable  # the library is missing: a reason to skip, not a crash


def describe_exit(returncode: int | None) -> str:
    """'exited with code 3' / 'was killed by signal 11 (SIGSEGV)'."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal_module.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def worker_command() -> list[str]:
    """How to start the llama.cpp worker: this Python on the worker file (not `-m`, which would import
    specdraft and torch into it)."""
    return [sys.executable, "-u", str(Path(__file__).with_name("llamacpp_worker.py"))]


class LlamaCppWorker:
    """The parent's handle on a `llamacpp_worker` process: JSON-lines requests with a timeout. Any failure
    (the process dies, hangs, or answers an error) raises `PeerFailed`, stops the process, and makes every
    later request raise the same error."""

    STDERR_LINES = 40

    def __init__(self, config: dict, command: Sequence[str] | None = None, peer: str = "llamacpp",
                 load_timeout: float = 600.0, run_timeout: float = 1800.0) -> None:
        self.peer = peer
        self.run_timeout = run_timeout
        self.failure: PeerFailed | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=self.STDERR_LINES)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(list(command or worker_command()), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     encoding="utf-8", bufsize=1)
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self._keep_stderr), daemon=True)]
        for t in self._threads:
            t.start()
        reply = self.request({"cmd": "load", "config": config}, load_timeout, "loading the model")
        self.methods: list[str] = reply.get("methods", [])
        self.info: dict = reply.get("info", {})

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line)
        stream.close()
        put(None)

    def _keep_stderr(self, line: str | None) -> None:
        if line is not None and line.strip():
            self.stderr_tail.append(line.rstrip("\n"))

    @property
    def alive(self) -> bool:
        return self.failure is None and self.proc.poll() is None

    def request(self, msg: dict, timeout: float | None = None, doing: str = "generating") -> dict:
        if self.failure is not None:
            raise self.failure
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._fail_dead(doing)
        try:
            line = self._lines.get(timeout=self.run_timeout if timeout is None else timeout)
        except queue.Empty:
            self._stop()
            self._fail(f"llama.cpp worker (pid {self.proc.pid}) gave no answer within "
                       f"{self.run_timeout if timeout is None else timeout:.0f} s while {doing}; stopped it")
        if line is None:
            self._fail_dead(doing)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self._stop()
            self._fail(f"llama.cpp worker sent a line that is not JSON while {doing}: {line[:200]!r}")
        if not reply.get("ok"):
            self._stop()
            if reply.get("kind") == "import":
                self._fail(f"llama-cpp-python is not importable in the worker (pip install llama-cpp-python): "
                           f"{reply.get('error')}", unavailable=True)
            self._fail(f"llama.cpp worker failed while {doing}: {reply.get('error')}")
        return reply

    def _fail_dead(self, doing: str) -> NoReturn:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._stop()
            rc = self.proc.returncode
        self._fail(f"llama.cpp worker (pid {self.proc.pid}) {describe_exit(rc)} while {doing}",
                   signal=-rc if rc is not None and rc < 0 else None)

    def _fail(self, reason: str, signal: int | None = None, unavailable: bool = False) -> NoReturn:
        self._threads[1].join(timeout=2)  # the rest of its stderr
        if self.stderr_tail and not unavailable:
            _stderr(f"{self.peer} worker's last stderr lines:\n" +
                    "\n".join(f"    {line}" for line in list(self.stderr_tail)[-12:]))
        self._close_stdin()
        self.failure = PeerFailed(self.peer, reason, signal, unavailable)
        raise self.failure

    def _close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Ask the worker to exit (kill it if it does not within 10 s)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._stop()
        self._close_stdin()
        if self.failure is None:
            self.failure = PeerFailed(self.peer, "llama.cpp worker was closed")


class LlamaCppMethod:
    """One llama.cpp method, run by the peer's worker process. `run` returns what the runner expects; the
    times come from the worker (generation only, IPC excluded). Raises `PeerFailed` when the worker
    breaks."""

    kind = "peer"

    def __init__(self, name: str, worker: LlamaCppWorker, tokenizer: Tokenizer, baseline: str) -> None:
        self.name = name
        self.peer = worker.peer
        self.worker = worker
        self.tokenizer = tokenizer
        self.baseline = baseline
        self.eos = sorted(tokenizer.eos_token_ids)

    def run(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        reply = self.worker.request({
            "cmd": "run", "method": self.name, "prompt_ids": [int(t) for t in prompt_ids], "eos": self.eos,
            "params": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                       "min_p": params.min_p, "seed": params.seed, "max_tokens": params.max_tokens,
                       "ignore_eos": params.ignore_eos}}, doing=f"generating ({self.name})")
        tokens = [int(t) for t in reply["token_ids"]]
        return {"token_ids": tokens, "text": self.tokenizer.decode(tokens), "tokens": len(tokens),
                "time_s": float(reply["time_s"]), "ttft_s": reply.get("ttft_s"),
                "finish_reason": reply.get("finish_reason", "length")}

    def close(self) -> None:
        self.worker.close()


def parse_peers(spec: str | None) -> list[str]:
    """`hf,llamacpp` -> ['hf-bf16', 'hf-fp32', 'llamacpp']; unknown names are an error."""
    from specdraft.errors import SpecdraftError

    out: list[str] = []
    for name in (s.strip() for s in (spec or "").split(",")):
        if not name:
            continue
        if name not in PEER_NAMES:
            raise SpecdraftError(f"unknown peer {name!r}; choose from {', '.join(PEER_NAMES)}")
        for expanded in (["hf-bf16", "hf-fp32"] if name == "hf" else [name]):
            if expanded not in out:
                out.append(expanded)
    return out


def load_hf(model_ref: str, dtype_name: str, tokenizer: Tokenizer) -> list[HFMethod]:
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not importable ({exc})") from exc
    from specdraft.runtime.loader import resolve

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(resolve(model_ref, progress=False), dtype=dtype).eval()
    except Exception as exc:  # transformers raises many kinds for architectures it cannot load
        raise PeerUnavailable(f"transformers could not load {model_ref}: {type(exc).__name__}: {exc}") \
            from exc
    finally:
        hf_logging.enable_progress_bar()
    # The converted checkpoint may carry sampling defaults (top_k=50...): the bench passes every setting.
    model.generation_config.top_k = None
    model.generation_config.top_p = None
    model.generation_config.temperature = None
    base = f"hf-{dtype_name}"
    return [HFMethod(base, model, tokenizer, None, base),
            HFMethod(f"{base}-pld", model, tokenizer, PLD_TOKENS, base)]


def gguf_path(model_ref: str) -> Path:
    from specdraft.runtime.loader import CATALOG

    if model_ref in CATALOG:
        return CATALOG[model_ref].locate()
    path = Path(model_ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise PeerUnavailable(f"{model_ref} is not a GGUF model (llama.cpp needs a catalog model or a .gguf "
                          "file)")


EXTRA_BUFTS_NOTE = (
    "llama.cpp {crash} in its first batched forward with its default CPU extra buffer types (weight "
    "repacking, AMX kernels: a llama.cpp bug on CPUs with AMX); measured with use_extra_bufts=False, i.e. "
    "its generic CPU kernels")


def load_llamacpp(model_ref: str, tokenizer: Tokenizer, max_len: int, command: Sequence[str] | None = None,
                  log: Callable[[str], None] = _stderr, notes: list[dict] | None = None) -> list[LlamaCppMethod]:
    """Start the llama.cpp worker on the model's GGUF file. Loading includes a probe forward; if the worker
    dies there with llama.cpp's defaults, it is started once more without its extra buffer types (the AMX
    crash, see `llamacpp_worker`) and a note saying so is appended to `notes`."""
    if command is None and importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)")
    path = gguf_path(model_ref)
    config = dict(model_path=str(path), n_ctx=max_len, n_threads=torch.get_num_threads(),
                  pld_tokens=PLD_TOKENS, extra_bufts=None)
    try:
        worker = LlamaCppWorker(config, command)
    except PeerFailed as exc:
        if exc.unavailable:
            raise PeerUnavailable(exc.reason) from exc
        if exc.signal is None:
            raise PeerUnavailable(f"llama.cpp could not load {path}: {exc.reason}") from exc
        log(f"peer llamacpp: {exc.reason}; starting it again with use_extra_bufts=False")
        try:
            worker = LlamaCppWorker(dict(config, extra_bufts=False), command)
        except PeerFailed as exc2:
            raise PeerUnavailable(f"{exc.reason}, and again with use_extra_bufts=False: {exc2.reason}") \
                from exc2
        note = EXTRA_BUFTS_NOTE.format(crash=describe_exit(-exc.signal))
        log(f"peer llamacpp: {note}")
        if notes is not None:
            notes.append({"peer": "llamacpp", "note": note})
    return [LlamaCppMethod("llamacpp", worker, tokenizer, "llamacpp"),
            LlamaCppMethod("llamacpp-pld", worker, tokenizer, "llamacpp")]


class PeerUnavailable(Exception):
    """A peer that cannot run here; the benchmark skips it."""


def load_peers(names: Sequence[str], model_ref: str, tokenizer: Tokenizer, max_len: int,
               log: Callable[[str], None] = _stderr, notes: list[dict] | None = None) -> tuple[list, list[dict]]:
    """Build the peers' methods. Returns (methods, skipped) where skipped is [{"peer", "reason"}]; notes on
    how a peer runs ([{"peer", "note"}]) are appended to `notes`."""
    methods: list = []
    skipped: list[dict] = []
    for name in names:
        try:
            if name.startswith("hf-"):
                methods += load_hf(model_ref, name.removeprefix("hf-"), tokenizer)
            elif name == "llamacpp":
                methods += load_llamacpp(model_ref, tokenizer, max_len, log=log, notes=notes)
            else:
                raise PeerUnavailable(f"unknown peer {name!r}")
        except PeerUnavailable as exc:
            skipped.append({"peer": name, "reason": str(exc)})
            log(f"peer {name} skipped: {exc}")
    return methods, skipped
