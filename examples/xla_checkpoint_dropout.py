"""The torch_xla report that started rngcheck (pytorch/xla PR 4690), checked by rngcheck.

A Linear + Dropout module under torch_xla's ``checkpoint_module`` runs its forward twice: once in
the forward pass and again in backward (the recompute). Both dropout outputs are captured with
``xm.add_step_closure``, as in the report. Before the fix, torch_xla's checkpoint restored the CPU
RNG but not the XLA seed, so the recompute drew a different dropout mask and the gradients were
silently those of another mask.

    PJRT_DEVICE=CPU python examples/xla_checkpoint_dropout.py            # pre-fix: a finding
    PJRT_DEVICE=CPU python examples/xla_checkpoint_dropout.py --fixed    # torch_xla as it is: quiet

The pre-fix behaviour is reproduced on today's torch_xla by making its checkpoint skip the one
call the PR added, ``xm.set_rng_state(ctx.fwd_xla_state)`` (see ``xla_seed_not_restored``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.utils.checkpoint as xla_checkpoint  # noqa: E402
from torch_xla.distributed.fsdp import checkpoint_module  # noqa: E402

import rngcheck  # noqa: E402

to_save: list[torch.Tensor] = []


def save_output(output: torch.Tensor) -> None:
    to_save.append(output.detach().cpu())


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = torch.nn.Linear(128, 128)
        self.dropout = torch.nn.Dropout(p=0.1)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.x(inp)
        output = self.dropout(x)  # the line a finding points at
        xm.add_step_closure(save_output, args=(output,), run_async=False)
        return output


class _XlaModelWithoutSeedRestore:
    """``xm`` as torch_xla's checkpoint sees it, minus the XLA seed restore (pre-PR 4690)."""

    def __getattr__(self, name: str) -> object:
        return getattr(xm, name)

    @staticmethod
    def set_rng_state(seed: int, device: object = None) -> None:
        del seed, device  # the restore the fix added is skipped: the recompute continues the seed


@contextlib.contextmanager
def xla_seed_not_restored() -> Iterator[None]:
    """torch_xla's checkpoint as before pytorch/xla PR 4690, for as long as this is active."""
    original = xla_checkpoint.xm
    xla_checkpoint.xm = _XlaModelWithoutSeedRestore()  # type: ignore[assignment]
    try:
        yield
    finally:
        xla_checkpoint.xm = original


def run(*, fixed: bool, console: object = None) -> tuple[rngcheck.Report, bool]:
    """One training step of the report's script under rngcheck: its report, and whether the two
    captured dropout outputs are the same (the report's own check)."""
    to_save.clear()
    device = torch_xla.device()
    xm.set_rng_state(0, device)
    model = checkpoint_module(Model().to(device))
    inp = torch.randn(128, 128, requires_grad=True).to(device)

    bug = contextlib.nullcontext() if fixed else xla_seed_not_restored()
    with bug, rngcheck.RNGConsistencyMode(on_finding="record", console=console) as mode:
        output = model(inp)
        torch.sum(output).backward()
        xm.mark_step()  # runs the graph, then the step closures that captured both outputs
    return mode.report, torch.allclose(to_save[0], to_save[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="use torch_xla's checkpoint as it is (restores the XLA seed); default: pre-fix",
    )
    args = parser.parse_args(argv)
    report, same_output = run(fixed=args.fixed)
    rngcheck.print_report(report)
    print(f"xla 1 same_output {same_output}")  # the report's own line
    return 0 if report.ok == same_output else 1  # rngcheck agrees with the masks


if __name__ == "__main__":
    sys.exit(main())
