"""The guard that keeps the unit tier free of processes (tests/launch_guard.py), run on a small test file of its
own in a pytest session inside this one (pytester): each kind of start it must refuse, and those it must allow."""

from pathlib import Path

import pytest

# The allowed cases start a real process (`true`), as a marked test may; this test is marked for them.
pytestmark = pytest.mark.launch

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from launch_guard import LaunchGuard


def pytest_configure(config):
    guard = LaunchGuard()
    guard.install()
    config.pluginmanager.register(guard, "launch-guard")


def pytest_unconfigure(config):
    config.pluginmanager.get_plugin("launch-guard").uninstall()
"""

CASES = """
import subprocess
import threading

import pytest


def test_unmarked_run():
    subprocess.run(["true"])


def test_unmarked_that_swallows_the_refusal():
    try:
        subprocess.run(["true"])
    except BaseException:
        pass


def test_unmarked_starting_from_a_thread():
    thread = threading.Thread(target=subprocess.run, args=(["true"],))
    thread.start()
    thread.join()


def test_unmarked_that_starts_nothing():
    assert True


@pytest.mark.launch
def test_marked_run():
    assert subprocess.run(["true"]).returncode == 0


@pytest.fixture(scope="module")
def started():
    return subprocess.run(["true"]).returncode


@pytest.mark.launch
def test_marked_sets_up_a_shared_fixture(started):
    assert started == 0


def test_unmarked_reads_the_shared_fixture_a_marked_test_set_up(started):
    assert started == 0
"""


# Runs after test_cases.py: a fixture of the same name that starts nothing is not the one that did.
NAMESAKE = """
import pytest


@pytest.fixture(scope="module")
def started():
    return 0


def test_unmarked_reads_a_namesake_of_the_shared_fixture(started):
    assert started == 0
"""


def test_unmarked_starts_are_refused_and_marked_ones_run(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    launch: starts a process\n")
    pytester.makepyfile(test_cases=CASES, test_namesake=NAMESAKE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore")
    outcomes = {report.nodeid.split("::")[-1]: report.outcome for report in result.reprec.getreports()
                if report.when == "call" or report.outcome != "passed"}
    assert outcomes == {
        "test_unmarked_run": "failed",
        "test_unmarked_that_swallows_the_refusal": "failed",
        "test_unmarked_starting_from_a_thread": "failed",
        "test_unmarked_that_starts_nothing": "passed",
        "test_marked_run": "passed",
        "test_marked_sets_up_a_shared_fixture": "passed",
        "test_unmarked_reads_the_shared_fixture_a_marked_test_set_up": "failed",   # in its set-up
        "test_unmarked_reads_a_namesake_of_the_shared_fixture": "passed",
    }
    text = result.stdout.str()
    assert "test_unmarked_run started a process (Popen._execute_child: true) but is not marked `launch`" in text
    assert "test_unmarked_starting_from_a_thread tried to start a process (Popen._execute_child: true)" in text
    assert ("test_unmarked_reads_the_shared_fixture_a_marked_test_set_up uses fixture 'started', which started "
            "a process (Popen._execute_child: true), but is not marked `launch`") in text
    assert text.count('mark it `launch` (@pytest.mark.launch); the unit tier, pytest -m "not launch", starts no '
                      'process') >= 4
