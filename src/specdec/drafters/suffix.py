"""`SuffixDecoding`: model-free drafting from a suffix trie over this request's tokens and earlier requests'
outputs (SuffixDecoding, Oliaro et al., arXiv 2411.04975; vLLM's `suffix` speculative method).

Each round the longest suffix of the committed context seen before (the *pattern*, at most `depth` − `max_depth`
tokens, so that the tree has room below it) is looked up in two tries: the request's own (its prompt and output
so far) and a `SuffixCache` shared by every request of a drafter and its forks (the outputs of earlier requests).
From where the pattern ends, the continuations seen after its earlier occurrences are grown best first into a
token tree: a node's score is the product, along its path, of count(child) / count(parent), so a continuation seen
3 times in 4 scores 0.75. Nodes scoring below `min_token_prob` are dropped and at most `max_spec_factor` ·
len(pattern) + `max_spec_offset` nodes (and `max_nodes`) are proposed: a long match earns a big tree, a short one
a small guess. The two tries' trees are merged (a path in both keeps its higher score) and the best nodes kept.
Every node is a deterministic function of the context and the cache, a point mass (draft_probs=None), so
verification stays exact at every temperature.

The index (`SuffixTrie`) holds every suffix of every sequence cut to `depth` tokens, identical prefixes merged, and
counts at each node how many suffixes pass through it. A path taken by one suffix only is not spelt out: it is a
*leaf*, a reference (sequence, position) into the sequence itself, which grows with the sequence at no cost. A
second occurrence splits the leaf into a node with count 2. So one more token costs one step per suffix of the
sequence that still ends at a shared node (those that repeat earlier text), not `depth` steps, and a prompt is
indexed in about one step per token plus one per repeated token.

The cache keeps whole requests, least recently used first out: an entry is used when it is stored and when a
proposal drawn from the cache walks its tokens; storing more than `max_tokens` tokens evicts the least recently
used entries. A request enters the cache when it is over: at the drafter's next `reset`, when its row leaves a
batch (`SuffixRows`) or on `finish()`. A request whose prompt equals a cached request's replaces that entry and is
not drafted from it, so a rerun of the same prompt is drafted as its first run was (benchmark repeats stay fair).

On the fast path (`compile=True` / "static") every verification width is a compiled shape: the drafter names the
node budgets `FAST_BUDGETS` (`plan`), pads its wanted budget up to the next one and fills the free rows with the
next best nodes of any score.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import BatchSetting, Drafter, DrafterCapabilities, DraftRow, Proposal
from specdec.drafters.per_row import PerRow
from specdec.errors import ConfigError

#: An internal node's key for its count (token ids are >= 0, so it never clashes with a child).
COUNT = -1
#: Suffix depth of the tries unless told otherwise: the pattern plus the tree's depth fit in it.
DEFAULT_DEPTH = 32
#: Tokens a `SuffixCache` keeps unless told otherwise (whole requests; the least recently used leave first).
DEFAULT_CACHE_TOKENS = 1 << 16
#: Node budgets on the fast path (each budget + 1 rows is a compiled verification shape; 0: a plain pass).
FAST_BUDGETS = (0, 3, 7, 15)  # max_nodes caps them (7 by default: 1, 4 and 8 rows)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_float(name: str, value: object, minimum: float, maximum: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name} must be a number {bound}, got {value!r}")
    return float(value)


class _Tokens(list):
    """One sequence of a trie: its tokens, and the starts of its suffixes that end at a shared (internal) node
    with the node, in order of start (longest first): the only suffixes a new token must be walked for."""

    __slots__ = ("active", "key")

    def __init__(self, key: object = None):
        super().__init__()
        self.active: list[tuple[int, dict]] = []
        self.key = key


class SuffixTrie:
    """Every suffix of every sequence added, cut to `depth` tokens, as a trie counting its occurrences.

    An internal node is a dict: token -> child, and COUNT -> how many suffixes pass through it (or end at it).
    A child taken by one suffix only is a leaf, the tuple (sequence, i): the path goes on with sequence[i], ...
    up to the suffix's `depth`-th token or the sequence's end (it grows with the sequence).
    """

    def __init__(self, depth: int = DEFAULT_DEPTH):
        self.depth = _check_int("depth", depth, 2)
        self.root: dict = {COUNT: 0}
        self.nodes = 0  # internal nodes besides the root
        self.tokens = 0  # tokens of the sequences held

    # -- building ---------------------------------------------------------------------------------------
    def add(self, tokens: Sequence[int] = (), key: object = None) -> _Tokens:
        """A new sequence (a handle for `extend` / `remove`), indexed with `tokens`."""
        seq = _Tokens(key)
        self.extend(seq, tokens)
        return seq

    def extend(self, seq: _Tokens, tokens: Sequence[int]) -> None:
        """Append `tokens` to `seq`: each new token extends the suffixes that end at a shared node."""
        root, depth = self.root, self.depth
        for t in tokens:
            i = len(seq)
            seq.append(t)
            root[COUNT] += 1
            active = seq.active
            active.append((i, root))  # the suffix starting at t, empty so far
            kept = []
            for start, node in active:  # node: where seq[start:i] ends; extend it by t
                child = node.get(t)
                if child is None:  # first time this path goes on with t: the suffix becomes a leaf
                    node[t] = (seq, i)
                elif type(child) is dict:
                    child[COUNT] += 1
                    if i + 1 - start < depth:
                        kept.append((start, child))
                else:  # another suffix's leaf: split off its first token as a shared node
                    other, j = child
                    shared = {COUNT: 2}
                    self.nodes += 1
                    node[t] = shared
                    d = i + 1 - start  # depth of the shared node
                    if d < depth:
                        if j + 1 < len(other):
                            shared[other[j + 1]] = (other, j + 1)
                        else:  # the other suffix ends there for now (a sequence still growing)
                            other.active.append((j + 1 - d, shared))
                        kept.append((start, shared))
            seq.active = kept
        self.tokens += len(tokens)

    def remove(self, seq: _Tokens) -> None:
        """Take `seq` out: every one of its suffixes is walked, its counts taken back, its nodes and leaves freed."""
        depth = self.depth
        n = len(seq)
        for start in range(n):
            node = self.root
            node[COUNT] -= 1
            for i in range(start, min(start + depth, n)):
                token = seq[i]
                child = node.get(token)
                if child is None:
                    break
                if type(child) is not dict:  # a leaf on this suffix's path has this suffix as its only one
                    if child[0] is seq:
                        del node[token]
                    break
                child[COUNT] -= 1
                if child[COUNT] == 0:
                    del node[token]
                    self.nodes -= 1
                node = child
        seq.active = []
        self.tokens -= n
        seq.clear()

    # -- looking up -------------------------------------------------------------------------------------
    def locate(self, pattern: Sequence[int]):
        """Where `pattern` ends: (node, None, 0) at an internal node, (None, seq, i) inside a leaf whose next
        token is seq[i] (if the leaf goes on), or None if it does not occur (within `depth`)."""
        node = self.root
        depth = self.depth
        n = len(pattern)
        if n > depth:
            return None
        for k in range(n):
            child = node.get(pattern[k])
            if child is None:
                return None
            if type(child) is dict:
                node = child
                continue
            seq, i = child  # one suffix from here: compare the rest with its tokens
            end = min(i - k + depth, len(seq))
            rest = n - k
            if i + rest > end or seq[i : i + rest] != list(pattern[k:]):
                return None
            return None, seq, i + rest
        return node, None, 0

    def count(self, pattern: Sequence[int]) -> int:
        """How many suffixes start with `pattern` (its occurrences, each cut to `depth` tokens)."""
        where = self.locate(pattern)
        if where is None:
            return 0
        return where[0][COUNT] if where[0] is not None else 1

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """token -> how many occurrences of `pattern` go on with it (within `depth`)."""
        where = self.locate(pattern)
        if where is None:
            return {}
        node, seq, i = where
        if node is None:
            end = min(i - len(pattern) + self.depth, len(seq))
            return {seq[i]: 1} if i < end else {}
        return {t: (c[COUNT] if type(c) is dict else 1) for t, c in node.items() if t != COUNT}

    def longest_match(self, context: Sequence[int], longest: int):
        """The longest suffix of `context` (at most `longest` tokens) that occurs with a continuation:
        (its length m, where it ends as `locate` gives it), or (0, None). A binary search on the length (a
        suffix of an occurring pattern occurs too), then down to the first length with a continuation."""
        lo, hi = 0, min(longest, len(context), self.depth - 1)
        n = len(context)
        found = {}
        while lo < hi:  # invariant: a pattern of length lo occurs (lo = 0: the empty one)
            mid = (lo + hi + 1) // 2
            where = self.locate(context[n - mid :])
            if where is None:
                hi = mid - 1
            else:
                found[mid] = where
                lo = mid
        for m in range(lo, 0, -1):
            where = found.get(m) or self.locate(context[n - m :])
            node, seq, i = where
            if node is not None and len(node) > 1:
                return m, where
            if node is None and i < min(i - m + self.depth, len(seq)):
                return m, where
        return 0, None

    def repeated(self, seq: _Tokens, longest: int):
        """The longest suffix of `seq` (at most `longest` tokens) that also occurs earlier in this trie, with a
        continuation: (its length m, where it ends as `locate` gives it), or (0, None). Read off the suffixes of
        `seq` that end at a shared node (`seq.active`), no walk."""
        n = len(seq)
        best = None
        for start, node in seq.active:
            m = n - start
            if m <= longest and len(node) > 1 and (best is None or m > best[0]):
                best = (m, (node, None, 0))
        return best or (0, None)

    def grow(self, where, matched: int, budget: int, max_depth: int, min_prob: float, fill: int = 0,
             discount: int = 0):
        """The best-first tree of continuations from `where` (a pattern of `matched` tokens): up to `budget`
        nodes scoring at least `min_prob`, then up to `fill` nodes in all of any score; at most `max_depth` deep.
        A node's score is its parent's times count(child) / count(parent) (`discount` occurrences of the pattern
        itself that have no continuation yet are left out of the first level's count).
        Returns (tokens, parents, scores, sequences whose leaves were walked)."""
        depth_cap = min(max_depth, self.depth - matched)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        walked: list[_Tokens] = []
        limit = max(budget, fill)
        if where is None or limit <= 0 or depth_cap <= 0:
            return tokens, parents, scores, walked
        heap: list = []
        order = 0

        def push_children(state, prob: float, parent: int, d: int, discount: int = 0) -> None:
            """Push the continuations after `state` (a node or a leaf position) at tree depth d + 1."""
            nonlocal order
            if d >= depth_cap:
                return
            node, seq, i = state
            if node is None:
                if i < min(i - (matched + d) + self.depth, len(seq)):
                    heapq.heappush(heap, (-prob, order, seq[i], (None, seq, i + 1), parent, d + 1))
                    order += 1
                return
            total = node[COUNT] - discount
            if total <= 0:
                return
            kids = [(c[COUNT] if type(c) is dict else 1, t, c) for t, c in node.items() if t != COUNT]
            room = limit - len(tokens)
            if len(kids) > room:  # only the `room` most frequent siblings can be taken (ties: first seen)
                kids = heapq.nlargest(room, kids, key=_first)
            for count, t, child in kids:
                nxt = (child, None, 0) if type(child) is dict else (None, child[0], child[1] + 1)
                heapq.heappush(heap, (-(prob * (count / total)), order, t, nxt, parent, d + 1))  # <= prob
                order += 1

        push_children(where, 1.0, -1, 0, discount)
        while heap and len(tokens) < limit:
            neg, _, token, state, parent, d = heapq.heappop(heap)
            prob = -neg
            if prob < min_prob and len(tokens) >= fill:
                break
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(prob)
            if state[0] is None and (not walked or walked[-1] is not state[1]):
                walked.append(state[1])
            push_children(state, prob, index, d)
        return tokens, parents, scores, walked


class SuffixCache:
    """The outputs of earlier requests, as one `SuffixTrie`, shared by a drafter and its forks (one per server).

    max_tokens: the most tokens kept; storing more evicts whole requests, least recently used first (a request is
        used when stored and when a proposal walks its tokens). 0 keeps nothing (no cross-request drafting).
    depth: the tries' suffix depth (a drafter using this cache indexes its requests with the same depth).
    Memory: at most `depth` nodes per token; text seen once costs one leaf per token.
    """

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS, depth: int = DEFAULT_DEPTH):
        self.max_tokens = _check_int("max_tokens", max_tokens, 0)
        self.trie = SuffixTrie(depth)
        self.entries: OrderedDict[object, _Tokens] = OrderedDict()  # key -> sequence, least recently used first

    @property
    def depth(self) -> int:
        return self.trie.depth

    @property
    def tokens(self) -> int:
        """Tokens held now (<= max_tokens)."""
        return self.trie.tokens

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def store(self, key: object, tokens: Sequence[int]) -> None:
        """Keep `tokens` (a request's output, cut to max_tokens) as the entry `key`, replacing any entry of that
        key, then evict the least recently used entries until max_tokens holds."""
        self.forget(key)
        tokens = list(tokens[: self.max_tokens])
        if not tokens:
            return
        while self.entries and self.trie.tokens + len(tokens) > self.max_tokens:
            _, oldest = self.entries.popitem(last=False)
            self.trie.remove(oldest)
        self.entries[key] = self.trie.add(tokens, key)

    def forget(self, key: object) -> None:
        """Drop the entry `key` if there is one."""
        seq = self.entries.pop(key, None)
        if seq is not None:
            self.trie.remove(seq)

    def used(self, sequences: Sequence[_Tokens]) -> None:
        """Mark the entries of these sequences as just used (a proposal walked them)."""
        for seq in sequences:
            if seq.key in self.entries and self.entries[seq.key] is seq:
                self.entries.move_to_end(seq.key)

    def clear(self) -> None:
        for key in list(self.entries):
            self.forget(key)


class SuffixDecoding(Drafter):
    """Propose a token tree from the continuations of the context's longest suffix seen before, in this request
    or in earlier requests' outputs (`SuffixCache`), scored by their frequencies.

    max_nodes: the most nodes a proposal has (the eager path's widest verification pass is max_nodes + 1 rows).
    max_depth: the deepest a proposal goes (its default γ; an explicit γ caps it further).
    max_spec_factor, max_spec_offset: a pattern of m tokens earns at most floor(factor · m + offset) nodes
        (vLLM's defaults are 1 and 0; here offset 1 and max_nodes 7 suit a CPU pass, whose cost grows with its
        rows: docs/suffix.md).
    min_token_prob: nodes whose estimated probability (the product of count ratios along the path) is lower are
        not proposed (on the fast path they may still fill rows the padded pass pays for anyway).
    cache: the cross-request cache (default: a new `SuffixCache()`, shared with this drafter's forks); pass one
        cache to several drafters to share it, `SuffixCache(max_tokens=0)` to draft from the request alone.
    """

    vocab_size = None  # no vocabulary of its own: any target works

    def __init__(self, max_nodes: int = 7, max_depth: int = 15, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 1.0, min_token_prob: float = 0.1, cache: SuffixCache | None = None):
        self.max_nodes = _check_int("max_nodes", max_nodes, 1)
        self.max_depth = _check_int("max_depth", max_depth, 1)
        self.max_spec_factor = _check_float("max_spec_factor", max_spec_factor, 0.0)
        self.max_spec_offset = _check_float("max_spec_offset", max_spec_offset, -float(self.max_nodes))
        self.min_token_prob = _check_float("min_token_prob", min_token_prob, 0.0, 1.0)
        if cache is not None and not isinstance(cache, SuffixCache):
            raise ConfigError(f"cache must be a specdec.SuffixCache (or None for a new one), got "
                              f"{type(cache).__name__}; share a cache by passing the same SuffixCache to each drafter")
        self.cache = SuffixCache() if cache is None else cache
        if self.max_depth >= self.cache.depth:
            raise ConfigError(f"max_depth ({max_depth}) must be below the cache's suffix depth ({self.cache.depth}): "
                              f"lower max_depth or pass cache=SuffixCache(depth={self.max_depth + 17})")
        self.fast = False
        self.last: dict | None = None  # the last proposal: pattern length per trie, score, nodes (for reports)
        self._start_request(None, None)

    def _start_request(self, key: object, prompt: torch.Tensor | None) -> None:
        self._local = SuffixTrie(self.cache.depth)
        self._seq = self._local.add()
        self._key = key
        self._prompt_len = 0 if prompt is None else int(prompt.shape[0])
        if prompt is not None:
            self._local.extend(self._seq, prompt.tolist())

    @property
    def index(self) -> SuffixTrie:
        """The request's own trie (its prompt and the tokens committed so far)."""
        return self._local

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A tree of at most max_nodes nodes, max_depth (and max_nodes) deep; batched as a fork per row whose request
        enters the shared cache when its row leaves (`SuffixRows`)."""
        return DrafterCapabilities(tree=True, batched=SuffixRows, default_gamma=min(self.max_depth, self.max_nodes),
                                   max_nodes=self.max_nodes)  # a tree of max_nodes is at most that deep

    def fork(self) -> SuffixDecoding:
        """The same settings and the same cache; its own request."""
        twin = super().fork()
        twin.last = None
        twin._start_request(None, None)
        return twin

    def use_fast_path(self, mode: bool | str) -> None:
        self.fast = bool(mode)

    def plan(self, target: object) -> tuple[int, ...]:
        """On the fast path: the node budgets it pads to (FAST_BUDGETS up to max_nodes, and max_nodes)."""
        if not self.fast:
            return ()
        return tuple(sorted({b for b in FAST_BUDGETS if b < self.max_nodes} | {self.max_nodes}))

    # -- requests -----------------------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor, **_) -> None:
        """A new request: the previous one's output enters the cache (unless its prompt is this one's), an entry
        of this prompt leaves it, and the prompt is indexed."""
        key = hash(tuple(prompt_ids.tolist()))
        if key != self._key:
            self.finish()
        self.cache.forget(key)
        self._start_request(key, prompt_ids)

    def finish(self) -> None:
        """The request is over: its output (the tokens after its prompt) enters the cache. Called by `reset` and
        when the request's row leaves a batch; a second call does nothing."""
        if self._key is not None:
            self.cache.store(self._key, self._seq[self._prompt_len :])
        self._start_request(None, None)

    def _extend(self, context: torch.Tensor) -> None:
        """Index the committed tokens not indexed yet. context [n] starts with the indexed tokens."""
        done = len(self._seq)
        n = int(context.shape[0])
        if n < done:  # not this request's context: start over with it as a prompt
            self._start_request(self._key, context)
            return
        if n > done:
            self._local.extend(self._seq, context[done:].tolist())

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        self._extend(context)

    # -- proposing ----------------------------------------------------------------------------------------
    def budget(self, matched: int) -> int:
        """Nodes a pattern of `matched` tokens earns: floor(factor · m + offset), at most max_nodes."""
        return max(0, min(self.max_nodes, int(self.max_spec_factor * matched + self.max_spec_offset + 1e-6)))

    def draft(self, gamma: int) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, scores) of the proposal continuing the indexed context, at most `gamma` deep: the
        trees grown in the request's trie and in the cache, merged (a path found in both scores the higher of
        its two scores), best first, as many nodes as the longer match earns (on the fast path: its padded
        width)."""
        depth = min(gamma, self.max_depth)
        longest = self.cache.depth - self.max_depth  # the pattern leaves room for a max_depth-deep tree
        trees, walked, limit, matched = [], [], 0, {}
        for name, trie, discount in (("request", self._local, 1), ("cache", self.cache.trie, 0)):
            if trie.tokens == 0:
                continue
            # In its own trie the context's suffixes are indexed: those seen before end at shared nodes.
            if trie is self._local:
                m, where = trie.repeated(self._seq, longest)
            else:
                m, where = trie.longest_match(self._seq[-longest:], longest)
            if m == 0:
                continue
            budget = self.budget(m)
            fill = _padded(budget, self.plan(None)) if self.fast else 0
            tokens, parents, scores, seqs = trie.grow(where, m, budget, depth, self.min_token_prob, fill=fill,
                                                      discount=discount if where[0] is not None else 0)
            if tokens:
                trees.append((tokens, parents, scores))
                walked += seqs
                limit = max(limit, budget, fill)
                matched[name] = m
        tokens, parents, scores = _merge(trees, limit)
        if walked:
            self.cache.used(walked)
        self.last = {"matched": matched, "score": sum(scores), "nodes": len(tokens)}
        return tokens, parents, scores

    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        self._extend(context)  # no-op after commit; catches up if commit was skipped
        tokens, parents, _ = self.draft(gamma)
        device = context.device
        if all(p == i - 1 for i, p in enumerate(parents)):  # a chain (or nothing): the chain path
            return Proposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device))  # [γ']
        # A point mass on every node at any temperature: q(x) = 1 for the proposed token.
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device),  # [N]
                        parents=torch.tensor(parents, dtype=torch.long))  # [N]


def _merge(trees: list[tuple[list[int], list[int], list[float]]], limit: int):
    """The trees (tokens, parents, scores) as one: a path in several keeps its highest score; the `limit` best
    nodes (a node never scores above its parent, so they form a tree), parents first."""
    if len(trees) == 1:
        tokens, parents, scores = trees[0]
        return tokens[:limit], parents[:limit], scores[:limit]
    best: dict[tuple[int, ...], list] = {}  # path -> [score, first seen]
    for tokens, parents, scores in trees:
        paths: list[tuple[int, ...]] = []
        for token, parent, score in zip(tokens, parents, scores):
            path = (paths[parent] if parent >= 0 else ()) + (token,)
            paths.append(path)
            if path in best:
                best[path][0] = max(best[path][0], score)
            else:
                best[path] = [score, len(best)]
    index: dict[tuple[int, ...], int] = {}
    for path in sorted(best, key=lambda path: (-best[path][0], len(path), best[path][1])):
        if len(index) == limit:
            break
        if len(path) == 1 or path[:-1] in index:  # always so: a parent scores at least its child, and sorts first
            index[path] = len(index)
    return ([path[-1] for path in index], [index.get(path[:-1], -1) for path in index],
            [best[path][0] for path in index])


def _first(item: tuple) -> object:
    return item[0]


def _padded(budget: int, budgets: tuple[int, ...]) -> int:
    """The smallest fast-path budget >= `budget` (the rows the padded pass pays for)."""
    return next((b for b in budgets if b >= budget), budgets[-1] if budgets else budget)


class SuffixRows(PerRow):
    """`SuffixDecoding` over a batch's rows: a fork per row (sharing the cache); a row's request enters the cache
    when the row leaves."""

    def __init__(self, drafter: SuffixDecoding, fork: bool = True, setting: BatchSetting | None = None):
        super().__init__(drafter, fork)
        self.rows: list[Drafter] = []  # each row's drafter, in row order

    def add_rows(self, rows: Sequence[DraftRow], features) -> None:
        super().add_rows(rows, features)
        self.rows.extend(row.drafter for row in rows)

    def remove_rows(self, keep: Sequence[int]) -> None:
        kept = set(keep)
        for i, drafter in enumerate(self.rows):
            if i not in kept:
                drafter.finish()
        self.rows = [self.rows[i] for i in keep]
