"""Adaptive draft length and automatic fallback to plain decoding.

With per-token acceptance probability `alpha`, a round that drafts K tokens produces on average
(1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al., 2023). It costs K draft steps plus one target
forward over K+1 tokens. Both costs are measured as the request runs, so the controller picks the K that
maximizes tokens per second, and drafts nothing (plain decoding) when no K beats a plain forward. After a
fallback it re-probes speculation after `reprobe_after` plain rounds, since acceptance depends on the text;
each probe that falls back again doubles that wait (up to `max_reprobe_after`), because with a fast target
a failed probe (the draft catching up, then a verification) costs several plain steps, and a drafter that
never pays on this model would otherwise keep paying for probes.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        for table, value in ((self.tokens, float(tokens)), (self.seconds, seconds)):
            table[arm] = value if arm not in table else (1 - w) * table[arm] + w * value
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


class LadderBandit(RateBandit):
    """A `RateBandit` over ordered arms (cheapest first) that only ever measures the best arm's neighbours:
    it climbs one arm at a time while the higher arm measures faster, and re-measures just the arms on either
    side of the best one. Where every arm is one more draft token for a whole batch, a losing large arm can
    cost several plain rounds to try, and one that loses to its smaller neighbour is not worth trying.

    A costlier arm counts as faster only by more than `margin`: rounds on a shared 2-core VM vary by more than
    near-equal arms differ, and without it the best arm flipped with the noise, each flip resetting the wait
    of the arm above and paying for its re-measurement (8 clients, ngram at acceptance 0.2 on the dev suite:
    3-5% slower than plain decoding where drafting gains nothing)."""

    def __init__(self, arms: list[int], window: int = 8, explore_every: int = 8, max_wait: int = 256,
                 margin: float = 0.05) -> None:
        super().__init__(arms, window, explore_every, max_wait)
        self.margin = margin

    def best(self) -> int:
        best = self.arms[0]
        best_rate = self.rate(best) or 0.0
        for arm in self.arms[1:]:
            rate = self.rate(arm)
            if rate is not None and rate > best_rate * (1 + self.margin):
                best, best_rate = arm, rate
        return best

    def choose(self) -> int:
        if not self.tokens:
            return self.arms[0]
        best = self.best()
        i = self.arms.index(best)
        for j in (i + 1, i - 1):
            if 0 <= j < len(self.arms):
                arm = self.arms[j]
                if arm not in self.tokens:
                    if j == i + 1:
                        return arm
                elif self.due[arm] <= self.rounds:
                    return arm
        return best


class BatchDepthChooser:
    """Caps the draft depth of a whole batched round, by measured tokens per second of the batch.

    A batched verification is padded to its longest draft, so on a machine whose forward cost grows with the
    rows it computes (CPUs, and GPUs under large batches) every request's draft costs all the others: each
    request's own controller sees its acceptance but not what its rows cost the batch. Per batch size (in
    buckets 2, 3-4, 5-8, ...) the caps 0 (no drafting: a plain round), 1, K_max / 2 and K_max are the rungs of
    a `LadderBandit` measured in tokens the whole batch produced per second; the round's drafts are cut to
    the chosen cap. Each batch size starts plain and climbs while a longer cap measures faster. So drafts
    shorten, and switch off, as the batch grows and wide verification stops paying, by measurement rather
    than a fixed threshold, and come back when it pays again. A lone request (batch 1) is left to its own
    controller.
    """

    def __init__(self, max_k: int, window: int = 8, explore_every: int = 8, max_wait: int = 256) -> None:
        self.arms = sorted({max_k, max(1, max_k // 2), 1, 0})
        self.window, self.explore_every, self.max_wait = window, explore_every, max_wait
        self.bandits: dict[int, LadderBandit] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """The batch-size bucket: the smallest power of two at least `batch`."""
        return 1 << max(0, batch - 1).bit_length()

    def bandit(self, batch: int) -> LadderBandit:
        key = self.bucket(batch)
        if key not in self.bandits:
            self.bandits[key] = LadderBandit(self.arms, self.window, self.explore_every, self.max_wait)
        return self.bandits[key]

    def choose(self, batch: int) -> int | None:
        """The round's depth cap (0: plain), or None for a lone request."""
        return None if batch < 2 else self.bandit(batch).choose()

    def update(self, batch: int, cap: int, tokens: int, seconds: float) -> None:
        self.bandit(batch).update(cap, tokens, seconds)


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
        self.plain_forward: float | None = None  # seconds of a 1-token target forward (EMA)
        self.plain_rounds = 0
        self.verify_extra = 0.0  # extra seconds per verified draft token over a plain forward (EMA)
        self.fallback_left = 0
        self.reprobe_after = self.config.reprobe_after  # the current wait (grows while probes fail)
        self.probing = False  # the speculation under way is a probe after a fallback
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
        if old is None:
            return new
        w = 1.0 / self.config.window
        return (1 - w) * old + w * new

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

    def update(self, drafted: int, accepted: int, draft_time: float, verify_time: float,
               nodes: int | None = None) -> None:
        """Feed one round's outcome. drafted == 0 means a plain forward (used to time the baseline); drafted
        is a tree's depth and `nodes` its size (None: a chain of `drafted` tokens)."""
        if drafted == 0:
            self.plain_rounds += 1
            if self.plain_rounds <= CALIBRATION_ROUNDS:  # the first decoding step runs cold: keep the fastest
                self.plain_forward = min(self.plain_forward or verify_time, verify_time)
            else:
                self.plain_forward = self._ema(self.plain_forward, verify_time)
            return
        if self.plain_forward is not None:
            # Verifying K+1 tokens never beats a 1-token forward: a bound that keeps the baseline honest
            # while speculation runs and no plain round refreshes it.
            self.plain_forward = min(self.plain_forward, verify_time)
        failures = 1 if accepted < drafted else 0
        round_alpha = accepted / (accepted + failures) if accepted + failures else self.alpha
        self.alpha = self._ema(self.alpha, round_alpha)
        self.draft_rounds += 1
        step = draft_time / drafted
        if self.draft_rounds <= CALIBRATION_ROUNDS:
            # The first drafting runs cold too (a drafter's first call lays out its weights, warms its
            # caches): keep the fastest, or one cold round would read as a draft that can never pay.
            self.draft_step = min(self.draft_step or step, step)
        else:
            self.draft_step = self._ema(self.draft_step, step)
        if self.plain_forward is not None:
            extra = max(0.0, (verify_time - self.plain_forward) / (nodes or drafted))
            self.verify_extra = self._ema(self.verify_extra, extra)
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
