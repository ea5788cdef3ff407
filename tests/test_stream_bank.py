"""The suite's stream bank (tests/launch_streams.py) on stand-in launches: a stream that fails costs its own readers
their rows, and nothing else - not the other streams' rows, not a second launch of every stream for each reader."""

import pytest

import launch_streams
from launch_streams import Stream, StreamBank

FIRST, SECOND, BROKEN = Stream("first", ()), Stream("second", ()), Stream("broken", ())


@pytest.fixture
def launches(monkeypatch):
    """The stream names launched, in order; "broken" raises as a stream whose `harness run` failed would."""
    launched = []

    def run(folder, stream):
        launched.append(stream.name)
        if stream.name == BROKEN.name:
            raise RuntimeError("stream broken: `python -m harness run ...` exited 1")
        return [f"{stream.name} row"]

    monkeypatch.setattr(launch_streams, "_run", run)
    return launched


def test_a_failed_stream_fails_its_readers_and_leaves_the_others_rows(tmp_path, launches):
    bank = StreamBank(tmp_path, [BROKEN, FIRST, SECOND])
    with pytest.raises(RuntimeError, match="stream broken failed"):
        bank.rows(BROKEN)
    assert bank.rows(FIRST) == ["first row"] and bank.rows(SECOND, FIRST) == ["second row", "first row"]
    with pytest.raises(RuntimeError, match="stream broken failed") as raised:
        bank.rows(FIRST, BROKEN)
    assert "exited 1" in str(raised.value.__cause__)
    assert sorted(launches) == ["broken", "first", "second"]        # each once, the failed one included


def test_the_first_demand_launches_every_planned_stream_once(tmp_path, launches):
    bank = StreamBank(tmp_path, [FIRST, SECOND])
    assert bank.rows(SECOND) == ["second row"]
    assert bank.rows(FIRST) == ["first row"]
    assert sorted(launches) == ["first", "second"]


def test_run_streams_raises_the_first_failure_unless_told_to_keep_going(tmp_path, launches):
    with pytest.raises(RuntimeError, match="exited 1"):
        launch_streams.run_streams(tmp_path, [FIRST, BROKEN])
    kept = launch_streams.run_streams(tmp_path, [FIRST, BROKEN], keep_going=True)
    assert kept["first"] == ["first row"] and isinstance(kept["broken"], RuntimeError)
