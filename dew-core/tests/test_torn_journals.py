"""A journal whose last line a crash cut short, appended to by the resumed run.

The line a resumed run appended first was glued to the torn one, so the journal read as damaged in
its middle (dew report, dew audit refused it) and, in the rollout journal, the fit's open line (which
says what made the rollouts after it) was lost. Appending now drops the torn line first.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from dew.data.base import DataPartition
from dew.data.order import RecordOrder
from dew.provenance.ledger import LedgerEmptyError, read_ledger
from dew.telemetry.render import TornJournalError, journal_rows
from dew.tracking.local import LocalTracker
from dew.training.ledger import RecordLedger, records_digest
from dew.training.rollout_journal import ROLLOUTS, RolloutJournal


def _tear(path):
    path.write_text(path.read_text() + '{"step": 9, "train/lo')  # no newline: a write cut short


def test_the_local_trackers_journal_reads_whole_after_a_torn_line(tmp_path):
    tracker = LocalTracker(tmp_path)
    tracker.log({"loss": 1.0}, step=1)
    tracker.close()
    _tear(tmp_path / "scalars.jsonl")
    resumed = LocalTracker(tmp_path)
    resumed.log({"loss": 0.5}, step=2)
    resumed.close()
    assert [row["step"] for row in journal_rows(tmp_path / "scalars.jsonl")] == [1, 2]


def test_the_ledger_reads_whole_after_a_torn_line(tmp_path):
    RecordLedger(tmp_path, processes=1).opened(0, None, DataPartition())
    _tear(tmp_path / "ledger.jsonl")
    RecordLedger(tmp_path, processes=1).opened(0, None, DataPartition())
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["open", "open"]
    with pytest.raises(LedgerEmptyError):  # read whole (no step was kept), not refused as damaged
        read_ledger(tmp_path)


def test_the_rollout_journal_keeps_the_open_line_after_a_torn_one(tmp_path):
    RolloutJournal(tmp_path).opened(0, "first")
    _tear(tmp_path / ROLLOUTS)
    RolloutJournal(tmp_path).opened(3, "second")
    rows = [json.loads(line) for line in (tmp_path / ROLLOUTS).read_text().splitlines()]
    assert [(row["kind"], row["maker"]) for row in rows] == [("open", "first"), ("open", "second")]


def test_a_resumed_runs_redone_steps_are_read_once_in_step_order(tmp_path):
    """Killed at step 5 after a checkpoint at 3, the resumed run logged 4 and 5 again: the report drew
    the loss from 5 back to 4 and counted those steps twice."""
    from dew.provenance.diff import _losses
    from dew.telemetry.render import read_scalars

    first = LocalTracker(tmp_path)
    for step in range(1, 6):
        first.log({"train/loss": 10.0 - step}, step=step)
    first.log({"val/loss": 7.5}, step=4)  # an evaluation row beside a train row of one step
    first.close()
    resumed = LocalTracker(tmp_path)  # from the checkpoint at step 3
    for step in range(4, 8):
        resumed.log({"train/loss": 20.0 - step}, step=step)
    resumed.close()
    series = read_scalars(tmp_path / "scalars.jsonl")
    steps, values = series["train/loss"]
    assert steps.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert values.tolist() == [9.0, 8.0, 7.0, 16.0, 15.0, 14.0, 13.0]  # the resumed run's from step 4
    assert series["val/loss"][0].tolist() == [4]
    assert _losses(tmp_path / "scalars.jsonl") == dict(zip(steps.tolist(), values.tolist(), strict=True))


def test_steps_a_killed_fit_logged_past_its_checkpoint_are_dropped_where_the_resume_went_on(tmp_path):
    """Killed at 450 after a checkpoint at 400, resumed to 410: the report's last value was the killed
    fit's step 450, and a resume that logged every 7 steps kept the undone 1325..1345 among its own."""
    from dew.provenance.diff import _losses
    from dew.telemetry.records import RunStarted
    from dew.telemetry.render import read_scalars

    for killed, start, resumed, expected in (
            (range(5, 451, 5), 400, (405, 410), [*range(5, 401, 5), 405, 410]),
            (range(1300, 1346, 5), 1320, (1323, 1330), [1300, 1305, 1310, 1315, 1320, 1323, 1330])):
        folder = tmp_path / str(start)
        first = LocalTracker(folder)
        first.artifact(RunStarted(config={}, start=0, steps=10_000), step=0)
        for step in killed:
            first.log({"train/loss": float(step)}, step=step)
        first.close()  # killed: no goodput, no end
        again = LocalTracker(folder)
        again.artifact(RunStarted(config={}, start=start, steps=resumed[-1]), step=start)
        for step in resumed:
            again.log({"train/loss": -float(step)}, step=step)
        again.close()
        steps, values = read_scalars(folder / "scalars.jsonl")["train/loss"]
        assert steps.tolist() == expected
        assert values.tolist() == [float(s) for s in expected[:-2]] + [-float(s) for s in resumed]
        assert _losses(folder / "scalars.jsonl") == dict(zip(steps.tolist(), values.tolist(), strict=True))


def test_a_step_a_killed_fit_logged_past_its_checkpoint_is_dropped_when_the_resume_logs_less_often(tmp_path):
    """Killed after logging 22 past its checkpoint at 20, resumed logging every 4 steps (24, 28): the
    steps never went back, so 22 (undone with the kill) stayed on the page among the resumed fit's."""
    from dew.telemetry.records import RunStarted
    from dew.telemetry.render import read_scalars

    first = LocalTracker(tmp_path)
    first.artifact(RunStarted(config={}, start=0, steps=40), step=0)
    for step in range(2, 23, 2):
        first.log({"train/loss": float(step)}, step=step)
    first.close()  # killed
    again = LocalTracker(tmp_path)
    again.artifact(RunStarted(config={}, start=20, steps=40), step=20)
    for step in (24, 28):
        again.log({"train/loss": -float(step)}, step=step)
    again.close()
    steps, values = read_scalars(tmp_path / "scalars.jsonl")["train/loss"]
    assert steps.tolist() == [*range(2, 21, 2), 24, 28]
    assert values.tolist() == [*map(float, range(2, 21, 2)), -24.0, -28.0]
    rows = [row for row in journal_rows(tmp_path / "records.jsonl") if row["type"] == "run_started"]
    lines = (tmp_path / "scalars.jsonl").read_bytes().splitlines(keepends=True)
    assert [row["scalars_at"] for row in rows] == [0, sum(len(line) for line in lines[:11])]


def test_a_journal_written_before_fits_marked_their_rows_still_drops_where_the_steps_go_back(tmp_path):
    """A run whose run_started rows say nothing of where their scalar rows begin reads as it did."""
    from dew.telemetry.records import RunStarted
    from dew.telemetry.render import read_scalars

    first = LocalTracker(tmp_path)
    first.artifact(RunStarted(config={}, start=0, steps=40), step=0)
    for step in range(5, 31, 5):
        first.log({"train/loss": float(step)}, step=step)
    first.close()
    again = LocalTracker(tmp_path)
    again.artifact(RunStarted(config={}, start=20, steps=40), step=20)
    again.log({"train/loss": -23.0}, step=23)
    again.close()
    records = tmp_path / "records.jsonl"
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    records.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "scalars_at"}) + "\n" for row in rows))
    steps, values = read_scalars(tmp_path / "scalars.jsonl")["train/loss"]
    assert steps.tolist() == [5, 10, 15, 20, 23]
    assert values.tolist() == [5.0, 10.0, 15.0, 20.0, -23.0]


def test_a_fit_that_failed_before_its_first_checkpoint_leaves_nothing_once_the_run_starts_over(tmp_path):
    """A first fit that failed at step 6 (NaN) before any checkpoint, then a fit started over from step 0
    that logged every 3 steps: the two fits' starts were one (a set), so none counted as a later fit's,
    and the failed fit's NaN at steps 2 and 4 stayed among the run's values (dew diff: "the runs differ")."""
    from dew.provenance.diff import _losses
    from dew.telemetry.records import RunStarted
    from dew.telemetry.render import read_scalars

    failed = LocalTracker(tmp_path)
    failed.artifact(RunStarted(config={}, start=0, steps=12), step=0)
    for step in (2, 4, 6):
        failed.log({"train/loss": float("nan"), "train/rejected_steps_in_a_row": float(step // 2)}, step=step)
    failed.close()
    again = LocalTracker(tmp_path)
    again.artifact(RunStarted(config={}, start=0, steps=12), step=0)
    for step in (3, 6, 9, 12):
        again.log({"train/loss": 1.0 / step}, step=step)
    again.close()
    series = read_scalars(tmp_path / "scalars.jsonl")
    assert series["train/loss"][0].tolist() == [3, 6, 9, 12]
    assert series["train/loss"][1].tolist() == [1.0 / step for step in (3, 6, 9, 12)]
    assert "train/rejected_steps_in_a_row" not in series  # only the failed fit logged it
    assert _losses(tmp_path / "scalars.jsonl") == {step: 1.0 / step for step in (3, 6, 9, 12)}


# -- a write the disk refuses (a file-size limit makes writes fail as a full disk does) ------------

REFUSED_WRITES = """
import json, pathlib, resource, signal, sys
from dew.data.base import GLOBAL_POSITION
from dew.errors import RunFileWriteError
from dew.telemetry.render import append_lines
from dew.training.ledger import RecordLedger
from dew.training.rundir import write_recipe

folder = pathlib.Path(sys.argv[1])
append_lines(folder / "journal.jsonl", ['{"step": 1}', '{"step": 2}'])
(folder / "run.json").write_text('{"kept": true}\\n')


class Beside:
    directory = folder


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
said = []
for attempt in (lambda: append_lines(folder / "journal.jsonl", ['{"step": 3, "pad": "' + "x" * 2000 + '"}']),
                lambda: write_recipe(Beside(), {"pad": "x" * 2000}),
                lambda: RecordLedger(folder).checkpoint(7, GLOBAL_POSITION + json.dumps({"pad": "x" * 2000}).encode())):
    try:
        attempt()
        said.append(None)
    except RunFileWriteError as error:
        said.append(str(error))
print(json.dumps(said))
"""


def test_a_write_the_disk_refuses_is_named_and_leaves_whole_lines_and_the_old_recipe(tmp_path):
    """The data ledger, the rollout journal and run.json raised a bare OSError (a traceback) on a
    full disk, and a journal was left with half a line."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REFUSED_WRITES, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    journal, recipe, ledger = json.loads(done.stdout.strip().splitlines()[-1])
    assert journal.startswith(f"{tmp_path / 'journal.jsonl'} could not be written (") and "Free space" in journal
    assert (tmp_path / "journal.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # cut back, no half line
    assert recipe.startswith(f"{tmp_path / 'run.json'} could not be written (") and "is kept" in recipe
    assert (tmp_path / "run.json").read_text() == '{"kept": true}\n' and not list(tmp_path.glob(".run.json*"))
    assert ledger is not None and (tmp_path / "ledger.jsonl").read_text() == ""


def test_a_damaged_middle_line_is_named_by_its_own_line_with_the_way_on(tmp_path):
    # The message quoted json's position inside the line ("line 2 column 1") beside the journal's
    # line 11, and said nothing of what to do.
    journal = tmp_path / "scalars.jsonl"
    rows = [json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, 21)]
    rows[10] = rows[10][:12] + "\n"
    journal.write_text("".join(rows))
    with pytest.raises(TornJournalError) as raised:
        list(journal_rows(journal))
    message = str(raised.value)
    assert f"{journal}, line 11, is not JSON (" in message and "column" not in message
    assert f"sed -i '11d' {journal}" in message
    subprocess.run(["sed", "-i", "11d", str(journal)], check=True)  # the way on it names
    assert [row["step"] for row in journal_rows(journal)] == [s for s in range(1, 21) if s != 11]


def _ledger(folder, position):
    """A run folder whose ledger read 4 records a step for 3 steps, its checkpoint saving position."""
    folder.mkdir()
    (folder / "run.json").write_text("{}\n")
    lines = [{"kind": "open", "position": None, "processes": 1, "shares": 1, "step": 0},
             {"kind": "order", "seed": 0, "size": 100, "step": 1}]
    lines += [{"kind": "step", "step": s, "first": 4 * (s - 1), "end": 4 * s,
               "digest": records_digest(RecordOrder(100, 0)(np.arange(4 * (s - 1), 4 * s)))} for s in (1, 2, 3)]
    lines += [{"kind": "checkpoint", "position": {"records": 12, "content": "c", **position}, "step": 3}]
    (folder / "3").mkdir()  # its committed checkpoint
    (folder / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return read_ledger(folder)


def test_an_audit_against_a_run_on_edited_files_or_other_weights_is_not_identical(tmp_path):
    """A run over a file edited in place (hf_text's content digest sees only lengths; its files' digests
    see the bytes) and a mixture with other weights read the same positions of other records, and the
    audit against the reference called them identical."""
    from dew.provenance.ledger import audit

    mixture = {"sources": [["a", 50], ["b", 50]], "weights": [[0, [["a", 2], ["b", 1]]]]}
    ref = _ledger(tmp_path / "ref", {"files": ["f1", "f2"], "layout": mixture})
    same = _ledger(tmp_path / "same", {"files": ["f1", "f2"], "layout": mixture})
    assert audit(same, ref).first_difference is None
    edited = _ledger(tmp_path / "edited", {"files": ["f1", "F2"], "layout": mixture})
    found = audit(edited, ref)
    assert found.first_difference == 1 and any("files of other bytes (their digests: f1, F2 here, f1, f2"
                                                in note for note in found.notes), found.notes
    weighted = _ledger(tmp_path / "weighted", {"files": ["f1", "f2"], "layout": {
        **mixture, "weights": [[0, [["a", 1], ["b", 1]]]]}})
    found = audit(weighted, ref)
    assert found.first_difference == 1 and any("draw their records otherwise" in note for note in found.notes)
    # A schedule piece the longer run began later is no difference: the shorter run had not reached it.
    later = _ledger(tmp_path / "later", {"files": ["f1", "f2"], "layout": {
        **mixture, "weights": [*mixture["weights"], [12, [["a", 1], ["b", 3]]]]}})
    assert audit(later, ref).first_difference is None and audit(ref, later).first_difference is None
    # One switched its weights at record 4 and the other drew on past it with its old ones: both
    # were called identical, since the shorter list of pieces was taken as the longer's start.
    switched = _ledger(tmp_path / "switched", {"files": ["f1", "f2"], "layout": {
        **mixture, "weights": [*mixture["weights"], [4, [["a", 1], ["b", 3]]]]}})
    for found in (audit(switched, ref), audit(ref, switched)):
        assert found.first_difference == 2 and any("draw their records otherwise" in n for n in found.notes)



@pytest.mark.parametrize("line, said", [
    ('{"kind": "step", "step": Infinity, "first": 0, "end": 4, "digest": "d"}', "not a number"),
    ('{"kind": "step", "step": 1000000000000000000, "first": 0, "end": 4, "digest": "d"}', None),
])
def test_a_crafted_ledger_is_named_as_damaged_or_audited_without_a_hang(tmp_path, line, said):
    """A step of Infinity raised OverflowError (a traceback); a step of 10**18 made the audit count every
    step up to it, which never ended; an open line's position without its record count raised KeyError."""
    from dew.provenance.ledger import LedgerDamagedError, audit

    (tmp_path / "run.json").write_text("{}\n")
    lines = ['{"kind": "open", "position": {"x": 1}, "processes": 1, "shares": 1, "step": 0}', line]
    (tmp_path / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    if said is not None:
        with pytest.raises(LedgerDamagedError, match=said):
            read_ledger(tmp_path)
        return
    found = audit(read_ledger(tmp_path))  # against an uninterrupted run: at once
    assert found.records == 4


@pytest.mark.parametrize("line", [
    '{"kind": "rollout", "step": Infinity, "data": "d", "transcript": []}',
    '{"kind": "rollout", "step": 0, "transcript": []}',
    '{"kind": "rollout", "step": 0, "data": "d", "transcript": "abc"}',
])
def test_a_crafted_rollout_journal_is_refused_in_one_line(tmp_path, line):
    """An infinite step, a line without its data digest and a transcript that is a string raised
    OverflowError, KeyError and AttributeError out of dew rescore and dew report."""
    from dew.training.rollout_journal import RolloutJournalError, kept_rollouts

    (tmp_path / "run.json").write_text("{}\n")
    (tmp_path / ROLLOUTS).write_text(line + "\n")
    with pytest.raises(RolloutJournalError, match="this dew cannot read"):
        kept_rollouts(tmp_path, batches=False)
