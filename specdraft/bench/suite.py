"""Benchmark suites: Spec-Bench style JSONL files and the six category groups Spec-Bench reports.

One JSON object per line: `question_id`, `category`, `turns` (a list of user turns; MT-bench prompts have
two). Blank lines are allowed; anything else that is not such an object is an error naming the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities")
MULTI_TURN = "multi-turn conversation"
# Spec-Bench's report order.
GROUPS = (MULTI_TURN, "translation", "summarization", "qa", "math_reasoning", "rag")
OVERALL = "overall"

DEFAULT_SUITE = Path(__file__).resolve().parents[1] / "data" / "specbench-mini.jsonl"
# The repository's dev prompts live next to the checkout: <repo>/../shared/data/specbench-dev.jsonl.
DEV_SUITE = Path(__file__).resolve().parents[3] / "shared" / "data" / "specbench-dev.jsonl"


class SuiteError(SpecdraftError):
    """A benchmark suite file that cannot be used."""


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        return group_of(self.category)


def group_of(category: str) -> str:
    """The Spec-Bench report group of a category: the eight MT-bench ones form one group, any other category
    is its own group."""
    return MULTI_TURN if category in MT_BENCH_CATEGORIES else category


def order_groups(groups) -> list[str]:
    """Known groups in Spec-Bench's order, then unknown ones alphabetically."""
    groups = set(groups)
    return [g for g in GROUPS if g in groups] + sorted(groups - set(GROUPS))


def parse_suite(text: str, source: str = "<suite>") -> list[Question]:
    questions: list[Question] = []
    seen: set = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise SuiteError(f"{where}: expected a JSON object with question_id, category, turns")
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise SuiteError(f"{where}: missing field(s) {', '.join(missing)}")
        qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
        if not isinstance(qid, (int, str)) or isinstance(qid, bool):
            raise SuiteError(f"{where}: question_id must be an integer or a string")
        if not isinstance(category, str) or not category.strip():
            raise SuiteError(f"{where}: category must be a non-empty string")
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise SuiteError(f"{where}: turns must be a non-empty list of non-empty strings")
        if qid in seen:
            raise SuiteError(f"{where}: duplicate question_id {qid!r}")
        seen.add(qid)
        questions.append(Question(qid, category, tuple(turns)))
    if not questions:
        raise SuiteError(f"{source}: no prompts in the suite")
    return questions


def load_suite(path: str | Path | None = None) -> list[Question]:
    """Read a suite file; None means the small suite shipped with the package."""
    path = Path(path) if path is not None else DEFAULT_SUITE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SuiteError(f"cannot read suite {path}: {exc.strerror or exc}") from None
    return parse_suite(text, str(path))


def select_per_group(questions: list[Question], per_group: int | None,
                     groups: list[str] | None = None) -> list[Question]:
    """The first `per_group` questions of each category group (all when None), optionally only some groups;
    suite order is kept."""
    if per_group is not None and per_group < 1:
        raise SuiteError("--per-category must be >= 1")
    if groups:
        unknown = set(groups) - {q.group for q in questions}
        if unknown:
            raise SuiteError(f"no prompts in group(s) {sorted(unknown)}; the suite has "
                             f"{order_groups({q.group for q in questions})}")
    counts: dict[str, int] = {}
    out = []
    for q in questions:
        if groups and q.group not in groups:
            continue
        if per_group is not None and counts.get(q.group, 0) >= per_group:
            continue
        counts[q.group] = counts.get(q.group, 0) + 1
        out.append(q)
    return out


def spread(questions: list[Question], n: int) -> list[Question]:
    """n questions spread over the category groups round robin (first of each group, then second, ...)."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.group, []).append(q)
    out: list[Question] = []
    depth = 0
    while len(out) < n and any(depth < len(v) for v in by_cat.values()):
        for qs in by_cat.values():
            if depth < len(qs) and len(out) < n:
                out.append(qs[depth])
        depth += 1
    return out


def first_turns(questions: list[Question], order: str = "spread") -> list[str]:
    """The questions' first turns in the order a load test sends them: `spread` round robin over the category
    groups (so the first n requests cover them all alike), `first` the file's order."""
    if order not in ("spread", "first"):
        raise ValueError(f"order must be 'spread' or 'first', got {order!r}")
    return [q.turns[0] for q in (spread(questions, len(questions)) if order == "spread" else questions)]
