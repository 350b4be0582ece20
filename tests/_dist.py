"""Start real gloo process groups on 127.0.0.1 for tests, with a hard timeout on everything.

One launch runs several *scenarios* (plain functions in a test module) one after another in the
same process group, so a test file pays the torch import and the rendezvous once::

    results = run_scenarios(__file__, ["clean_training", "extra_draw"], world_size=2)
    results["extra_draw"][1]  # what rank 1's scenario function returned (plain JSON data)

Each scenario is called as ``fn(rank, world_size)`` in every rank and returns JSON-able data; the
parent reads it back from files (never pickle). A scenario that raises returns
``{"error": type name, "message": text, "traceback": text}`` for that rank instead. A scenario
marked ``fn.breaks_group = True`` (it leaves the process group unusable, say by a rank that
stops) ends the launch; put it last. Every worker runs in its own session so a timeout kills the
whole process tree and the test fails instead of hanging CI.

Run ``python tests/_dist.py MODULE_PATH NAMES OUT_DIR`` with RANK/WORLD_SIZE/MASTER_* set to
reproduce one rank by hand.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "DistRun",
    "assert_compared",
    "clean_env",
    "compared",
    "free_port",
    "run_scenarios",
    "scenario_mode",
]

_REPO = Path(__file__).resolve().parent.parent
_COLLECTIVE_TIMEOUT_S = 60  # the training group's own timeout inside workers


def scenario_mode(**kwargs: Any) -> Any:
    """An RNGConsistencyMode for a scenario inside a rank: findings recorded, not raised, drawn
    into a string nobody reads, and every exchange bounded (30 s unless ``timeout`` is given)."""
    import io

    import rich.console

    import rngcheck

    console = rich.console.Console(file=io.StringIO(), width=140, force_terminal=False)
    kwargs.setdefault("timeout", 30.0)
    kwargs.setdefault("on_finding", "record")
    return rngcheck.RNGConsistencyMode(console=console, **kwargs)


def compared(report: Any) -> dict[str, Any] | None:
    """What a mode's rank checker compared across the ranks and what it left uncompared, by
    reason (``report.meta["rank_compared"]``), for a scenario's summary; None where no rank
    checker ran. A quiet test asserts on it: a check that compared nothing is quiet too."""
    found = report.meta.get("rank_compared")
    return dict(found) if found is not None else None


def assert_compared(
    found: dict[str, Any] | None,
    rank: int,
    *,
    not_compared: Mapping[str, int] | None = None,
    **at_least: int,
) -> None:
    """What one rank compared across the ranks (a summary's ``compared``), beside "no findings":
    at least ``at_least[kind]`` rows of each kind named (``by_state=3``: three rows compared by
    state; also by_what_runs, as_calls, among_peers, must_differ, initialisations,
    initialisations_broadcast, initialisations_replaced, replicated_parameters, step_rounds),
    and, where ``not_compared`` is given, the random ops left uncompared for those reasons
    alone, at least so many for each (``{"own_batch": 3, "per_rank_seed": 3}``). A check that
    compared nothing is quiet, and so is one that exempts what it should compare: this tells
    them from a correct run."""
    from rngcheck.ranks.verdict import Reason

    assert found is not None, f"rank {rank}: no rank checker ran"
    for kind, least in at_least.items():
        assert kind != "not_compared" and kind in found, f"rank_compared has no count {kind!r}"
        assert found[kind] >= least, f"rank {rank}: {kind} {found[kind]} < {least}: {found}"
    if not_compared is None:
        return
    reasons = {r.value for r in Reason} | {"among_peers_only"}
    assert set(not_compared) <= reasons, f"no such reason: {set(not_compared) - reasons}"
    exempted = found["not_compared"]
    assert set(exempted) == set(not_compared), f"rank {rank}: not compared {exempted}"
    for reason, least in not_compared.items():
        assert exempted[reason] >= least, f"rank {rank}: {reason} < {least}: {exempted}"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process of a test, without any ``RNGCHECK*`` or
    rank variable of its own (one thread, gloo on loopback, unbuffered output), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# torch 2.14's gloo aborts a rank now and then as the interpreter exits, after its work is done,
# also without rngcheck (RNGCHECK=0): C++ std::terminate from a thread still running at exit.
EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(run: subprocess.CompletedProcess[str], ranks: int) -> bool:
    """Whether a launch of ``ranks`` ranks that each print "training finished" failed only by
    that abort at exit (worth running again, and saying so)."""
    return (
        run.returncode != 0
        and EXIT_ABORT in run.stderr
        and run.stdout.count("training finished") == ranks
    )


EXIT_TRIES = 3  # (twice in a row seen on a loaded machine, RNGCHECK=0: 2 ranks, torch 2.13)


def launch_past_exit_aborts(
    launch: Callable[[], subprocess.CompletedProcess[str]], ranks: int, what: str
) -> subprocess.CompletedProcess[str]:
    """``launch()`` of ``ranks`` ranks, again after torch's abort at exit (``EXIT_ABORT``), at
    most ``EXIT_TRIES`` times in all, saying so on stderr each time."""
    for _ in range(EXIT_TRIES - 1):
        run = launch()
        if not aborted_at_exit(run, ranks):
            return run
        print(f"{what}: a rank aborted at exit after training; run again", file=sys.stderr)
    return launch()


@dataclass
class DistRun:
    """What one launch produced: per-scenario, per-rank results, and each rank's stderr."""

    results: dict[str, dict[int, Any]]
    stderr: dict[int, str]
    wall_s: float

    def __getitem__(self, name: str) -> dict[int, Any]:
        if name not in self.results:
            raise KeyError(
                f"scenario {name!r} left no result; stderr of the ranks:\n"
                + "\n".join(f"--- rank {r}\n{t[-4000:]}" for r, t in sorted(self.stderr.items()))
            )
        return self.results[name]

    def ok(self, name: str) -> dict[int, Any]:
        """The per-rank results of ``name``, failing the test on a rank whose scenario raised."""
        results = self[name]
        for r in results.values():
            assert "error" not in r, r.get("traceback")
        return results


def run_scenarios(
    module_path: str | os.PathLike[str],
    names: Sequence[str],
    *,
    world_size: int,
    out_dir: str | os.PathLike[str],
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> DistRun:
    """Run the named scenarios of ``module_path`` in ``world_size`` gloo ranks; kill on timeout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    errs = []
    start = time.monotonic()
    for rank in range(world_size):
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(_REPO), child_env.get("PYTHONPATH")) if p),
        )
        err = open(out / f"stderr.{rank}.txt", "wb")  # noqa: SIM115 - closed below
        errs.append(err)
        cmd = [sys.executable, __file__, str(module_path), ",".join(names), str(out)]
        procs.append(
            subprocess.Popen(
                cmd, env=child_env, stdout=err, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    timed_out = False
    try:
        for p in procs:
            left = timeout - (time.monotonic() - start)
            try:
                p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for e in errs:
            e.close()
    wall = time.monotonic() - start
    stderr = {r: (out / f"stderr.{r}.txt").read_text(errors="replace") for r in range(world_size)}
    if timed_out:
        done = sorted(f.name for f in out.glob("*.json"))
        raise TimeoutError(
            f"distributed scenarios {list(names)} did not finish within {timeout} s; killed. "
            f"Results written before that: {done}\n"
            + "\n".join(f"--- rank {r}\n{t[-3000:]}" for r, t in sorted(stderr.items()))
        )
    results: dict[str, dict[int, Any]] = {}
    for name in names:
        per_rank = {}
        for rank in range(world_size):
            f = out / f"{name}.{rank}.json"
            if f.exists():
                per_rank[rank] = json.loads(f.read_text())
        if len(per_rank) == world_size:
            results[name] = per_rank
    return DistRun(results=results, stderr=stderr, wall_s=wall)


def _load(module_path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_rngcheck_scenarios", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _worker(module_path: str, names: list[str], out: Path) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    module = _load(module_path)
    try:
        for name in names:
            torch.manual_seed(0)
            fn = getattr(module, name)
            try:
                result = fn(rank, world)
            except Exception as e:  # noqa: BLE001 - reported to the parent as data
                result = {
                    "error": type(e).__name__,
                    "message": str(e),
                    "traceback": traceback.format_exc(),
                }
            (out / f"{name}.{rank}.json").write_text(json.dumps(result, default=str))
            if getattr(fn, "breaks_group", False):
                break  # the scenario left the group unusable (a rank that stopped): end here
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])))
