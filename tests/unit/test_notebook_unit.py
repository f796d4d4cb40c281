"""notebooks/quickstart.ipynb as committed (no kernel): valid, and without outputs. Its execution is checked in
tests/launch/test_notebook.py."""

import nbformat
from helpers import NOTEBOOK


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "clear the notebook's outputs before committing"
