"""`bench serve --rate-schedule`: the schedule's arrivals (each segment at its own rate, quiet ones empty), bad
schedules as errors naming the flag, and the timeline plot drawn from a run's records."""

from __future__ import annotations

import pytest

from tokenmill.bench.timeline import parse_schedule, schedule_arrivals


def test_arrivals_follow_each_segments_rate():
    times = schedule_arrivals(parse_schedule("100:0.5,100:5,100:0"), seed=3)
    assert times == sorted(times)
    first = sum(1 for t in times if t < 100)
    second = sum(1 for t in times if 100 <= t < 200)
    assert 30 <= first <= 75 and 420 <= second <= 580   # Poisson around 50 and 500
    assert not [t for t in times if t >= 200]            # the quiet end has none
    assert schedule_arrivals(parse_schedule("100:0.5,100:5,100:0"), seed=3) == times


@pytest.mark.parametrize("spec", ["10", "10:x", "0:1", "10:-1", "10:1,"])
def test_a_bad_schedule_is_an_error_naming_the_flag(spec):
    with pytest.raises(ValueError, match="--rate-schedule"):
        parse_schedule(spec)


def test_the_timeline_plot_is_drawn(tmp_path):
    from tokenmill.bench.plot import plot_timeline

    timeline = {"requests": [[0.5, 5.2, 5.6, True], [20.0, 0.05, 0.9, True], [21.0, 0.0, 0.0, False]],
                "fleet": [[0.0, 0, 0, 1, 0], [0.5, 1, 1, 1, 0], [5.0, 1, 1, 0, 1], [22.0, 2, 2, 0, 2]]}
    plot_timeline(timeline, str(tmp_path / "t.png"), "test")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
