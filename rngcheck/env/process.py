"""Which process to check: the one running the user's script or module; not launchers (torchrun,
accelerate, DeepSpeed's, Lightning Fabric's), not multiprocessing children (until they become
ranks: spawned.py), not pytest (its plugin checks there), not the CLI, and not a python process
started by an already checked one (its report would overwrite the parent's), unless it is another
rank of the job (Lightning starts ranks 1 to N-1 as children of rank 0)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

__all__ = [
    "OWNER_VAR",
    "RANKS_VAR",
    "RUN_VAR",
    "may_become_a_rank",
    "owner",
    "task_index",
    "run_id",
    "skip_reason",
]

# "<pid> <place>", set by a checked process: its python children stay unchecked unless the
# variables launchers set put them at another place in the job (another rank).
OWNER_VAR = "_RNGCHECK_ACTIVE_IN"
RUN_VAR = "_RNGCHECK_RUN_ID"  # set by a checked process: the ranks it starts are of its run
# set by a checked process: where the ranks it starts itself say so (spawned.py)
RANKS_VAR = "_RNGCHECK_RANKS_IN"
_PLACE_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands",
    "deepspeed.launcher",
    "pytest",
    "rngcheck.cli",
)
_LAUNCHER_SCRIPTS = (
    "torchrun",
    "accelerate",
    "accelerate-launch",
    "deepspeed",
    "ds",
    "fabric",
    "lightning",
    "pytest",
    "py.test",
    "rngcheck",
)


def run_id(environ: Mapping[str, str]) -> str:
    """The same on every rank of one job, different between jobs: what `rngcheck show` groups by."""
    inherited = environ.get(RUN_VAR)
    if inherited:  # started by a checked rank (Lightning starts ranks 1 to N-1 from rank 0)
        return inherited
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


def _place(environ: Mapping[str, str]) -> str:
    """Where the launcher's variables put this process in a distributed job ("" outside one)."""
    if "RANK" not in environ and "LOCAL_RANK" not in environ:
        return ""
    return ",".join(environ.get(name, "") for name in _PLACE_VARS)


def owner(environ: Mapping[str, str], rank: int | None = None) -> str:
    """The value of OWNER_VAR for this process, checked, at the place ``environ`` gives (or,
    without one, at ``rank`` of its process group: a rank started with multiprocessing)."""
    place = _place(environ) or ("" if rank is None else f"rank {rank}")
    return f"{os.getpid()} {place}"


def skip_reason(environ: Mapping[str, str]) -> str:
    """Why this process is not the one to check (empty: check it)."""
    pid, _, place = environ.get(OWNER_VAR, "").partition(" ")
    mine = _place(environ)
    if pid and pid != str(os.getpid()) and not (mine and mine != place):
        return f"a child of the checked process {pid}"
    script, module = _launched_as()
    if module.startswith(_LAUNCHER_MODULES) or script in _LAUNCHER_SCRIPTS:
        return f"a launcher or tool ({module or script})"
    if _multiprocessing_child(module):
        return "a multiprocessing child"
    return ""


def _multiprocessing_child(module: str) -> bool:
    return "multiprocessing" in module or "--multiprocessing-fork" in sys.argv


def may_become_a_rank(environ: Mapping[str, str]) -> bool:
    """Whether this process is a child that multiprocessing started (``spawn``, ``forkserver``)
    from a checked process that is no rank itself: ``torch.multiprocessing.spawn``'s ranks, but
    also a DataLoader worker with a ``spawn`` context. It is checked once it initialises the
    default process group (a worker never does; spawned.py). A checked rank's children are left
    alone: a group they made would be another job's, its files named as this job's ranks'."""
    pid, _, place = environ.get(OWNER_VAR, "").partition(" ")
    if not pid or pid == str(os.getpid()) or place:
        return False
    return _multiprocessing_child(_launched_as()[1])


# Set by launchers that start every rank themselves and that rngcheck reads no RANK from: Slurm's
# srun, Open MPI's and MPICH's mpirun, PMIx.
_TASK_VARS = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def task_index(environ: Mapping[str, str]) -> int | None:
    """This process's index among the tasks such a launcher started (None: no such launcher).
    Only who speaks first hangs on it: the rank is the process group's, once it is up."""
    for name in _TASK_VARS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None
