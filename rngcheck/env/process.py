"""Which process to check: the one running the user's script or module; not launchers, not
multiprocessing children, not pytest (its plugin checks there), not the CLI, and not a python
process started by an already checked one (its report would overwrite the parent's)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

__all__ = ["OWNER_VAR", "run_id", "skip_reason"]

OWNER_VAR = "_RNGCHECK_ACTIVE_IN"  # set by a checked process; its python children stay unchecked
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "pytest", "rngcheck.cli")
_LAUNCHER_SCRIPTS = ("torchrun", "pytest", "py.test", "rngcheck")


def run_id(environ: Mapping[str, str]) -> str:
    """The same on every rank of one job, different between jobs: what `rngcheck show` groups by."""
    host = socket.gethostname()
    run = environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return run
    if "LOCAL_RANK" in environ:  # torchrun workers: the agent (our parent) is one per job and node
        return f"{host}-{os.getppid()}-{environ.get('MASTER_PORT', '')}"
    return f"{host}-{os.getpid()}"


def _launched_as() -> tuple[str, str]:
    """(script basename, ``-m`` module) of this interpreter's command line."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    module = ""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-c"):  # "-m pytest", and "-mpytest" below (the form pytester runs)
            rest = argv[i + 1] if i + 1 < len(argv) else ""
            module = rest if a == "-m" else f"-c {rest}"
            break
        if a.startswith(("-m", "-c")):
            module = a[2:] if a.startswith("-m") else f"-c {a[2:]}"
            break
        if a in ("-W", "-X"):  # interpreter options that take a value
            i += 2
            continue
        if not a.startswith("-"):
            break  # the script: what follows is its own command line
        i += 1
    return os.path.basename(sys.argv[0]) if sys.argv else "", module


def skip_reason(environ: Mapping[str, str]) -> str:
    """Why this process is not the one to check (empty: check it)."""
    owner = environ.get(OWNER_VAR)
    if owner and owner != str(os.getpid()):
        return f"a child of the checked process {owner}"
    script, module = _launched_as()
    if module.startswith(_LAUNCHER_MODULES) or script in _LAUNCHER_SCRIPTS:
        return f"a launcher or tool ({module or script})"
    if "multiprocessing" in module or "--multiprocessing-fork" in sys.argv:
        return "a multiprocessing child"
    return ""
