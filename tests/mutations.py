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
