"""What every command-line entry point of kiln does around its `main`: arguments parsed by tyro (printed by rank 0
alone under torchrun), and errors a user can act on reported as one `error:` line instead of a traceback.

    if __name__ == "__main__":
        with cli.one_line_errors():
            main(cli.parse_args(Args))
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import tyro

import containers
import task_rows


def parse_args(args_class):
    """`tyro.cli(args_class)`, with --help and argument errors printed by rank 0 alone under torchrun. Args with a
    `dry_run` field that is set are printed resolved, as JSON, and the process exits: nothing loads."""
    first_rank = int(os.environ.get("RANK", "0")) == 0
    if first_rank:
        args = tyro.cli(args_class)
    else:
        with open(os.devnull, "w") as devnull, redirect_stdout(devnull), redirect_stderr(devnull):
            args = tyro.cli(args_class)
    if getattr(args, "dry_run", False):
        if first_rank:
            print(json.dumps(dataclasses.asdict(args), indent=2))
        sys.exit(0)
    return args


# Errors a user acts on (a bad argument, row or path), reported with their type and message.
KNOWN_ERRORS = (task_rows.RowError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                PermissionError, containers.DockerUnavailable, containers.ImageMissing)
KILN_DIR = Path(__file__).resolve().parent


@contextmanager
def one_line_errors():
    """`with one_line_errors(): main(args)`, what every command-line entry point does: library functions raise
    ordinary exceptions, and here a known error (a bad row, a missing file or image) or a ValueError / RuntimeError
    that kiln's own code raised with its message (a bad setting, a failed run) is printed as one `error:` line and
    the process exits with status 1: under torchrun no rank prints a traceback above torchrun's own report, and only
    rank 0 prints when every rank fails alike (another rank prints only an error of its own). Anything else, such as
    a ValueError from inside torch, propagates with its traceback (a bug); so does everything with KILN_TRACEBACK=1."""
    try:
        yield
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        _exit_with(e.code)
    except KNOWN_ERRORS as e:
        if os.environ.get("KILN_TRACEBACK") == "1":
            raise
        _exit_with(f"{type(e).__name__}: {e}")
    except (ValueError, RuntimeError) as e:
        if os.environ.get("KILN_TRACEBACK") == "1" or not _raised_by_kiln(e):
            raise
        _exit_with(str(e))


def _raised_by_kiln(error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback is kiln's own code (a `raise` with a message for the user)
    rather than a library's."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    return path.parent == KILN_DIR


def _exit_with(message: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # torchrun stops every rank once one exits: rank 0, failing alike, reports and ends this one first
        time.sleep(5)
    line = f"error: {message}" if rank == 0 else f"error (rank {rank}): {message}"
    print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun: its failure report ends with this line
        record_for_torchrun(os.environ["TORCHELASTIC_ERROR_FILE"], line)
    os._exit(1)  # not the interpreter's teardown: gloo threads may hold the process group (policy.exit_distributed)


def record_for_torchrun(error_file: str, line: str) -> None:
    """`line` in the error file torchrun reads when a rank fails (the layout of torch.distributed.elastic's
    ErrorHandler.record_exception, with the line in place of a traceback): torchrun's report of the failed ranks, which
    it prints after everything the ranks printed, then ends with the line instead of "To enable traceback see ..."."""
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        Path(error_file).write_text(json.dumps(record))
    except OSError:  # the line is on stderr already
        pass
