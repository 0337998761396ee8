"""`moemesh ...` run in the test's own process, for the commands whose tests read what it
prints and what it writes: a subprocess would spend most of its time importing torch again,
which the test process has done already. It returns what subprocess.run does, with stdout
and stderr as a process would show them: the command's prints, its log lines, argparse's
errors (exit 2) and, for an exception that escapes, the traceback and exit status 1.

What makes a process's behaviour the subject (startup, signals, a one-line error before
anything is imported) stays a subprocess test."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import traceback

import torch

from moemesh.tools.cli.main import main


def moemesh(*args, cwd=None) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level, threads, here = root.level, torch.get_num_threads(), os.getcwd()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if cwd is not None:
                os.chdir(cwd)
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's errors, and a command that exits
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=err)
            except Exception:
                traceback.print_exc(file=err)
                rc = 1
    finally:
        os.chdir(here)
        root.removeHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)  # `eplb` sets its own
    return subprocess.CompletedProcess(["moemesh", *argv], rc, out.getvalue(), err.getvalue())
