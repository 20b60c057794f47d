"""Routing flips of MoE models: the pure comparison (evalrun/routing.py), and that `evalrun diff` and
`golden verify` name a planted routing flip as such, with the router margin there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evalrun.config import build_config
from evalrun.engine.faults import Fault, fault_hook, plant
from evalrun.golden import open_golden
from evalrun.routing import RoutingPath, margin_movement, router_error, routing_flip, routing_path
from evalrun.runner import execute_run, prepare
from evalrun.store import Store
from evalrun.verify import candidate_config, verify_golden
from test_moe import moe_checkpoint

# ---------------------------------------------------------------- the pure comparison

EXPERTS = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])  # [N=3, L=2, k=2]
MARGINS = np.array([[0.10, 0.20], [0.30, 0.40], [0.05, 0.06]], dtype=np.float32)  # [N, L]


def test_equal_routing_and_a_reordered_set_are_no_flip():
    reordered = EXPERTS[..., ::-1].copy()
    assert routing_flip(EXPERTS, MARGINS, EXPERTS, MARGINS, 3) is None
    assert routing_flip(EXPERTS, MARGINS, reordered, MARGINS + 0.01, 3) is None


def test_the_first_flip_is_found_in_step_then_layer_order_and_counted():
    other, margins = EXPERTS.copy(), MARGINS.copy()
    other[1, 1] = [6, 0]  # step 1, MoE layer 1
    other[2, 0] = [3, 4]
    margins[0, 0] += 0.002  # the router moved a little before the flip
    flip = routing_flip(EXPERTS, MARGINS, other, margins, 3)
    assert (flip.step, flip.layer, flip.experts_a, flip.experts_b) == (1, 1, [6, 7], [0, 6])
    assert flip.margin_a == pytest.approx(0.4) and flip.flipped == 2 and flip.compared == 6
    assert flip.needed == pytest.approx(0.8) and flip.moved == pytest.approx(0.002, rel=1e-3)
    assert not flip.near_tie
    assert routing_flip(EXPERTS, MARGINS, other, margins, 1) is None  # only the first step compared


def test_a_flip_needing_less_than_the_router_moved_before_is_a_near_tie():
    other, margins_a, margins_b = EXPERTS.copy(), MARGINS.copy(), MARGINS.copy()
    other[2, 0] = [0, 3]
    margins_a[2, 0], margins_b[2, 0] = 0.001, 0.002
    margins_b[1, 0] += 0.01
    flip = routing_flip(EXPERTS, margins_a, other, margins_b, 3)
    assert flip.near_tie and flip.needed == pytest.approx(0.003) and flip.moved == pytest.approx(0.01, rel=1e-3)
    assert "near-tie" in flip.describe()


def test_forced_routing_judges_a_flip_by_the_sets_movement():
    """Given an allowance (B forced along A's routing), a flip is judged by it, not by the entries before it: the
    same flip is a near-tie against an allowance that covers it and no near-tie against one that does not."""
    other = EXPERTS.copy()
    other[0, 0] = [0, 5]  # the very first entry flips: nothing before it moved
    margins = MARGINS.copy()
    margins[0, 0], margins[2, 1] = 0.0, MARGINS[2, 1] + 0.2  # B tied there; the router moved 0.2 later on
    assert not routing_flip(EXPERTS, MARGINS, other, margins, 3).near_tie  # before the flip: no movement at all
    moved = margin_movement(EXPERTS, MARGINS, other, margins, 3)
    assert moved == pytest.approx(0.2)  # the flipped entry itself is not counted
    flip = routing_flip(EXPERTS, MARGINS, other, margins, 3, moved)
    assert flip.forced and flip.near_tie and flip.moved == moved and "the golden allows 0.2" in flip.describe()
    assert not routing_flip(EXPERTS, MARGINS, other, margins, 3, 0.05).near_tie
    later = other.copy()
    later[2, 1] = [1, 7]  # a second flip, needing more: forced, it is the one judged and reported
    margins[2, 1] = 0.3
    decisive = routing_flip(EXPERTS, MARGINS, later, margins, 3, moved)
    assert (decisive.step, decisive.layer, decisive.flipped) == (2, 1, 2) and not decisive.near_tie
    assert decisive.needed == pytest.approx(MARGINS[2, 1] + 0.3)
    assert routing_flip(EXPERTS, MARGINS, later, margins, 3).step == 0  # not forced: the first flip
    broken = margins.copy()
    broken[0, 0] = -0.3  # a margin no router reports: that flip decides, whatever it needs, and is no near-tie
    flip = routing_flip(EXPERTS, MARGINS, later, broken, 3, 1.0)
    assert (flip.step, flip.layer) == (0, 0) and not flip.near_tie and flip.distance > 1
    assert "not a near-tie: more than the golden allows" in routing_flip(EXPERTS, MARGINS, other, margins, 3,
                                                                     0.05).describe()
    assert margin_movement(EXPERTS, MARGINS, EXPERTS[:, :1], MARGINS[:, :1], 3) == 0.0  # another model: nothing


def test_router_error_counts_every_entry_of_runs_along_one_routing():
    """Along one routing (B forced along A's), every entry compares: agreeing entries by their margin movement,
    flipped ones by the gap their flip needs. The measure before the first flip sees only what precedes it."""
    other, margins = EXPERTS.copy(), MARGINS.copy()
    other[0, 1] = [2, 5]  # the second entry flips, needing 0.20 + 0.01
    margins[0, 1] = 0.01
    margins[2, 1] += 0.03  # a later agreeing entry moved 0.03
    assert router_error(EXPERTS, MARGINS, other, margins, 3) == pytest.approx(0.21)
    assert router_error(EXPERTS, MARGINS, EXPERTS, margins, 3) == pytest.approx(0.19)  # no flip: movements only
    assert margin_movement(EXPERTS, MARGINS, other, margins, 3, until_flip=True) == 0.0  # only entry 0, unmoved
    assert router_error(EXPERTS, MARGINS, other, margins, 1) == pytest.approx(0.21)
    assert router_error(EXPERTS, MARGINS, EXPERTS[:, :1], MARGINS[:, :1], 3) == 0.0  # another model: nothing


# ---------------------------------------------------------------- planted flips, end to end

STEPS = 12
ROUTER_FAULT = Fault("router", 1.0, layer=1)  # expert 0's router logit doubled in the second MoE layer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory.mktemp("routing") / "moe")


def test_verify_names_a_planted_routing_flip_with_its_router_margin(golden_factory, moe_dir):
    directory = golden_factory(model=str(moe_dir), tokens=STEPS)
    golden = open_golden("g", directory)
    assert golden.results("pinned")[0].arrays["routing_experts"].shape == (STEPS, 2, 2)
    config = candidate_config(golden, None, {}, ())
    clean = verify_golden(golden, config)
    assert clean.verdict == "identical" and not any("routing" in cause for cause in clean.causes)
    verdict = verify_golden(golden, config, hook=fault_hook(ROUTER_FAULT))
    assert verdict.verdict == "changed", verdict.causes
    routing = [cause for cause in verdict.causes if cause.startswith("routing:")]
    assert len(routing) == 1 and "routing flip at step" in routing[0] and "router margin" in routing[0], routing
    flips = [p.routing for p in verdict.prompts if p.routing is not None]
    # forced along the golden's tokens and routing (same dtype, not the function config); the function check
    # (bit for bit here) says changed
    assert all(f.forced for f in flips) and any("no longer reproduces" in c for c in verdict.causes), verdict.causes
    assert flips and all(f.layer == 1 for f in flips)  # layer 0 is untouched: only the faulted layer flips first
    assert all(f.experts_a != f.experts_b and f.margin_a >= 0 for f in flips)
    # the float64 oracle, along the golden's tokens, chose the float32 golden's experts there, by its margin
    assert all(f.oracle_experts == f.experts_a and abs(f.oracle_margin - f.margin_a) < 1e-5 for f in flips), flips
    assert "the oracle's router margin there" in routing[0] and "its experts golden's" in routing[0], routing[0]
    from evalrun.verdict_report import render
    assert "routing flip at step" in render(verdict, "text")
    assert json.loads(render(verdict, "json"))["prompts"][0]["routing"] is not None or len(flips) < len(verdict.prompts)


def test_routing_flips_of_a_dtype_change_are_near_ties_and_the_verdict_is_drift(golden_factory, moe_dir):
    """float32 golden, bfloat16 candidate: numerics alone differ; any routing flip sits at a near-tie."""
    golden = open_golden("g", golden_factory(model=str(moe_dir), tokens=STEPS))
    verdict = verify_golden(golden, candidate_config(golden, None, {"dtype": "bfloat16"}, ()))
    assert verdict.verdict == "drift", verdict.causes
    flips = [p.routing for p in verdict.prompts if p.routing is not None]
    assert all(f.near_tie for f in flips), [f.describe() for f in flips]
    assert all(("at near-ties" in c) for c in verdict.causes if c.startswith("routing:"))
    assert all(f.oracle_margin is not None and f.oracle_margin <= f.moved for f in flips), [f.describe() for f in flips]


def test_a_candidate_that_captures_no_routing_is_told_so_in_the_causes(golden_factory, moe_dir):
    """--engine transformers captures no expert choices: it neither follows the golden's routing nor shows a flip, so
    the verdict rests on the logits alone, and the causes say so instead of staying silent about routing."""
    golden = open_golden("g", golden_factory(model=str(moe_dir), tokens=STEPS))
    verdict = verify_golden(golden, candidate_config(golden, None, {"engine": "transformers"}, ()))
    assert verdict.verdict == "drift", verdict.causes  # another engine: other bits, never the golden's
    unseen = [c for c in verdict.causes if c.startswith("routing: not compared")]
    assert len(unseen) == 1 and "engine transformers captures no expert choices" in unseen[0], verdict.causes
    assert all(p.routing is None for p in verdict.prompts)


def test_diff_names_a_planted_routing_flip(cli, moe_dir, store_path):
    config = build_config(None, {"model": str(moe_dir), "prompts": "smoke", "max_new_tokens": STEPS}, ())
    store = Store(store_path)
    clean = execute_run(config, store)
    faulted = prepare(config)
    plant(faulted, ROUTER_FAULT)
    changed = execute_run(config, store, prepared=faulted)
    code, out, err = cli("diff", clean.run_id, changed.run_id, "--store", str(store_path), "--format", "json")
    assert code in (0, 1), err
    prompts = json.loads(out)["prompts"]
    flips = [p["routing"] for p in prompts if p["routing"]]
    assert flips and all(f["layer"] == 1 for f in flips)
    for prompt in prompts:  # routing is compared only where both runs had the same input
        if prompt["routing"] and prompt["first_divergent_step"] >= 0:
            assert prompt["routing"]["step"] <= prompt["first_divergent_step"]
    in_prompts = [p["prompt_routing"] for p in prompts if p["prompt_routing"]]  # the fault routes prompt tokens too
    assert in_prompts and all(f["layer"] == 1 and f["experts_a"] != f["experts_b"] for f in in_prompts), in_prompts
    code, text, _ = cli("diff", clean.run_id, changed.run_id, "--store", str(store_path))
    assert "routing flip at step" in text and "router margin" in text and "prompt routing differs at" in text
    code, same, _ = cli("diff", clean.run_id, clean.run_id, "--store", str(store_path), "--format", "json")
    assert all(p["routing"] is None and p["prompt_routing"] is None for p in json.loads(same)["prompts"])


def test_dense_runs_store_no_routing_arrays(cli, tiny_args, store_path):
    code, out, err = cli("run", *tiny_args, "--json", "--quiet")
    assert code == 0, err
    results = Store(store_path).load_results(json.loads(out)["run_id"])
    assert all("routing_experts" not in r.arrays and "routing_margins" not in r.arrays for r in results)


# ---------------------------------------------------------------- forced routing in verify

TIES = dict(seed=7, num_experts=32, num_experts_per_tok=4)  # bfloat16 routing ties that piecewise compile tips
BF16 = ("--dtype", "bfloat16", "--device", "cpu", "-O0")


@pytest.fixture(scope="module")
def ties_dir(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory.mktemp("ties") / "moe", **TIES)


def test_piecewise_compile_tipping_bfloat16_routing_ties_is_drift(golden_factory, ties_dir, verify):
    """A bfloat16 -O0 golden of an MoE model, verified under piecewise compile (-O1: a legitimate change of
    bits). Compile tips routing near-ties; before forced routing the candidate's forced run then took other
    experts from the flip on and one prompt failed the execution check at 1.61x its budget (a false changed).
    Now the flips are judged alone, as near-ties, and the logits along the golden's routing are drift."""
    directory = golden_factory(*BF16, model=str(ties_dir), tokens=16)
    code, verdict, err = verify(directory, "-O1")
    assert code == 0 and verdict["verdict"] in ("identical", "drift"), (err, verdict and verdict["causes"])
    flips = [p["routing"] for p in verdict["prompts"] if p["routing"]]
    assert flips, "no routing flip on this machine: the case no longer exercises forced routing (pick another seed)"
    assert all(f["forced"] and f["near_tie"] for f in flips), flips
    assert any(c.startswith("routing:") and "the golden allows" in c and "not a near-tie" not in c
               for c in verdict["causes"]), verdict["causes"]


SCALE = dict(seed=4, num_experts=128, num_experts_per_tok=8, num_hidden_layers=24)  # Qwen3-30B-A3B's routing


def test_tipped_ties_of_a_model_with_many_experts_and_layers_are_drift(tmp_path, monkeypatch):
    """128 experts, top-8, 24 MoE layers (Qwen3-MoE's routing at half its depth), bfloat16: the pinned run flips
    against its float64 oracle within its first few (step, layer) entries, and -O1 tips a tenth of them. A golden
    whose oracle routed freely could measure its router error only before that first flip (2-4 entries of 384):
    the tipped ties needed 4-7x that, and verify said changed (measured on 4 of 9 such checkpoints). Its runs now
    follow the pinned routing, the error is measured at every entry, and the same verification is drift. An older
    golden is still judged the old way, and its verdict says how to re-create it."""
    from evalrun import golden as golden_module
    from evalrun.golden import create_golden

    directory = moe_checkpoint(tmp_path / "moe", fused_experts=True, **SCALE)  # loaded 10 times: 0.4 s each, not 4
    config = build_config(None, {"model": str(directory), "prompts": "smoke", "max_new_tokens": 12,
                                 "dtype": "bfloat16", "device": "cpu", "opt_level": 0}, ())
    golden = create_golden("g", config, tmp_path)
    verdict = verify_golden(golden, candidate_config(golden, None, {"opt_level": 1}, ()))
    flips = [p.routing for p in verdict.prompts if p.routing is not None]
    assert verdict.verdict == "drift", verdict.causes
    assert len(flips) == 3 and all(f.forced and f.near_tie and f.flipped > 10 for f in flips), flips
    monkeypatch.setattr(golden_module, "pinned_routing", lambda pinned: None)  # a golden made before stop 21
    older = create_golden("older", config, tmp_path)
    assert not older.routing_followed
    verdict = verify_golden(older, candidate_config(older, None, {"opt_level": 1}, ()))
    assert verdict.verdict == "changed", verdict.causes
    assert any("re-create it with `evalrun golden create older --force`" in c for c in verdict.causes)


def test_a_router_change_in_the_candidates_execution_alone_is_still_changed(golden_factory, ties_dir):
    """Forced routing must not hide a routing change: expert 0's router logit doubled in the candidate's
    execution only (the function check passes) still fails the execution check."""
    golden = open_golden("g", golden_factory(*BF16, model=str(ties_dir), tokens=16))
    config = candidate_config(golden, None, {"opt_level": 1}, ())
    candidate_only = fault_hook(ROUTER_FAULT, only=lambda prepared: prepared.config.dtype == "bfloat16")
    verdict = verify_golden(golden, config, hook=candidate_only)
    assert verdict.verdict == "changed", verdict.causes
    assert any(c.startswith("execution check failed") for c in verdict.causes), verdict.causes
    assert [p.routing.forced for p in verdict.prompts if p.routing is not None] != []


def test_an_older_moe_goldens_function_check_keeps_its_batch_size(tmp_path, ties_dir, monkeypatch):
    """The function check runs at the candidate's batch size, except against an MoE golden whose runs routed freely
    (made before stop 21): its float32 router at another batch size could tip a tie no allowance covers. There it
    keeps the golden's batch of one and reproduces the golden's function run bit for bit."""
    from evalrun import golden as golden_module
    from evalrun.golden import create_golden

    monkeypatch.setattr(golden_module, "pinned_routing", lambda pinned: None)
    config = build_config(None, {"model": str(ties_dir), "prompts": "smoke", "max_new_tokens": 6,
                                 "dtype": "bfloat16", "device": "cpu", "opt_level": 0}, ())
    older = create_golden("older", config, tmp_path)
    assert not older.routing_followed
    verdict = verify_golden(older, candidate_config(older, None, {"batch_size": 3}, ()))
    assert verdict.function_check.startswith("reproduced the golden's float32 reference bit for bit"), (
        verdict.function_check, verdict.causes)


def test_every_run_of_an_moe_golden_follows_its_pinned_routing(golden_factory, ties_dir):
    """Oracle, envelope and function runs follow the pinned run's routing as well as its tokens, so the oracle's
    router error is measured at every entry, and the table says so: the oracle config run again along the pinned
    tokens and routing reproduces the stored oracle bit for bit; routing freely it does not (the float64 router
    chooses other experts at bfloat16's ties). A dense golden says nothing of routing."""
    from evalrun.report import golden_text
    from evalrun.runner import Probes, execute

    golden = open_golden("g", golden_factory(*BF16, model=str(ties_dir), tokens=16))
    assert golden.routing_followed and golden.meta["routing"] == "pinned" and golden.summary()["routing"] == "pinned"
    assert "every run along the pinned routing" in golden_text(golden, golden.results("pinned"))  # `golden show`
    pinned = {r.prompt_index: r for r in golden.results("pinned")}
    tokens = {i: r.arrays["tokens"] for i, r in pinned.items()}
    routing = {i: routing_path(r.arrays) for i, r in pinned.items()}
    assert all(path.prompt.shape == (len(pinned[i].arrays["input_ids"]) - 1, *path.steps.shape[1:])
               for i, path in routing.items())
    probes = Probes({r.prompt_index: r.arrays["probe_ids"] for r in golden.results("oracle")})
    prepared = prepare(golden.config("oracle"))
    same = lambda run, role: all(np.array_equal(run[r.prompt_index].arrays["probe_values"],  # noqa: E731
                                                r.arrays["probe_values"]) for r in golden.results(role))
    for role in ("oracle", "function"):
        along = execute(prepare(golden.config(role), reuse=prepared), forced=tokens, probes=probes, timed=False,
                        routing=routing).by_index()
        assert same(along, role), role
        # its own choices at the prompt's tokens are not the pinned run's everywhere: the ties it was made to follow
        assert not all(np.array_equal(along[i].arrays["prompt_routing"], pinned[i].arrays["prompt_routing"])
                       for i in pinned), role
    free = execute(prepared, forced=tokens, probes=probes, timed=False).by_index()
    assert not same(free, "oracle")
    steps_only = {i: RoutingPath(path.steps) for i, path in routing.items()}  # the prompt's tokens routed freely
    assert not same(execute(prepared, forced=tokens, probes=probes, timed=False, routing=steps_only).by_index(),
                    "oracle")
    dense = open_golden("g", golden_factory())
    assert not dense.routing_followed and "routing" not in dense.meta and dense.summary()["routing"] is None
    assert "pinned routing" not in golden_text(dense, dense.results("pinned"))


@pytest.mark.parametrize("flags", [{"dtype": "float32"}, {"dtype": "float32", "deterministic": True}],
                         ids=["float32", "the-function-config"])
def test_a_candidate_in_another_dtype_follows_the_golden_routing_too(golden_factory, ties_dir, flags):
    """The golden's oracle and envelope followed its bfloat16 pinned routing, so a float32 candidate must too:
    routing freely, it took the float64 oracle's own experts where bfloat16 had not, and was compared with an
    oracle along other experts (changed, at 29,605x its budget). The golden's function config in its own
    environment must reproduce the golden's function run bit for bit: a prompt whose experts matched as sets
    but not in order is re-run along the golden's order (the engine sums experts in the order routed)."""
    golden = open_golden("g", golden_factory(*BF16, model=str(ties_dir), tokens=16))
    verdict = verify_golden(golden, candidate_config(golden, None, flags, ()))
    assert verdict.verdict == "drift" and verdict.distance < 1, verdict.causes
    assert all(p.routing.forced for p in verdict.prompts if p.routing is not None)
    if "deterministic" in flags:
        assert verdict.function_check.startswith("reproduced the golden's float32 reference bit for bit"), (
            verdict.function_check, verdict.env_diff, verdict.config_diff)


def forge(golden_factory, ties_dir, tmp_path, edit) -> Path:
    """A copy of the bfloat16 ties golden, edited by `edit(conn)` and its content digest recomputed: a golden made
    this way (goldens come from pull requests), not one damaged on the way."""
    import shutil
    import sqlite3

    from evalrun.golden import content_digest

    directory = tmp_path / "forged"
    shutil.copytree(golden_factory(*BF16, model=str(ties_dir), tokens=16), directory)
    conn = sqlite3.connect(directory / "g.db", isolation_level=None)
    edit(conn)
    conn.execute("UPDATE golden SET value = ? WHERE key = 'content_digest'", [content_digest(conn)])
    conn.close()
    return directory


def reshape_arrays(conn, name_like: str, cut) -> None:
    """Each stored array whose name is LIKE `name_like` replaced by cut(name, array), stored raw."""
    from evalrun.hashing import hash_bytes
    from evalrun.store import decode_array_row

    rows = conn.execute("SELECT rowid, name, dtype, shape, encoding, data FROM arrays WHERE name LIKE ?", [name_like])
    for rowid, name, dtype, shape, encoding, data in rows.fetchall():
        array = decode_array_row({"name": name, "dtype": dtype, "shape": shape, "encoding": encoding, "data": data})
        changed = np.ascontiguousarray(cut(name, array))
        conn.execute("UPDATE arrays SET shape = ?, encoding = 'raw', data = ?, digest = ? WHERE rowid = ?",
                     [json.dumps(list(changed.shape)), changed.tobytes(), hash_bytes(changed.tobytes()), rowid])


def assert_refused_in_one_line(verify, directory: Path, *needles: str, options=("--batch-size", "2")) -> None:
    code, verdict, err = verify(directory, *options)
    assert code == 2 and verdict is None, (options, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(needle in lines[0] for needle in needles), err


def test_a_golden_that_claims_another_routing_is_refused_in_one_line(golden_factory, ties_dir, verify, tmp_path):
    directory = forge(golden_factory, ties_dir, tmp_path, lambda conn: conn.execute(
        "UPDATE golden SET value = ? WHERE key = 'routing'", [json.dumps("free")]))
    assert_refused_in_one_line(verify, directory, "routing 'free'", "--force")


FORGED_ROUTING = {  # array name -> (dtype, what every value becomes)
    "an expert past the model's": ("routing_experts", "<i2", 99),
    "NaN ids of a float array": ("routing_experts", "<f8", np.nan),
    "a margin that is no probability gap": ("routing_margins", "<f4", 5.0),
    "a prompt token's expert past the model's": ("prompt_routing", "<i2", 99),
    "a negative prompt expert": ("prompt_routing", "<i2", -3),
}


@pytest.mark.parametrize("forgery", list(FORGED_ROUTING))
def test_a_golden_whose_routing_is_not_the_models_is_refused_in_one_line(golden_factory, ties_dir, verify, tmp_path,
                                                                         forgery):
    """The golden's routing feeds forced routing and its allowance (goldens come from pull requests): a made golden
    whose experts are not the model's, or whose margins are no probability gaps, is one line and exit 2, not an
    index error inside the engine nor a widened allowance. Verified at another batch size: other bits, no compile."""
    name, dtype, value = FORGED_ROUTING[forgery]
    directory = forge(golden_factory, ties_dir, tmp_path, lambda conn: reshape_arrays(
        conn, name, lambda _, array: np.full(array.shape, value, dtype=dtype)))
    assert_refused_in_one_line(verify, directory, name, "--force")


@pytest.mark.parametrize("forgery", ["one layer and one expert", "a prompt without routing"])
def test_a_golden_whose_routing_has_another_shape_is_refused_before_any_run_forces_it(golden_factory, ties_dir,
                                                                                     verify, tmp_path, forgery):
    """Routing of one MoE layer and one expert per token (every run's, so the golden is consistent in itself),
    for a model of two layers and four: one line, exit 2, also for a float32 candidate, whose forced runs would
    otherwise broadcast the forged experts over every slot. Likewise a golden whose first prompt has no routing
    in any run (it was a KeyError, exit 3)."""
    def edit(conn):
        if forgery == "a prompt without routing":
            conn.execute("DELETE FROM arrays WHERE name LIKE '%routing%' AND prompt_index = 0")
        else:
            reshape_arrays(conn, "%routing%",
                           lambda name, array: array[:, :1, :1] if name != "routing_margins" else array[:, :1])

    directory = forge(golden_factory, ties_dir, tmp_path, edit)
    shape = "(1, 1)" if forgery == "one layer and one expert" else "None"
    for options in (("--dtype", "float32"), ("--batch-size", "2")):
        assert_refused_in_one_line(verify, directory, f"routing of shape {shape}, this model's (2, 4)", options=options)


def test_a_golden_whose_prompt_routing_has_another_shape_is_refused_in_one_line(golden_factory, ties_dir, verify,
                                                                              tmp_path):
    """The pinned run's prompt routing is written into the prefill's slots of each prompt: a made golden whose
    prompt routing is one token short of its prompt is one line and exit 2, not a broadcast into other slots."""
    directory = forge(golden_factory, ties_dir, tmp_path, lambda conn: reshape_arrays(
        conn, "prompt_routing", lambda _, array: array[1:]))
    assert_refused_in_one_line(verify, directory, "prompt_routing of another shape", "--force")


def test_a_router_that_chooses_wrong_experts_is_changed_though_forced_logits_are_right(golden_factory, ties_dir,
                                                                                      monkeypatch):
    """Forced routing applies the golden's experts, so a candidate whose router computes the right probabilities
    but chooses the wrong experts would compute the golden's logits along them: the flips alone must say so. Its
    runs here report the next expert over (id + 1 mod E) as their own choice, with their true margins: every flip
    needs the golden's whole margin, far past its router error, and the verdict is changed by the routing
    judgement."""
    import dataclasses

    from evalrun import verify as verify_module

    real_execute = verify_module.execute

    def misrouting(prepared, *args, **kwargs):
        run = real_execute(prepared, *args, **kwargs)
        if prepared.config.dtype != "bfloat16":  # the candidate's runs only (the function run is float32)
            return run
        wrong = [dataclasses.replace(r, arrays={**r.arrays, "routing_experts": (r.arrays["routing_experts"] + 1) % 32})
                 for r in run.results]
        return dataclasses.replace(run, results=wrong)

    monkeypatch.setattr(verify_module, "execute", misrouting)
    golden = open_golden("g", golden_factory(*BF16, model=str(ties_dir), tokens=16))
    # -O1: a knob that changes the bits under every CPU instruction set (batch size 2 gave the golden's bits under
    # ATEN_CPU_CAPABILITY=avx2, and an identical run is never judged further)
    verdict = verify_golden(golden, candidate_config(golden, None, {"opt_level": 1}, ()))
    assert verdict.verdict == "changed", verdict.causes
    judged = [p for p in verdict.prompts if p.routing is not None]
    assert judged and all(p.routing.forced and not p.routing.near_tie for p in judged)
    assert any(p.reason.startswith("execution check: routing flip") for p in verdict.prompts), verdict.causes
    assert verdict.distance > 1 and "routing flip" in verdict.closest
