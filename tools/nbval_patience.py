"""A pytest plugin for the course's nbval runs: wait longer for the last messages of a cell.

nbval waits 5 s (a constant, `IPyNbCell.output_timeout`, with no option to change it) for each
message the kernel publishes after a cell has replied. On a busy machine a cell that streamed a
progress bar for minutes can take longer than that to deliver its last messages, and nbval then
fails the cell with "Timeout of 5 seconds exceeded waiting for output" although the cell ran
fine (seen once in a fresh clone's `make test`, notebook 12's training cell, with another job
on the same two cores). The time a cell may run (`--nbval-cell-timeout`) is not changed.
`tools/notebooks.py` loads this plugin with `-p nbval_patience`.
"""

OUTPUT_TIMEOUT = 60  # seconds to wait for each message after a cell's reply


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if hasattr(item, "output_timeout"):  # nbval's cells
            item.output_timeout = max(item.output_timeout, OUTPUT_TIMEOUT)
