"""The matrix's cells selected in this session (after -m and -k), for test_matrix.plan_runs: only their runs are
planned into the session's launches."""

import pytest


@pytest.hookimpl(trylast=True)  # after the mark plugin's deselection
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if hasattr(item, "callspec") and "cell_index" in item.callspec.params:
            item.module.MATRIX["selected"].add(item.callspec.params["cell_index"])


def pytest_terminal_summary(terminalreporter):
    """The matrix's table (test_matrix.table) of the cells this session ran."""
    import sys

    module = sys.modules.get("test_matrix")
    if module is None or not module.RESULTS:
        return
    terminalreporter.section("capability matrix")
    for line in module.table(module.RESULTS, module.MATRIX):
        terminalreporter.write_line(line)
