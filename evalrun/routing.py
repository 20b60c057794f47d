"""Routing flips of mixture-of-experts models: pure comparison of two runs' captured routing. No I/O.

Top-k routing is a discrete decision inside the model, like a greedy token: two runs of one MoE model
can send a token to different experts. An MoE run stores, per decode step and MoE layer, the chosen
experts of the step's token (`routing_experts` [N, L, k]) and the router margin (`routing_margins`
[N, L]: the k-th minus the (k+1)-th router probability).

A flip's size is bounded below by the margins: if run A chose expert x and not y and run B chose y
and not x, the gap pA(x) - pA(y) >= mA became pB(x) - pB(y) <= -mB, so a gap between two router
probabilities changed by at least `needed` = mA + mB. Before the flip, where both runs chose the same
experts, the margins (gaps between router probabilities too) changed by |mA - mB|; the largest of
those is `moved`. A flip with needed <= moved is a **near-tie**: a change of the size the runs showed
where nothing flipped tipped a balanced decision (drift-like evidence). A flip that needs more than
the router moved anywhere before it is not explained by that movement.

When run B was forced along run A's routing (and tokens), every flip is comparable and verify judges them
all, through the one that needs the most, against an allowance it passes in as `moved`: the router error against
the float64 oracle of the golden's pinned run (and of the envelope of the candidate's dtype) x
rules.ROUTING_FLIP_MULTIPLIER. A golden whose oracle followed the pinned run's routing measures that error at
every entry (`router_error`: margin movements and the needs of its own flips); an older golden's oracle routed
freely, so only its entries before their first flip compare (`margin_movement`, until_flip). A flip that is no
near-tie is a routing change, not drift. A negative margin (no router reports one) is never a near-tie.

A run also stores the experts of its prompt's tokens before the last (`prompt_routing` [P - 1, L, k]: the
last's are step 0's). A golden's runs, and verify's forced runs, follow the pinned run's prompt routing too, so a
tie tipped inside a prefill moves nothing after it; those prompt flips are not judged (a router change shows at
the decode steps, which compare every step's own choice).

Shapes: N decode steps, P prompt tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np

ARRAYS = ("routing_experts", "routing_margins")
PROMPT_ARRAY = "prompt_routing"  # [P - 1, L, k] int16: the experts of the prompt's tokens before its last


@dataclass
class RoutingFlip:
    """The first (step, MoE layer) where two runs chose different experts for the same input; under forced routing
    the decisive one: the flip that needs the largest router-probability gap move."""

    step: int
    layer: int  # index among the model's MoE layers
    experts_a: list[int]  # sorted
    experts_b: list[int]
    margin_a: float  # router margin of run A there
    margin_b: float
    needed: float  # margin_a + margin_b: a router-probability gap changed at least this much
    moved: float  # largest |margin_a - margin_b| where both chose the same experts, before the flip (forced: the
    # allowance verify passes in: the golden's router error against the oracle x its multiplier)
    near_tie: bool  # needed <= moved
    flipped: int  # (step, layer) entries whose chosen experts differ, over the compared steps
    compared: int  # (step, layer) entries compared
    forced: bool = False  # B was forced along A's routing: `moved` is verify's allowance, and the flip is judged
    oracle_margin: float | None = None  # the float64 oracle's router margin there (along the same tokens)
    oracle_experts: list[int] | None = None  # and the experts it chose, sorted

    @property
    def distance(self) -> float:
        """needed / moved: <= 1 is a near-tie (with non-negative margins); a large finite number when nothing moved."""
        if not (self.margin_a >= 0 and self.margin_b >= 0):  # negative or NaN
            return 1e9
        return self.needed / self.moved if self.moved > 0 else (0.0 if self.needed <= 0 else 1e9)

    def describe(self, name_a: str = "A", name_b: str = "B") -> str:
        if self.forced:
            kind = "a near-tie: drift-like" if self.near_tie else "not a near-tie: more than the golden allows"
            movement = (f"the golden allows {self.moved:.3g} (its own router error against the float64 oracle, x "
                        "the verdict's multiplier)")
        else:
            kind = ("a near-tie: drift-like" if self.near_tie else
                    "not a near-tie: more than the router moved anywhere before it")
            movement = f"before it margins moved up to {self.moved:.3g}"
        oracle = ""
        if self.oracle_margin is not None:
            side = (name_a if self.oracle_experts == self.experts_a else name_b if self.oracle_experts == self.experts_b
                    else "neither")
            oracle = f"; the oracle's router margin there {self.oracle_margin:.3g}, its experts {side}'s"
        return (f"routing flip at step {self.step}, MoE layer {self.layer}: experts {self.experts_a} ({name_a}) vs "
                f"{self.experts_b} ({name_b}), router margin {self.margin_a:.3g} vs {self.margin_b:.3g}; the flip "
                f"needs a router-probability gap to move {self.needed:.3g}, {movement} ({kind}){oracle}; "
                f"{self.flipped} of {self.compared} step-layer routings differ")

    def with_oracle(self, oracle: Mapping[str, np.ndarray]) -> "RoutingFlip":
        """This flip with the oracle's router margin and experts at its step and layer (unchanged if the oracle
        holds no routing there). A margin near 0 says the model itself sits at a tie: whichever experts a run
        chose there, its implementation's rounding or tie-breaking chose them."""
        if not has_routing(oracle) or oracle["routing_experts"].shape[0] <= self.step:
            return self  # (a golden's oracle has the pinned run's routing shape: golden.results_problem)
        experts = np.sort(oracle["routing_experts"][self.step, self.layer]).tolist()
        return dataclasses.replace(self, oracle_margin=float(oracle["routing_margins"][self.step, self.layer]),
                                   oracle_experts=experts)


def has_routing(arrays: Mapping[str, np.ndarray]) -> bool:
    return all(name in arrays for name in ARRAYS)


@dataclass(frozen=True)
class RoutingPath:
    """The experts a forced run applies for one prompt: at each decode step's token [N, L, k], and at the prompt's
    tokens before its last [P - 1, L, k] (None: a result stored before prompt routing was: they route freely)."""

    steps: np.ndarray
    prompt: np.ndarray | None = None


def routing_path(arrays: Mapping[str, np.ndarray]) -> RoutingPath:
    """A result's routing as the path forced runs follow (a result with routing: has_routing)."""
    return RoutingPath(arrays["routing_experts"], arrays.get(PROMPT_ARRAY))


@dataclass
class PromptRoutingDiff:
    """Where two runs of one prompt routed its tokens before the last to other experts (sets: order is no flip)."""

    differ: int  # (prompt token, MoE layer) entries whose expert sets differ
    compared: int
    token: int  # the first of them: its prompt token (0: the prompt's first) and MoE layer
    layer: int
    experts_a: list[int]  # sorted
    experts_b: list[int]

    def describe(self, name_a: str = "A", name_b: str = "B") -> str:
        return (f"prompt routing differs at {self.differ} of {self.compared} prompt token-layer routings, first at "
                f"prompt token {self.token}, MoE layer {self.layer}: experts {self.experts_a} ({name_a}) vs "
                f"{self.experts_b} ({name_b}); every step's logits follow from the prefill")


def prompt_routing_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> PromptRoutingDiff | None:
    """Two results' prompt routing compared, None when either has none, their shapes differ, or none differs."""
    experts_a, experts_b = a.get(PROMPT_ARRAY), b.get(PROMPT_ARRAY)
    if experts_a is None or experts_b is None or experts_a.shape != experts_b.shape:
        return None
    sets_a, sets_b = np.sort(experts_a, axis=-1), np.sort(experts_b, axis=-1)  # [P - 1, L, k]
    differ = ~np.all(sets_a == sets_b, axis=-1)  # [P - 1, L]
    if not differ.any():
        return None
    token, layer = (int(i) for i in np.argwhere(differ)[0])  # token-major: the earliest token first
    return PromptRoutingDiff(int(differ.sum()), int(differ.size), token, layer, sets_a[token, layer].tolist(),
                             sets_b[token, layer].tolist())


def left_path(path: RoutingPath, arrays: Mapping[str, np.ndarray]) -> bool:
    """A run (its result's arrays) applied other experts than `path` somewhere, or the same ones in another order
    (the engine sums a token's experts in the order routed, so a forced run along the path differs in the bits):
    at a decode step or, when the path has them, at a prompt token."""
    own = arrays.get("routing_experts")
    if own is None or not np.array_equal(path.steps, own[:len(path.steps)]):
        return True
    return path.prompt is not None and not np.array_equal(path.prompt, arrays.get(PROMPT_ARRAY, np.empty(0)))


def _agreement(experts_a: np.ndarray, experts_b: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """-> (sets_a [n, L, k] sorted, agree [n*L] step-major, n), or None when the shapes differ (another model)."""
    n = min(steps, len(experts_a), len(experts_b))
    if experts_a.shape[1:] != experts_b.shape[1:] or n <= 0:
        return None
    sets_a, sets_b = np.sort(experts_a[:n], axis=-1), np.sort(experts_b[:n], axis=-1)  # [n, L, k]: order is no flip
    return sets_a, np.all(sets_a == sets_b, axis=-1).reshape(-1), n


def margin_movement(experts_a: np.ndarray, margins_a: np.ndarray, experts_b: np.ndarray, margins_b: np.ndarray,
                    steps: int, until_flip: bool = False) -> float:
    """The largest |margin_a - margin_b| over the (step, layer) entries where both runs chose the same experts,
    in their first `steps` steps (0.0 where none agree); `until_flip`: only before the first entry where they
    did not (runs not forced along one routing see other inputs after it)."""
    found = _agreement(experts_a, experts_b, steps)
    if found is None:
        return 0.0
    _, agree, n = found
    end = int(np.argmin(agree)) if until_flip and not agree.all() else agree.size  # step-major entries counted
    moved = np.abs(margins_a[:n].astype(np.float64) - margins_b[:n].astype(np.float64)).reshape(-1)[:end][agree[:end]]
    return float(moved.max()) if moved.size else 0.0


def router_error(experts_a: np.ndarray, margins_a: np.ndarray, experts_b: np.ndarray, margins_b: np.ndarray,
                 steps: int) -> float:
    """How far run B's router probabilities moved from run A's, bounded below at every (step, layer) entry of their
    first `steps` steps, when B followed A's routing (so that every entry has the same discrete inputs, but for
    the prefill's tokens before the last, whose routing nothing forces: a flip there moves later entries): where
    both chose the same experts |margin_a - margin_b|, where they did not margin_a + margin_b (a flip's `needed`);
    the largest of those (0.0 for other shapes)."""
    found = _agreement(experts_a, experts_b, steps)
    if found is None:
        return 0.0
    _, agree, n = found
    ma, mb = margins_a[:n].reshape(-1).astype(np.float64), margins_b[:n].reshape(-1).astype(np.float64)
    return float(np.where(agree, np.abs(ma - mb), ma + mb).max())


def routing_flip(experts_a: np.ndarray, margins_a: np.ndarray, experts_b: np.ndarray, margins_b: np.ndarray,
                 steps: int, moved: float | None = None) -> RoutingFlip | None:
    """experts [N, L, k], margins [N, L] of two runs over the same inputs for their first `steps` steps ->
    the first flip, or None when every chosen set agrees (or the shapes differ: another model). `moved`: the
    router's movement to judge it by, when B was forced along A's routing (default: before the flip)."""
    found = _agreement(experts_a, experts_b, steps)
    if found is None or found[1].all():
        return None
    sets_a, agree, n = found
    ma, mb = margins_a[:n].reshape(-1).astype(np.float64), margins_b[:n].reshape(-1).astype(np.float64)
    forced = moved is not None
    if forced:  # the decisive flip: a broken margin (negative, NaN) first, then the largest gap needed
        broken = (ma < 0) | (mb < 0) | np.isnan(ma + mb)
        first = int(np.argmax(np.where(agree, -np.inf, np.where(broken, np.inf, ma + mb))))
    else:
        first = int(np.argmin(agree))
    step, layer = divmod(first, experts_a.shape[1])
    if moved is None:
        before = np.abs(ma[:first] - mb[:first])  # every entry before the flip agrees
        moved = float(before.max()) if before.size else 0.0
    needed = ma[first] + mb[first]
    near_tie = needed <= moved and ma[first] >= 0 and mb[first] >= 0
    return RoutingFlip(step, layer, sets_a[step, layer].tolist(), np.sort(experts_b[step, layer]).tolist(),
                       float(ma[first]), float(mb[first]), float(needed), moved, bool(near_tie),
                       int((~agree).sum()), int(agree.size), forced)


def result_flip(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], steps: int,
                moved: float | None = None) -> RoutingFlip | None:
    """The first routing flip between two prompt results' arrays (None for dense models); `moved` as routing_flip."""
    if not (has_routing(a) and has_routing(b)):
        return None
    return routing_flip(a["routing_experts"], a["routing_margins"], b["routing_experts"], b["routing_margins"], steps,
                        moved)


def result_movement(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], steps: int,
                    until_flip: bool = False) -> float:
    """margin_movement between two prompt results' arrays (0.0 for dense models)."""
    if not (has_routing(a) and has_routing(b)):
        return 0.0
    return margin_movement(a["routing_experts"], a["routing_margins"], b["routing_experts"], b["routing_margins"],
                           steps, until_flip)


def result_router_error(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], steps: int) -> float:
    """router_error between two prompt results' arrays (0.0 for dense models)."""
    if not (has_routing(a) and has_routing(b)):
        return 0.0
    return router_error(a["routing_experts"], a["routing_margins"], b["routing_experts"], b["routing_margins"], steps)


def problem(arrays: Mapping[str, np.ndarray], steps: int, prompt_tokens: int) -> str:
    """What is wrong with a result's routing arrays ('' when nothing, or when it has none): one without the
    other, shapes that are not [steps, L, k] and [steps, L] (and [prompt_tokens - 1, L, k] for the prompt's),
    experts that are not non-negative integer ids, margins that are not probability gaps in [0, 1] (what
    verify's forced routing and its allowance read)."""
    present = [name in arrays for name in ARRAYS]
    if not any(present):
        return "prompt routing without the steps' routing" if PROMPT_ARRAY in arrays else ""
    if not all(present):
        return "routing arrays of inconsistent shapes"
    experts, margins = arrays["routing_experts"], arrays["routing_margins"]
    if not (experts.ndim == 3 and experts.shape[0] == steps and margins.shape == experts.shape[:2]
            and experts.shape[2] > 0):
        return "routing arrays of inconsistent shapes"
    prompt = arrays.get(PROMPT_ARRAY)
    if prompt is not None and prompt.shape != (max(prompt_tokens - 1, 0),) + experts.shape[1:]:
        return "prompt_routing of another shape than the prompt's tokens and the steps' routing"
    for name, ids in (("routing_experts", experts), (PROMPT_ARRAY, prompt)):
        if ids is not None and (not np.issubdtype(ids.dtype, np.integer) or (ids.size and ids.min() < 0)):
            return f"{name} that are not expert ids (dtype {ids.dtype})"
    if not (np.issubdtype(margins.dtype, np.floating) and np.all((margins >= 0) & (margins <= 1))):
        return "routing_margins that are not probability gaps in [0, 1]"
    return ""
