"""The reshard's plan, without processes: which bytes each new rank needs and from whom,
and how they are cut into messages (``regroup.elastic.memory.reshard_plan``)."""

from __future__ import annotations

from collections import defaultdict

from regroup.elastic.memory.reshard_plan import (
    CHUNK,
    NONE,
    WHOLE,
    Choice,
    Entry,
    Info,
    choose,
    flat_span,
    plan_messages,
    plan_pieces,
    row_span,
)

W = Entry("model/w", (10, 3), True, 4, "torch.float32")  # 10 rows: chunks of 4, 4, 2 over 3; 3, 3, 3, 1 over 4
STEP = Entry("optim/state.w.step", (), False, 4, "torch.float32")
BIAS = Entry("model/b", (7,), False, 2, "torch.bfloat16")  # replicated, another dtype
ENTRIES = [BIAS, W, STEP]


def _coverage(pieces: list, world: int) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(new rank, key) -> the destination ranges its pieces fill, sorted."""
    filled: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for piece in pieces:
        filled[(piece.dst, piece.key)].append((piece.dst_offset, piece.dst_offset + piece.numel))
    return {key: sorted(ranges) for key, ranges in filled.items()}


def _assert_fills_exactly(pieces: list, world: int) -> None:
    """Every new rank's every entry is filled once, end to end, and nothing else."""
    coverage = _coverage(pieces, world)
    for rank in range(world):
        for entry in ENTRIES:
            lo, hi = row_span(entry.shape, world, rank) if entry.sharded else (0, entry.numel)
            ranges = coverage.get((rank, entry.key), [])
            assert sum(b - a for a, b in ranges) == hi - lo, (rank, entry.key, ranges)
            position = 0
            for a, b in ranges:
                assert a == position, (rank, entry.key, ranges)
                position = b


def test_spans_follow_torch_chunk_and_split_replicated_state_once_over_the_ranks() -> None:
    assert [row_span((10, 3), 3, r) for r in range(3)] == [(0, 12), (12, 24), (24, 30)]
    assert [row_span((10, 3), 4, r) for r in range(4)] == [(0, 9), (9, 18), (18, 27), (27, 30)]
    assert [row_span((2, 5), 4, r) for r in range(4)] == [(0, 5), (5, 10), (10, 10), (10, 10)]
    assert [flat_span(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert [flat_span(1, 4, r) for r in range(4)] == [(0, 1), (1, 1), (1, 1), (1, 1)]


def test_a_grow_from_live_state_copies_what_a_survivor_holds_and_sends_the_rest() -> None:
    # Old world of 3 at step 5: new ranks 0-2 are the survivors in place, 3 is a newcomer.
    infos = [[(0, 3, 5, WHOLE)], [(1, 3, 5, WHOLE)], [(2, 3, 5, WHOLE)], None]
    choice = choose(infos)
    assert isinstance(choice, Choice)
    pieces = plan_pieces(ENTRIES, infos, choice, 4)
    _assert_fills_exactly(pieces, 4)
    replicated = [p for p in pieces if p.key != W.key]
    # Survivors hold the replicated entries whole: a local copy each; the newcomer's come
    # whole from one survivor.
    assert {(p.src, p.dst) for p in replicated} == {(0, 0), (1, 1), (2, 2), (0, 3)}
    # New rank 1 needs rows 3-5: row 3 is old rank 0's (remote), rows 4-5 its own old rows.
    rows = [(p.src, p.src_offset, p.dst_offset, p.numel) for p in pieces if p.key == W.key and p.dst == 1]
    assert rows == [(0, 9, 0, 3), (1, 0, 3, 6)]


def test_a_loss_rebuilds_from_snapshots_and_gathers_the_replicated_chunks() -> None:
    # Old world of 3, old rank 2 lost: its snapshot lives on as a buddy copy on new rank 0.
    infos = [[(0, 3, 8, CHUNK), (2, 3, 8, CHUNK)], [(1, 3, 8, CHUNK)]]
    choice = choose(infos)
    assert isinstance(choice, Choice) and not choice.whole and choice.chunks == {0: (0, 0), 1: (1, 0), 2: (0, 1)}
    pieces = plan_pieces(ENTRIES, infos, choice, 2)
    _assert_fills_exactly(pieces, 2)
    bias = sorted((p.src, p.dst, p.state, p.dst_offset, p.numel) for p in pieces if p.key == BIAS.key)
    # Chunks of 7 over 3: [0,3) old rank 0, [3,6) old rank 1, [6,7) old rank 2 (new rank 0's buddy copy).
    assert bias == [(0, 0, 0, 0, 3), (0, 0, 1, 6, 1), (0, 1, 0, 0, 3), (0, 1, 1, 6, 1), (1, 0, 0, 3, 3), (1, 1, 0, 3, 3)]


def test_shards_handed_over_travel_and_a_rank_keeps_its_own_unless_told_not_to() -> None:
    # Same size (4), old rank 2 handed to new rank 0 (no replicated entries), new rank 2 fresh.
    infos = [[(0, 4, 3, WHOLE), (2, 4, 3, NONE)], [(1, 4, 3, WHOLE)], None, [(3, 4, 3, WHOLE)]]
    choice = choose(infos)
    assert isinstance(choice, Choice)
    own = plan_pieces(ENTRIES, infos, choice, 4)
    _assert_fills_exactly(own, 4)
    remote = [p for p in own if p.src != p.dst]
    assert {(p.src, p.dst, p.key) for p in remote} == {(0, 2, W.key), (3, 2, BIAS.key), (3, 2, STEP.key)}
    # The handed state (index 1 on new rank 0) is where rank 2's rows come from.
    assert [p.state for p in remote if p.key == W.key] == [1]
    borrowed = plan_pieces(ENTRIES, infos, choice, 4, prefer_own=False)
    _assert_fills_exactly(borrowed, 4)
    assert len([p for p in borrowed if p.src != p.dst]) > len(remote)


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "torch.bfloat16" else 4


def test_large_pieces_go_whole_and_small_ones_are_packed_within_the_budget() -> None:
    big = Entry("model/big", (3_000_000, 3), True, 4, "torch.float32")  # 36 MB: 12 MB a rank
    small = [Entry(f"model/s{i:02}", (1000, 50), True, 4, "torch.float32") for i in range(30)]  # 200 KB each
    entries = [BIAS, big, STEP, W, *small]
    infos = [[Info(0, 1, 2, WHOLE)], None, None]
    choice = choose(infos)
    assert isinstance(choice, Choice)
    pieces = plan_pieces(entries, infos, choice, 3)
    dtypes = {e.key: e.dtype for e in entries}
    messages = plan_messages(pieces, entries, bucket=256 << 10, direct=64 << 10)
    assert set(messages) == {(0, 1), (0, 2)}
    for pair, sent in messages.items():
        whole = [m for m in sent if len(m.segments) == 1 and m.numel * _itemsize(m.dtype) >= 64 << 10]
        assert {m.segments[0].piece.key for m in whole} == {"model/big", *(e.key for e in small)}
        assert all(m.round == 0 for m in whole), "whole pieces need no buffer: all in the first round"
        packed = [m for m in sent if m not in whole]
        # Rank 0 sends to two partners: they share its budget, 128 KB each.
        assert all(m.numel * _itemsize(m.dtype) <= 128 << 10 for m in packed), pair
        assert [m.round for m in packed] == list(range(len(packed))), "one packed message a round"
        assert all({dtypes[s.piece.key] for s in m.segments} == {m.dtype} for m in sent)
        # Every element of every piece for this pair is in exactly one message, in order.
        carried: dict = defaultdict(int)
        for message in sent:
            for piece, offset, numel in message.segments:
                assert offset == carried[piece], (piece.key, offset)
                carried[piece] += numel
        assert carried == {p: p.numel for p in pieces if (p.src, p.dst) == pair}
