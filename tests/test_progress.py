"""When progress shows (ninfer/progress.py): NINFER_PROGRESS=0 never, =1 always, unset only on a
terminal; the silent stand-in still iterates and takes every call a tqdm bar takes."""

from __future__ import annotations

from ninfer.progress import bar, note


def _use(b) -> list[int]:
    b.update(2)
    b.set_postfix(errors=1)
    b.set_description("x")
    items = list(b)
    b.close()
    return items


def test_off_draws_and_notes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("NINFER_PROGRESS", "0")
    with bar([1, 2, 3], desc="work") as b:
        assert _use(b) == [1, 2, 3]
    note("step")
    assert capsys.readouterr().err == ""


def test_on_draws_into_a_pipe(monkeypatch, capsys):
    monkeypatch.setenv("NINFER_PROGRESS", "1")
    assert list(bar([1, 2], desc="work", unit="req")) == [1, 2]
    note("step")
    err = capsys.readouterr().err
    assert "work" in err and "2/2" in err and "step\n" in err


def test_unset_is_quiet_off_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("NINFER_PROGRESS", raising=False)
    b = bar(total=3, desc="work")                     # pytest's stderr is not a terminal
    b.update(3)
    b.close()
    assert list(bar(range(2))) == [0, 1]
    assert "work" not in capsys.readouterr().err
