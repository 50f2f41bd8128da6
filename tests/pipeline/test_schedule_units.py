"""Single-process checks of the schedule plumbing: pp = 1 is a schedule like the others, and the
gloo receive look-ahead posts a stream's next receive only while more are announced."""
from __future__ import annotations

from megazero.parallel.state import ParallelState
from megazero.pipeline.p2p import NEXT, PREV, ReceiveAhead
from megazero.pipeline.schedules import build_schedule
from megazero.pipeline.timeline import NullTimeline
from megazero.run_plan import RunPlan
from tests.helpers.pipeline_harness import make_cfg, train


def test_pp1_is_the_no_pipelining_schedule_with_or_without_a_timeline(tmp_path):
    cfg = make_cfg("gpt2", gbs=8)  # m = 4 micro-batches of 2
    serial = ParallelState.serial()
    schedule = build_schedule(RunPlan.resolve(cfg, serial.layout.world_size))
    assert schedule.name == "no-pipelining" and isinstance(schedule.timeline, NullTimeline)
    plain = train(cfg, serial)
    timed = train(cfg.updated(timeline=str(tmp_path / "trace.json")), serial)
    assert timed["losses"] == plain["losses"]  # bitwise: the timeline only measures
    assert plain["max_in_flight"] == timed["max_in_flight"] == 1
    assert plain["bubble"] == [None] * len(plain["losses"])
    assert all(0 <= b < 1 for b in timed["bubble"]), timed["bubble"]


def test_receive_ahead_posts_the_next_receive_while_more_are_expected():
    posted: list[str] = []

    def post_receive(stream: str) -> tuple[object, object]:
        posted.append(stream)
        return f"work-{len(posted)}", f"buffer-{len(posted)}"

    ahead = ReceiveAhead(True, post_receive)
    ahead.expected = {PREV: 2, NEXT: 1}
    assert ahead.take(PREV) is None  # nothing posted early yet: the caller posts this one itself
    ahead.taken(PREV)  # one of two taken: the second goes out now
    ahead.taken(NEXT)  # the only gradient: nothing more to post
    assert posted == [PREV] and ahead.take(PREV) == ("work-1", "buffer-1") and ahead.take(NEXT) is None
    ahead.taken(PREV)
    assert posted == [PREV] and ahead.drained() and ahead.expected == {PREV: 0, NEXT: 0}

    off = ReceiveAhead(False, post_receive)  # NCCL: counts only
    off.expected = {PREV: 2, NEXT: 0}
    off.taken(PREV)
    assert posted == [PREV] and off.expected[PREV] == 1
