"""Break each scheduling rule on purpose and check that its named test fails (docs/testing.md).

    .venv/bin/python -m tests.mutations            # all rules (several minutes on 2 cores)
    .venv/bin/python -m tests.mutations take_back  # the rules whose name contains a word

Each entry replaces one exact piece of source (it must occur once), runs the named tests with
pytest and restores the file. A rule is *pinned* when at least one of its tests fails. Not
collected by pytest (it runs pytest itself).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
E = "tests/engine/"

MUTATIONS = [
    # (rule, file, original, broken, tests)
    ("permit order: recovery holder, then ticket", "ninfer/policy/scheduler.py",
     "key=lambda r: (r is not self.recovery, r.ticket))", "key=lambda r: (r is not self.recovery, -r.ticket))",
     ["tests/policy/test_scheduler.py::test_rows_are_permitted_recovery_holder_first_then_by_ticket"]),
    ("overtaking bound (guard)", "ninfer/policy/scheduler.py",
     "guards.append(Guard((iids[j],), between, budgets[j]))", "pass",
     [E + "test_scheduling.py::test_overtaking_bound_holds_across_scans"]),
    ("overtaking bound (scan stops after a head with no budget left)", "ninfer/policy/scheduler.py",
     "            if budget == 0:\n                break", "            if False:\n                break",
     [E + "test_scheduling.py::test_bounded_overtaking", E + "test_scheduling.py::test_overtaking_bound_holds_across_scans"]),
    ("lane bound (guard)", "ninfer/policy/scheduler.py",
     "guards = [Guard((), tuple(iids[:k]), lanes)]", "guards = []",
     [E + "test_scheduling.py", "tests/policy/test_scheduler.py"]),
    ("failed checks do not consume the quota", "ninfer/policy/scheduler.py",
     "st.overtaken += sum(1 for later in tried[i + 1:] if later.rid in admitted)",
     "st.overtaken += sum(1 for later in tried[i + 1:])",
     [E + "test_scheduling.py::test_failed_checks_do_not_consume_the_quota"]),
    ("no re-quote under the same event", "ninfer/policy/scheduler.py",
     "            if self.st(req).failed_epoch != self.epoch:", "            if True:",
     [E + "test_scheduling.py::test_scan_is_not_reopened_by_ordinary_decode"]),
    ("a just-paused request is not woken by its own release", "ninfer/policy/scheduler.py",
     "            if req.rid not in causes:\n", "            if True:\n",
     ["tests/policy/test_scheduler.py::test_a_just_paused_request_is_not_woken_by_its_own_release"]),
    ("lane take-back by the oldest paused", "ninfer/engine/planning.py",
     "                plan.take_back = victims[0]          # seed: 收回较年轻请求占用的 lane\n                lanes += 1",
     "                pass",
     [E + "test_cycle.py::test_oldest_paused_takes_back_a_lane"]),
    ("take-back only without an older resident", "ninfer/policy/scheduler.py",
     "return bool(self.paused) and self.paused[0] is req and not self.older_resident_than(req)",
     "return bool(self.paused) and self.paused[0] is req",
     [E + "test_scheduling.py::test_long_request_paused_behind_an_older_resident",
      "tests/policy/test_scheduler.py::test_oldest_paused_takes_back_only_without_an_older_resident"]),
    ("materializing / terminal / permit holder are never victims", "ninfer/policy/scheduler.py",
     "if r.ticket > req.ticket and r.phase is Phase.RUNNING and r is not self.recovery and r.live]",
     "if r.ticket > req.ticket]",
     ["tests/policy/test_scheduler.py::test_materializing_finished_and_permit_holder_are_never_victims"]),
    ("a Snapshot pause moves its content to the Host", "ninfer/policy/pressure.py",
     "        if not facts.host_capacity or victim.sid is None:\n", "        if True:\n",
     [E + "test_cycle.py::test_snapshot_pause_frees_device_memory_and_resume_reads_back"]),
    ("remedies commit only the prefix that covers the gap", "ninfer/actors/worker.py",
     "        freed = reclaim.simulate(self.prog, remedies)\n",
     "        freed = [reclaim.Freed({k: 1 << 30 for k in short})] * len(remedies)\n",
     ["tests/actors/test_worker.py::test_a_short_intent_commits_no_remedy_that_does_not_cover_it"]),
    ("a reclaim that freed capacity retries the permit at once", "ninfer/actors/worker.py",
     "                    return P.Outcome.SHORT if short else P.Outcome.OK",
     "                    return P.Outcome.SHORT",
     [E + "test_cycle.py::test_reclaim_that_frees_capacity_retries_the_permit_at_once",
      E + "test_cycle.py::test_every_shortfall_of_a_cycle_is_settled"]),
    ("fresh binds only after resident permits (from slack)", "ninfer/engine/planning.py",
     "        skip = plan.take_back\n", "        self._fresh(plan, lanes, chunk_taken, recovery)\n        skip = plan.take_back\n",
     [E + "test_cycle.py::test_fresh_binds_only_from_slack_after_resident_permits"]),
    ("an ordinary unit settles its unused reservation", "ninfer/actors/worker.py",
     "            if not unit.hold:\n                self.prog.settle(seq)\n", "            pass\n",
     [E + "test_cycle.py::test_an_ordinary_unit_settles_its_unused_reservation"]),
    ("the full recovery permit is held across chunks", "ninfer/engine/planning.py",
     "        spec = P.UnitSpec(unit.n_tokens, unit.kind, hold=True)", "        spec = P.UnitSpec(unit.n_tokens, unit.kind)",
     [E + "test_scheduling.py::test_recovery_permit_is_kept_past_the_old_frontier"]),
    ("no optional capture while a recovery permit is active", "ninfer/engine/planning.py",
     "        if recovery:\n            unit.declined = True", "        if False:\n            unit.declined = True",
     [E + "test_cycle.py::test_optional_captures_are_skipped_while_a_recovery_permit_is_active"]),
    ("chunk rotation among residents", "ninfer/engine/outcomes.py",
     "        if unit.n_tokens > 1:\n            core.sched.rotate(req)", "        if False:\n            core.sched.rotate(req)",
     [E + "test_cycle.py::test_chunk_rotation_among_residents"]),
    ("the young row that cannot progress pauses itself", "ninfer/policy/pressure.py",
     "        young = n.req is not self.sched.recovery and self._older_exists(n.req)", "        young = False",
     [E + "test_cycle.py::test_permit_order_the_older_row_gets_the_last_page"]),
    ("the capacity contract error", "ninfer/policy/pressure.py",
     "            elif self.alone(n, taken, tx_busy):", "            elif False:",
     [E + "test_scheduling.py::test_capacity_contract_error_for_a_lone_request"]),
    ("transaction progress after admission (point 2)", "ninfer/actors/worker.py",
     "        run.progress(2)\n", "",
     [E + "test_cycle.py::test_a_bind_completed_in_the_step_runs_its_unit"]),
    ("a Host save joins the running transaction", "ninfer/native/program.py",
     "        ext = self.host.allocate(self.mem.image_bytes, kind=\"state\")\n        if ext is not None:\n            return CaptureDest(owner, ext=ext)",
     "        ext = self.host.allocate(self.mem.image_bytes, kind=\"state\") if self.tx is None else None\n        if ext is not None:\n            return CaptureDest(owner, ext=ext)",
     [E + "test_cycle.py::test_a_host_save_is_not_lost_to_a_read_back"]),
    ("a failed copy aborts its transaction", "ninfer/native/program.py",
     "            if error:\n                failed, lost = part.abort()", "            if False:\n                failed, lost = part.abort()",
     [E + "test_cycle.py::test_a_failed_read_back_fails_only_its_request"]),
    ("a save's admitted room is committed only when the save needs it", "ninfer/actors/worker.py",
     "        dest = prog.prepare_capture(cap.owner, self.w.retires(cap.retire))\n        if dest is not None:",
     "        dest = prog.prepare_capture(cap.owner, self.w.retires(cap.retire))\n        if dest is not None and not cap.room:",
     ["tests/actors/test_worker.py::test_a_saves_admitted_room_is_committed_only_when_it_needs_it"]),
    ("no deletion for a bind that does not happen (remedies are conditional)", "ninfer/actors/worker.py",
     "        freed = reclaim.simulate(self.prog, remedies)\n",
     "        freed = [reclaim.Freed({k: 1 << 30 for k in short})] * len(remedies)\n",
     [E + "test_cycle.py::test_no_deletion_for_a_bind_that_does_not_happen"]),
    ("the worker evaluates the guards it is sent", "ninfer/actors/worker.py",
     "        ok = P.Outcome.OK\n        for g in guards:", "        ok = P.Outcome.OK\n        for g in ():",
     ["tests/actors/test_worker.py::test_worker_applies_the_guards_it_is_sent",
      E + "test_scheduling.py::test_bounded_overtaking"]),
    ("a take-back's shared content is reclaimed in a second pass", "ninfer/policy/pressure.py",
     "            if not covered and victims:\n", "            if False:\n",
     [E + "test_invariance.py::test_random_workloads_match_the_oracle"]),
    ("deletions alone when a demotion-first plan cannot cover", "ninfer/policy/pressure.py",
     "            if alt_covered:\n", "            if False:\n",
     [E + "test_invariance.py::test_random_workloads_match_the_oracle"]),
    # ---- context cache (issue: context cache rules) ----
    ("P: a raw prompt's input point is its input end", "ninfer/policy/resources.py",
     "        if not self._carried(rec.input_point, req.prompt, r):",
     "        if req.spec.recovery_frontier is not None and not self._carried(rec.input_point, req.prompt, r):",
     [E + "test_context_rules.py::test_a_raw_prompt_retry_hits_its_input_point"]),
    ("takeover never of a later publication order", "ninfer/policy/resources.py",
     "if rec.active is not None or rec.publication_order > req.ticket:", "if rec.active is not None:",
     [E + "test_context_rules.py::test_takeover_respects_publication_order"]),
    ("one physical point per identical position", "ninfer/engine/planning.py",
     "        if existing is not None:\n", "        if False:\n",
     [E + "test_context_rules.py::test_one_physical_point_per_shared_prefix"]),
    ("Move E only when no queued sibling extends it", "ninfer/policy/resources.py",
     "                    and not self._extended_by(src, req, queued):", "                    and True:",
     [E + "test_context_rules.py::test_sibling_continuations_fork_the_generation_end"]),
    ("a source that cannot be restored alone is reselected", "ninfer/engine/outcomes.py",
     "            if item.need is not None and item.need.source is not None:", "            if False:",
     [E + "test_context_rules.py::test_a_source_that_cannot_be_restored_alone_is_given_up"]),
    ("a pure save is no evidence", "ninfer/policy/resources.py",
     "self._promote(list(tokens), ref.frontier, obs.last)", "self._promote(list(tokens), ref.frontier, time.monotonic())",
     [E + "test_context_rules.py::test_evidence_is_real_demand_only"]),
    ("an adoption alone is repeat demand", "ninfer/policy/resources.py",
     "req.rid, now, adopted=True)", "req.rid, now)",
     [E + "test_context_rules.py::test_evidence_is_real_demand_only"]),
    ("nested points deleted together count their history once", "ninfer/policy/reclaim.py",
     "                if other in group and (pf < f or other < c):", "                if False:",
     ["tests/policy/test_reclaim_planner.py::test_nested_points_deleted_together_count_their_history_once"]),
    ("no capacity contract while a take-back publishes", "ninfer/policy/pressure.py",
     " and not any(isinstance(r, P.TakeBack) for r in verdict.remedies):", ":",
     [E + "test_invariance.py::test_random_workloads_match_the_oracle"]),
    ("skipped saves count as lost hits by cause", "ninfer/policy/resources.py",
     "            self._note_missing(sp.frontier, digest(tokens), cause)", "            pass",
     [E + "test_context_rules.py::test_lost_hits_are_attributed_to_their_cause"]),
    ("a Move-consumed E is not a lost hit", "ninfer/policy/resources.py",
     'self._forget(adm.source.cid, "moved")', "self._forget(adm.source.cid)",
     [E + "test_context_rules.py::test_lost_hits_are_attributed_to_their_cause"]),
    ("anchors: stale ones are replaced before valid ones", "ninfer/policy/resources.py",
     "            victim = (stale or [cid for cid, _ in live])[0]", "            victim = [cid for cid, _ in live][0]",
     [E + "test_context_rules.py::test_anchors_are_keyed_by_position"]),
    ("anchors: the same position is updated in place", "ninfer/policy/resources.py",
     "        same = [cid for cid, info in live if info.frontier == sp.frontier]", "        same = []",
     [E + "test_context_rules.py::test_anchors_are_keyed_by_position"]),
    ("an anchor's replacement goes only with a save that happens", "ninfer/native/program.py",
     "        replace = [(c, o) for c, o in replace if c.cid in self.checkpoints and o in c.owners]\n",
     "        replace = [(c, o) for c, o in replace if c.cid in self.checkpoints and o in c.owners]\n"
     "        self._retire(replace)\n",
     ["tests/native/test_program.py::test_a_replaced_hold_goes_only_with_a_save_that_happens"]),
    ("a capture's coverage budget holds over its Host step too", "ninfer/policy/reclaim.py",
     "host = self.place_host(sizes, lambda v, cid=cid: admissible(v) and v.cid != cid, budget)",
     "host = self.place_host(sizes, lambda v, cid=cid: admissible(v) and v.cid != cid, None)",
     ["tests/policy/test_reclaim_planner.py::test_a_capture_without_own_demand_loses_less_than_its_benefit_in_all"]),
    ("a point only waiters keep is no public candidate", "ninfer/policy/resources.py",
     "        return not info.owners or not all(isinstance(o, WaiterOwner) and o.rid != rid for o in info.owners)",
     "        return True",
     [E + "test_context_rules.py::test_waiting_references_carry_their_points_and_are_no_public_entry"]),
    ("a waiter holds the points it carries", "ninfer/policy/resources.py",
     "        rec = adm.record if adm.takeover else None\n", "        rec = None\n",
     [E + "test_context_rules.py::test_waiting_references_carry_their_points_and_are_no_public_entry"]),
    ("revocable waiters go youngest first", "ninfer/policy/reclaim.py",
     "                if cls >= 2:     # revocable", "                if False:     # revocable",
     ["tests/policy/test_reclaim_planner.py::test_revocable_waiters_go_youngest_first"]),
    ("a rewrite retires the superseded E at admission", "ninfer/policy/resources.py",
     "            adm.retire = self._superseded(rec, src, req)\n", "",
     [E + "test_context_rules.py::test_a_rewrite_retires_the_superseded_generation_end_at_admission"]),
    ("soft target: the single newest record may exceed it", "ninfer/policy/reclaim.py",
     "            if over and i > 0:\n                break", "            if over:\n                break",
     ["tests/policy/test_reclaim_planner.py::test_soft_target_keeps_whole_records_and_the_newest_may_exceed"]),
    ("soft target off", "ninfer/policy/reclaim.py",
     "        self._apply_soft_target()\n", "\n",
     ["tests/policy/test_reclaim_planner.py::test_soft_target_keeps_whole_records_and_the_newest_may_exceed"]),
    ("hot protection: only the record's own points cover its proven position", "ninfer/policy/reclaim.py",
     "        own = {c for _, c in rec.points()}", "        own = set(self.f.checkpoints)",
     ["tests/policy/test_reclaim_planner.py::test_hot_protection_is_covered_only_by_the_records_own_points"]),
    ("hot protection off", "ninfer/policy/reclaim.py",
     "        self._hot_protection_covers_proven_only()\n", "\n",
     ["tests/policy/test_reclaim_planner.py::test_hot_protection_is_covered_only_by_the_records_own_points"]),
    ("a lone continuation Moves E (no copy of its state)", "ninfer/policy/resources.py",
     "                adm.mode, adm.mover = P.BindMode.MOVE, rec.owner(Role.E)\n", "                pass\n",
     [E + "test_context_rules.py::test_lost_hits_are_attributed_to_their_cause"]),
    ("a Fork child's parent keeps its evidence unless the source covers its proven position", "ninfer/policy/resources.py",
     "            if rec is child or src.frontier >= rec.evidence.proven_frontier:", "            if True:",
     [E + "test_context_rules.py::test_a_fork_from_a_shallower_point_leaves_the_parents_evidence"]),
    ("Host placement: an action that lets it fit first", "ninfer/policy/reclaim.py",
     "        return (c.cls, not fits, order, c.cid)", "        return (c.cls, False, order, c.cid)",
     ["tests/policy/test_reclaim_planner.py::test_host_placement_prefers_an_action_that_lets_it_fit"]),
    ("Host placement: unneeded victims are pruned", "ninfer/policy/reclaim.py",
     "        for cid in list(chosen):                     # drop actions no longer needed\n",
     "        for cid in []:                               # drop actions no longer needed\n",
     ["tests/policy/test_reclaim_planner.py::test_host_placement_prunes_victims_it_no_longer_needs"]),
    ("Host placement: the gain cap", "ninfer/policy/reclaim.py",
     "        return need - free if free < need else max(sizes)", "        return need",
     ["tests/policy/test_reclaim_planner.py::test_host_gain_is_capped_at_the_shortfall"]),
    ("Native skips a reclaim step that no longer commits and tries the later ones", "ninfer/native/reclaim.py",
     "                out.append(_freed(prog, sim))\n                continue", "                break",
     ["tests/actors/test_worker.py::test_reclaim_steps_are_trimmed_to_the_shortfall_and_a_stale_one_is_skipped"]),
    ("Host placement releases safe duplicates before any victim", "ninfer/policy/reclaim.py",
     "        if dups:\n            spare = sorted(", "        if False:\n            spare = sorted(",
     ["tests/policy/test_reclaim_planner.py::test_host_placement_releases_safe_duplicates_before_any_victim"]),
    ("source ties: the legal session hint", "ninfer/policy/resources.py",
     "                not session, not recs, -order, info.cid)", "                False, not recs, -order, info.cid)",
     [E + "test_context_rules.py::test_source_ties_break_by_session_hint_then_private_use_then_newer_publication"]),
    ("source ties: private use", "ninfer/policy/resources.py",
     "                not session, not recs, -order, info.cid)", "                not session, False, -order, info.cid)",
     [E + "test_context_rules.py::test_source_ties_break_by_session_hint_then_private_use_then_newer_publication"]),
    ("source ties: the newer publication order", "ninfer/policy/resources.py",
     "                not session, not recs, -order, info.cid)", "                not session, not recs, 0, info.cid)",
     [E + "test_context_rules.py::test_source_ties_break_by_session_hint_then_private_use_then_newer_publication"]),
    # ---- bounded policy cost: scoped quotes and the Host order ----
    ("scoped quote: every checkpoint with Device content is quoted", "ninfer/native/reclaim.py",
     "ids = prog.device_checkpoints() | {c for c in host_window if c in prog.checkpoints}",
     "ids = {c for c in host_window if c in prog.checkpoints}",
     [E + "test_scoped_quote.py::test_device_decisions_on_a_scoped_quote_equal_those_on_the_whole_directory"]),
    ("scoped quote: a fallback outside the facts is live when the records know it", "ninfer/policy/reclaim.py",
     "if o in live or (self.f.partial and o in self.table.ckpts)]", "if o in live]",
     [E + "test_scoped_quote.py::test_device_decisions_on_a_scoped_quote_equal_those_on_the_whole_directory"]),
    ("a Host window that does not suffice is quoted again whole", "ninfer/policy/reclaim.py",
     "                    self.window_short()\n", "                    pass\n",
     [E + "test_scoped_quote.py::test_a_host_window_that_does_not_suffice_is_quoted_again_whole"]),
    ("Host order: a placement change re-ranks the checkpoint", "ninfer/policy/resources.py",
     "            self.table.dirty.add(cid)\n            if r.device != on_device:", "            if r.device != on_device:",
     [E + "test_scoped_quote.py::test_the_host_order_follows_every_change"]),
    ("a deleted carried point does not end the wait on its source", "ninfer/policy/resources.py",
     "if book.wait is not None and book.wait.cid == cid:", "if book.wait is not None:",
     [E + "test_context_rules.py::test_a_deleted_carried_point_does_not_end_the_wait_on_its_source"]),
    ("no split points: rewrite execution frontiers end a unit", "ninfer/engine/units.py",
     "    for x in req.spec.split_points:", "    for x in ():",
     [E + "test_context_rules.py::test_rewrite_execution_frontiers_split_the_math_even_without_a_save"]),
    ("Fork slot handover when slots are short and a Host copy exists", "ninfer/native/program.py",
     "return mode is BindMode.MOVE or (img.host is not None and self.pools[STATE].available == 0)",
     "return mode is BindMode.MOVE",
     ["tests/native/test_program.py::test_a_fork_takes_the_sources_device_slot_when_slots_are_short_and_a_host_copy_keeps_it"]),
    ("Host copies of pages read back are safe duplicates (Native)", "ninfer/native/program.py",
     "        return out + [b.host for b in self._dup_pages(ck)]", "        return out",
     ["tests/native/test_program.py::test_host_copies_of_pages_read_back_are_safe_duplicates"]),
    ("a demotion after a released duplicate writes the pages again", "ninfer/native/program.py",
     "                   if not (b.host is not None and b.host_filled >= b.filled) or b.bid in gone_pages])",
     "                   if not (b.host is not None and b.host_filled >= b.filled)])",
     ["tests/native/test_program.py::test_host_copies_of_pages_read_back_are_safe_duplicates"]),
    ("Host placement releases page duplicates first (planner)", "ninfer/policy/reclaim.py",
     "        return out + [self.f.blocks[b].host_at for b in self._dup_page_ids(cid)]", "        return out",
     ["tests/policy/test_reclaim_planner.py::test_host_copies_of_device_pages_are_released_before_any_victim_but_not_for_their_own_demotion"]),
    ("a demotion does not release its own pages' copies", "ninfer/policy/reclaim.py",
     " and not keep & set(self._dup_page_ids(cid))),", "),",
     ["tests/policy/test_reclaim_planner.py::test_host_copies_of_device_pages_are_released_before_any_victim_but_not_for_their_own_demotion"]),
    ("reclaim as separately committable steps (policy)", "ninfer/policy/pressure.py",
     "        verdict.remedies += [P.Reclaim(step) for step in planner.steps]\n",
     "        verdict.remedies += [P.Reclaim([a for st in planner.steps for a in st])] if planner.steps else []\n",
     [E + "test_scoped_quote.py::test_reclaim_is_planned_as_separately_committable_steps"]),
    ("a deletion counts nothing for pages a chosen demotion frees", "ninfer/policy/reclaim.py",
     "        before = self._freed_blocks(self.victims) | self.demoted_blocks\n"
     "        after = self._freed_blocks(self.victims | group) | self.demoted_blocks",
     "        before = self._freed_blocks(self.victims)\n        after = self._freed_blocks(self.victims | group)",
     ["tests/policy/test_reclaim_planner.py::test_a_deletion_counts_nothing_for_pages_a_chosen_demotion_already_frees"]),
]


def run(words: list[str]) -> int:
    results = []
    for rule, path, old, new, tests in MUTATIONS:
        if words and not any(w in rule for w in words):
            continue
        f = ROOT / path
        src = f.read_text()
        if src.count(old) != 1:
            results.append((rule, "source changed: update the mutation"))
            continue
        f.write_text(src.replace(old, new))
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=ROOT, capture_output=True, text=True, timeout=1800)
            failed = [ln.split(" ")[1] for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")]
            if proc.returncode == 1 and failed:
                verdict = f"pinned: {failed[0].split('::')[-1]} failed"
            elif proc.returncode == 0:
                verdict = "NOT PINNED: every test passed"
            else:
                verdict = f"BROKEN MUTATION (pytest exit {proc.returncode}): {proc.stdout[-300:]}"
        finally:
            f.write_text(src)
        results.append((rule, f"{verdict} [{time.time() - t0:.0f} s]"))
        print(f"{rule}: {results[-1][1]}", flush=True)
    bad = [r for r, v in results if not v.startswith("pinned")]
    print(f"\n{len(results) - len(bad)} of {len(results)} rules pinned")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
