"""A pairwise covering array (every pair of values of two dimensions in at least one cell) whose forbidden
combinations are learnt from the configuration's own refusals, not written down beside them.

Our own greedy generator (AETG's idea: one cell at a time, each value chosen to cover the most pairs not yet
covered), about 100 lines, rather than allpairspy or covertable: neither is installed here, and both take their
constraints as a predicate over a partial row, which the pre-launch check cannot be (it needs a whole config). Stable:
the dimensions' order, the seam cells first, the first uncovered pair in a fixed order and ties broken by a
``random.Random(seed)`` give the same cells for the same check results; adding a value adds the cells its pairs need.

``refused(values)`` (the check; memoised) decides each candidate. A refused candidate is reduced towards the base
values (each dimension's first) to a minimal set of values that is still refused, the *forbidden* set (a value
refused with the base values alone is widened by the base value it clashes with, e.g. tp with GPT-2); that set's
cell (base values elsewhere) becomes a refused cell of the array, and no later candidate contains the set. Every
pair then ends in a cell that runs, or inside a forbidden set of two (or one) values, or is listed as not coverable.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field


@dataclass
class Array:
    cells: list[tuple[dict, str | None, str | None]] = field(default_factory=list)  # (values, refusal, seam)
    forbidden: list[tuple[dict, str]] = field(default_factory=list)  # (values, the refusal's message)
    uncoverable: list[tuple] = field(default_factory=list)  # pairs in no running cell and no forbidden set
    # pairs refused in every cell: a forbidden set within them, or a dimension each of whose values completes one
    refused_pairs: list[tuple] = field(default_factory=list)
    checks: int = 0


def covering_array(dimensions: dict[str, tuple[str, ...]], refused, seeds=(), seed: int = 0,
                   max_rounds: int = 400) -> Array:
    """``refused(values: dict) -> str | None``: the refusal's message, or None if accepted. ``seeds``: (name,
    partial values) cells to make first."""
    dims, base = list(dimensions), {d: v[0] for d, v in dimensions.items()}
    rng, memo, out = random.Random(seed), {}, Array()
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(dims, 2)
                 for x in dimensions[a] for y in dimensions[b]}

    def check(values: dict) -> str | None:
        key = tuple(values[d] for d in dims)
        if key not in memo:
            memo[key] = refused(values)
            out.checks += 1
        return memo[key]

    def clashes(values: dict) -> bool:
        return any(all(values.get(d) == v for d, v in bad.items()) for bad, _ in out.forbidden)

    def gain(values: dict, dim: str, value: str) -> int:
        return sum(1 for d, v in values.items() if _pair(dims, (d, v), (dim, value)) in uncovered)

    def fill(partial: dict, tries: int = 20) -> dict | None:
        """A cell holding ``partial``, clashing with no forbidden set, each free value the one covering most pairs
        (in a shuffled order of the dimensions); another order where the greedy choices met a dimension with every
        value clashing (merge, then an adapter, then a layout that adapter is refused under)."""
        for _ in range(tries):
            values = _fill_once(partial)
            if values is not None:
                return values
        return None

    def _fill_once(partial: dict) -> dict | None:
        values = dict(partial)
        free = [d for d in dims if d not in values]
        rng.shuffle(free)
        for dim in free:
            options = [v for v in dimensions[dim] if not clashes({**values, dim: v})]
            if not options:
                return None
            values[dim] = max(options, key=lambda v: gain(values, dim, v))  # first of the best: stable
        return {d: values[d] for d in dims}

    def refused_everywhere(partial: dict) -> bool:
        """Every cell holding ``partial`` holds a forbidden set: one within it, or a dimension each of whose values
        completes one (TP with GPT-2 refused for the plan, with Llama and Qwen2 for compiling: TP x aot_eager)."""
        return clashes(partial) or any(all(clashes({**partial, d: v}) for v in dimensions[d])
                                       for d in dims if d not in partial)

    def add(values: dict, seam: str | None, partial: dict | None = None) -> None:
        message = check(values)
        if message is None:
            out.cells.append((values, None, seam))
            uncovered.difference_update(_pairs(dims, values))
            return
        bad = _reduce(values, base, dimensions, check)
        reduced = {**base, **bad}
        if any(bad == known for known, _ in out.forbidden):  # nothing learnt (the caller sees it)
            return
        out.forbidden.append((bad, check(reduced)))
        if all(v != reduced for v, _, _ in out.cells):
            own = seam if all((partial or {}).get(d) == v for d, v in bad.items()) else None
            out.cells.append((reduced, check(reduced), own))
        if len(bad) == 2:  # that pair is refused in any cell
            uncovered.discard(_pair(dims, *bad.items()))
        elif len(bad) == 1:  # that value is refused whatever one other value is
            uncovered.difference_update({p for p in uncovered if set(bad.items()) & set(p)})

    for name, partial in seeds:  # a seam is a cell that runs if any completion of it does
        for _ in range(20):
            if _label(out, base, partial, name):  # refused whatever the rest: an earlier cell's refusal is its
                break
            values = fill(partial) if not clashes(partial) else None
            if values is None:
                out.uncoverable.append(tuple(partial.items()))
                break
            add(values, name, partial)
            if out.cells[-1][1] is None or all(partial.get(d) == v for d, v in out.forbidden[-1][0].items()):
                break  # it runs, or the refusal is about the seam's own values
    for _ in range(max_rounds):
        if not uncovered:
            break
        pair = min(uncovered, key=lambda p: (dims.index(p[0][0]), dimensions[p[0][0]].index(p[0][1]),
                                             dims.index(p[1][0]), dimensions[p[1][0]].index(p[1][1])))
        values = fill(dict(pair)) if not clashes(dict(pair)) else None
        learnt = len(uncovered), len(out.forbidden)
        if values is not None:
            add(values, None)
        if values is None or (len(uncovered), len(out.forbidden)) == learnt:  # no cell to try, or nothing learnt
            (out.refused_pairs if refused_everywhere(dict(pair)) else out.uncoverable).append(pair)
            uncovered.discard(pair)
    out.uncoverable += sorted(uncovered)
    return out


def _label(out: Array, base: dict, partial: dict, name: str) -> bool:
    """A seam whose own values hold a set already forbidden (an earlier cell's refusal reduced to them): that set's
    refused cell is the seam's cell, named so (instead of the seam listed as not coverable)."""
    for bad, _ in out.forbidden:
        if all(partial.get(d) == v for d, v in bad.items()):
            reduced = {**base, **bad}
            for i, (values, message, seam) in enumerate(out.cells):
                if values == reduced and seam is None:
                    out.cells[i] = (values, message, name)
            return True
    return False


def _pair(dims, a, b):
    return (a, b) if dims.index(a[0]) < dims.index(b[0]) else (b, a)


def _pairs(dims, values: dict) -> set:
    return {_pair(dims, (a, values[a]), (b, values[b])) for a, b in itertools.combinations(dims, 2)}


def _field(message: str) -> str:
    """The field a refusal names (``ConfigError``'s "field: why"): what tells one refusal's cause from another's."""
    return message.split(":", 1)[0]


def _reduce(values: dict, base: dict, dimensions: dict, check) -> dict:
    """A minimal set of ``values``' non-base values still refused, for the same field, with base values elsewhere
    (each dropped in turn where the refusal's field stays). A value whose base value is refused for another field
    stays in the set: GPT-2 (the base) has no TP plan, so a cell refused for compiling under TP on Llama reduces to
    {tp, llama, aot_eager}, not {tp} widened by GPT-2; reading TP's own refusal as the cell's had recorded a set the
    cell did not hold and tried the same cell again until the rounds ran out (267 pairs left in no cell). A single
    value refused with the base values is widened by the base value it needs (the first dimension where another value
    is accepted)."""
    field = _field(check(values))
    bad = {d: v for d, v in values.items() if v != base[d]}
    for d in list(bad):
        trial = {k: v for k, v in bad.items() if k != d}
        message = check({**base, **trial})
        if message is not None and _field(message) == field:
            bad = trial
    if len(bad) == 1:
        for d in dimensions:
            if d not in bad and any(check({**base, **bad, d: v}) is None for v in dimensions[d][1:]):
                return {**bad, d: base[d]}
    return bad
