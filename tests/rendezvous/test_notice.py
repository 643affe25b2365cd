"""What a SIGTERM means to the in-place agent (``regroup.rendezvous.inplace.notice``): a hand-off
while a controller leads the job and the node has ranks in its round, within the grace less
a margin; otherwise a stop at once. Pure: every moment is built by hand."""

from __future__ import annotations

from datetime import timedelta

from regroup.rendezvous.inplace.notice import TERM_MARGIN_S, overdue, take_notice

NOW = 1_790_000_000.0
GRACE = timedelta(seconds=30)


def test_with_a_controller_a_node_in_the_round_trains_on_until_the_grace_less_the_margin() -> None:
    notice = take_notice(NOW, GRACE, controller=True, in_round=True)
    assert notice.hands_over
    assert (notice.since, notice.by, notice.stop_at) == (NOW, NOW + 30, NOW + 30 - TERM_MARGIN_S)
    assert overdue(notice, NOW) == ""
    assert overdue(notice, notice.stop_at - 0.01) == ""
    assert "not left out of the job within its grace of 30s" in overdue(notice, notice.stop_at)


def test_without_a_controller_the_node_stops_at_once() -> None:
    notice = take_notice(NOW, GRACE, controller=False, in_round=True)
    assert not notice.hands_over and notice.stop_at == NOW and notice.by == NOW + 30
    assert "no controller leads the job" in overdue(notice, NOW)


def test_a_node_with_no_place_in_the_round_has_nothing_to_hand_over() -> None:
    notice = take_notice(NOW, GRACE, controller=True, in_round=False)
    assert not notice.hands_over
    assert "nothing to hand over" in overdue(notice, NOW)


def test_a_grace_no_longer_than_the_margin_leaves_no_time_for_a_hand_off() -> None:
    notice = take_notice(NOW, timedelta(seconds=TERM_MARGIN_S), controller=True, in_round=True)
    assert not notice.hands_over
    assert "leaves no time for a hand-off" in overdue(notice, NOW)
