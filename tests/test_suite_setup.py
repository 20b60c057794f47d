"""The suite's own setup (conftest.py): each pytest-xdist worker runs on its share of the cores."""

import os

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import share_cores_between_workers

THREAD_VARIABLES = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


@pytest.fixture
def unset_thread_settings(monkeypatch):
    """The thread variables unset, and this worker's torch threads, variables and Inductor compile threads as they
    were after the test (share_cores_between_workers changes all three)."""
    threads = torch.get_num_threads()
    for variable in THREAD_VARIABLES:
        monkeypatch.setenv(variable, "0")  # recorded (delenv of an unset variable is not), so the end restores it
        monkeypatch.delenv(variable)
    try:
        with inductor_config.patch(compile_threads=99):  # restored at its end (pytest's monkeypatch cannot)
            yield
    finally:
        torch.set_num_threads(threads)


def test_each_worker_of_several_gets_its_share_of_the_cores(unset_thread_settings):
    share = share_cores_between_workers("2")
    assert share == max(1, len(os.sched_getaffinity(0)) // 2)
    assert torch.get_num_threads() == share and os.environ["OMP_NUM_THREADS"] == str(share)  # inherited
    assert inductor_config.compile_threads == share
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == str(share)


def test_one_worker_or_a_thread_count_the_caller_set_is_left_alone(unset_thread_settings, monkeypatch):
    assert share_cores_between_workers(None) is None and share_cores_between_workers("1") is None
    assert not any(variable in os.environ for variable in THREAD_VARIABLES)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert share_cores_between_workers("2") is None and os.environ["OMP_NUM_THREADS"] == "3"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ


def test_a_compile_thread_count_the_caller_set_is_kept(unset_thread_settings, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")
    assert share_cores_between_workers("2") is not None
    assert inductor_config.compile_threads == 5 and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "5"


def test_this_worker_runs_with_the_thread_count_its_children_inherit():
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        pytest.skip("not a pytest-xdist worker of several (make test runs two)")
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:  # unset where the caller set OMP_NUM_THREADS
        assert inductor_config.compile_threads == int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
