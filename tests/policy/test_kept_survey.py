"""The pressure planner's owners' survey kept across settlements (``reclaim.Survey``): what drops
an entry — a record or entry inserted, deleted or touched (``RecordTable.touched_records``), and
an owner set that differs from the quote's. Model-free, milliseconds."""

from __future__ import annotations

from ninfer.policy.reclaim import Cls, Planner, Survey, stale_survey
from ninfer.policy.records import Level, RecordTable
from ninfer.protocol import EntryOwner, RecordOwner, Role
from tests.policy.test_reclaim_planner import Quote


def test_every_insertion_deletion_and_touch_of_a_record_or_entry_is_noted():
    table = RecordTable()
    rec = table.new_record(None, insert=False)
    ent = table.new_entry(7, 10, insert=False)
    table.touched_records.clear()
    table.records[rec.id] = rec
    table.entries.setdefault(ent.id, ent)
    assert table.touched_records == {rec.id, ent.id}
    table.touched_records.clear()
    table.touch(rec)
    assert table.touched_records == {rec.id}
    table.touched_records.clear()
    del table.records[rec.id]
    table.entries.pop(ent.id)
    assert table.touched_records == {rec.id, ent.id}
    table.records[rec.id] = rec
    table.entries.update({ent.id: ent})
    table.touched_records.clear()
    table.entries.clear()                       # drop_all: every entry at once
    table.records.popitem()
    assert table.touched_records == {rec.id, ent.id}


def test_forget_drops_the_entries_of_the_named_records_only():
    s = Survey()
    s[5] = ((RecordOwner(1, Role.E),), False, Cls.REUSE, 2.0)
    s[6] = ((RecordOwner(2, Role.E), EntryOwner(3)), False, Cls.NORMAL, 0.0)
    s[7] = ((EntryOwner(3),), False, Cls.NORMAL, 0.0)
    s.forget({1})
    assert set(s) == {6, 7}
    s.forget({3})
    assert set(s) == set()


def test_a_kept_entry_is_taken_again_when_the_quoted_owners_differ():
    """A kept entry made for other owners (a survey from an earlier quote) says reuse; the
    quote's owner is a normal record: the planner classifies from the quote, and the kept entry
    is replaced."""
    q = Quote()
    cid = q.ckpt(1, 64, level=Level.NORMAL)
    survey = Survey()
    survey[cid] = ((RecordOwner(999, Role.E),), False, Cls.REUSE, 5.0)
    p = Planner(q.facts(), q.table, set(), lambda o: False, survey=survey)
    assert p.cands[cid].cls is Cls.NORMAL
    assert survey[cid][0] == q.facts().checkpoints[cid].owners
    assert not stale_survey(survey, q.table)


def test_stale_survey_names_an_entry_whose_record_changed_unnoted():
    q = Quote()
    cid = q.ckpt(1, 64, level=Level.NORMAL)
    survey = Survey()
    Planner(q.facts(), q.table, set(), lambda o: False, survey=survey)
    rec = next(iter(q.table.records.values()))
    rec.level, rec.evidence.demand_time = Level.REUSE, 9.0        # without touch
    assert stale_survey(survey, q.table) == [cid]
