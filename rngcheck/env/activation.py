"""The environment-started mode and everything around it, one per process: binding to
torch.distributed when the script initialises it (and ending the checking before it destroys it),
the report and trace written at exit and after an uncaught exception, the start-up and closing
lines, and forked children (DataLoader workers) left unchecked.

No signal handler: a SIGTERM (how torchrun stops the other ranks when one fails) ends a checked
process at once, as it ends an unchecked one. A Python handler would run only once the main
thread is back in the interpreter (a rank waiting in a collective for a slow peer would outlive
its SIGTERM by as long as the wait lasts), and the ``SystemExit`` it would raise is one a
script's ``except BaseException`` can swallow. The mode keeps the report on disk current while
the run goes instead (``session/keeper.py``), so a killed rank's report, ``completed`` False,
holds every finding it made."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import os
import shutil
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from . import spawned
from .process import OWNER_VAR, RANKS_VAR, RUN_VAR, owner, run_id, task_index
from .variables import EnvSettings

__all__ = ["Activation"]

log = logging.getLogger(__name__)

# How long a rank waits at its bind for rank 0's run id (rank 0 posts it as it binds, just after
# the start that every rank has passed): then it keeps its own.
_RUN_ID_WAIT = 60.0


class Activation:
    """The environment-started mode and everything around it. One per process."""

    def __init__(self, settings: EnvSettings) -> None:
        from ..mode import RNGConsistencyMode

        self.settings = settings
        self.mode = RNGConsistencyMode(**settings.mode_kwargs)
        report = self.mode.report
        report.rank, report.world_size = settings.rank, settings.world_size
        report.meta.update(
            run_id=run_id(os.environ),
            argv=list(sys.argv),
            pid=os.getpid(),
            host=socket.gethostname(),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            activated_by="RNGCHECK",
        )
        self.steps = 0
        self.bound = False
        # Where the ranks this process starts itself (torch.multiprocessing.spawn) say they are
        # ranks (spawned.py); whether any did, once known at the end
        self.ranks_dir = spawned.ranks_dir()
        self._launcher = False
        self.forked = False  # a forked child of the checked process: switched off
        self.exited = False
        self.finished = False
        self.stopped_by: BaseException | None = None  # the finding's error that ended the run
        # Whether this process's report path is its own before it binds: the launcher gave its
        # rank (torchrun's RANK), or it is no task of a launcher (else it is rank 0's path, which
        # an srun task or a Lightning child would share until the process group gives its rank).
        self._rank_given = "RANK" in os.environ or (
            task_index(os.environ) is None and "LOCAL_RANK" not in os.environ
        )
        # The mode keeps the report on disk current while the run goes, where its path is this
        # process's own to write (from the mode's start: set before it).
        self.mode._keeper.allowed = self._owns_report_path
        self._restore: list[Callable[[], None]] = []
        self._step_hook: Any = None  # (removed at the end, never in _restore)
        self._previous_excepthook: Callable[..., Any] = sys.excepthook
        self._lock = threading.RLock()

    # -- start -------------------------------------------------------------------------------

    def start(self) -> Activation:
        import torch

        self.mode.report.meta["torch"] = torch.__version__
        self.mode.__enter__()
        try:
            self._patch_distributed()
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._step_hook = register_optimizer_step_post_hook(self._after_step)
            atexit.register(self.finish)
            self._finish_as_child()
            os.register_at_fork(after_in_child=self._in_forked_child)
            # Kept after the checking ends: the last exchange (at destroy_process_group) can raise
            # a finding's error that reaches the top only later.
            self._previous_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
        except BaseException:
            exc_type, exc, tb = sys.exc_info()
            self._exit(exc_type, exc, tb, "rngcheck failed to start")
            raise
        os.environ[OWNER_VAR] = owner(os.environ)
        os.environ[RUN_VAR] = self.mode.report.meta["run_id"]
        os.environ[RANKS_VAR] = self.ranks_dir
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # started as the group came up
            self.bind()  # (a rank that torch.multiprocessing.spawn started: spawned.py)
        elif self.settings.world_size <= 1 and task_index(os.environ) in (None, 0):
            self._announce()  # not launched as a rank: say it now (else at bind); under srun
            # or mpirun, only the first task does (the others' start lines would repeat it)
        return self

    def _announce(self) -> None:
        """One line at start, on the lowest rank: what is checked, how, and where reports go."""
        import torch

        mode, report = self.mode, self.mode.report
        if report.rank != 0:
            return
        cfg = mode.config
        checks = []
        if report.world_size > 1 and cfg.sync != "off":
            timeout = report.meta.get("rank_timeout") or {}
            wait = f", timeout {timeout['seconds']:g} s from {timeout['from']}" if timeout else ""
            checks.append(
                f"random ops across ranks 0-{report.world_size - 1} (sync={cfg.sync}{wait})"
            )
        if cfg.check_recompute:
            checks.append("checkpoint recomputes")
        what = " and ".join(checks) or "random ops (nothing to compare: one process, recompute off)"
        if cfg.level == "step":
            what += (
                f" at the step level (op by op on the first {cfg.sample_first} steps, then one "
                f"in {cfg.sample_every}, and after any sign of trouble)"
            )
        where = (
            f"; reports: {self.settings.report_template}" if self.settings.report_template else ""
        )
        sys.stderr.write(
            f"rngcheck: checking {what} (torch {torch.__version__}; on a finding: "
            f"{cfg.on_finding}){where}. RNGCHECK=0 turns it off.\n"
        )
        sys.stderr.flush()

    def _patch_distributed(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import distributed_c10d

        modules = [dist, distributed_c10d]
        mesh = sys.modules.get("torch.distributed.device_mesh")
        if mesh is not None:  # it imported init_process_group by name; patch its copy as well
            modules.append(mesh)
        from ..output.report import ended_by

        original_init = distributed_c10d.init_process_group
        original_destroy = distributed_c10d.destroy_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = original_init(*args, **kwargs)
            self.bind()
            return out

        def destroy_process_group(group: Any = None) -> Any:
            # The last exchange needs the group: end the checking before the group goes away.
            if group is None or group is distributed_c10d.GroupMember.WORLD:
                try:
                    failed = _in_flight()
                    if failed is None:
                        self.stop("destroy_process_group()")  # may raise the last finding's error
                    else:
                        # Destroyed as an exception unwinds (a script's `finally:`): the run ends
                        # by it, with no final exchange against ranks still mid-step (they report
                        # this one missing, with its error, not a divergence).
                        self._exit(type(failed), failed, failed.__traceback__, ended_by(failed))
                finally:
                    original_destroy(group)  # freed either way
                return None
            return original_destroy(group)

        wrappers = ((init_process_group, original_init), (destroy_process_group, original_destroy))
        for fn, original in wrappers:
            fn.__wrapped__ = original  # type: ignore[attr-defined]
            fn.__doc__ = original.__doc__
            for module in modules:
                if getattr(module, original.__name__, None) is original:
                    setattr(module, original.__name__, fn)
                    self._restore.append(
                        functools.partial(setattr, module, original.__name__, original)
                    )

    def bind(self) -> None:
        """Start the cross-rank checks once torch.distributed is up (on every rank, together)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if self.exited:
            if self.forked:  # a rank forked from the checked process (start_method="fork")
                self._warn_forked_rank()
            return
        report = self.mode.report
        report.rank, report.world_size = dist.get_rank(), dist.get_world_size()
        if (report.rank, report.world_size) != (self.settings.rank, self.settings.world_size):
            # A launcher that sets no RANK (Lightning starts ranks 1 to N-1 with LOCAL_RANK
            # only): the files take the rank the process group gives, not rank 0's names.
            self.mode._move_outputs(*self.settings.paths(report.rank, report.world_size))
        report.meta["process_group"] = {
            "backend": str(dist.get_backend()),
            "world_size": report.world_size,
            "bound_after_step": self.steps,
        }
        self.mode.bind_distributed()
        self.bound = True
        self._agree_on_the_run()
        # Saved now as the rank it is, in the run it belongs to (an srun task or a Lightning
        # child saves nothing before: its path was rank 0's).
        self.mode._keeper.save(force=True)
        # Its place in the job is known now (a launcher that starts the other ranks from this
        # one, like Lightning's, sets it after start-up): a child started from here on at the
        # same place is this rank's helper, not another rank.
        os.environ[OWNER_VAR] = owner(os.environ, report.rank)
        self._announce()

    def _agree_on_the_run(self) -> None:
        """Every rank names its run as rank 0 does: under a launcher whose job rngcheck cannot
        read from the environment (``srun``, ``mpirun``, a scheduler of the user's), each rank
        would otherwise be a run of its own, and ``rngcheck show`` would miss the others."""
        from ..ranks.board import rank0s

        meta = self.mode.report.meta
        run = rank0s("run_id", meta["run_id"], self.mode.report.rank, _RUN_ID_WAIT)
        if run != meta["run_id"]:
            meta["run_id"] = run
            os.environ[RUN_VAR] = run

    def _warn_forked_rank(self) -> None:
        from ..core.findings import RNGCheckWarning

        self.forked = False  # once
        warnings.warn(
            "rngcheck does not check this rank: it was forked from a checked process (a "
            "multiprocessing start method of 'fork', as in start_processes(start_method='fork') "
            "or Lightning's ddp_fork), whose checker switches itself off in a forked child, as in "
            "a DataLoader worker. Start the ranks with 'spawn' (torch.multiprocessing.spawn's "
            "way) or 'forkserver' to have each checked, or start the mode in the function each "
            "rank runs.",
            RNGCheckWarning,
            stacklevel=4,
        )

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.exited:
            return
        self.steps += 1
        if not self.bound:  # a group made through a copy of init_process_group we did not patch
            self.bind()  # (the rank checker then exchanges at this and every later step itself)

    def _owns_report_path(self) -> bool:
        """Whether the report may be saved at its path while the run goes: once bound (the rank
        is the process group's), or before where the launcher gave the rank; never in a process
        that started the ranks itself (their files are theirs)."""
        return self.bound or (self._rank_given and not self.launched_only)

    def _in_forked_child(self) -> None:
        """A forked child (a DataLoader worker) inherits the checker mid-run: switch it off there.

        Left on, the worker's random ops (augmentation) would be exchanged with the other ranks
        from the wrong process and hang the job; its report would never be written anyway (workers
        leave with os._exit). The parent goes on checking its own ops.
        """
        if self.exited:
            return
        self.exited = True
        self.forked = True
        self.mode.leave_forked_child()

    # -- end ---------------------------------------------------------------------------------

    def _excepthook(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from ..core.findings import RNGCheckError

        if isinstance(exc, RNGCheckError):
            # The finding was rendered when it was raised; a traceback would repeat it.
            self.stopped_by = exc
            if self._renders(exc.finding):
                where = self.mode.config.report_path
                saved = f" Report: {where}." if where else ""
                sys.stderr.write(
                    f"rngcheck: stopped the run at the first finding ({exc_type.__name__} at "
                    f"{exc.finding.site}).{saved} Set RNGCHECK_ON_FINDING=record to run to the "
                    "end and collect every finding.\n"
                )
            return
        self._previous_excepthook(exc_type, exc, tb)

    def _renders(self, finding: Any) -> bool:
        """One merged rendering: the mode's rule (the rank checker's, with several ranks)."""
        return self.mode.renders(finding)

    def stop(self, reason: str = "stop()") -> None:
        """End the checking now: final exchange, report and trace written. Raises a finding's
        error if the final exchange finds one and on_finding is "raise"."""
        self._exit(None, None, None, reason)

    def _exit(self, exc_type: Any, exc: Any, tb: Any, reason: str) -> None:
        with self._lock:
            if self.exited:
                return
            self.exited = True
        self.mode.report.meta.setdefault("ended_by", reason)  # what `rngcheck show` tells
        if self.launched_only:
            self._as_launcher()
        try:
            self.mode.__exit__(exc_type, exc, tb)
        finally:
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            for undo in reversed(self._restore):
                undo()
            self._restore.clear()

    @property
    def launched_only(self) -> bool:
        """Whether this process started ranks itself (``torch.multiprocessing.spawn``) and is
        none of them: it never joined a process group, and a child of its did (spawned.py)."""
        if not self._launcher:
            self._launcher = not self.bound and spawned.ranks_started(self.ranks_dir)
        return self._launcher

    def _as_launcher(self) -> None:
        """The ranks' files (``rank0.json``, ...) are theirs: this process keeps a report only
        when it checked something itself, under ``launcher`` and as a run of its own."""
        report = self.mode.report
        self._drop_own_save()
        if _checked_nothing(report):
            self.mode._move_outputs(None, None)
            return
        report.meta["run_id"] = f"{report.meta['run_id']}-launcher"
        self.mode._move_outputs(*self.settings.launcher_paths())

    def _drop_own_save(self) -> None:
        """The report this process saved at rank 0's path while it ran, before a rank it started
        began checking (then it stopped: ``_owns_report_path``): removed, unless rank 0 has saved
        its own there since."""
        from ..output.report import Report

        path = self.mode.config.report_path
        if not path or not self.mode._keeper.saves:
            return
        with contextlib.suppress(Exception):  # (gone, or rank 0's own being replaced: leave it)
            if Report.load(path).meta.get("pid") == os.getpid():
                os.unlink(path)

    def _finish_as_child(self) -> None:
        """A rank that multiprocessing started (spawned.py) may leave by ``os._exit`` (a
        ``forkserver`` child does) without running atexit: finish from multiprocessing's own
        exit function as well, which every child of its runs."""
        mp = sys.modules.get("multiprocessing")
        if mp is not None and mp.parent_process() is not None:
            from multiprocessing.util import Finalize

            Finalize(None, self.finish, exitpriority=0)

    def finish(self) -> None:
        """At interpreter exit: end the mode (unless the script already did), then one line."""
        from ..core.findings import RNGCheckError
        from ..output.report import ended_by

        if self.finished:  # (a multiprocessing child: from its exit function, then atexit)
            return
        self.finished = True
        # (a rank that multiprocessing started finishes in its exit function, as the error its
        # function raised is on its way)
        exc = getattr(sys, "last_value", None) or _in_flight()
        failed = False
        try:
            if exc is not None:
                self._exit(type(exc), exc, exc.__traceback__, ended_by(exc))
            else:
                self._exit(None, None, None, "exit")
        except RNGCheckError:
            failed = True  # rendered by the mode; the exit status must say so
        except Exception as e:  # noqa: BLE001 - report the checker's own failure, keep the exit
            sys.stderr.write(f"rngcheck: could not finish checking: {type(e).__name__}: {e}\n")
        self._print_summary()
        shutil.rmtree(self.ranks_dir, ignore_errors=True)  # (made by a rank it started, if any)
        if failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _print_summary(self) -> None:
        from ..output.render import print_finding, summary_line

        report = self.mode.report
        if self.mode.config.on_finding == "record" and report.findings:
            for f in report.findings:
                if self._renders(f):
                    print_finding(f, console=self.mode.console, world_size=report.world_size)
        if report.rank != 0 or self.stopped_by is not None:
            return
        launcher = ""
        if self.launched_only:  # each rank it started says its own line
            if _checked_nothing(report):
                return
            launcher = " in the process that started the ranks"
        where = ""
        if self.settings.report_template:
            where = f"; reports: {self.settings.report_template} (read with `rngcheck show`)"
        if self.settings.trace_template:
            where += f"; trace: {self.settings.trace_template}"
        sys.stderr.write(f"{summary_line(report)}{launcher}{where}\n")
        sys.stderr.flush()


def _in_flight() -> BaseException | None:
    """The exception on its way up now (from a ``finally:`` or an ``except:`` block, or
    multiprocessing's exit function as a rank's function failed), or None; a ``SystemExit`` of
    status 0 is a normal end, and one that torch.multiprocessing raised for its function's error
    (``SystemExit(1)``) is that error."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return None
    if isinstance(exc, SystemExit) and isinstance(exc.__context__, Exception):
        return exc.__context__  # the function's own error, which torch's wrapper caught
    return exc


def _checked_nothing(report: Any) -> bool:
    """A launcher's report with nothing of its own: no random op, no finding."""
    return report.random_ops == 0 and not report.findings
