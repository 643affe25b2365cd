"""The ``RendezvousFlapping`` alert counts the rounds that gave way before the trainers took
a step in them, not every round.

A healthy ``regroup demo`` goes through ten rounds in under three minutes: a reclaim, a
loss, a grow, a flaky node's three crashes (the agents re-form around each in place) and
the grows between them, its cordon. Every one of them trained at once. Counting rounds
raised the alert seven times in a healthy run; rounds that form and give way again and
again before any training (ranks dying before their first step, members coming and going
while a round gathers) still raise it."""

from __future__ import annotations

from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import PostEvent
from regroup.records import Progress, RoundState

from .builders import KEYS, T0, Scene, decide, job, of

S = ControllerSettings()
NODES = ("n1", "n2", "n3")


def formed(s: Scene, number: int, nodes: tuple[str, ...], at: float, expected: int = 0) -> Scene:
    """``rdzv/state``: round ``number`` formed with ``nodes``, seen ``at`` (``expected``: the
    controller's expected membership it consumed; the agents' own rounds leave it as it was)."""
    record = RoundState(min_nodes=1, max_nodes=3, round=number, nodes=list(nodes), agents=[f"{n}@0.0" for n in nodes],
                        expected_generation=expected, formed_at=at)  # fmt: skip
    return s.with_record(KEYS.rdzv + "state", record, revision=number, at=at)


def trained(s: Scene, number: int, step: int, at: float, round_: int | None = None) -> Scene:
    """Rank 0's progress after a step of round ``number`` (``round_=0``: a trainer that names no round)."""
    progress = Progress(step=step, loss=1.0, samples_seen=step * 8, world_size=2, time=at,
                        round=number if round_ is None else round_)  # fmt: skip
    return s.with_progress(progress, revision=1000 + step)


def flapping_events(s: Scene, now: float) -> list[PostEvent]:
    return [e for e in of(decide(s, now, S).actions, PostEvent) if e.reason == "RendezvousFlapping"]


# The short demo's rounds as a run of it recorded them (seconds after T0), the first from no
# round at all: who formed each ("g": the controller's expected membership it consumed), and
# when the trainers' first progress in it came.
SHORT_DEMO = [
    (1, NODES, 0.0, 0, 0.3), (2, ("n1", "n3"), 6.2, 1, 6.6), (3, ("n1",), 24.1, 2, 24.2),
    (4, NODES, 39.6, 3, 40.0), (5, ("n2", "n3"), 66.2, 3, 66.5), (6, NODES, 73.7, 4, 74.2),
    (7, ("n2", "n3"), 75.0, 4, 75.3), (8, NODES, 82.8, 5, 83.3), (9, ("n2", "n3"), 84.2, 5, 84.6),
    (10, ("n2", "n3"), 89.3, 6, 89.6),
]  # fmt: skip


def test_a_healthy_demos_rounds_all_trained_and_do_not_flap() -> None:
    s = job(NODES, round_=0, step=None)  # the agents registered; no round formed yet
    for number, nodes, at, expected, first_step in SHORT_DEMO:
        s = formed(s, number, nodes, T0 + at, expected)
        for now in (T0 + at + 0.1, T0 + first_step + 0.1):
            d = decide(s, now, S)
            assert not d.alerts.flapping and not flapping_events(s, now), (number, d.reason)
        s = trained(s, number, step=10 * number, at=T0 + first_step)
    # Ten rounds formed (the first from none), none of them gave way untrained.
    assert len(s.round_times) == 10 and list(s.untrained_round_times) == []


def test_rounds_that_give_way_before_training_flap() -> None:
    # Ranks that die before their first step: the agents re-form, and again, and again.
    s = trained(formed(job(NODES), 2, NODES, T0 - 100), 2, step=100, at=T0 - 99)
    for number, at in zip(range(3, 8), (T0 - 80, T0 - 60, T0 - 40, T0 - 20, T0 - 5)):
        s = formed(s, number, NODES if number % 2 else NODES[:2], at)
    # Round 2 trained; 3, 4, 5 and 6 gave way untrained (7 is the one forming now).
    assert list(s.untrained_round_times) == [T0 - 60, T0 - 40, T0 - 20, T0 - 5]
    d = decide(s, T0, S)
    [event] = flapping_events(s, T0)
    assert d.alerts.flapping and event.type_ == "Warning"
    assert event.message == "job llama: 4 rendezvous rounds gave way before a training step in them within 0:10:00"
    # Once the window has passed, the alert clears.
    assert not decide(s, T0 + 1000, S).alerts.flapping


def test_the_controllers_reforms_flap_too_when_none_of_their_rounds_trains() -> None:
    # Whoever asks for them: rounds that never train are a job getting nowhere.
    s = job(NODES)
    for number in range(2, 7):
        s = formed(s, number, NODES if number % 2 else NODES[:2], T0 - 60 + number, expected=number - 1)
    assert decide(s, T0, S).alerts.flapping


def test_many_rounds_that_each_trained_do_not_flap() -> None:
    # Planned in-place re-forms one after the other, each trained in before the next.
    s = job(NODES)
    for number in range(2, 14):
        at = T0 - 120 + 10 * number
        s = trained(formed(s, number, NODES if number % 2 else NODES[:2], at, expected=number - 1), number,
                    step=10 * number, at=at + 0.5)  # fmt: skip
    assert len(s.round_times) == 12 and list(s.untrained_round_times) == []
    assert not decide(s, T0 + 11, S).alerts.flapping


def test_a_trainer_that_names_no_round_trains_in_the_round_in_place() -> None:
    s = job(NODES)
    for number in range(2, 8):
        at = T0 - 60 + 5 * number
        s = trained(formed(s, number, NODES, at), number, step=10 * number, at=at + 0.5, round_=0)
    assert list(s.untrained_round_times) == [] and not decide(s, T0, S).alerts.flapping
