"""What a benchmark ran on: CPU, cores, threads, library versions, date, command line."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from importlib import metadata


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; None when not available."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "physical_cores": physical_cores(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def versions() -> dict:
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "specdraft": _version("specdraft"),
    }
    llama = _version("llama_cpp_python") or _version("llama-cpp-python")
    if llama:
        out["llama_cpp_python"] = llama
    return out


def command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py", "/specdraft")):
        argv[0] = "specdraft"
    return shlex.join(argv)


def header(argv: list[str] | None = None) -> dict:
    return {
        "machine": machine_info(),
        "versions": versions(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(argv),
    }


def header_lines(h: dict) -> list[str]:
    m, v = h["machine"], h["versions"]
    cores = f"{m['logical_cores']} logical"
    if m.get("physical_cores"):
        cores += f" / {m['physical_cores']} physical"
    if m.get("usable_cores") and m["usable_cores"] != m["logical_cores"]:
        cores += f", {m['usable_cores']} usable"
    lines = [
        f"machine: {m['cpu']} ({cores} cores), torch threads {m['torch_threads']}"
        + (f", GPU {m['cuda']}" if m.get("cuda") else ""),
        "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
    ]
    for key in ("model", "dtype"):
        if key in h:
            lines.append(f"{key}: {h[key]}")
    lines += [f"date: {h['date']}", f"command: {h['command']}"]
    return lines
