"""Activation from environment variables: ``RNGCHECK=1 torchrun ... train.py`` checks an
unmodified script.

The package installs a startup hook (``rngcheck-autostart.pth``) that Python runs before any user
code. Unless ``RNGCHECK`` is set to an "on" value, that hook imports nothing at all. When it is on,
:func:`_startup_hook` reads the ``RNGCHECK_*`` variables (all of them validated here, at the edge),
enters an :class:`~rngcheck.RNGConsistencyMode` and arranges for the rest:

- binding to torch.distributed right after the script calls ``init_process_group`` (and before it
  calls ``destroy_process_group``, which is where the checking ends and the final exchange runs);
- exchanges at optimizer steps with ``sync="step"`` (the rank checker's own global step hook; the
  activation binds late at the first step when the group came from an unpatched copy of
  ``init_process_group``);
- the report kept on disk as the run goes (from the start, at each new finding, every few seconds
  at exchanges and steps: the mode's ``session/keeper.py``), and written at exit and after an
  uncaught exception; no signal handler, so a SIGTERM (how torchrun stops the other ranks when
  one fails) ends a rank at once, its report on disk with every finding it made;
- one short line on stderr at exit (rank 0 only) and, with ``RNGCHECK_ON_FINDING=record``, the
  findings rendered there once (by the lowest rank involved).

Which processes it starts in: the one running the user's script or module. Not in launchers
(``torchrun``, ``python -m torch.distributed.run``), not in pytest (``RNGCHECK=1 pytest`` turns
the plugin's ``--rngcheck`` on instead), not in the ``rngcheck`` CLI, and not in a python process
started by an already checked one (its report would overwrite the parent's). A multiprocessing
child of a checked process (``torch.multiprocessing.spawn``'s ranks, a DataLoader worker) is
checked once it initialises the default process group, as a rank (spawned.py).
"""

from __future__ import annotations

import functools
import logging
import os
import sys

from .activation import Activation
from .process import RANKS_VAR, may_become_a_rank, skip_reason
from .variables import VARIABLES, EnvError, EnvSettings, settings_from_env

__all__ = ["VARIABLES", "Activation", "EnvError", "EnvSettings", "activate", "settings_from_env"]

log = logging.getLogger(__name__)

_ACTIVATION: Activation | None = None
_STARTED = False


def activate(settings: EnvSettings | None = None) -> Activation:
    """Start checking this process the way ``RNGCHECK=1`` does (for launchers of your own)."""
    global _ACTIVATION
    if _ACTIVATION is not None and not _ACTIVATION.exited:
        raise RuntimeError("rngcheck is already active in this process (RNGCHECK=1?)")
    settings = settings or settings_from_env()
    _prove_outputs(settings)
    _ACTIVATION = Activation(settings).start()
    return _ACTIVATION


def _prove_outputs(settings: EnvSettings) -> None:
    """Create the folders of RNGCHECK_REPORT and RNGCHECK_TRACE now, and a file in each, so that
    a path that can never be written stops the run before the script, naming the variable (the
    mode proves its paths again as it starts, by its arguments' names)."""
    from ..core.config import OutputError, prepare_output

    kwargs = settings.mode_kwargs
    for name, given, path in (
        ("RNGCHECK_REPORT", settings.report_template, kwargs.get("report_path")),
        ("RNGCHECK_TRACE", settings.trace_template, kwargs.get("trace")),
    ):
        if path:
            try:
                prepare_output(path)
            except OutputError as e:
                raise EnvError(
                    f"{name}={given!r} cannot be written: {e}. Give a directory (or a file path) "
                    "that exists or can be created, and that this process can write"
                ) from None


def _startup_hook() -> None:
    """Run by ``rngcheck-autostart.pth`` at interpreter start-up, when RNGCHECK is not off."""
    global _STARTED
    if _STARTED:  # a .pth can be processed twice (a venv over a venv)
        return
    _STARTED = True
    reason = skip_reason(os.environ)
    rank_to_be = bool(reason) and may_become_a_rank(os.environ)
    if reason and not rank_to_be:
        log.debug("RNGCHECK is set, but this process is %s: not checking it", reason)
        return
    try:
        settings = settings_from_env()
        if not settings.enabled:
            return
        if rank_to_be:  # torch.multiprocessing.spawn's: checked once it is a rank
            from .spawned import when_a_rank

            when_a_rank(functools.partial(_start_as_rank, settings))
        else:
            activate(settings)
    except Exception as e:  # noqa: BLE001 - a start-up failure must stop the run, loudly
        # Raising here would only print a warning from site.py and run the script unchecked.
        message = str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"
        sys.stderr.write(f"rngcheck: cannot start: {message}\n")
        sys.stderr.flush()
        os._exit(2)


def _start_as_rank(settings: EnvSettings) -> None:
    """A child that a checked process started with multiprocessing has just initialised the
    default process group: check it from here, as a rank (unless the function it runs started
    a mode of its own first)."""
    from ..mode import active_mode
    from .spawned import mark_rank

    if active_mode() is None:
        launcher = os.environ.get(RANKS_VAR)  # (the launcher's: activate() names this one's)
        activate(settings)
        mark_rank(launcher)
