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
  ``init_process_group``), and a report re-saved after each step that brought a new finding;
- the report and trace written at exit, also after an uncaught exception and on SIGTERM (how
  torchrun stops the other ranks when one fails), so a rank killed by the finding leaves its
  report on disk;
- one short line on stderr at exit (rank 0 only) and, with ``RNGCHECK_ON_FINDING=record``, the
  findings rendered there once (by the lowest rank involved).

Which processes it starts in: the one running the user's script or module. Not in launchers
(``torchrun``, ``python -m torch.distributed.run``), not in multiprocessing children
(DataLoader workers, ``torch.multiprocessing.spawn``), not in pytest (``RNGCHECK=1 pytest`` turns
the plugin's ``--rngcheck`` on instead), not in the ``rngcheck`` CLI, and not in a python process
started by an already checked one (its report would overwrite the parent's).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import ON_FINDING, SYNC_MODES
from .policy import EXPECTATIONS

__all__ = ["VARIABLES", "Activation", "EnvError", "EnvSettings", "activate", "settings_from_env"]

log = logging.getLogger(__name__)

ON_VALUES = ("1", "true", "on", "yes")
OFF_VALUES = ("0", "false", "off", "no", "")
_OWNER_VAR = "_RNGCHECK_ACTIVE_IN"  # set by a checked process; its python children stay unchecked
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "pytest", "rngcheck.cli")
_LAUNCHER_SCRIPTS = ("torchrun", "pytest", "py.test", "rngcheck")


class EnvError(ValueError):
    """An RNGCHECK_* variable has a value rngcheck cannot use. The message names it and the valid
    values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Variable:
    """One environment variable: its name, what it takes, its default, and what it does."""

    name: str
    values: str  # the valid values, as the README table and error messages show them
    default: str
    help: str
    parse: Callable[[str, str], Any] = field(repr=False)


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    raise EnvError(
        f"{name}={raw!r} is not valid: use one of {', '.join(ON_VALUES)} (on) or "
        f"{', '.join(v for v in OFF_VALUES if v)} (off)"
    )


def _choice(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise EnvError(f"{name}={raw!r} is not valid: use one of {', '.join(choices)}")
        return value

    return parse


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise EnvError(f"{name}={raw!r} is not valid: use a positive whole number (e.g. 10)")
    return value


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise EnvError(f"{name}={raw!r} is not valid: use a positive number of seconds (e.g. 120)")
    return value


def _path(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise EnvError(f"{name} is set but empty: use a directory or a file path, or unset it")
    # Absolute now: the script may chdir before the report is written at exit.
    return os.path.abspath(os.path.expanduser(value))


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            name="RNGCHECK",
            values="1/true/on/yes, 0/false/off/no",
            default="off",
            help="Check this run. Off: nothing of rngcheck is imported.",
            parse=_flag,
        ),
        Variable(
            name="RNGCHECK_ON_FINDING",
            values=", ".join(ON_FINDING),
            default="raise",
            help="raise: stop at the first finding (rendered on stderr, non-zero exit); warn: "
            "render and go on; record: go on, render the findings at exit.",
            parse=_choice(ON_FINDING),
        ),
        Variable(
            name="RNGCHECK_SYNC",
            values=", ".join(SYNC_MODES),
            default="step",
            help="When ranks compare digests: at every random op, at optimizer steps, or never.",
            parse=_choice(SYNC_MODES),
        ),
        Variable(
            name="RNGCHECK_EXPECT",
            values=", ".join(EXPECTATIONS),
            default="same",
            help="What ranks' generators must be by default: the same, different, or unchecked.",
            parse=_choice(EXPECTATIONS),
        ),
        Variable(
            name="RNGCHECK_EVERY",
            values="a positive integer N",
            default="1",
            help="With sync=step, exchange at every Nth optimizer step only (a long job can keep "
            "the check on cheaply). A divergence is still pinned to its first op.",
            parse=_positive_int,
        ),
        Variable(
            name="RNGCHECK_EVERY_OPS",
            values="a positive integer",
            default="1024",
            help="With sync=step, also exchange after this many random ops (jobs without an "
            "optimizer).",
            parse=_positive_int,
        ),
        Variable(
            name="RNGCHECK_TIMEOUT",
            values="seconds > 0",
            default="the process group's timeout",
            help="How long a rank waits for the others at an exchange (then: rank_missing). By "
            "default the timeout of torch.distributed's own process group, so a rank that is "
            "only slow (saving a checkpoint, evaluating) is never reported missing.",
            parse=_seconds,
        ),
        Variable(
            name="RNGCHECK_REPORT",
            values="a directory, or a path with {rank}",
            default="unset: no file",
            help="Where each rank writes its JSON report (DIR/rank<N>.json): at exit, after a "
            "crash, on SIGTERM, and after each step with a new finding. Read with `rngcheck show`.",
            parse=_path,
        ),
        Variable(
            name="RNGCHECK_TRACE",
            values="a directory, or a path with {rank}",
            default="unset: no trace",
            help="Record every random op of the run (DIR/rank<N>.trace.jsonl) for `rngcheck diff`.",
            parse=_path,
        ),
        Variable(
            name="RNGCHECK_RECOMPUTE",
            values="1/true/on/yes, 0/false/off/no",
            default="on",
            help="Compare each activation-checkpoint recompute with its forward.",
            parse=_flag,
        ),
        Variable(
            name="RNGCHECK_WINDOW",
            values="a positive integer",
            default="4096",
            help="How many recent random-op events each rank keeps in memory.",
            parse=_positive_int,
        ),
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSettings:
    """What the environment asks for, validated."""

    enabled: bool
    mode_kwargs: dict[str, Any]  # keyword arguments for RNGConsistencyMode
    every_steps: int = 1
    rank: int = 0
    world_size: int = 1
    report_template: str | None = None  # as given, before the rank is filled in
    trace_template: str | None = None


def _rank_path(template: str, rank: int, world_size: int, default_name: str) -> str:
    """``{rank}`` filled in; a directory gets ``default_name``; a plain file of a multi-rank run
    gets the rank before its extension, so ranks never overwrite each other's files."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    root, ext = os.path.splitext(template)
    if ext in (".json", ".jsonl") and not os.path.isdir(template):
        return f"{root}.rank{rank}{ext}" if world_size > 1 else template
    return os.path.join(template, default_name.format(rank=rank))


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def settings_from_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Read and validate every ``RNGCHECK*`` variable; an :class:`EnvError` names the bad one."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("RNGCHECK") and k not in VARIABLES)
    values: dict[str, Any] = {}
    for name, var in VARIABLES.items():
        if name in environ:
            values[name] = var.parse(name, environ[name])
    enabled = bool(values.get("RNGCHECK", False))
    if enabled and unknown:
        raise EnvError(
            f"unknown variable {unknown[0]} (a typo?): rngcheck reads " + ", ".join(VARIABLES)
        )
    rank = _env_int(environ, "RANK", 0)
    world_size = _env_int(environ, "WORLD_SIZE", 1)
    report = values.get("RNGCHECK_REPORT")
    trace = values.get("RNGCHECK_TRACE")
    kwargs: dict[str, Any] = {
        "on_finding": values.get("RNGCHECK_ON_FINDING", "raise"),
        "sync": values.get("RNGCHECK_SYNC", "step"),
        "expect": values.get("RNGCHECK_EXPECT", "same"),
        "timeout": values.get("RNGCHECK_TIMEOUT"),
        "every": values.get("RNGCHECK_EVERY_OPS", 1024),
        "window": values.get("RNGCHECK_WINDOW", 4096),
        "check_recompute": values.get("RNGCHECK_RECOMPUTE", True),
        "report_path": _rank_path(report, rank, world_size, "rank{rank}.json") if report else None,
        "trace": _rank_path(trace, rank, world_size, "rank{rank}.trace.jsonl") if trace else None,
    }
    return EnvSettings(
        enabled=enabled,
        mode_kwargs=kwargs,
        every_steps=values.get("RNGCHECK_EVERY", 1),
        rank=rank,
        world_size=world_size,
        report_template=report,
        trace_template=trace,
    )


def _run_id(environ: Mapping[str, str]) -> str:
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
    for i, a in enumerate(argv[1:], start=1):
        if a == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            break
        if a == "-c":
            module = "-c " + (argv[i + 1] if i + 1 < len(argv) else "")
            break
    return os.path.basename(sys.argv[0]) if sys.argv else "", module


def _skip_reason(environ: Mapping[str, str]) -> str:
    """Why this process is not the one to check (empty: check it)."""
    owner = environ.get(_OWNER_VAR)
    if owner and owner != str(os.getpid()):
        return f"a child of the checked process {owner}"
    script, module = _launched_as()
    if module.startswith(_LAUNCHER_MODULES) or script in _LAUNCHER_SCRIPTS:
        return f"a launcher or tool ({module or script})"
    if "multiprocessing" in module or "--multiprocessing-fork" in sys.argv:
        return "a multiprocessing child"
    return ""


class Activation:
    """The environment-started mode and everything around it. One per process."""

    def __init__(self, settings: EnvSettings) -> None:
        from .mode import RNGConsistencyMode

        self.settings = settings
        self.mode = RNGConsistencyMode(**settings.mode_kwargs, every_steps=settings.every_steps)
        report = self.mode.report
        report.rank, report.world_size = settings.rank, settings.world_size
        report.meta.update(
            run_id=_run_id(os.environ),
            argv=list(sys.argv),
            pid=os.getpid(),
            host=socket.gethostname(),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            activated_by="RNGCHECK",
        )
        self.steps = 0
        self.bound = False
        self.exited = False
        self.signal: int | None = None
        self.stopped_by: BaseException | None = None  # the finding's error that ended the run
        self._saved_findings = 0
        self._restore: list[Callable[[], None]] = []
        self._step_hook: Any = None  # re-registered at bind, so it is never in _restore
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
            os.register_at_fork(after_in_child=self._in_forked_child)
            self._install_signal_handler()
            # Kept after the checking ends: the last exchange (at destroy_process_group) can raise
            # a finding's error that reaches the top only later.
            self._previous_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
        except BaseException:
            self._exit(*sys.exc_info(), "rngcheck failed to start")
            raise
        os.environ[_OWNER_VAR] = str(os.getpid())
        if self.settings.world_size <= 1:  # not launched as a rank: say it now (else at bind)
            self._announce()
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
                    self.stop("destroy_process_group()")  # may raise the last finding's error
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
                    self._restore.append(lambda m=module, o=original: setattr(m, o.__name__, o))

    def bind(self) -> None:
        """Start the cross-rank checks once torch.distributed is up (on every rank, together)."""
        import torch.distributed as dist

        if self.exited or not (dist.is_available() and dist.is_initialized()):
            return
        report = self.mode.report
        report.rank, report.world_size = dist.get_rank(), dist.get_world_size()
        report.meta["process_group"] = {
            "backend": str(dist.get_backend()),
            "world_size": report.world_size,
            "bound_after_step": self.steps,
        }
        self.mode.bind_distributed()
        self.bound = True
        self._announce()
        # Run after the rank checker's own step hook (added by bind_distributed), so that a step's
        # new findings are saved at that step.
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook.remove()
        self._step_hook = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.exited:
            return
        self.steps += 1
        if not self.bound:  # a group made through a copy of init_process_group we did not patch
            self.bind()  # (the rank checker then exchanges at this and every later step itself)
        self._save_if_new_findings()

    def _save_if_new_findings(self) -> None:
        path = self.mode.config.report_path
        count = len(self.mode.report.findings)
        if path and count != self._saved_findings:
            self._saved_findings = count
            try:
                self.mode.report.save(path)
            except OSError as e:
                log.warning("rngcheck could not save its report to %s: %s", path, e)

    def _in_forked_child(self) -> None:
        """A forked child (a DataLoader worker) inherits the checker mid-run: switch it off there.

        Left on, the worker's random ops (augmentation) would be exchanged with the other ranks
        from the wrong process and hang the job; its report would never be written anyway (workers
        leave with os._exit). The parent goes on checking its own ops.
        """
        if self.exited:
            return
        self.exited = True
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

        from .mode import _Interceptor

        stack = _get_current_dispatch_mode_stack()
        if stack and isinstance(stack[-1], _Interceptor):
            _pop_mode()

    def _install_signal_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself; atexit still writes the report

        def on_sigterm(signum: int, frame: Any) -> None:
            if self.exited:  # already finishing (or finished): die the default way
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.signal = signum
            path = self.mode.config.report_path
            if path:
                self.mode.report.meta["ended_by"] = signal.Signals(signum).name
                with contextlib.suppress(OSError):
                    self.mode.report.save(path)
            # Unwind like an exit, so finally blocks and atexit (the trace) still run.
            raise SystemExit(128 + signum)

        # Not undone at exit: it must keep saving until the process is gone (see above).
        signal.signal(signal.SIGTERM, on_sigterm)

    # -- end ---------------------------------------------------------------------------------

    def _excepthook(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from .report import RNGCheckError

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
        return self.mode._should_render(finding)

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
        try:
            self.mode.__exit__(exc_type, exc, tb)
        finally:
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            for undo in reversed(self._restore):
                undo()
            self._restore.clear()

    def finish(self) -> None:
        """At interpreter exit: end the mode (unless the script already did), then one line."""
        from .report import RNGCheckError

        exc = getattr(sys, "last_value", None)
        failed = False
        try:
            if exc is not None:
                reason = f"{type(exc).__name__}: {exc}"[:300]
                if isinstance(exc, RNGCheckError):  # its message is the finding, shown anyway
                    reason = f"{type(exc).__name__} at {exc.finding.site}"
                self._exit(type(exc), exc, exc.__traceback__, reason)
            elif self.signal is not None:
                stop = SystemExit(128 + self.signal)
                self._exit(SystemExit, stop, None, signal.Signals(self.signal).name)
            else:
                self._exit(None, None, None, "exit")
        except RNGCheckError:
            failed = True  # rendered by the mode; the exit status must say so
        except Exception as e:  # noqa: BLE001 - report the checker's own failure, keep the exit
            sys.stderr.write(f"rngcheck: could not finish checking: {type(e).__name__}: {e}\n")
        self._print_summary()
        if failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _print_summary(self) -> None:
        report = self.mode.report
        if self.mode.config.on_finding == "record" and report.findings:
            from .render import print_finding

            for f in report.findings:
                if self._renders(f):
                    print_finding(f, console=self.mode.console)
        if report.rank != 0 or self.stopped_by is not None:
            return
        status = "no findings" if report.ok else f"{len(report.findings)} finding(s)"
        where = ""
        if self.settings.report_template:
            where = f"; reports: {self.settings.report_template} (read with `rngcheck show`)"
        if self.settings.trace_template:
            where += f"; trace: {self.settings.trace_template}"
        ranks = f" on rank 0 of {report.world_size}" if report.world_size > 1 else ""
        checked = f"{report.random_ops} random op(s) checked{ranks}"
        sys.stderr.write(f"rngcheck: {checked}, {status}{where}\n")
        sys.stderr.flush()


_ACTIVATION: Activation | None = None
_STARTED = False


def activate(settings: EnvSettings | None = None) -> Activation:
    """Start checking this process the way ``RNGCHECK=1`` does (for launchers of your own)."""
    global _ACTIVATION
    if _ACTIVATION is not None and not _ACTIVATION.exited:
        raise RuntimeError("rngcheck is already active in this process (RNGCHECK=1?)")
    settings = settings or settings_from_env()
    _ACTIVATION = Activation(settings).start()
    return _ACTIVATION


def _startup_hook() -> None:
    """Run by ``rngcheck-autostart.pth`` at interpreter start-up, when RNGCHECK is not off."""
    global _STARTED
    if _STARTED:  # a .pth can be processed twice (a venv over a venv)
        return
    _STARTED = True
    reason = _skip_reason(os.environ)
    if reason:
        log.debug("RNGCHECK is set, but this process is %s: not checking it", reason)
        return
    try:
        settings = settings_from_env()
        if settings.enabled:
            activate(settings)
    except Exception as e:  # noqa: BLE001 - a start-up failure must stop the run, loudly
        # Raising here would only print a warning from site.py and run the script unchecked.
        message = str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"
        sys.stderr.write(f"rngcheck: cannot start: {message}\n")
        sys.stderr.flush()
        os._exit(2)
