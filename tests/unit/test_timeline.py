"""common/timeline.py: marks merge into one timeline per request through the links, the
earliest time of an event wins (a retried request marks some twice), and a timeline that
cannot be written turns itself off instead of raising into a request or a step."""
from __future__ import annotations

from common import timeline


def test_links_fold_every_id_into_the_clients_and_the_earliest_time_wins(tmp_path):
    try:
        timeline.record_to(str(tmp_path))
        timeline.mark("gateway.in", "client|7")          # a client id may hold '|'
        timeline.link("client|7", "attempt-1")
        timeline.link("client|7", "attempt-2")
        timeline.mark("decode.in", "attempt-1")
        timeline.mark("decode.in", "attempt-2")          # the migrated attempt, later
        timeline.mark("decode.in", "other")
    finally:
        timeline.record_to("")
    merged = timeline.read(tmp_path)
    assert sorted(merged) == ["client|7", "other"]
    lines = {line.split()[2]: float(line.split()[0]) for path in tmp_path.glob("*.timeline")
             for line in path.read_text().splitlines() if line.split()[1] == "decode.in"}
    assert merged["client|7"]["decode.in"] == lines["attempt-1"] < lines["attempt-2"]
    assert set(merged["client|7"]) == {"gateway.in", "decode.in"}


def test_a_timeline_that_cannot_be_written_turns_off_without_raising(tmp_path, caplog):
    timeline.record_to(str(tmp_path / "missing"))
    timeline.mark("gateway.in", "r")                     # must not raise
    assert timeline._DIR == ""
    assert "cannot be written" in caplog.text
    timeline.mark("gateway.in", "r")                     # off: nothing happens
    assert not list(tmp_path.iterdir())
