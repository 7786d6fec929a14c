"""A pytest plugin for the course's nbval runs: wait longer for the last messages of a cell.

nbval waits 5 s (a constant, `IPyNbCell.output_timeout`, with no option to change it) for each
message the kernel publishes after a cell has replied. On a busy machine a cell that streamed a
progress bar for minutes can take longer than that to deliver its last messages, and nbval then
fails the cell with "Timeout of 5 seconds exceeded waiting for output" although the cell ran
fine (seen once in a fresh clone's `make test`, notebook 12's training cell, with another job
on the same two cores). The time a cell may run (`--nbval-cell-timeout`) is not changed.

It also starts a notebook's kernel again when the kernel dies before it has said it is ready
("Kernel died before replying to kernel_info"): a start-up failure that happens before any cell
runs, so a second start changes nothing the test compares (seen once in a fresh clone's
`make test`, notebook 13, while other kernels started on the same machine).
`tools/notebooks.py` loads this plugin with `-p nbval_patience`.
"""

import logging

import nbval.kernel

OUTPUT_TIMEOUT = 60  # seconds to wait for each message after a cell's reply
KERNEL_STARTS = 3  # attempts to start a notebook's kernel
_start_new_kernel = nbval.kernel.start_new_kernel  # nbval's own


def start_new_kernel(*args, **kwargs):
    """nbval's start_new_kernel, tried up to KERNEL_STARTS times when the kernel dies starting."""
    for attempt in range(1, KERNEL_STARTS):
        try:
            return _start_new_kernel(*args, **kwargs)
        except RuntimeError:
            logging.getLogger(__name__).warning("kernel start %d failed; starting again", attempt)
    return _start_new_kernel(*args, **kwargs)  # the last attempt: its error is nbval's


def pytest_configure(config) -> None:
    nbval.kernel.start_new_kernel = start_new_kernel  # RunningKernel looks it up here


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if hasattr(item, "output_timeout"):  # nbval's cells
            item.output_timeout = max(item.output_timeout, OUTPUT_TIMEOUT)
