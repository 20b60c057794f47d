"""Past one process: tensor parallelism and sharded runs/verifies on torch.distributed (torchrun, gloo on
CPU), `--shard I/N` jobs and `evalrun store merge`, and a killed rank.

torchrun sets OMP_NUM_THREADS=1 in its ranks; the single-process references here run with the same, so
that the thread count (an environment key that changes CPU matmul bits) is not what differs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from evalrun.distributed import Shard, parse_shard, shard_batches
from evalrun.engine.tensor_parallel import check_divisible, shard_columns, shard_gate_up, shard_qkv
from evalrun.errors import ConfigError, StoreError
from evalrun.store import Store
from evalrun.store_check import check_store
from evalrun.store_merge import merge_stores

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "4", "-q"]
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def evalrun(*args: str, ranks: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """`evalrun ARGS` in a fresh process, or under `torchrun --nproc-per-node RANKS`."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    done = subprocess.run([*launcher, "-m", "evalrun", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def stored(path: Path) -> dict[str, dict]:
    """prompt id -> (tokens digest, logits digest, tokens) over every complete run of a store."""
    store = Store(path, readonly=True)
    out = {}
    for record in store.list_runs():
        assert record.status == "complete"
        for result in store.load_results(record.id):
            assert result.prompt_id not in out
            out[result.prompt_id] = (result.tokens_digest, result.logits_digest, result.arrays["tokens"].tolist(),
                                     result.arrays["topk_values"].tobytes())
    return out


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("golden")
    evalrun("golden", "create", "tiny", *TINY, "--dir", str(folder))
    return folder


@pytest.fixture(scope="module")
def single_verdict(golden_dir) -> dict:
    """The unsharded, single-process verify of the golden (OMP_NUM_THREADS=1, like the ranks)."""
    return json.loads(evalrun("golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json").stdout)


def _without_timings(verdict: dict) -> dict:
    return {key: value for key, value in verdict.items() if key != "timings"}


# ---------------------------------------------------------------- the shard arithmetic

def test_column_and_row_shards_recompose_the_full_projections():
    torch.manual_seed(0)
    heads, kv_heads, dim, hidden, inter, ranks = 4, 2, 8, 32, 48, 2
    qkv = torch.randn((heads + 2 * kv_heads) * dim, hidden, dtype=torch.float64)
    x = torch.randn(3, hidden, dtype=torch.float64)
    full = (x @ qkv.T).view(3, heads + 2 * kv_heads, dim)
    parts = [(x @ shard_qkv(qkv, heads, kv_heads, dim, r, ranks).T).view(3, -1, dim) for r in range(ranks)]
    q = torch.cat([p[:, :heads // ranks] for p in parts], 1)
    k = torch.cat([p[:, heads // ranks: heads // ranks + kv_heads // ranks] for p in parts], 1)
    assert torch.equal(q, full[:, :heads]) and torch.equal(k, full[:, heads:heads + kv_heads])
    gate_up = torch.randn(2 * inter, hidden, dtype=torch.float64)
    gate, up = (x @ gate_up.T).chunk(2, -1)
    halves = [(x @ shard_gate_up(gate_up, r, ranks).T).chunk(2, -1) for r in range(ranks)]
    assert torch.equal(torch.cat([h[0] for h in halves], -1), gate) and torch.equal(torch.cat([h[1] for h in halves], -1), up)
    down, y = torch.randn(hidden, inter, dtype=torch.float64), torch.randn(3, inter, dtype=torch.float64)
    partial = sum(y[:, r * inter // ranks:(r + 1) * inter // ranks] @ shard_columns(down, r, ranks).T for r in range(ranks))
    assert torch.allclose(partial, y @ down.T, rtol=0, atol=1e-12)


def test_a_split_model_releases_its_whole_projections_and_is_built_once():
    from evalrun.engine.tensor_parallel import sharded_transformer
    from evalrun.models import load_model

    model = load_model("random:tiny", "cpu", "float32", "sdpa").model
    parameters = sum(p.numel() for p in model.parameters())
    split = sharded_transformer(model, "sdpa", 1, 2, group=None)
    assert sharded_transformer(model, "sdpa", 1, 2, group=None) is split
    layer = model.model.layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj]
    assert all(p.weight.stride() == (0, 0) and not p.weight.any() for p in projections)  # released
    assert model.model.embed_tokens.weight.stride() != (0, 0) and layer.input_layernorm.weight.any()
    assert sum(p.numel() for p in model.parameters()) == parameters  # the identity's count is unchanged
    assert (split.heads, split.kv_heads, split.layers[0].qkv.shape, split.layers[0].down.shape) == (2, 1, (64, 64),
                                                                                                    (64, 64))


def _split_forward_logits(model, ids: list[int], ranks: int):
    """Logits of a `ranks`-way tensor-parallel decode in one process: each rank's forward in a thread, the
    all-reduce a sum over the threads' partial products (same arithmetic as the ranks' gloo all-reduce)."""
    import threading

    from evalrun.engine.driver import generate_batch
    from evalrun.engine.generate import BatchSpec
    from evalrun.engine.tensor_parallel import shard
    from evalrun.engine.transformer import Transformer

    barrier, partials, outs = threading.Barrier(ranks), [None] * ranks, [None] * ranks

    def rank(r: int) -> None:
        def reduce(x):
            partials[r] = x
            barrier.wait()
            total = sum(partials[1:], partials[0])
            barrier.wait()
            return total
        split = shard(Transformer(model, "sdpa"), r, ranks, group=None)
        split.reduce = reduce
        outs[r] = generate_batch(split, BatchSpec([ids], 4, pad_id=0, keep_logits=True)).logits

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outs[0]


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "llama-gelu-tanh-biases"])
def test_a_tensor_parallel_split_keeps_every_norm_and_bias_of_the_family(tmp_path, case):
    """TP=2 computes the unsplit model (to float32 rounding): no norm or bias dropped in the split (Gemma's
    norms of the attention and MLP outputs were, silently)."""
    import numpy as np

    from test_model_support import CASES, _checkpoint

    from evalrun.engine.driver import generate_batch
    from evalrun.engine.generate import BatchSpec
    from evalrun.engine.transformer import Transformer
    from evalrun.models import load_model

    family, overrides = CASES[case]
    model = load_model(str(_checkpoint(tmp_path / case, family, **overrides)), "cpu", "float32").model
    ids = list(range(5, 30))
    whole = generate_batch(Transformer(model, "sdpa"), BatchSpec([ids], 4, pad_id=0, keep_logits=True)).logits
    split = _split_forward_logits(model, ids, 2)
    assert np.abs(split.view(np.float32) - whole.view(np.float32)).max() < 1e-4


def test_sizes_the_ranks_do_not_divide_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        check_divisible(4, 2, 128, 3)
    with pytest.raises(ConfigError, match="key/value heads"):
        check_divisible(8, 2, 128, 4)


def test_tensor_parallel_outside_torchrun_names_the_torchrun_command(cli, tiny_args):
    code, _, err = cli("run", *tiny_args, "--tensor-parallel", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "torchrun --nproc-per-node 2 -m evalrun" in err


@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR"),  # a cluster's variables without torchrun's rendezvous
    ({"WORLD_SIZE": "2", "RANK": "5"}, "0 <= RANK < WORLD_SIZE"),
    ({"WORLD_SIZE": "-3", "RANK": "0"}, "0 <= RANK < WORLD_SIZE"),
])
def test_a_torchrun_environment_that_is_not_one_is_refused_with_one_line(cli, tiny_args, monkeypatch, env, needle):
    """It crashed (internal error, exit 3) in init_process_group, or ran rank 5 of 2 as a shard."""
    from conftest import one_line_exit_2

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    one_line_exit_2(cli("run", *tiny_args), needle, "launch with torchrun, or unset them")


def test_shards_take_whole_batches_round_robin():
    assert parse_shard("1/3") == Shard(1, 3)
    assert [shard_batches(7, Shard(i, 3)) for i in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


# ---------------------------------------------------------------- torchrun, gloo

def test_tensor_parallel_2_matches_the_single_process_run_within_the_envelope(golden_dir, single_verdict):
    """TP=2 under torchrun against a golden made by one process: drift or identical, never changed; the
    verdict says which (bit-identical or not), and the run really was split (each rank half the heads)."""
    done = evalrun("golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--tensor-parallel", "2", "--json",
                   ranks=2)
    verdict = json.loads(done.stdout)
    assert verdict["verdict"] in ("identical", "drift"), verdict["causes"]
    assert verdict["candidate_config"]["tensor_parallel"] == 2
    assert ("config: tensor_parallel 1 -> 2" in verdict["causes"]) == (verdict["verdict"] != "identical")
    print(f"TP=2 vs the single process: {verdict['verdict']} (bit-identical: {verdict['verdict'] == 'identical'}), "
          f"distance {verdict['distance']:.3f}")


def test_tensor_parallel_run_shards_the_heads_and_rank_0_alone_stores(tmp_path):
    store = tmp_path / "tp.db"
    evalrun("run", *TINY, "--store", str(store), "--tensor-parallel", "2", "--json", ranks=2)
    db = Store(store, readonly=True)
    (record,) = db.list_runs()
    assert record.json["evidence"]["tensor_parallel"] == {"rank": 0, "ranks": 2, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}
    assert record.config["tensor_parallel"] == 2 and check_store(db)["ok"]


def test_sharded_run_under_torchrun_stores_the_unsharded_results(tmp_path):
    evalrun("run", *TINY, "--store", str(tmp_path / "one.db"))
    evalrun("run", *TINY, "--store", str(tmp_path / "two.db"), ranks=2)
    (record,) = Store(tmp_path / "two.db", readonly=True).list_runs()
    assert record.json["evidence"]["ranks"] == 2
    assert stored(tmp_path / "two.db") == stored(tmp_path / "one.db")


def test_sharded_verify_under_torchrun_gives_the_unsharded_verdict(golden_dir, single_verdict):
    """Identical (the golden's environment): the ranks agree that no check needs to run."""
    done = evalrun("golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json", ranks=2)
    assert single_verdict["verdict"] == "identical"
    assert _without_timings(json.loads(done.stdout)) == _without_timings(single_verdict)


def test_sharded_verify_of_drift_with_two_prompt_batches_gives_the_unsharded_verdict(golden_dir):
    """Batches of 2 (3 prompts: rank 0 runs a batch of two, rank 1 one of one): drift, so every rank runs the
    forced and function runs of its batches, and rank 0 judges them all."""
    args = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--batch-size", "2", "--json"]
    single = json.loads(evalrun(*args).stdout)
    sharded = json.loads(evalrun(*args, ranks=2).stdout)
    assert single["verdict"] == "drift" and "function_s" in single["timings"]
    assert _without_timings(sharded) == _without_timings(single)


def test_shard_jobs_merged_give_the_unsharded_results_and_verdict(cli, tmp_path, golden_dir):
    """--shard I/N jobs (in this process, like the unsharded reference), their stores merged."""
    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json"]
    assert cli("run", *TINY, "--store", str(tmp_path / "one.db"))[0] == 0
    code, out, _ = cli(*verify)
    unsharded = json.loads(out)
    for index in range(2):
        assert cli("run", *TINY, "--store", str(tmp_path / f"run{index}.db"), "--shard", f"{index}/2")[0] == 0
        assert cli(*verify, "--shard", f"{index}/2", "--store", str(tmp_path / f"verify{index}.db"))[0] == 0
    parts = [tmp_path / name for name in ("run0.db", "run1.db", "verify0.db", "verify1.db")]
    first = merge_stores(tmp_path / "all.db", parts)
    again = merge_stores(tmp_path / "all.db", parts)
    assert first["check"]["ok"] and sum(s["copied"] for s in first["sources"]) > 2
    assert [s["copied"] for s in again["sources"]] == [0, 0, 0, 0]  # idempotent
    run_shards = tmp_path / "runs.db"
    merge_stores(run_shards, parts[:2])
    assert stored(run_shards) == stored(tmp_path / "one.db")
    code, out, _ = cli(*verify, "--store", str(tmp_path / "all.db"), "--from-shards")
    assert code == 0 and _without_timings(json.loads(out)) == _without_timings(unsharded)
    code, _, err = cli(*verify, "--store", str(tmp_path / "verify0.db"), "--from-shards")  # a shard missing
    assert code == 2 and "run the missing `golden verify --shard I/N` jobs" in err


@pytest.mark.parametrize("damage,needle", [
    ("UPDATE arrays SET dtype = 'float64' WHERE name = 'tokens' AND prompt_index = 0", "tokens of dtype float64"),
    ("UPDATE arrays SET digest = 'x' WHERE name = 'digests' AND prompt_index = 0", "bytes do not match their digest"),
])
def test_damaged_shards_are_refused_not_judged(cli, tmp_path, golden_dir, damage, needle):
    """--from-shards reads the shards' arrays as `diff` does: bytes that do not match their digest, or ids of a
    float dtype, are a damaged run (exit 2, `store check`), never a verdict."""
    import sqlite3

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json"]
    for index in range(2):
        assert cli(*verify, "--shard", f"{index}/2", "--store", str(tmp_path / f"verify{index}.db"))[0] == 0
    merge_stores(tmp_path / "all.db", [tmp_path / "verify0.db", tmp_path / "verify1.db"])
    with sqlite3.connect(tmp_path / "all.db") as conn:
        conn.execute(damage)
    conn.close()
    code, out, err = cli(*verify, "--store", str(tmp_path / "all.db"), "--from-shards")
    assert code == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert json.loads(out) == {"error": err.strip(), "exit_code": 2}  # no verdict: the error's JSON object
    assert needle in err and "is damaged" in err and "`evalrun store check`" in err, err


def test_shards_of_an_older_scheme_of_runs_are_missing_not_mixed_in(cli, tmp_path, golden_dir, monkeypatch):
    """Shards an older evalrun stored (another SHARD_SCHEME: it made other runs, e.g. before every run of a routing
    golden followed its pinned routing) are not this verification's: judged from them, the shards are missing."""
    from evalrun import sharding

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json"]
    monkeypatch.setattr(sharding, "SHARD_SCHEME", sharding.SHARD_SCHEME - 1)
    for index in range(2):
        assert cli(*verify, "--shard", f"{index}/2", "--store", str(tmp_path / f"verify{index}.db"))[0] == 0
    merge_stores(tmp_path / "old.db", [tmp_path / "verify0.db", tmp_path / "verify1.db"])
    code, out, _ = cli(*verify, "--store", str(tmp_path / "old.db"), "--from-shards")
    assert code == 0 and json.loads(out)["verdict"] in ("identical", "drift")  # the older evalrun reads its own shards
    monkeypatch.undo()
    code, _, err = cli(*verify, "--store", str(tmp_path / "old.db"), "--from-shards")
    assert code == 2 and "run the missing `golden verify --shard I/N` jobs" in err, err


def test_merge_refuses_a_run_id_with_other_content(cli, tmp_path):
    assert cli("run", *TINY, "--store", str(tmp_path / "a.db"))[0] == 0
    merge_stores(tmp_path / "out.db", [tmp_path / "a.db"])
    db = Store(tmp_path / "a.db")
    db.db.execute("UPDATE runs SET label = 'edited'")
    db.close()
    with pytest.raises(StoreError, match="differs between"):
        merge_stores(tmp_path / "out.db", [tmp_path / "a.db"])


def test_a_merge_refused_midway_leaves_out_as_it_was(cli, tmp_path):
    """A conflict found after earlier runs were copied left a half-merged OUT (exit 2, a red-team pass): the merge
    is one transaction now, and an OUT it created is removed."""
    import shutil

    for store in ("a.db", "c.db"):
        assert cli("run", *TINY, "--store", str(tmp_path / store))[0] == 0
    assert cli("run", *TINY, "--store", str(tmp_path / "a.db"), "--label", "second")[0] == 0
    shutil.copy(tmp_path / "a.db", tmp_path / "b.db")
    db = Store(tmp_path / "b.db")
    db.db.execute("UPDATE runs SET label = 'edited' WHERE label = 'second'")  # the later run: the first is copied
    db.close()
    with pytest.raises(StoreError, match="differs between"):
        merge_stores(tmp_path / "new.db", [tmp_path / "a.db", tmp_path / "b.db"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("new")) == []
    merge_stores(tmp_path / "out.db", [tmp_path / "a.db"])
    before = Store(tmp_path / "out.db", readonly=True).list_runs()
    with pytest.raises(StoreError, match="differs between"):
        merge_stores(tmp_path / "out.db", [tmp_path / "c.db", tmp_path / "b.db"])  # c's run copied, then refused
    assert [r.id for r in Store(tmp_path / "out.db", readonly=True).list_runs()] == [r.id for r in before]


def test_a_run_merged_while_running_is_replaced_once_its_job_completes(cli, tmp_path):
    """A merge taken while a job still ran copies its run as interrupted; merging the job's store again after it
    finished stores the complete run (it was refused as 'differs', so that OUT could never hold it)."""
    import sqlite3

    from evalrun.store_merge import run_content

    assert cli("run", *TINY, "--store", str(tmp_path / "done.db"))[0] == 0
    with sqlite3.connect(tmp_path / "done.db") as source, sqlite3.connect(tmp_path / "live.db") as copy:
        source.backup(copy)  # the file with its write-ahead log
    live = Store(tmp_path / "live.db")  # the same run as its job's store held it before finishing
    for table in ("arrays", "results"):
        live.db.execute(f"DELETE FROM {table}")
    live.db.execute("UPDATE runs SET status = 'running', finished_at = NULL, tokens_digest = NULL, "
                    "logits_digest = NULL, timings_json = NULL, evidence_json = NULL, batches_json = NULL")
    live.db.conn.commit()
    live.close()
    out = tmp_path / "out.db"
    assert merge_stores(out, [tmp_path / "live.db"])["check"]["runs"] == {"interrupted": 1}
    outcome = merge_stores(out, [tmp_path / "done.db"])
    assert outcome["check"]["ok"] and outcome["check"]["runs"] == {"complete": 1}
    done, merged = Store(tmp_path / "done.db", readonly=True), Store(out, readonly=True)
    (run_id,) = [record.id for record in done.list_runs()]
    assert run_content(done, run_id) == run_content(merged, run_id)
    assert merge_stores(out, [tmp_path / "done.db"])["sources"][0]["already_there"] == 1  # idempotent again
    with pytest.raises(StoreError, match="differs between"):  # a complete copy is never replaced
        merge_stores(out, [tmp_path / "live.db"])


def _rank_process(launcher: psutil.Process, rank: int) -> psutil.Process | None:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "evalrun" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _has_running_run(store: Path) -> bool:
    """Whether the store has a run marked running (a store still being created is not ready yet)."""
    try:
        return store.exists() and bool(Store(store, readonly=True).db.execute(
            "SELECT count(*) FROM runs WHERE status = 'running'").fetchone()[0])
    except StoreError:
        return False


def test_killing_one_rank_leaves_the_store_consistent_and_the_run_interrupted(tmp_path):
    store = tmp_path / "killed.db"
    args = [*TINY[:4], "--max-new-tokens", "4000", "--store", str(store), "-q"]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", "-m", "evalrun", "run", *args], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _has_running_run(store):  # rank 0 has begun the run in the store
            time.sleep(0.2)
        victim = _rank_process(psutil.Process(launcher.pid), 1)
        assert victim is not None, "rank 1 not found"
        os.kill(victim.pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    db = Store(store, readonly=True)
    check = check_store(db)
    (record,) = db.list_runs()
    assert check["ok"], check["problems"]
    assert check["interrupted"] == [record.id] and record.status in ("interrupted", "running")
    assert db.db.execute("SELECT count(*) FROM results").fetchone()[0] == 0  # nothing half-written
    print(f"after the kill: status {record.status}, error {record.error!r}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("level", ["-O0", "-O2"])
def test_tensor_parallel_on_two_gpus_with_nccl(tmp_path, level):
    """nccl, compiled pieces with the all-reduce inside them and (-O2) CUDA graphs around them: the run
    completes, rank 0 stores it, and its evidence names any fallback (not run here: CPU only)."""
    store = tmp_path / "gpu.db"
    done = evalrun("run", *TINY, "--device", "cuda", "--dtype", "bfloat16", level, "--tensor-parallel", "2",
                   "--strict-config", "--store", str(store), "--json", ranks=2)
    run = json.loads(done.stdout)
    assert run["evidence"]["tensor_parallel"]["ranks"] == 2 and run["evidence"]["fallbacks"] == []
    assert len(run["timings"]["ranks_peak_memory"]) == 2


def test_a_shard_job_refuses_junit_and_speaks_markdown(cli, tmp_path, golden_dir):
    """A --shard job has no verdict: --junit there wrote nothing and said nothing (refused now; the --from-shards
    verify writes it), and --format markdown printed text."""
    from conftest import one_line_exit_2

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--shard", "0/2", "--store",
              str(tmp_path / "s0.db")]
    one_line_exit_2(cli(*verify, "--junit", str(tmp_path / "j.xml")), "--from-shards")
    assert not (tmp_path / "s0.db").exists()
    code, out, err = cli(*verify, "--format", "markdown")
    assert code == 0, err
    assert out.startswith("### evalrun golden tiny shard 0/2: ") and "\n\nnext: " in out


def _faulty_prepare(monkeypatch):
    """Every run the verify prepares computes another function (a model change that no identity hash sees)."""
    from evalrun import runner, verify
    from evalrun.engine.faults import Fault, fault_hook

    real, hook = runner.prepare, fault_hook(Fault("scale", 0.01))

    def faulty(*args, **kwargs):
        prepared = real(*args, **kwargs)
        hook(prepared)
        return prepared

    monkeypatch.setattr(verify, "prepare", faulty)


def test_two_jobs_of_one_shard_that_disagree_are_refused_not_judged_newest_first(cli, tmp_path, golden_dir,
                                                                                  monkeypatch):
    """A store holding shard 0 from a changed model and, newer, from the unchanged one verified `identical` (the
    newest result of each prompt won, the changed one unseen; per phase, so two jobs' phases could mix): two
    results of one prompt that differ are mixed data now, exit 2 with one line."""
    from conftest import one_line_exit_2

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir)]
    with monkeypatch.context() as patched:
        _faulty_prepare(patched)
        assert cli(*verify, "--shard", "0/2", "--store", str(tmp_path / "changed0.db"))[0] == 0
    for index in range(2):
        assert cli(*verify, "--shard", f"{index}/2", "--store", str(tmp_path / f"good{index}.db"))[0] == 0
    merge_stores(tmp_path / "mixed.db", [tmp_path / name for name in ("changed0.db", "good0.db", "good1.db")])
    one_line_exit_2(cli(*verify, "--store", str(tmp_path / "mixed.db"), "--from-shards"), "with other bits",
                    "merge the stores of one job per shard")
    merge_stores(tmp_path / "changed.db", [tmp_path / "changed0.db", tmp_path / "good1.db"])
    assert cli(*verify, "--store", str(tmp_path / "changed.db"), "--from-shards")[0] == 1  # one changed shard
    merge_stores(tmp_path / "again.db", [tmp_path / name for name in ("good0.db", "good1.db", "good0.db")])
    assert cli(*verify, "--store", str(tmp_path / "again.db"), "--from-shards")[0] == 0
    for index in range(3):  # the same prompts in shards of another count: the same results, joined
        assert cli(*verify, "--shard", f"{index}/3", "--store", str(tmp_path / f"third{index}.db"))[0] == 0
    merge_stores(tmp_path / "counts.db", [tmp_path / name for name in ("good0.db", "good1.db", "third0.db",
                                                                       "third1.db", "third2.db")])
    assert cli(*verify, "--store", str(tmp_path / "counts.db"), "--from-shards")[0] == 0


def test_a_run_relabelled_as_another_verifications_shard_is_refused(cli, tmp_path, golden_dir):
    """The label's key names config and environment; a bfloat16 candidate's shards relabelled as the float32
    candidate's were judged as its runs (`changed`, blaming the execution config): refused now."""
    import sqlite3

    from conftest import one_line_exit_2

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir)]
    for index in range(2):
        assert cli(*verify, "--dtype", "bfloat16", "--shard", f"{index}/2", "--store",
                   str(tmp_path / f"bf{index}.db"))[0] == 0
    assert cli(*verify, "--shard", "0/2", "--store", str(tmp_path / "fp.db"))[0] == 0
    key = lambda path: Store(path, readonly=True).list_runs()[0].label.split(":")[2]  # noqa: E731
    theirs, ours = key(tmp_path / "bf0.db"), key(tmp_path / "fp.db")
    merge_stores(tmp_path / "forged.db", [tmp_path / "bf0.db", tmp_path / "bf1.db"])
    with sqlite3.connect(tmp_path / "forged.db") as conn:
        conn.execute("UPDATE runs SET label = replace(label, ?, ?)", [theirs, ours])
    conn.close()
    one_line_exit_2(cli(*verify, "--store", str(tmp_path / "forged.db"), "--from-shards"), "config_hash",
                    "edited label")


RANK_ONE_DIFFERS = '''
import os, sys
import evalrun.models as models
import evalrun.verify as verify
if os.environ.get("RANK") == "1":  # another node: the same model path holds other weights
    _real = models._load_random
    models._load_random = lambda ref, seed, device, dtype: _real(ref, seed + 1, device, dtype)
from evalrun.cli import main
sys.argv[0] = "evalrun"
main()
'''


def test_a_shard_job_whose_files_held_another_model_is_refused_not_joined(cli, tmp_path, golden_dir, monkeypatch):
    """The label names the config (the model by its path) and environment: a shard job whose files at that path
    held another checkpoint joined the others under the same label, one verdict of two models."""
    from conftest import one_line_exit_2

    from evalrun import runner

    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir)]
    assert cli(*verify, "--shard", "0/2", "--store", str(tmp_path / "s0.db"))[0] == 0
    with monkeypatch.context() as patched:
        real = runner.model_identity
        patched.setattr(runner, "model_identity", lambda loaded: {**real(loaded), "hash": "another-checkpoint"})
        assert cli(*verify, "--shard", "1/2", "--store", str(tmp_path / "s1.db"))[0] == 0
    merge_stores(tmp_path / "all.db", [tmp_path / "s0.db", tmp_path / "s1.db"])
    one_line_exit_2(cli(*verify, "--store", str(tmp_path / "all.db"), "--from-shards"),
                    "was computed by another model than the one here", "give every shard job and this join the same")


def test_a_rank_with_another_model_is_refused_not_joined_nor_waited_for(tmp_path, golden_dir):
    """Rank 1 loading other weights at the same path: `run` stored one complete run under rank 0's model identity
    holding rank 1's prompts of the other model; `golden verify` gated on rank 1 only (changed) while rank 0 went
    on, and the two waited in unmatched collectives (the 30-minute timeout). Both refuse with one line now."""
    script = tmp_path / "rank_one_differs.py"
    script.write_text(RANK_ONE_DIFFERS)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    store = tmp_path / "mixed.db"
    done = subprocess.run([*launcher, "run", *TINY, "--store", str(store)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "rank 1 ran another model than rank 0" in done.stderr, done.stderr[-2000:]
    assert [record.status for record in Store(store, readonly=True).list_runs()] == ["failed"]
    done = subprocess.run([*launcher, "golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and json.loads(done.stdout)["exit_code"] == 2, done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert "ranks disagree whether golden tiny gates this candidate (rank 1 changed: " in error, error
    assert "; the others not)" in error and "rank 0 " not in error, error


def test_a_shard_job_rerun_keeping_logits_joins_its_first_run(cli, tmp_path, golden_dir):
    """keep_logits is no hashed factor: a shard re-run with --set keep_logits=all has the same label and bits, and
    holds the logits arrays besides; --from-shards refused the two as runs 'with other bits'."""
    verify = ["golden", "verify", "tiny", *TINY, "--dir", str(golden_dir)]
    for index in range(2):
        assert cli(*verify, "--shard", f"{index}/2", "--store", str(tmp_path / f"s{index}.db"))[0] == 0
    assert cli(*verify, "--shard", "0/2", "--set", "keep_logits=all", "--store", str(tmp_path / "kept0.db"))[0] == 0
    merge_stores(tmp_path / "all.db", [tmp_path / name for name in ("s0.db", "s1.db", "kept0.db")])
    code, out, err = cli(*verify, "--store", str(tmp_path / "all.db"), "--from-shards")
    assert code == 0, err


def test_a_rank_with_another_environment_is_refused_naming_what_differs():
    """The line named two hash prefixes only: which of some twenty environment keys differed between the nodes
    (a kernel release, a driver, a thread count) was for the user to find."""
    import copy

    from evalrun.sharding import empty_run, runs_from_bytes, runs_to_bytes

    header = {"config": {"dtype": "float32"}, "config_hash": "c" * 32, "environment": {"os": "Linux 6.8.0-45",
              "backend_flags": {"num_threads": 96}}, "environment_hash": "e" * 32, "model": {"hash": "m" * 32},
              "prompt_set": {"hash": "p" * 32, "name": "smoke"}}
    rank0 = copy.deepcopy(header)
    rank0["environment"]["os"], rank0["environment_hash"] = "Linux 6.8.0-40", "f" * 32
    data = runs_to_bytes([("shard", header, empty_run(header))])
    with pytest.raises(ConfigError, match="rank 1 ran another environment than rank 0 .environment os: rank 0 "
                                          "Linux 6.8.0-40, rank 1 Linux 6.8.0-45"):
        runs_from_bytes(data, rank0, 1)
    assert runs_from_bytes(data, header, 1).keys() == {"shard"}
    rank0 = copy.deepcopy(header)  # a factor named, not a recorded knob that no hash covers
    rank0["config"], rank0["config_hash"] = {"dtype": "bfloat16", "keep_logits": "all"}, "d" * 32
    with pytest.raises(ConfigError, match=r"another config than rank 0 \(config dtype: rank 0 bfloat16, rank 1 "
                                          r"float32\)"):
        runs_from_bytes(data, rank0, 1)


RANK_ONE_ENVIRONMENT = '''
import os, sys
if os.environ.get("RANK") == "1":  # another node: a numerics variable set there only
    os.environ["TORCHINDUCTOR_FREEZING"] = "1"
from evalrun.cli import main
sys.argv[0] = "evalrun"
main()
'''


def test_a_verify_rank_with_another_environment_is_refused_not_joined(tmp_path, golden_dir):
    """The verify path's rank check: an environment difference is no gate, so both ranks run and rank 0 joined
    rank 1's prompts into a verdict under its own environment (no test reached this path)."""
    script = tmp_path / "rank_one_environment.py"
    script.write_text(RANK_ONE_ENVIRONMENT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run([*launcher, "golden", "verify", "tiny", *TINY, "--dir", str(golden_dir), "--json"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert "rank 1 ran another environment than rank 0 (environment env.TORCHINDUCTOR_FREEZING" in error, error
