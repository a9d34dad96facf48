"""Adaptive draft length and automatic fallback to plain decoding.

With per-token acceptance probability `alpha`, a round that drafts K tokens produces on average
(1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al., 2023). It costs K draft steps plus one target
forward over K+1 tokens. Both costs are measured as the request runs, so the controller picks the K that
maximizes tokens per second, and drafts nothing (plain decoding) when no K beats a plain forward. After a
fallback it re-probes speculation after `reprobe_after` plain rounds, since acceptance depends on the text;
each probe that falls back again doubles that wait (up to `max_reprobe_after`), because with a fast target
a failed probe (the draft catching up, then a verification) costs several plain steps, and a drafter that
never pays on this model would otherwise keep paying for probes.

In a batched round each request's controller says how deep it would draft, and one plan for the batch
(`plan_batch_drafts`) cuts those depths to what pays for the whole batch, from what a forward over so many
rows measures (`ForwardCostTable`) and how many tokens earlier plans got (`AcceptanceCalibration`), and
whether rounds drafted as planned emit more tokens per second than plain ones is measured apart
(`PlanCheck`); the engine keeps all three in one `BatchPlanner`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specdraft.smoothing import STALL_FACTOR, ema, geometric_ema, timing_ema


@dataclass
class AdaptiveConfig:
    enabled: bool = True
    min_acceptance: float = 0.4  # fall back when the recent acceptance rate drops below this (costly drafts)
    window: int = 8  # rounds of history the estimates average over (EMA horizon)
    reprobe_after: int = 16  # plain rounds before speculation is tried again
    max_reprobe_after: int = 256  # the wait doubles after each failed probe, up to this
    min_speedup: float = 1.0  # fall back when the best expected speedup is below this

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError("min_acceptance must be in [0, 1)")
        if self.window < 1 or self.reprobe_after < 1:
            raise ValueError("window and reprobe_after must be >= 1")
        if self.max_reprobe_after < self.reprobe_after:
            raise ValueError("max_reprobe_after must be >= reprobe_after")


# Plain rounds before the first speculation: the first decoding step after a prefill is slower than the rest
# (caches and threads are cold), and a baseline taken from it alone would make any drafter look profitable.
CALIBRATION_ROUNDS = 2


class RateBandit:
    """Chooses among a few arms by measured tokens per second.

    Every arm's tokens per round and seconds per round (drafting and verification) are averaged as it runs;
    the round goes to the arm with the most tokens per second. A losing arm is re-measured now and then,
    after a wait that doubles each time it loses again (from `explore_every` up to `max_wait` rounds), since
    on a machine where wide verification is expensive every exploration of a big draft costs several plain
    steps. Each arm is tried once first, in the order given (largest first).
    """

    def __init__(self, arms: list[int], window: int = 8, explore_every: int = 8, max_wait: int = 256) -> None:
        self.arms = list(arms)
        self.smoothing = 1.0 / window
        self.explore_every, self.max_wait = explore_every, max_wait
        self.tokens: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.wait = dict.fromkeys(self.arms, explore_every)
        self.due = dict.fromkeys(self.arms, 0)  # round from which an arm may be re-measured
        self.rounds = 0

    def fork(self) -> RateBandit:
        """A chooser (for a new request) that starts from these estimates (the machine's verification cost is
        the same for every request, and recent text is the best guess for the next), so a request does not
        pay again for measuring every arm; each arm keeps its current wait before re-measurement."""
        child = self.__class__.__new__(self.__class__)
        child.__dict__.update(self.__dict__)
        child.tokens, child.seconds, child.wait = dict(self.tokens), dict(self.seconds), dict(self.wait)
        child.rounds = 0
        child.due = {arm: self.due[arm] - self.rounds for arm in self.arms}
        return child

    def rate(self, arm: int) -> float | None:
        """Measured tokens per second of an arm (None before it ran)."""
        if arm not in self.seconds or self.seconds[arm] <= 0:
            return None
        return self.tokens[arm] / self.seconds[arm]

    def best(self) -> int:
        return max(self.arms, key=lambda arm: self.rate(arm) or 0.0)

    def choose(self) -> int:
        """The arm for the next round."""
        untried = [arm for arm in self.arms if arm not in self.tokens]
        if untried:
            return untried[0]
        best = self.best()
        overdue = [arm for arm in self.arms if arm != best and self.due[arm] <= self.rounds]
        return min(overdue, key=self.due.__getitem__) if overdue else best

    def update(self, arm: int, tokens: int, seconds: float) -> None:
        """One round with `arm`: the tokens it produced and what drafting + verifying cost."""
        self.rounds += 1
        explored = arm in self.tokens and arm != self.best()
        # A re-measurement replaces the arm's stale estimate (the text may have changed since); the arm in use
        # is smoothed over its recent rounds.
        w = 1.0 if explored else self.smoothing
        self.tokens[arm] = ema(self.tokens.get(arm), float(tokens), w)
        self.seconds[arm] = timing_ema(self.seconds.get(arm), seconds, w)
        if explored:
            lost = self.best() != arm
            self.wait[arm] = min(2 * self.wait[arm], self.max_wait) if lost else self.explore_every
        self.due[arm] = self.rounds + self.wait[arm]


class TreeShapeChooser(RateBandit):
    """Chooses each round's draft shape, a chain or a tree of a few sizes up to `max_nodes`, by measurement.

    Whether a tree pays depends on the text (how often the drafter's second guesses are right) and on the
    machine (what verifying more tokens costs), neither known in advance, so every shape is an arm of a
    `RateBandit`. Arm 0 is the chain: it stays the choice where trees do not pay.

    Tree sizes are 2^k - 1 nodes (up to three of them), so that with the pending token the verified block is
    2^k rows: kernels tile rows in powers of two, and one row past a tile costs a tile (SmolLM2-135M bf16 on
    AVX512-BF16: 9 rows 1.37x one row, 8 rows 1.21x). Other sizes only where max_nodes allows no such size.
    """

    def __init__(self, max_nodes: int, window: int = 8, explore_every: int = 8, max_wait: int = 256) -> None:
        sizes = [2**k - 1 for k in range(2, max_nodes.bit_length() + 1) if 2**k - 1 <= max_nodes][-3:]
        if not sizes and max_nodes >= 2:
            sizes = [max_nodes]
        super().__init__(sorted({0, *sizes}, reverse=True), window, explore_every, max_wait)


# The weight of each plain round in the machine's current pace (`ForwardCostTable`): a few rounds' memory.
PACE_SMOOTHING = 0.25
# At most this many batched rounds in a row draft: the next is plain, which keeps the pace current.
PLAIN_EVERY = 16


def context_bucket(context_tokens: int) -> int:
    """The class of a batched round by the cached tokens its requests attend to: 0 below CONTEXT_BUCKET_TOKENS,
    then one per doubling."""
    return (max(context_tokens, 0) // CONTEXT_BUCKET_TOKENS).bit_length()


# Batched rounds are timed apart by the cached tokens their requests attend to, a class per doubling from
# this many (`context_bucket`). Reading a sequence's keys and values is a cost per sequence, not per row: 8
# sequences of 1,000 cached tokens made a forward of 8 rows 13.4 ms against 6.2 after 100, one of 16 rows 19.5
# against 10.6 (SmolLM2-135M Q4, Zen 4, `scripts/bench_forward_shapes.py --context`). A table that mixed such
# rounds compared row counts measured at different contexts: over the dev suite's six categories, 8 requests
# at a time, 8 rows read 28 ms and 9 rows 13 (more rows cheaper), and plans drafted where drafting did not
# pay (`scripts/engine_batch_ab.py --one-context-class`).
CONTEXT_BUCKET_TOKENS = 512


class ForwardCostTable:
    """Measured seconds of a batched target forward (with its verification) by the rows it computes, for each
    class of context (`context_bucket`: the cached tokens the round's requests attend to).

    A batched round computes one row per request plus one per draft token (ragged), so what drafting costs
    the batch is the difference between two entries of this table. That difference is the machine's, not a
    formula's: on a CPU whose kernels tile rows by four, rows up to the fourth cost little and the fifth
    more than the three before it together (SmolLM2-135M Q4 on Zen 4: 2 rows 4.2 ms, 4 rows 4.7, 5 rows 5.4;
    other runs 4 rows 5.0, 5 rows 7.6), and where the forward is compute-bound every row costs most of what
    an average one does. Every batched round adds its measurement (an average over recent rounds per row
    count; a lone request's one-slot block is another forward and is left out) to its context's table; a plan
    reads the table of its own context. A class's first round starts its table from a copy of the nearest
    class's (rows cost much the same relative to each other there) at that class's pace: started empty, a
    class's first few entries were measured before its pace had settled, at different speeds, and a plain
    count measured in a slow moment made the next counts up look free (in one run, 8 rows 37 ms, 9 rows 15).

    A shared machine's speed drifts by tens of percent over seconds, and a row count measured rarely would
    compare its slow moment with another's fast one, so entries are kept at one speed: each plain round
    updates the machine's current pace (its time over its row count's entry; a pace per context class, whose
    entries are each at their own first rounds' speed), and every measurement is divided by the pace before
    it enters the table (the engine runs a plain round at least every
    `PLAIN_EVERY` batched rounds, so the pace stays current while drafting pays). Pace and entries are
    averages of logarithms (`geometric_ema`): each is measured by dividing by the other, and as arithmetic
    averages the noise's bias compounded between them, so the counts plain rounds measure drifted cheaper
    and cheaper against those measured only by drafting (a steady machine with 15% noise: 16 rows against 8
    read 2.5 times dearer after 2,000 plain rounds, 3.7 times after 4,000, where 1.5 was true), and a
    long-running server drafted less and less.

    Between measured counts the table interpolates; past the largest it extends the line through the largest
    and the one nearest half of it. With one count measured (an engine that started with a full batch) more
    rows are taken to be free: optimism that makes the first plan draft, which measures what rows cost.
    """

    def __init__(self, window: int = 32) -> None:
        self.smoothing = 1.0 / window  # slow: what rows cost relative to each other is the machine's
        # context class -> row count -> seconds, in the machine's speed at the class's first rounds
        self.tables: dict[int, dict[int, float]] = {}
        # context class -> how much slower the machine runs now than then (over the last few plain rounds):
        # each class's entries are at its own first rounds' speed, so each has its own pace
        self.paces: dict[int, float] = {}

    def _class_of(self, context: int) -> int | None:
        """The measured class a plan at `context` cached tokens reads: its own, else the nearest."""
        bucket = context_bucket(context)
        return min(self.tables, key=lambda b: (abs(b - bucket), b)) if self.tables else None

    def seconds(self, context: int = 0) -> dict[int, float]:
        """The entries a plan at `context` cached tokens reads ({} before any round was measured)."""
        bucket = self._class_of(context)
        return {} if bucket is None else self.tables[bucket]

    def pace(self, context: int = 0) -> float:
        """The current pace of the class a plan at `context` reads (1.0 before any round was measured)."""
        bucket = self._class_of(context)
        return 1.0 if bucket is None else self.paces[bucket]

    def record(self, rows: int, seconds: float, plain: bool, context: int = 0) -> None:
        """One batched round: `rows` computed in `seconds` over requests attending to `context` cached tokens
        in all; `plain` if no request drafted (such rounds, of the same few row counts and frequent, are what
        the pace is measured on)."""
        bucket = context_bucket(context)
        if bucket not in self.tables:  # a new class starts from the nearest one's rows and pace (see above)
            nearest = self._class_of(context)
            self.tables[bucket] = {} if nearest is None else dict(self.tables[nearest])
            self.paces[bucket] = 1.0 if nearest is None else self.paces[nearest]
        table, pace = self.tables[bucket], self.paces[bucket]
        old = table.get(rows)
        if plain and old is not None:
            pace = self.paces[bucket] = timing_ema(pace, seconds / old, PACE_SMOOTHING, geometric=True)
        table[rows] = timing_ema(old, seconds / pace, self.smoothing, geometric=True)

    def costs(self, first: int, last: int, context: int = 0) -> list[float] | None:
        """Estimated seconds of a forward over each row count from `first` to `last` for requests attending
        to `context` cached tokens (None before any round was measured)."""
        bucket = self._class_of(context)
        if bucket is None:
            return None
        table, pace = self.tables[bucket], self.paces[bucket]
        known = sorted(table)
        top = known[-1]
        slope = 0.0  # one count measured: more rows are taken to be free until a round measures them
        if len(known) > 1:
            mid = min(known[:-1], key=lambda n: abs(n - top / 2))
            slope = max(0.0, (table[top] - table[mid]) / (top - mid))
        out, i = [], 0  # known[i] is the first measured count >= rows
        for rows in range(first, last + 1):
            while i < len(known) and known[i] < rows:
                i += 1
            if i == len(known):
                out.append(table[top] + slope * (rows - top))
            elif known[i] == rows or i == 0:  # measured, or fewer rows than any measured: at most that
                out.append(table[known[i]])
            else:
                lo, hi = known[i - 1], known[i]
                out.append(table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo))
        # A longer block never costs less than a shorter one: where one measured cheaper (the shorter in a
        # noisy moment, or the longer long ago), the shorter is taken at the cheaper cost, so that a plan
        # tries it and the next measurement settles which was wrong.
        for j in range(len(out) - 2, 0, -1):
            out[j] = min(out[j], out[j + 1])
        return [max(cost, out[0]) * pace for cost in out]


# How fast `AcceptanceCalibration` returns to trusting the requests' estimates while nothing drafts.
RELAX = 1 / 256
# Outcomes of its own drafts a request's acceptance estimate needs before `AcceptanceCalibration` counts it.
CALIBRATED_AFTER = 4


class AcceptanceCalibration:
    """Tokens the plans' drafts got, over what the plans expected of them (EMAs over recent drafted rounds).

    Expected acceptance comes from each request's own estimate (alpha^j for its j-th draft token); a plan
    picks the requests whose estimates are highest, which are partly so by luck, and chains are not as
    independent token to token as alpha^j says, so plans expected more than they got (ngram, 16 clients on
    the dev suite: 7.7 tokens expected, 5.2 accepted). The ratio corrects the next plans. Only requests
    whose estimate rests on `CALIBRATED_AFTER` outcomes of their own count: a new request's first drafts
    test the prior, which its own estimate corrects, and would otherwise lower every request's plans.
    """

    def __init__(self, window: int = 16) -> None:
        self.smoothing = 1.0 / window
        self.expected = self.accepted = 0.0

    def record(self, expected: float, accepted: int) -> None:
        self.expected = ema(self.expected, expected, self.smoothing)
        self.accepted = ema(self.accepted, accepted, self.smoothing)

    def relax(self) -> None:
        """A round that drafted nothing: the ratio creeps back towards 1 (half way in about 180 such rounds),
        so that one unlucky measurement does not switch drafting off for good; the plan that follows tries
        again and measures."""
        self.accepted = ema(self.accepted, self.expected, RELAX)

    @property
    def factor(self) -> float:
        """What to scale expected acceptance by (1 until a drafted round was measured), within [0.25, 1.5]."""
        return 1.0 if self.expected <= 0 else min(1.5, max(0.25, self.accepted / self.expected))


def plan_batch_drafts(alphas: Sequence[float], depths: Sequence[int], table: ForwardCostTable,
                      draft_cost: float = 0.0, margin: float = 0.05, calibration: float = 1.0,
                      context: int = 0) -> list[int]:
    """How deep each request of a batched round drafts: the depths (at most `depths`, what each request's own
    controller wants) that maximize the batch's expected tokens per second.

    A round over B requests emits B tokens plus the accepted drafts, and costs a forward over B rows plus one
    per draft token (from `table`, measured) plus `draft_cost` seconds per draft token. With a request's
    per-token acceptance alpha, its j-th draft token is accepted with probability alpha^j, so the draft
    tokens of all requests are taken best first while the batch's rate grows: in a small batch (where rows
    cost little) every request drafts as deep as it wants; in a large one only requests whose drafts are
    likely right draft at all, and with none of them the round is plain. Per request, not one cap for the
    batch: one request copying from its prompt pays for its rows where the others' would not. A plan drafts
    only where it expects `margin` more than a plain round: costs measured on a shared machine are noisy, and
    a gain smaller than their noise is as likely a loss. `calibration` scales every expected acceptance: the
    engine measures how many tokens its plans' drafts got against how many the plans expected (the requests
    a plan picks are the ones whose estimates are highest, partly by luck), see `AcceptanceCalibration`.
    `context`: the cached tokens the batch's requests attend to, which pick the table's class.
    """
    batch = len(alphas)
    units = sorted(((min(max(alpha, 0.0), 1.0) ** j, b) for b, (alpha, depth) in enumerate(zip(alphas, depths))
                    for j in range(1, depth + 1)), key=lambda unit: -unit[0])
    costs = table.costs(batch, batch + len(units), context) if units else None
    if costs is None or costs[0] <= 0:
        return [0] * batch
    plain_rate = batch / costs[0]
    best_rate, best_m, gain = plain_rate, 0, 0.0
    for m, (accept, _) in enumerate(units, start=1):
        gain += calibration * accept
        rate = (batch + gain) / (costs[m] + m * draft_cost)
        if rate > best_rate:
            best_rate, best_m = rate, m
    if best_rate < (1 + margin) * plain_rate:
        best_m = 0
    planned = [0] * batch
    for _, b in units[:best_m]:
        planned[b] += 1
    return planned


# How far one round's measured rate over the plain rate may move `PlanCheck`'s average: a stall's share.
LOG_STALL = math.log(STALL_FACTOR)
# The weight of a re-try of losing plans in `PlanCheck`'s average (the rounds in a row that draft: 1 / window).
EXPLORED_WEIGHT = 0.5


class PlanCheck:
    """Whether a batch size's plans emit more tokens per second than its plain rounds, by measurement.

    A plan rests on a model (forward costs by rows, expected acceptance), and a shared machine's timings are
    noisy enough to mislead it: at 8 requests over the dev suite's six categories, the cost table once read
    8 rows 28 ms and 11 rows 13, plans drafted in most rounds, and drafting cost 12% more decode time than
    plain rounds (`scripts/engine_batch_ab.py --no-batch-drafting`, stop 57). So what the plans produce is
    measured as well, on whole rounds (drafting, forward, verification, the requests' bookkeeping): plain
    rounds' tokens per second (a few rounds' memory: the machine's speed drifts, and the engine runs a plain
    round at least every `PLAIN_EVERY`), and each drafted round's rate over it (an average of logarithms over
    `window` drafted rounds, so that one noisy round does not decide). While that average is below 1 the
    plans are set aside (plain rounds), and a drafted round re-tries them after `explore_every` rounds, then
    after waits that double while they keep losing (up to `max_wait`). Kept per batch size: a round of 5
    requests emits fewer tokens per second than one of 8 whatever it drafts.
    """

    def __init__(self, window: int = 8, explore_every: int = 8, max_wait: int = 256) -> None:
        self.smoothing = 1.0 / window
        self.explore_every, self.max_wait = explore_every, max_wait
        self.plain_rate: float | None = None  # tokens per second of recent plain rounds
        self.gain: float | None = None  # log of drafted rounds' rate over plain rounds' (EMA)
        self.wait = explore_every
        self.due = 0  # round from which a losing plan is re-tried
        self.rounds = 0

    def drafts(self) -> bool:
        """Whether the next round may draft as planned."""
        return self.gain is None or self.gain >= 0 or self.rounds >= self.due

    def update(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One round: drafted or plain, the tokens it emitted in `seconds`."""
        self.rounds += 1
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        if not drafted:
            if self.plain_rate is not None:  # one stalled round moves it no more than a slow stretch would
                rate = min(max(rate, self.plain_rate / STALL_FACTOR), self.plain_rate * STALL_FACTOR)
            self.plain_rate = geometric_ema(self.plain_rate, rate, PACE_SMOOTHING)
            return
        if self.plain_rate is None:
            return  # nothing to compare it with yet
        was_losing = self.gain is not None and self.gain < 0
        gain = max(-LOG_STALL, min(LOG_STALL, math.log(rate / self.plain_rate)))
        # A re-try after a wait counts for more than a round among many: what the plans get may have changed.
        self.gain = ema(self.gain, gain, EXPLORED_WEIGHT if was_losing else self.smoothing)
        if self.gain >= 0:
            self.wait = self.explore_every
        else:
            if was_losing:
                self.wait = min(2 * self.wait, self.max_wait)
            self.due = self.rounds + self.wait


class BatchPlanner:
    """The engine's memory for batched rounds: what a forward over so many rows costs (`costs`), how many
    tokens earlier plans' drafts got against what they expected (`calibration`), the drafter's seconds per
    draft token asked for, whether each batch size's plans beat its plain rounds (`checks`) and when the
    next plain round is due. `plan` sizes each request's draft for the next round; `learn` books what the
    round's forward measured, `check` what the whole round produced.

    Two kinds of round are not timed: a lone request's (its block is another forward, with no batch to
    share the weights' reads) and the first after a prompt forward, whose caches that forward left cold.
    """

    def __init__(self, window: int) -> None:
        self.costs = ForwardCostTable()
        self.calibration = AcceptanceCalibration()
        self.draft_token_cost = 0.0  # seconds of drafting per draft token asked for (EMA)
        self.smoothing = 1.0 / window
        self.drafted_rounds = 0  # batched rounds in a row that drafted
        self.cold = False  # the next round follows a prompt forward
        self.timed = False  # the last round `learn` booked was timed (not cold)
        self.checks: dict[int, PlanCheck] = {}  # batch size -> what its plans produce (see `check`)

    def _check_of(self, batch: int) -> PlanCheck:
        if batch not in self.checks:
            self.checks[batch] = PlanCheck()
        return self.checks[batch]

    def plan(self, alphas: Sequence[float], depths: Sequence[int], context: int = 0) -> list[int]:
        """Each request's draft depth for a batched round (`plan_batch_drafts`) over requests attending to
        `context` cached tokens: none after PLAIN_EVERY drafted rounds in a row, so that the plain round keeps
        the table's pace current, and none where the rounds these plans drafted in produced fewer tokens per
        second than plain rounds of batches of this size (`check`)."""
        if self.drafted_rounds >= PLAIN_EVERY or not self._check_of(len(depths)).drafts():
            return [0] * len(depths)
        return plan_batch_drafts(alphas, depths, self.costs, self.draft_token_cost,
                                 calibration=self.calibration.factor, context=context)

    def check(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole batched round of `batch` requests (drafting, forward, verification and the requests'
        bookkeeping) emitted `tokens` in `seconds`: booked with that batch size's `PlanCheck`, unless it was
        the first after a prompt forward (its caches were cold)."""
        if self.timed:
            self._check_of(batch).update(drafted, tokens, seconds)

    def prompt_forward(self) -> None:
        """A prompt's forward ran: the round after it is not timed."""
        self.cold = True

    def lone_round(self) -> None:
        """A round of one request ran (not timed, but its forward warmed the caches)."""
        self.cold = False

    def learn(self, rows: int, seconds: float, plain: bool, expected: float | None, accepted: int, asked: int,
              draft_seconds: float, context: int = 0) -> None:
        """A batched round: `rows` computed in `seconds` (forward and verification; `plain` if nothing was
        drafted) over requests attending to `context` cached tokens; the drafts of the requests the calibration
        counts expected `expected` tokens (None: no such request drafted) and got `accepted`; `asked` draft
        tokens (shadows included) cost `draft_seconds`."""
        if not self.cold:
            self.costs.record(rows, seconds, plain=plain, context=context)
        self.timed, self.cold = not self.cold, False
        self.drafted_rounds = 0 if plain else self.drafted_rounds + 1
        if plain:
            self.calibration.relax()
        elif expected is not None:
            self.calibration.record(expected, accepted)
        if asked:
            self.draft_token_cost = timing_ema(self.draft_token_cost, draft_seconds / asked, self.smoothing)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per round when each draft token is accepted with probability alpha (bonus included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# A draft token costing this many plain target forwards cannot pay at any K or acceptance: K draft steps and
# a verification of K + 1 tokens cost at least K * ratio + 1 forwards for at most K + 1 tokens. Above 1.0 by a
# margin, so that a draft about as costly as the target (and the timing noise of tiny models) is still tried.
HOPELESS_DRAFT_COST = 1.25
# A draft token costing under this share of a plain target forward is cheap: half `min_acceptance` applies.
CHEAP_DRAFT = 0.05


class DraftCostMemory:
    """What finished requests measured about the drafter on this machine, for the requests after them.

    A draft's cost per token relative to a plain target forward depends on the two models and the machine,
    not on the text, so it carries over. When it says the draft cannot pay (`HOPELESS_DRAFT_COST`), a new
    request starts in fallback, for twice the probe wait the earlier requests reached (up to the maximum),
    instead of paying for a probe of its own (for a draft model with a context of its own, the probe
    includes the draft's prefill of the whole prompt). Probes still happen, with doubling waits, in case the
    measurement was unlucky.
    """

    def __init__(self) -> None:
        self.cost_ratio: float | None = None  # draft step / plain forward, EMA over finished requests
        self.reprobe_after: int | None = None  # the probe wait the last measuring request reached

    def record(self, controller: DraftLengthController) -> None:
        if not controller.draft_step or not controller.plain_forward:
            return  # it never drafted (or never timed a plain forward): nothing learned
        ratio = controller.draft_step / controller.plain_forward
        self.cost_ratio = ratio if self.cost_ratio is None else 0.5 * (self.cost_ratio + ratio)
        self.reprobe_after = controller.reprobe_after

    @property
    def hopeless(self) -> bool:
        return self.cost_ratio is not None and self.cost_ratio >= HOPELESS_DRAFT_COST

    @property
    def cheap(self) -> bool:
        """Whether finished requests measured a draft token under `CHEAP_DRAFT` of a plain forward."""
        return self.cost_ratio is not None and self.cost_ratio < CHEAP_DRAFT


class DraftLengthController:
    """Chooses K per round from measured acceptance and measured draft / verify cost."""

    def __init__(self, max_k: int, config: AdaptiveConfig | None = None,
                 memory: DraftCostMemory | None = None) -> None:
        self.max_k = max_k
        self.config = config or AdaptiveConfig()
        # The first speculative round drafts one token: it measures what a draft step costs before long drafts
        # are risked (a draft as slow as the target would waste max_k steps); the next round picks K from it.
        self.k = 1
        self.alpha = 0.7  # optimistic prior so that speculation gets tried
        self.draft_step = 0.0  # seconds per draft token (EMA)
        self.draft_rounds = 0
        self.observed = 0  # drafts whose outcome reached `alpha` (verified rounds and shadow drafts)
        self.plain_forward: float | None = None  # seconds of a 1-token target forward (EMA)
        self.plain_rounds = 0
        self.verify_extra = 0.0  # extra seconds per verified draft token over a plain forward (EMA)
        self.fallback_left = 0
        self.reprobe_after = self.config.reprobe_after  # the current wait (grows while probes fail)
        self.probing = False  # the speculation under way is a probe after a fallback
        self.stale_costs = False  # the next drafted round replaces draft_step and verify_extra (a probe's)
        self.fallback_events = 0
        self.log: list[str] = []
        if memory is not None and memory.hopeless and self.config.enabled:
            # Earlier requests measured a draft that cannot pay: start as if their last probe had failed too.
            self.reprobe_after = min(2 * max(self.reprobe_after, memory.reprobe_after or 0),
                                     self.config.max_reprobe_after)
            self.fallback_left = self.reprobe_after
            self.log.append(f"starting in fallback for {self.fallback_left} rounds: earlier requests measured "
                            f"a draft token at {memory.cost_ratio:.2f} plain forwards")

    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, 1.0 / self.config.window)

    def _timing_ema(self, old: float | None, new: float, expected: float | None = None) -> float:
        """`_ema` of a measured time, a stall capped (`timing_ema`)."""
        return timing_ema(old, new, 1.0 / self.config.window, expected)

    @property
    def in_fallback(self) -> bool:
        return self.fallback_left > 0

    def next_k(self) -> int:
        if not self.config.enabled:
            return self.max_k
        if self.plain_rounds < CALIBRATION_ROUNDS:
            return 0  # plain forwards first: the baseline every speedup estimate is measured against
        if self.fallback_left > 0:
            self.fallback_left -= 1
            if self.fallback_left == 0:
                self.log.append("re-probing speculation")
                self.alpha = max(self.alpha, self.config.min_acceptance + 0.1)
                self.k = 1
                self.probing = True
                # What drafting cost was measured before the fallback, perhaps in a stall of the machine;
                # the probe measures it afresh, or one bad moment would fail every probe after it.
                self.stale_costs = True
            return 0
        return self.k

    @property
    def cheap(self) -> bool:
        """Whether a draft token measured under `CHEAP_DRAFT` of a plain forward (prompt lookup, tables)."""
        return (self.draft_rounds > 0 and self.plain_forward is not None
                and self.draft_step < CHEAP_DRAFT * self.plain_forward)

    def expected_speedup(self, k: int) -> float:
        if self.plain_forward is None or self.plain_forward <= 0:
            return float("inf")
        cost = k * self.draft_step + self.plain_forward + k * self.verify_extra
        return expected_tokens(self.alpha, k) * self.plain_forward / cost

    def observe_shadow(self, accepted: bool) -> None:
        """A one-token draft that was proposed but not verified (a batch's plan left it out), checked against
        the token the target emitted: it moves the acceptance estimate as a verified one-token round would."""
        self.alpha = self._ema(self.alpha, 1.0 if accepted else 0.0)
        self.observed += 1

    def update(self, drafted: int, accepted: int, draft_time: float, verify_time: float,
               nodes: int | None = None) -> None:
        """Feed one round's outcome. drafted == 0 means a plain forward (used to time the baseline); drafted
        is a tree's depth and `nodes` its size (None: a chain of `drafted` tokens)."""
        if drafted == 0:
            self.plain_rounds += 1
            if self.plain_rounds <= CALIBRATION_ROUNDS:  # the first decoding step runs cold: keep the fastest
                self.plain_forward = min(self.plain_forward or verify_time, verify_time)
            else:
                self.plain_forward = self._timing_ema(self.plain_forward, verify_time)
            return
        if self.plain_forward is not None:
            # Verifying K+1 tokens never beats a 1-token forward: a bound that keeps the baseline honest
            # while speculation runs and no plain round refreshes it.
            self.plain_forward = min(self.plain_forward, verify_time)
        failures = 1 if accepted < drafted else 0
        round_alpha = accepted / (accepted + failures) if accepted + failures else self.alpha
        self.alpha = self._ema(self.alpha, round_alpha)
        self.draft_rounds += 1
        self.observed += 1
        step = draft_time / drafted
        if self.draft_rounds <= CALIBRATION_ROUNDS:
            # The first drafting runs cold too (a drafter's first call lays out its weights, warms its
            # caches): keep the fastest, or one cold round would read as a draft that can never pay.
            self.draft_step = min(self.draft_step or step, step)
        elif self.stale_costs:
            self.draft_step = step
        else:
            self.draft_step = self._timing_ema(self.draft_step, step)
        if self.plain_forward is not None:
            extra = max(0.0, (verify_time - self.plain_forward) / (nodes or drafted))
            self.verify_extra = extra if self.stale_costs else self._timing_ema(
                self.verify_extra, extra, expected=max(self.verify_extra, self.plain_forward))
        self.stale_costs = False
        if not self.config.enabled:
            return
        if self.draft_rounds < CALIBRATION_ROUNDS:
            return  # one more round of K=1 before the draft's cost is known well enough to act on
        best_k = max(range(1, self.max_k + 1), key=self.expected_speedup)
        best = self.expected_speedup(best_k)
        # A draft that costs next to nothing (prompt lookup, tables) pays at lower acceptance: each accepted
        # token is almost free. It is held to half the bar, so that one right a third of the time keeps going
        # while one that is almost never right still stops within a few rounds.
        floor = self.config.min_acceptance / 2 if self.cheap else self.config.min_acceptance
        if self.alpha < floor or best <= self.config.min_speedup:
            if self.probing:  # the probe failed: wait longer before the next one
                self.reprobe_after = min(2 * self.reprobe_after, self.config.max_reprobe_after)
            self.fallback_left = self.reprobe_after
            self.fallback_events += 1
            self.log.append(f"fallback to plain decoding for {self.fallback_left} rounds: acceptance "
                            f"{self.alpha:.2f}, expected speedup {best:.2f} at K={best_k}")
        elif self.probing:  # speculation pays again
            self.reprobe_after = self.config.reprobe_after
        self.probing = False
        self.k = best_k
