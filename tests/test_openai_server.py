"""--engine openai:URL against a local stub server (tests/openai_stub.py): verdicts, and every misbehaviour
ending in one line, exit 2, nothing stored as complete."""

from __future__ import annotations

import json
import socket
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from evalrun.config import build_config
from evalrun.engine.openai_server import OpenAIClient, TokenIndex, parse_completion
from evalrun.errors import ServerError
from evalrun.golden import content_digest, open_golden
from evalrun.models import byte_tokenizer
from evalrun.server_golden import create_server_golden
from openai_stub import StubServer

pytest_plugins = ["pytester"]

LOCAL = ["--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "5"]


@pytest.fixture(scope="module")
def stub():
    server = StubServer()
    yield server
    server.close()


def _verify(cli, server, directory: Path, name: str = "g") -> tuple[int, dict | str, str]:
    code, out, err = cli("golden", "verify", name, "--dir", str(directory), "-q", "--engine", f"openai:{server.url}",
                         *LOCAL, "--json")
    return code, (json.loads(out) if out.strip().startswith("{") else out), err


def _server_golden(server, directory: Path, name: str = "g") -> Path:
    config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 5,
                                 "engine": f"openai:{server.url}"})
    create_server_golden(name, config, directory, cuda_available=False)
    return directory


@pytest.fixture(scope="module")
def server_golden(stub, tmp_path_factory) -> Path:
    """A golden made from the well-behaved stub."""
    return _server_golden(stub, tmp_path_factory.mktemp("golden"), "served")


def test_a_golden_of_a_bfloat16_server_is_made_and_verifies(cli, tmp_path):
    """Create refuses what verify would refuse; a server golden's other roles hold the server run, which verify
    never reads as a float32 function run: create refused every server that computes in bfloat16 ("no float32 run
    of that model"), the README's llama.cpp Q4_1 server too."""
    server = StubServer(dtype="bfloat16")
    try:
        code, verdict, err = _verify(cli, server, _server_golden(server, tmp_path, "bf16"), "bf16")
        assert code == 0 and verdict["verdict"] == "identical", (verdict, err)
    finally:
        server.close()


@pytest.fixture
def behaving(stub):
    """The module's stub, reset to `ok` after the test whatever it set."""
    yield stub
    stub.behaviour, stub.entry_extra, stub.eos, stub.rewrite = "ok", {}, None, None


def _complete_runs(store_path: Path) -> list[tuple[str, str]]:
    if not store_path.exists():
        return []
    with sqlite3.connect(store_path) as conn:
        return conn.execute("SELECT id, status FROM runs").fetchall()


def test_a_server_golden_holds_the_server_run_and_a_float64_oracle(server_golden):
    golden = open_golden("served", server_golden)
    assert golden.config("pinned").engine.startswith("openai:")
    assert golden.config("oracle").dtype == "float64" and golden.config("oracle").engine == "evalrun"
    assert golden.meta["server"]["values"] == "log-probabilities"
    pinned, oracle = golden.results("pinned")[0], golden.results("oracle")[0]
    np.testing.assert_array_equal(pinned.arrays["probe_ids"], oracle.arrays["probe_ids"])
    # the stub computes in float32, the oracle in float64, both log_softmax over the whole vocabulary
    assert np.abs(pinned.arrays["probe_values"] - oracle.arrays["probe_values"]).max() < 1e-4
    assert np.all(pinned.arrays["probe_values"] <= 0)
    assert golden.pinned.json["model"]["served_model"] == "stub-model"


def test_the_same_server_verifies_identical(cli, stub, server_golden):
    code, out, err = cli("golden", "verify", "served", "--dir", str(server_golden), "-q", "--engine",
                         f"openai:{stub.url}", *LOCAL, "--json")
    assert code == 0, err
    assert '"verdict": "identical"' in out


@pytest.mark.parametrize("behaviour, verdict, code", [("noise", "drift", 0), ("changed", "changed", 1),
                                                     ("runner-up", "changed", 1)])
def test_ulp_noise_is_drift_and_another_function_is_changed(cli, behaving, server_golden, behaviour, verdict, code):
    """runner-up: a choice within GREEDY_SLACK of the server's own top is not refused as sampling (a greedy server
    may print its numbers rounded); the verdict judges it: tokens the float64 oracle ranks lower by far more than a
    float32 server's budget are flips of a changed function."""
    behaving.behaviour = behaviour
    code_seen, out, err = cli("golden", "verify", "served", "--dir", str(server_golden), "-q", "--engine",
                              f"openai:{behaving.url}", *LOCAL, "--set", f"server_config={behaviour} build",
                              "--format", "text")
    assert code_seen == code, out + err
    assert f"{verdict.upper()} (exit {code})" in out
    if behaviour == "runner-up":
        assert "->" in out.split("flips (golden -> candidate")[1]  # listed, each with its oracle gap
    assert f"config: server_config  -> {behaviour} build" in out  # the notes are a hashed factor: named
    assert "function check: not run" in out and "execution check: server vs the envelope" in out


def test_a_golden_made_by_evalrun_verifies_against_a_server_computing_the_same_model(cli, stub, tmp_path):
    code, _, err = cli("golden", "create", "ours", "--dir", str(tmp_path), "-q", *LOCAL)
    assert code == 0, err
    code, out, err = cli("golden", "verify", "ours", "--dir", str(tmp_path), "-q", "--engine", f"openai:{stub.url}",
                         *LOCAL)
    assert code == 0, out + err  # the stub computes the same float32 model: drift, never identical
    assert "DRIFT" in out and "log-probabilities over the whole vocabulary" in out
    assert "model identity: not checkable through the API" in out
    forget_logsumexp(tmp_path / "ours.db")  # a golden made before evalrun stored each step's logsumexp
    code, out, err = cli("golden", "verify", "ours", "--dir", str(tmp_path), "-q", "--engine", f"openai:{stub.url}",
                         *LOCAL)
    assert code == 0 and "DRIFT" in out and "renormalised over the compared ids" in out, out + err


def forget_logsumexp(path: Path) -> None:
    """Drop the probe_logsumexp arrays and re-seal the file, as an older evalrun wrote goldens."""
    with sqlite3.connect(path) as conn:
        assert conn.execute("DELETE FROM arrays WHERE name = 'probe_logsumexp'").rowcount > 0
        conn.execute("UPDATE golden SET value = ? WHERE key = 'content_digest'", [content_digest(conn)])


def test_run_on_a_server_is_stored_complete(cli, stub, store_path):
    code, out, err = cli("run", "--engine", f"openai:{stub.url}", *LOCAL, "--store", str(store_path), "-q", "--json")
    assert code == 0, err
    assert '"prompt_format": "token ids"' in out
    assert [status for _, status in _complete_runs(store_path)] == ["complete"]


# nan verified as drift: NaN is over no budget
@pytest.mark.parametrize("behaviour", ["slow", "error500", "truncated", "fewer", "nan"])
def test_a_misbehaving_server_gives_one_line_exit_2_and_nothing_complete(cli, behaving, server_golden, tmp_path,
                                                                         store_path, behaviour):
    behaving.behaviour, behaving.delay = behaviour, 2.0
    target = ["--engine", f"openai:{behaving.url}", *LOCAL, "--set", "server_timeout=0.4", "-q"]
    calls = behaving.calls
    code, out, err = cli("run", *target, "--store", str(store_path))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and err.startswith("evalrun: error: ")
    assert [status for _, status in _complete_runs(store_path)] == ["failed"]
    if behaviour not in ("fewer", "nan"):  # the token-id probe (one try), then the request, retried a bounded number of times
        assert behaving.calls - calls == 4
    code, out, err = cli("golden", "create", "broken", "--dir", str(tmp_path / "g"), *target)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists() or not list((tmp_path / "g").iterdir())
    code, out, err = cli("golden", "verify", "served", "--dir", str(server_golden), *target)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "server" in err


def test_the_greedy_note_allows_half_a_nat_below_the_servers_own_top():
    """The bounds of GREEDY_SLACK, on the server's raw numbers (two of its tokens printing one string share a key
    of top_logprobs, so the chosen token's value is read from token_logprobs)."""
    from evalrun.server_run import GREEDY_SLACK, greedy_note

    assert GREEDY_SLACK == 0.5
    top = {"a": -1.0, "b": -1.3}
    for chosen in (-1.0, -1.3, -1.49, -1.0 - 1e-12):  # its top, a runner-up within the slack, rounding
        assert greedy_note(chosen, top, "b", "prompt 'p', token 0") is None
    assert greedy_note(-2.0, {}, "x", "prompt 'p', token 0") is None  # nothing to compare with
    for chosen in (-1.51, -7.0):
        note = greedy_note(chosen, top, "c", "prompt 'p', token 0")
        assert note.startswith("its chosen tokens are not the top of its own log-probabilities (first at prompt 'p', "
                               "token 0: 'c'"), note


def test_a_sampling_server_is_named_in_the_verdict(cli, behaving, server_golden):
    """A server whose choices trail its own top (it samples, or applies a penalty as llama.cpp's server does by
    default) verified as drift with nothing said; its verdict now names it (the verdict itself is unchanged: a
    penalty is a deterministic setting of a server, and its goldens verify against it)."""
    behaving.behaviour = "sampling"
    code, out, err = cli("golden", "verify", "served", "--dir", str(server_golden), "-q", "--engine",
                         f"openai:{behaving.url}", *LOCAL, "--json")
    causes = json.loads(out)["causes"]
    assert any(c.startswith("server: its chosen tokens are not the top of its own log-probabilities (first at prompt")
               for c in causes), (code, causes)


def test_a_server_answering_a_number_past_4300_digits_is_one_line_exit_2(cli, behaving, store_path):
    """json.loads raised ValueError, not JSONDecodeError, on it: an internal error (exit 3)."""
    behaving.behaviour = "huge-number"
    code, out, err = cli("run", "--engine", f"openai:{behaving.url}", *LOCAL, "--store", str(store_path), "-q")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and "over 4300 digits" in err, err


def test_the_fingerprint_of_a_server_holds_its_identity(cli, stub):
    code, out, err = cli("fingerprint", "--engine", f"openai:{stub.url}", "--model", "random:tiny", "--prompts", "smoke",
                         "--set", "server_config=vllm -O3", "--json")
    assert code == 0, err
    header = json.loads(out)
    assert header["environment"]["server"] == {"version": {"version": "stub-1.0"}, "headers": {"server": "evalrun-stub/1"},
                                               "entry": {"id": "stub-model", "object": "model", "owned_by": "stub"}}
    assert header["model"]["served_model"] == "stub-model" and header["config"]["server_config"] == "vllm -O3"


def test_no_server_at_the_url_is_one_line(cli, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed when the block ends: nothing listens there
    code, out, err = cli("run", "--engine", f"openai:http://127.0.0.1:{port}/v1", *LOCAL, "--store",
                         str(tmp_path / "s.db"), "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no answer" in err


def test_a_model_the_server_does_not_serve_is_refused(cli, stub, tmp_path):
    code, _, err = cli("run", "--engine", f"openai:{stub.url}", "--served-model", "other", *LOCAL, "--store",
                       str(tmp_path / "s.db"), "-q")
    assert code == 2 and "does not serve 'other'" in err and "stub-model" in err


def test_served_model_without_a_server_engine_is_refused(cli, tmp_path):
    code, _, err = cli("run", "--served-model", "x", *LOCAL, "--store", str(tmp_path / "s.db"), "-q")
    assert code == 2 and "use them with --engine openai:URL" in err


def test_token_strings_map_to_ids_and_ambiguous_ones_are_left_out():
    tokenizer = byte_tokenizer()
    index = TokenIndex(tokenizer, len(tokenizer))
    a = tokenizer.convert_tokens_to_ids("a")
    assert index.lookup("a") == a and index.lookup("token_id:7") == 7
    assert index.lookup("") is None and index.ambiguous == 1  # every special token prints as "" in llama.cpp
    assert index.top_ids({"a": -0.1, "": -2.0, "no such token": -3.0}) == {a: -0.1}


def test_a_completion_without_logprobs_or_with_a_broken_shape_is_refused():
    with pytest.raises(ServerError, match="no log-probabilities"):
        parse_completion({"choices": [{"text": "x", "logprobs": None}]}, "here")
    broken = {"choices": [{"text": "x", "logprobs": {"tokens": ["a"], "token_logprobs": [], "top_logprobs": []}}]}
    with pytest.raises(ServerError, match="malformed completion"):
        parse_completion(broken, "here")


def test_the_client_learns_whether_token_ids_are_accepted(stub):
    client = OpenAIClient(stub.url)
    assert client.identity()["model"] == "stub-model"
    assert client.accepts_token_ids([1, 2, 3]) is True


def test_evalrun_goldens_store_each_probed_steps_logsumexp(cli, tmp_path):
    """What turns the golden's logits into the log-probabilities a server returns: the logsumexp over the
    whole vocabulary at each probed step, equal to a teacher-forced float64 forward of the same model."""
    import torch

    from evalrun.models import load_model

    code, _, err = cli("golden", "create", "lse", "--dir", str(tmp_path), "-q", *LOCAL)
    assert code == 0, err
    golden = open_golden("lse", tmp_path)
    model = load_model("random:tiny", "cpu", "float64").model
    for role in ("oracle", "function"):
        for result in golden.results(role):
            tokens, prompt = result.arrays["tokens"], result.arrays["input_ids"].tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + tokens[:-1].tolist()])).logits[0, len(prompt) - 1:]
            expected = torch.logsumexp(logits, dim=-1).numpy()
            np.testing.assert_allclose(result.arrays["probe_logsumexp"], expected, rtol=0, atol=1e-5)
            assert np.all(result.arrays["probe_values"] <= result.arrays["probe_logsumexp"][:, None])


def test_the_pytest_plugin_verifies_a_server(stub, golden_factory, tmp_path, monkeypatch, pytester):
    """@pytest.mark.evalrun_golden(..., engine="openai:URL"): the plugin hands the candidate to the server
    verification and records the server's run in the store (pytester last: see test_pytest_plugin.py)."""
    directory = golden_factory()
    store = tmp_path / "store.db"
    monkeypatch.setenv("EVALRUN_STORE", str(store))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))  # this checkout's evalrun
    for variable in ("CI", "GITHUB_ACTIONS", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(variable, raising=False)
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.evalrun_golden("g", golden_dir={str(directory)!r}, engine={"openai:" + stub.url!r})
        def test_served(evalrun_verdict):
            assert evalrun_verdict.verdict == "drift"
            assert evalrun_verdict.function_check.startswith("not run")
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning")
    result.assert_outcomes(passed=1)
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT status FROM runs").fetchall() == [("complete",)]


def test_a_restart_with_another_max_model_len_is_the_same_model(cli, behaving, tmp_path):
    """vLLM's and SGLang's model-list entry holds max_model_len (--max-model-len, --context-length): a serving
    setting, named as environment. It was hashed into the model's identity: a restart with another context limit
    verified `changed`, exit 1. The rest of the entry still gates (the launch path, `root`)."""
    behaving.entry_extra = {"root": "/models/smollm2", "parent": None, "max_model_len": 2048}
    _server_golden(behaving, tmp_path)
    behaving.entry_extra = {"root": "/models/smollm2", "parent": None, "max_model_len": 4096}
    code, verdict, err = _verify(cli, behaving, tmp_path)
    assert (code, verdict["verdict"]) == (0, "identical"), (verdict, err)
    assert "environment: server.entry.max_model_len 2048 -> 4096" in verdict["causes"]
    behaving.entry_extra = {"root": "/models/other", "parent": None, "max_model_len": 2048}
    code, verdict, err = _verify(cli, behaving, tmp_path)
    assert (code, verdict["verdict"]) == (1, "changed"), verdict


def _tokens(directory: Path) -> list[list[int]]:
    return [r.arrays["tokens"].tolist() for r in open_golden("g", directory).results("pinned")]


def test_a_server_going_on_where_the_goldens_ended_is_changed(cli, behaving, tmp_path):
    """The golden's server ended a prompt at step 2 (its end-of-sequence another id: another generation config);
    the candidate, the same numbers bit for bit, goes on. It verified identical ("every token ... equal"): the step
    where the golden ended was never looked at. Now the candidate's own lead over end-of-sequence there is judged
    as a flip's gap."""
    _server_golden(behaving, tmp_path / "plain")
    behaving.eos = _tokens(tmp_path / "plain")[0][2]
    _server_golden(behaving, tmp_path / "g")
    assert len(_tokens(tmp_path / "g")[0]) == 2
    behaving.eos = None
    code, verdict, err = _verify(cli, behaving, tmp_path / "g")
    assert (code, verdict["verdict"]) == (1, "changed"), (verdict, err)
    assert any(c.startswith("end of sequence: step 2: the golden's server ended the sequence") and "at least" in c
               for c in verdict["causes"]), verdict["causes"]


def test_the_same_server_ending_where_the_golden_ended_stays_identical(cli, behaving, tmp_path):
    behaving.eos = _tokens(_server_golden(behaving, tmp_path / "plain"))[0][2]
    _server_golden(behaving, tmp_path / "g")
    code, verdict, err = _verify(cli, behaving, tmp_path / "g")
    assert (code, verdict["verdict"]) == (0, "identical"), (verdict, err)
    assert any(r.eos_step >= 0 for r in open_golden("g", tmp_path / "g").results("pinned"))


def _on_first_step(change):
    def rewrite(answer: dict) -> dict:
        logprobs = answer["choices"][0]["logprobs"]
        if logprobs["tokens"]:
            change(logprobs)
        return answer
    return rewrite


def _first_top(key: str | None = None, value: float | None = None):
    def change(logprobs: dict) -> None:
        top = logprobs["top_logprobs"][0]
        first = next(iter(top))
        kept = top.pop(first)
        top[key or first] = kept if value is None else value
        if value is not None and logprobs["tokens"][0] == first:
            logprobs["token_logprobs"][0] = value
    return change


def _every_first(value: float):
    def change(logprobs: dict) -> None:
        logprobs["token_logprobs"][0] = value
        logprobs["top_logprobs"][0] = {key: value for key in logprobs["top_logprobs"][0]}
    return change


def _cut_short(finish: str | None):
    def rewrite(answer: dict) -> dict:
        choice = answer["choices"][0]
        if len(choice["logprobs"]["tokens"]) > 2:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                choice["logprobs"][name] = choice["logprobs"][name][:-2]
            choice["finish_reason"] = finish
        return answer
    return rewrite


HOSTILE_ANSWERS = {
    "id past the vocabulary": _on_first_step(_first_top(key="token_id:999999")),
    "id past int64": _on_first_step(_first_top(key="token_id:" + "9" * 30)),
    "positive log-probability": _on_first_step(_every_first(50.0)),
    "log-probability -1e308": _on_first_step(_first_top(value=-1e308)),
    "log-probability 1e308": _on_first_step(_every_first(1e308)),
    "log-probability of 400 digits": _on_first_step(lambda logprobs: logprobs["token_logprobs"].__setitem__(
        0, -10 ** 400)),
    "cut short at its length": _cut_short("length"),
    "cut short, no reason": _cut_short(None),
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE_ANSWERS))
def test_a_hostile_answer_is_one_line_exit_2_and_nothing_stored_good(cli, behaving, server_golden, tmp_path,
                                                                     store_path, hostile):
    """Before: a token id past the vocabulary or past int64, a log-probability past 1e308 as a JSON integer: exit 3
    or `changed`; a positive or +-1e308 log-probability, or a completion cut short without ending the sequence:
    stored complete and a golden written (one whose envelope was infinite, so a server computing another function
    verified as drift; or one no verify could read)."""
    behaving.rewrite = HOSTILE_ANSWERS[hostile]
    target = ["--engine", f"openai:{behaving.url}", *LOCAL, "-q"]
    code, out, err = cli("run", *target, "--store", str(store_path))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and err.startswith("evalrun: error: "), err
    if "log-probability" in hostile and "digits" not in hostile:  # logits, as vLLM's raw_logits mode returns
        assert "start it with raw_logprobs" in err, err
    assert [status for _, status in _complete_runs(store_path)] == ["failed"]
    code, out, err = cli("golden", "create", "broken", "--dir", str(tmp_path / "g"), *target)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "g").exists() or not list((tmp_path / "g").iterdir())
    code, out, err = cli("golden", "verify", "served", "--dir", str(server_golden), *target)
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def _without_the_runner_up(answer: dict) -> dict:
    """Each step's second id left out, as llama.cpp's server leaves evalrun no id for a special token (it prints
    every one as "")."""
    for top in answer["choices"][0]["logprobs"]["top_logprobs"]:
        if len(top) > 2:  # not the one-id probe of whether the server takes token ids
            top.pop(list(top)[1])
    return answer


def test_a_flip_to_an_id_the_golden_server_did_not_show_is_judged_at_the_oracles_gap(cli, behaving, tmp_path):
    """A server golden probes the ids its server returned: a flip to one it left out (llama.cpp's end-of-sequence,
    printed as "") had an infinite oracle gap, a flip across a clear margin whatever the numbers. The oracle's own
    top-k, stored beside, gives the gap."""
    behaving.rewrite = _without_the_runner_up
    _server_golden(behaving, tmp_path)
    behaving.rewrite, behaving.behaviour = None, "runner-up"
    _, verdict, err = _verify(cli, behaving, tmp_path)
    flips = [flip for prompt in verdict["prompts"] for flip in prompt["flips"] or []]
    assert flips and all(0 < flip["oracle_gap"] < 1 for flip in flips), flips  # the runner-ups are within 0.4


def test_a_flip_within_the_budget_before_the_goldens_end_stays_drift(cli, tmp_path):
    """The golden's server (bfloat16) ended 'chat-hello' after 6 tokens; the candidate, the same server breaking a
    near tie (0.016 nats, inside bfloat16's error) the other way at step 4, goes on along its own tokens. Its step 6
    is another context than the golden's: judging its end-of-sequence there read a flip within the budget as
    `changed`, exit 1."""
    server = StubServer(dtype="bfloat16")
    try:
        server.eos = 192  # the golden's token at step 6 of 'chat-hello' (random:tiny): its server ends there
        config = build_config(flags={"model": "random:tiny", "prompts": "smoke", "max_new_tokens": 8,
                                     "engine": f"openai:{server.url}"})
        create_server_golden("g", config, tmp_path, cuda_available=False)
        assert [len(t) for t in _tokens(tmp_path)] == [8, 6, 8]
        server.behaviour, server.tie = "runner-up", 0.02
        code, out, err = cli("golden", "verify", "g", "--dir", str(tmp_path), "-q", "--engine", f"openai:{server.url}",
                             "--model", "random:tiny", "--prompts", "smoke", "--max-new-tokens", "8", "--json")
        verdict = json.loads(out)
        hello = next(p for p in verdict["prompts"] if p["prompt_id"] == "chat-hello")
        assert hello["first_divergent_step"] == 4 and all(f["passed"] for f in hello["flips"]), hello
        assert (code, verdict["verdict"]) == (0, "drift"), (verdict["causes"], err)
        assert not any(c.startswith("end of sequence:") for c in verdict["causes"]), verdict["causes"]
    finally:
        server.close()
