"""How `make test` splits the suite: two pytest workers that share the cores, then the servers' tests alone."""

from tests import conftest


def test_each_worker_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert conftest.worker_threads() == 1
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 16)
    assert conftest.worker_threads() == 8
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 2)
    assert conftest.worker_threads() == 1  # never none
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert conftest.worker_threads() is None  # one process: torch's own choice


def test_the_servers_tests_and_only_they_are_serial():
    tests = conftest.ROOT / "tests"
    assert conftest.is_serial(tests / "ch10_serving" / "test_load.py")
    assert conftest.is_serial(tests / "ch16_engine_core" / "test_failures.py")
    assert not conftest.is_serial(tests / "ch12_tensor_parallel" / "test_processes.py")
    assert not conftest.is_serial(tests / "test_benchmarks.py")
