"""`max_nodes="auto"`: the node budget of a `DraftTree`, chosen online for the hardware it runs on.

A tree drafter ranks its candidates by cumulative draft probability; a budget of N nodes verifies the N
best (`select_tree`), so the tree for N is the tree for N − 1 plus one node, and a node's chance of being
on the accepted path does not depend on N (greedy: it is accepted iff the target's argmax agrees along its
path). With a_r the probability that the node ranked r is accepted:

    accepted tokens per round    E(N) = Σ_{r < N} a_r         (each accepted node is one token)
    tokens per round             E(N) + 1                     (plus the recovered / bonus token)
    time per round               R(N) = f + t(N)              (f: drafting, verification, bookkeeping;
                                                               t(N): the target's pass over N + 1 rows)

and the budget is the N maximising (E(N) + 1) / R(N) among the candidate budgets: a greedy marginal-value
rule, since adding the node ranked N pays exactly a_N tokens for t(N + 1) − t(N) more time.

What is measured, per drafter (so across requests):
- a_r: a Beta estimate per rank from the nodes actually verified (hit = on the accepted path), with the
  draft's own mean cumulative probability at that rank as a prior worth PRIOR_WEIGHT rounds; counts decay
  by DECAY per round so a change of text is followed.
- t(N): the target adapter's own time for the scoring pass (`forward_s`), the median of the last
  COST_WINDOW passes of that budget (a median, so a pass that compiled a shape, e.g. after the cache grew,
  does not distort it). The first pass of each budget is not used. On the eager path budgets never tried
  are predicted by a least-squares line through the measured ones; on the compiled path every budget is a
  compiled shape, so each is tried WARM_PASSES times (round-robin) in the first request and never
  compiled again (`COMPILED_BUDGETS` is short for that reason).
- f: the wall time of a round minus its target pass, an exponential average.
Every PROBE_EVERY rounds the largest budget is verified once, so the deepest ranks keep being measured.
"""

from __future__ import annotations

import statistics
import time

#: Budgets on the eager path (any node count is one more row in the pass).
EAGER_BUDGETS = (2, 4, 6, 8, 10, 12, 16, 20, 24)
#: Budgets on the compiled path: each is a compiled verification shape (rows = budget + 1).
COMPILED_BUDGETS = (4, 8, 12, 16)
PRIOR_WEIGHT = 4.0
DECAY = 0.995
COST_EMA = 0.2
COST_WINDOW = 9
WARM_PASSES = 3
PROBE_EVERY = 16


class TreeBudget:
    """Chooses a tree's node budget each round; fed by the drafter (`propose` / `commit`)."""

    def __init__(self, candidates: int):
        self.candidates = candidates  # C: nodes the drafter ranks every round
        self.budgets = EAGER_BUDGETS
        self.compiled = False  # budgets are compiled shapes: time each, never predict one
        self.hits = [0.0] * candidates  # decayed count of accepted nodes per rank
        self.trials = [0.0] * candidates  # decayed count of verified nodes per rank
        self.prior_sum = [0.0] * candidates  # sum of the draft's probability at each rank
        self.prior_n = 0
        self.cost: dict[int, float] = {}  # budget -> t(N) seconds (median of the recent passes)
        self.recent: dict[int, list[float]] = {}  # budget -> its last COST_WINDOW pass times
        self.seen: dict[int, int] = {}  # budget -> passes timed so far (the first is not used)
        self.fixed: float | None = None  # f seconds (EMA)
        self.rounds = 0
        self.target = None
        self.chosen: list[int] = []  # the budget of every round (for reports)
        self._round: dict | None = None

    # -- wiring -----------------------------------------------------------------------------------------
    def bind(self, target, draft_lm) -> None:
        """Before a request: the target adapter whose passes are timed; its path fixes the budgets."""
        self.target = target
        self.compiled = getattr(target, "compile", False) is True and hasattr(target, "buckets")
        budgets = COMPILED_BUDGETS if self.compiled else EAGER_BUDGETS
        self.budgets = tuple(b for b in budgets if b <= self.candidates) or (self.candidates,)
        self._round = None

    # -- the model --------------------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """a_r for every rank r: the measured hit rate, shrunk towards the draft's own probability."""
        prior = [s / self.prior_n if self.prior_n else 0.5 for s in self.prior_sum]
        return [(h + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT) for h, t, p in zip(self.hits, self.trials, prior)]

    def pass_cost(self, budget: int) -> float | None:
        """t(N): measured, or (eager) predicted by a line through the measured budgets; None if unknown."""
        if budget in self.cost:
            return self.cost[budget]
        points = sorted(self.cost.items())
        if len(points) < 2 or self.compiled:
            return None
        n = len(points)
        mx = sum(b for b, _ in points) / n
        my = sum(c for _, c in points) / n
        sxx = sum((b - mx) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mx) * (c - my) for b, c in points) / sxx) if sxx else 0.0
        return my + slope * (budget - mx)

    def predict(self) -> dict[int, tuple[float, float, float]]:
        """budget -> (tokens per round E(N) + 1, seconds per round R(N), tokens/s) for the costed budgets."""
        a = self.acceptance()
        out = {}
        for b in self.budgets:
            t = self.pass_cost(b)
            if t is None or self.fixed is None:
                continue
            tokens = 1.0 + sum(a[:b])
            out[b] = (tokens, self.fixed + t, tokens / (self.fixed + t))
        return out

    def choose(self) -> int:
        """This round's node budget."""
        self.rounds += 1
        warm = WARM_PASSES + 1  # the first pass of a shape is not used
        untimed = [b for b in self.budgets if self.seen.get(b, 0) < warm and (self.compiled or self.pass_cost(b) is None)]
        if untimed:  # warm-up: time each budget that cannot be predicted (compiled: compile it now)
            budget = untimed[0] if self.compiled else (
                self.budgets[0] if self.seen.get(self.budgets[0], 0) < warm else self.budgets[-1])
        elif self.rounds % PROBE_EVERY == 0:
            budget = self.budgets[-1]
        else:
            predicted = self.predict()
            budget = max(predicted, key=lambda b: (predicted[b][2], -b)) if predicted else self.budgets[0]
        self.chosen.append(budget)
        return budget

    # -- observations -----------------------------------------------------------------------------------
    def proposed(self, probs_by_rank: list[float], tokens: list[int], parents: list[int],
                 ranks: list[int], budget: int) -> None:
        """A round's proposal: the draft probability of every ranked candidate (best first), the kept
        nodes (node order) and each one's rank. Starts timing the round's target pass."""
        for r, p in enumerate(probs_by_rank[: self.candidates]):
            self.prior_sum[r] += p
        self.prior_n += 1
        now = time.perf_counter()
        previous = self._round
        if previous is not None and previous.get("end") is not None:
            wall = now - previous["start"]
            self._update_fixed(wall - previous["target_s"])
        self._round = dict(start=now, tokens=tokens, parents=parents, ranks=ranks, budget=budget,
                           target_before=self._target_s(), target_s=0.0, end=None)

    def accepted(self, context, num_accepted: int) -> None:
        """After verification: which nodes survived (the accepted tokens are context[−k−1 : −1])."""
        r = self._round
        if r is None or r["end"] is not None:
            return
        r["end"] = time.perf_counter()
        r["target_s"] = self._target_s() - r["target_before"]
        self._update_cost(r["budget"], r["target_s"])
        path = accepted_nodes(r["tokens"], r["parents"], context[len(context) - num_accepted - 1 : -1].tolist()
                              if num_accepted else [])
        for i in range(len(self.hits)):
            self.hits[i] *= DECAY
            self.trials[i] *= DECAY
        for node, rank in enumerate(r["ranks"]):
            self.trials[rank] += 1.0
            if node in path:
                self.hits[rank] += 1.0

    def _target_s(self) -> float:
        return float(getattr(self.target, "forward_s", 0.0)) if self.target is not None else 0.0

    def _update_cost(self, budget: int, seconds: float) -> None:
        self.seen[budget] = self.seen.get(budget, 0) + 1
        if self.seen[budget] < 2 or seconds <= 0:
            return  # the first pass of a shape may include its compile
        recent = self.recent.setdefault(budget, [])
        recent.append(seconds)
        del recent[:-COST_WINDOW]
        self.cost[budget] = statistics.median(recent)

    def _update_fixed(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.fixed = seconds if self.fixed is None else (1 - COST_EMA) * self.fixed + COST_EMA * seconds

    def report(self) -> dict:
        """The current estimates, for benchmarks and docs."""
        return dict(budgets=self.budgets, cost_ms={b: 1000 * c for b, c in sorted(self.cost.items())},
                    fixed_ms=None if self.fixed is None else 1000 * self.fixed,
                    acceptance=self.acceptance(), predicted=self.predict(), chosen=list(self.chosen))


def accepted_nodes(tokens: list[int], parents: list[int], accepted: list[int]) -> set[int]:
    """The nodes of the tree (tokens, parents) on the path spelling `accepted` from the root (siblings
    carry distinct tokens, so the path is unique)."""
    path, node = set(), -1
    for token in accepted:
        child = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            break
        path.add(child)
        node = child
    return path
