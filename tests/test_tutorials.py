"""The tutorials (docs/tutorials/*.ipynb, #48) execute as a reader runs them: in order, in one
folder (the third reads the experiment the first wrote), each in a fresh Jupyter kernel of
this Python (nbclient); their own assertions check what they show. Their outputs are not
committed: a notebook's source is its cells."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.ipynb"))


def test_the_tutorials_are_committed_without_outputs():
    assert len(TUTORIALS) == 3
    for path in TUTORIALS:
        book = nbformat.read(path, as_version=4)
        ran = [c for c in book.cells if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not ran, f"{path.name}: clear its outputs before committing"


def test_the_tutorials_execute_in_order(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for path in TUTORIALS:
        book = nbformat.read(path, as_version=4)
        NotebookClient(book, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
        errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
                  if o.output_type == "error"]
        assert not errors, (path.name, errors)
        shown = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
        assert shown, path.name
        if path.stem.startswith("3_"):  # a report's figure, drawn inline as a PNG
            assert any("image/png" in o.get("data", {}) for o in shown)
    assert (tmp_path / "tutorials.db").is_file()


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_each_tutorial_says_what_it_shows(path):
    book = nbformat.read(path, as_version=4)
    assert book.cells[0].cell_type == "markdown" and book.cells[0].source.startswith("# ")
