"""A timm Vision Transformer from a tiny config (4 blocks, width 64, 2 heads, 32x32 images in 8x8
patches; stochastic depth, drop_path_rate 0.1, and dropout 0.1 on the embeddings, projections,
attention and head; timm's gradient checkpointing on): plain training, the no-op dispatch mode,
rngcheck at the op level and at the step level, interleaved in one run. Needs timm, and says in one
line why it was skipped otherwise.

No lane installs timm (requirements-models.txt leaves it out): importing timm imports torchvision,
and the one torchvision for torch 2.13.0 that pip reaches is PyPI's CUDA build (0.28.0+cu130; it
pins torch==2.13.0, which the main lane's 2.13.0+cpu satisfies, so pip takes it and keeps torch),
whose ops need libtorch_cuda: beside the CPU build, `import torchvision` fails ("operator
torchvision::nms does not exist"), and with it timm and transformers' GPT-2 (transformers imports
torchvision whenever it is installed). Without torchvision timm does not import at all. It runs
beside a torch build that has a torchvision of its own (a CUDA build from PyPI, on the CPU too).

.venv/bin/python -m benchmarks.vit            # a minute or two
.venv/bin/python -m benchmarks.vit --quick    # seconds
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from .common import NO_FOCUS, Focus, cli, model_section

__all__ = ["VIT_MODES", "make_vit_step", "section", "timm_missing"]

VIT_MODES = ("plain", "noop", "rngcheck", "rngcheck-dispatch", "rngcheck-step")
WHAT = "timm ViT (tiny config)"  # what the budget rows name


def timm_missing() -> str | None:
    """Why timm cannot build the model here, or None when it can. timm imports torchvision as it
    is imported, and a torchvision built for another torch fails with a RuntimeError, not an
    ImportError: that is said too, not raised."""
    try:
        import timm  # noqa: F401
    except ImportError as e:
        if e.name == "timm":
            return "timm is not installed"
        return f"timm does not import ({type(e).__name__}: {e})"  # (no torchvision, say)
    except Exception as e:  # (torchvision's "operator torchvision::nms does not exist")
        return f"timm does not import ({type(e).__name__}: {e})"
    return None


def make_vit_step(
    depth: int = 4,
    width: int = 64,
    batch: int = 32,
    *,
    heads: int = 2,
    image: int = 32,
    patch: int = 8,
    classes: int = 10,
    p: float = 0.1,
    drop_path: float = 0.1,
) -> tuple[Any, Callable[[], None]] | None:
    """The model and one training step (forward, backward, SGD step), or None when timm does not
    import (:func:`timm_missing` says why). Every block runs under timm's gradient checkpointing
    (non-reentrant ``torch.utils.checkpoint``), so each step draws each block's dropout masks and
    stochastic-depth masks in the forward and again in the recompute: 46 draws a step with the
    defaults (CPU attention's dropout included), 22 of them compared with their recompute."""
    if timm_missing() is not None:
        return None
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=image,
        patch_size=patch,
        num_classes=classes,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        drop_rate=p,
        pos_drop_rate=p,
        proj_drop_rate=p,
        attn_drop_rate=p,
        drop_path_rate=drop_path,
    )
    model.set_grad_checkpointing(True)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image, image, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    loss = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()

    return model, step


def section(quick: bool, focus: Focus = NO_FOCUS) -> tuple[str, dict[str, Any]]:
    from .overhead import model_budgets

    return model_section(
        quick,
        focus,
        name="timm ViT, tiny config",
        column="ViT",
        modes=VIT_MODES,
        make=make_vit_step,
        budgets=functools.partial(model_budgets, WHAT),
        missing=timm_missing,
    )


if __name__ == "__main__":
    sys.exit(cli(__doc__ or "", section))
