"""Tables and plots from a `specdraft bench` results dict: report.md, speedup.png, acceptance.png and
results.json."""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.bench.machine import header_lines
from specdraft.bench.suite import OVERALL

MAX_DIVERGENCES_PER_METHOD = 25


def _f(value, fmt: str, blank: str = "") -> str:
    return blank if value is None else format(value, fmt)


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1000:.0f}"


def _pct(value) -> str:
    return "" if value is None else f"{value:.1%}"


def _identical(agg: dict, greedy: bool) -> str:
    if not greedy:
        return "n/a"
    if agg.get("compared") is None:  # a method on other weights (`@gguf`): only against its own plain
        if agg.get("compared_to_baseline") is not None:
            return f"own plain {agg['identical_to_baseline']}/{agg['compared_to_baseline']}"
        return ""
    text = f"{agg['identical']}/{agg['compared']}"
    if agg.get("compared_to_baseline") is not None:
        text += f" (own plain {agg['identical_to_baseline']}/{agg['compared_to_baseline']})"
    return text


def _table(head: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    align = align or ["l"] + ["r"] * (len(head) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    return ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def _method_names(results: dict) -> list[str]:
    return [m["name"] for m in results["methods"]]


def _cross_table(results: dict, key: str, fmt) -> list[str]:
    """methods x (groups + overall) table of one summary number."""
    cols = [*results["groups"], OVERALL]
    rows = []
    for name in _method_names(results):
        cells = [fmt(results["summary"].get(g, {}).get(name, {}).get(key)) for g in cols]
        rows.append([name, *cells])
    return _table(["method", *cols], rows)


def peer_lines(results: dict, prefix: str = "") -> list[str]:
    """Peers that were skipped, that failed while running, and notes on how peers ran."""
    lines = [f"{prefix}peer {s['peer']} skipped: {s['reason']}" for s in results.get("skipped_peers", [])]
    lines += [f"{prefix}peer {f['peer']} failed during {f['stage']} (no figures for {', '.join(f['methods'])}): "
              f"{f['reason']}" for f in results.get("failed_peers", [])]
    lines += [f"{prefix}peer {n['peer']}: {n['note']}" for n in results.get("peer_notes", [])]
    return lines


def render_markdown(results: dict) -> str:
    h, cfg = results["header"], results["config"]
    greedy = results["greedy"]
    lines = [f"# specdraft bench: {h.get('model', '')}", ""]
    lines += [f"- {line}" for line in header_lines(h)]
    first = f", first {cfg['per_category']} prompts per group" if cfg.get("per_category") else ""
    lines.append(f"- suite: {cfg.get('suite')} ({len(results['samples'])} turns measured{first})")
    lines.append(f"- decoding: temperature {cfg.get('temperature')}, max {cfg.get('max_tokens')} new tokens, "
                 f"K={cfg.get('k')} ({'adaptive' if cfg.get('adaptive') else 'fixed'}), "
                 f"{cfg.get('repeats')} repeat(s) (medians), chat template: {cfg.get('chat_template')}")
    lines += peer_lines(results, "- ")
    lines.append("")
    lines.append("Throughput is generated tokens / wall time with prefill included; speedup is over `plain` "
                 "(our runtime, no drafter) in the same run. Accepted tokens per target forward count the "
                 "target's own correction/bonus token (plain = 1.00). Peers (transformers, llama.cpp) have "
                 "no acceptance numbers.")
    lines += ["", "## Speedup over plain", ""]
    lines += _cross_table(results, "speedup", lambda v: _f(v, ".2f") + ("x" if v is not None else ""))
    lines += ["", "## Throughput (tokens/s)", ""]
    lines += _cross_table(results, "tokens_per_s", lambda v: _f(v, ".1f"))
    lines += ["", "## Mean accepted tokens per target forward", ""]
    lines += _cross_table(results, "mean_accepted_length", lambda v: _f(v, ".2f"))
    lines += ["", "## Acceptance rate", ""]
    lines += _cross_table(results, "acceptance_rate", _pct)

    overall = results["summary"].get(OVERALL, {})
    width = max((len(a.get("per_position_acceptance") or []) for a in overall.values()), default=0)
    if width:
        lines += ["", "## Acceptance by draft position (overall)", ""]
        rows = []
        for name in _method_names(results):
            pp = (overall.get(name) or {}).get("per_position_acceptance")
            if not pp:
                continue
            drafted = overall[name]["drafted_per_position"]
            rows.append([name] + [f"{pp[i]:.1%} ({drafted[i]})" if i < len(pp) else "" for i in range(width)])
        lines += ["Rate at position i = accepted / drafted at i (number drafted in brackets).", ""]
        lines += _table(["method", *[str(i + 1) for i in range(width)]], rows)

    lines += ["", "## Per group", ""]
    for group in [*results["groups"], OVERALL]:
        by_method = results["summary"].get(group, {})
        if not by_method:
            continue
        n = next(iter(by_method.values()))["samples"]
        lines += [f"### {group} ({n} turn{'' if n == 1 else 's'})", ""]
        rows = []
        for name in _method_names(results):
            a = by_method.get(name)
            if a is None:
                continue
            rows.append([name, _f(a["tokens_per_s"], ".1f"), _f(a["speedup"], ".2f"),
                         _f(a["mean_accepted_length"], ".2f"), _pct(a["acceptance_rate"]),
                         _ms(a["ttft_s"]), f"{a['tokens']:.0f}", _identical(a, greedy)])
        lines += _table(["method", "tok/s", "speedup", "acc. tokens/forward", "acc. rate", "TTFT ms",
                         "tokens", "identical to plain"], rows)
        lines.append("")

    lines += ["## Divergences from plain", ""]
    if not greedy:
        lines.append("n/a: sampling (temperature > 0) is lossless in distribution, not token for token.")
    elif not results["divergences"]:
        lines.append("None: every output is identical to its reference.")
    else:
        lines.append("First differing output token; the gap is the target's top-1 minus top-2 logit there "
                     "(a small gap is a near-tie, where numerics legitimately decide).")
        lines.append("")
        rows = []
        per_method: dict[str, int] = {}
        for d in results["divergences"]:
            per_method[d["method"]] = per_method.get(d["method"], 0) + 1
            if per_method[d["method"]] > MAX_DIVERGENCES_PER_METHOD:
                continue
            if d["prompt_differs"]:
                where, ref, mine, gap = "prompt differs (earlier turn diverged)", "", "", ""
            else:
                where = str(d["position"])
                ref = _token(d["reference_token"], d["reference_piece"])
                mine = _token(d["method_token"], d["method_piece"])
                gap = _f(d["logit_gap"], ".3f")
            rows.append([d["method"], d["reference"], str(d["question_id"]), d["category"], str(d["turn"]),
                         where, ref, mine, gap])
        lines += _table(["method", "vs", "question", "category", "turn", "position", "reference token",
                         "method token", "top-2 logit gap"], rows,
                        ["l", "l", "r", "l", "r", "r", "l", "l", "r"])
        cap = MAX_DIVERGENCES_PER_METHOD
        more = {m: c - cap for m, c in per_method.items() if c > cap}
        if more:
            lines.append("")
            hidden = ", ".join(f"{m} {c} more" for m, c in more.items())
            lines.append(f"Not shown (see results.json): {hidden}")
    return "\n".join(lines) + "\n"


def _token(token: int | None, piece: str | None) -> str:
    if token is None:
        return "(end)"
    text = json.dumps(piece)[1:-1] if piece is not None else ""
    return f"{token} `{text}`" if text else str(token)


def console_summary(results: dict) -> str:
    """The speedup table and the overall per-method table, for the terminal."""
    greedy = results["greedy"]
    lines = ["", "Speedup over plain:"]
    lines += _cross_table(results, "speedup", lambda v: _f(v, ".2f"))
    lines += ["", "Overall:"]
    rows = []
    for name in _method_names(results):
        a = results["summary"][OVERALL].get(name)
        if a is None:
            continue
        rows.append([name, _f(a["tokens_per_s"], ".1f"), _f(a["speedup"], ".2f"),
                     _f(a["mean_accepted_length"], ".2f"), _pct(a["acceptance_rate"]), _ms(a["ttft_s"]),
                     _identical(a, greedy)])
    lines += _table(["method", "tok/s", "speedup", "acc. tokens/forward", "acc. rate", "TTFT ms",
                     "identical"], rows)
    peers = peer_lines(results)
    if peers:
        lines += ["", *peers]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(results: dict, path: Path) -> Path:
    """Grouped bars: speedup over plain per category group (and overall), one bar per method."""
    plt = _pyplot()
    groups = [*results["groups"], OVERALL]
    names = [n for n in _method_names(results) if n != "plain"]
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 3 + len(groups) * (0.6 + 0.25 * len(names)))), 4.8))
    rotation = 90 if len(names) > 4 else 0
    width = 0.8 / max(1, len(names))
    top = 1.0
    for j, name in enumerate(names):
        values = [results["summary"].get(g, {}).get(name, {}).get("speedup") for g in groups]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
        bars = ax.bar(xs, [v or 0.0 for v in values], width, label=name)
        for bar, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 1), textcoords="offset points", rotation=rotation)
        top = max([top, *[v for v in values if v is not None]])
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="plain")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g.replace(" conversation", "\nconversation") for g in groups], fontsize=8)
    ax.set_ylabel("speedup over plain (x)")
    ax.set_ylim(0, top * (1.35 if len(names) > 2 else 1.15))  # room for the labels and the legend
    h = results["header"]
    cfg = results["config"]
    ax.set_title(f"{h.get('model', '')} ({h.get('dtype', '')}), temperature {cfg.get('temperature')}, "
                 f"{cfg.get('max_tokens')} tokens", fontsize=10)
    if names:
        ax.legend(fontsize=8, ncol=min(4, len(names) + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance(results: dict, path: Path) -> Path:
    """Overall acceptance rate by draft position, one line per method that drafts."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    overall = results["summary"].get(OVERALL, {})
    drew = False
    for name in _method_names(results):
        pp = (overall.get(name) or {}).get("per_position_acceptance")
        if not pp:
            continue
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=name)
        drew = True
    if not drew:
        ax.text(0.5, 0.5, "no method drafted tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.set_title(f"acceptance by draft position: {results['header'].get('model', '')}", fontsize=10)
    if drew:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(results: dict, path: Path) -> Path:
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def write_all(results: dict, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(render_markdown(results), encoding="utf-8")
    return [write_json(results, out_dir / "results.json"), md, plot_speedup(results, out_dir / "speedup.png"),
            plot_acceptance(results, out_dir / "acceptance.png")]
