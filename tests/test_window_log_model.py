"""The change log against a model: random batches, results written out, refusals and
their retries, folds, idle closes, crashes, restarts, a second handle that folds, a
COMMIT that fails and one whose reply is lost, over real SQLite. After every step the
windows table with the log replayed holds exactly the model's windows and counts, and
``due`` offers exactly the closed ones not refused. (A reviewer's fuzz, made a test.)
Twice: with the windows held in Arrow columns where they can be (some batches folded row
by row turn them into a dict and back), and always as a dict."""

from __future__ import annotations

import random
import sqlite3

import pytest

from ackflow.state import columns, winlog
from ackflow.state import held as held_mod
from ackflow.state.store import WindowStore
from ackflow.state.winlog import folded
from ackflow.windows import hopping
from test_window_log import S, apply, spec


class Flaky(sqlite3.Connection):
    """``mode``: the next COMMIT fails ("fail"), or commits and its reply is lost ("lost")."""

    mode: str | None = None

    def execute(self, query, *args):
        if query == "COMMIT" and Flaky.mode is not None:
            mode, Flaky.mode = Flaky.mode, None
            if mode == "lost":
                super().execute(query, *args)
                raise sqlite3.OperationalError("the reply to COMMIT was lost")
            super().execute("ROLLBACK")
            raise sqlite3.OperationalError("COMMIT failed")
        return super().execute(query, *args)


def opened(path, sp):
    store = WindowStore(path)
    store.db.close()
    store.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=Flaky)
    store.retry_failed(sp)  # (as the window sink does at each start)
    return store


def stored(path):
    """(gk, start) -> rows, from the table with the log replayed."""
    db = sqlite3.connect(path)
    try:
        rows = folded(db, "w")
        if rows is None:
            rows = db.execute('SELECT gk, start, "end", nrows FROM windows WHERE op = ?', ("w",)).fetchall()
        return {(r[0], r[1]): r[3] for r in rows}
    finally:
        db.close()


STEPS = ["apply"] * 5 + ["emit", "emit", "fail", "retry", "settle", "crash", "close", "lost", "failed"]
STEPS += ["idle", "peek", "peek", "peek", "failfold"]


@pytest.mark.parametrize("held", ["columns", "dict"])
@pytest.mark.parametrize("seed", range(12))
def test_the_table_with_the_log_replayed_is_the_model(tmp_path, monkeypatch, seed, held):
    monkeypatch.setattr(columns, "ENABLED", held == "columns")
    monkeypatch.setattr(held_mod, "COLUMNS_AGAIN", 2)
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 3)
    monkeypatch.setattr(held_mod, "HOLD_MAX", 4 if seed % 4 < 2 else 1000)  # beyond it, read per batch
    monkeypatch.setattr(Flaky, "mode", None)
    rnd = random.Random(seed)
    sp = spec(hopping("10s", every="5s")) if seed % 2 else spec()
    path = str(tmp_path / "windows.db")
    store = opened(path, sp)
    model: dict[tuple[str, int], int] = {}
    refused: set[tuple[str, int]] = set()
    t, n, steps = 0.0, 0, []

    def windows(at):
        if seed % 2:
            start = int(at // 5) * 5
            return [start * S, (start - 5) * S]
        return [int(at // 10) * 10 * S]

    for _ in range(150):
        step = rnd.choice(STEPS)
        steps.append(step)
        if step in ("apply", "lost", "failed"):
            recs = [(t + rnd.random() * 8, rnd.choice("abc"), 1) for _ in range(rnd.randint(1, 4))]
            t += rnd.random() * 4
            keys = [f"r{n + i}" for i in range(len(recs))]
            n += len(recs)
            Flaky.mode = {"lost": "lost", "failed": "fail"}.get(step)
            try:
                apply(store, sp, *recs, keys=keys, arrow=rnd.random() > 0.15)
                counted = True
            except sqlite3.OperationalError:
                counted = step == "lost"
            if counted:
                for at, k, _ in recs:
                    for start in windows(at):
                        slot = (f'["{k}"]', start)
                        model[slot] = model.get(slot, 0) + 1
                        refused.discard(slot)  # (a window changed is tried again)
        elif step == "emit":
            bound = store.mark("w")["watermark"]
            due = store.due(sp, bound)
            closed = -(10**18) if bound is None else bound
            want = sorted(s for s in model if s not in refused and s[1] + 10 * S <= closed)
            assert sorted((d.gk, d.start) for d in due) == want, steps[-8:]
            assert all(model[(d.gk, d.start)] == d.accs[0] for d in due), steps[-8:]
            if rnd.random() < 0.3:
                Flaky.mode = "lost"
            try:
                store.done(sp, due)
            except sqlite3.OperationalError:
                pass  # (its reply lost: done all the same)
            for d in due:
                model.pop((d.gk, d.start))
        elif step == "fail":
            due = store.due(sp, store.mark("w")["watermark"])
            if due:
                d = rnd.choice(due)
                store.fail(sp, d, "refused")
                refused.add((d.gk, d.start))
        elif step == "retry":
            store.retry_failed(sp)
            refused.clear()
        elif step == "settle":
            if rnd.random() < 0.3:
                Flaky.mode = "lost"
            try:
                store.settle(sp)
            except sqlite3.OperationalError:
                pass
        elif step == "peek":  # another handle on the same file folds the log
            other = WindowStore(path)
            other.stats("w")
            other.close()
        elif step == "failfold":
            Flaky.mode = "fail"
            try:
                store._folded("w")
            except sqlite3.OperationalError:
                pass
        elif step == "idle":
            store.close_open(sp)
        elif step in ("crash", "close"):
            if step == "crash":
                store.db.close()
                store.scratch.close()
            else:
                store.close()
            store = opened(path, sp)
            refused.clear()
        Flaky.mode = None
        assert stored(path) == model, steps[-8:]
        assert store.stats("w")["open_windows"] == len(model), steps[-8:]
    store.close()
