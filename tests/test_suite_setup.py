"""The suite's own setup (conftest.py): each pytest-xdist worker runs on its share of the cores."""

import os

import torch
from conftest import share_cores_between_workers


def test_each_worker_of_several_gets_its_share_of_the_cores(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        share = share_cores_between_workers("2")
        assert share == max(1, (os.cpu_count() or 1) // 2)
        assert torch.get_num_threads() == share and os.environ["OMP_NUM_THREADS"] == str(share)  # children inherit it
    finally:
        torch.set_num_threads(threads)


def test_one_worker_or_a_thread_count_the_caller_set_is_left_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert share_cores_between_workers(None) is None and share_cores_between_workers("1") is None
    assert "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert share_cores_between_workers("2") is None and os.environ["OMP_NUM_THREADS"] == "3"


def test_this_worker_runs_with_the_threads_its_children_inherit():
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
