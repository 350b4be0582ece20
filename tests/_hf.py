"""Hugging Face models built from tiny configs (random initialisation, nothing downloaded), and a
batch for each, for the real-model tests and scripts. Each family is a different code base:
decoder-only (GPT-2, Llama, OPT), encoder (BERT), encoder-decoder (T5), vision (ViT, and DINOv2,
whose only randomness is drop-path, the kind timm's ViTs have)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched: every model is built here
warnings.filterwarnings("ignore", module="transformers")

import transformers  # noqa: E402 - after the offline switch

transformers.logging.set_verbosity_error()

VOCAB = 64


def bert_tokenizer() -> Any:
    """A word-level BERT tokenizer over the tiny vocabulary (its file written here: nothing is
    downloaded)."""
    import tempfile

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    vocab = os.path.join(tempfile.mkdtemp(), "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(words))
    return transformers.BertTokenizerFast(vocab_file=vocab)


def saved_gpt_neox() -> str:
    """A GPT-NeoX from a tiny config (dropout 0.1 on the embeddings, residuals and attention),
    saved by rank 0 of the process group: the directory, on every rank. Hugging Face's tensor
    parallelism loads its plan with ``from_pretrained``."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.1,
            attention_dropout=0.1,
        )  # fmt: skip
        transformers.GPTNeoXForCausalLM(config).save_pretrained(path[0])
    dist.barrier()
    assert path[0] is not None
    return path[0]


def parameters_digest(model: torch.nn.Module) -> str:
    """A digest of a model's parameters, to compare runs (and ranks) bitwise."""
    import hashlib

    digest = hashlib.sha256()
    for p in model.parameters():  # (a DTensor's whole tensor: tensor parallelism, FSDP2)
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(whole.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _gpt2(p: float) -> Any:
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
    )  # fmt: skip


def _llama(p: float) -> Any:
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=p,
    )  # fmt: skip


def _bert(p: float) -> Any:
    return transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    )  # fmt: skip


def _t5(p: float) -> Any:
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=p, decoder_start_token_id=0,
    )  # fmt: skip


def _vit(p: float) -> Any:
    return transformers.ViTForImageClassification, transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=p,
        attention_probs_dropout_prob=p, num_labels=3,
    )  # fmt: skip


def _opt(p: float) -> Any:
    return transformers.OPTForCausalLM, transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32,
        dropout=p, attention_dropout=p,
    )  # fmt: skip


def _dinov2(p: float) -> Any:
    return transformers.Dinov2ForImageClassification, transformers.Dinov2Config(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        mlp_ratio=2, drop_path_rate=2 * p, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip


FAMILIES: dict[str, Callable[[float], Any]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
    "t5": _t5,
    "vit": _vit,
    "opt": _opt,
    "dinov2": _dinov2,
}


def build(family: str, *, dropout: float = 0.1, attn: str = "sdpa") -> torch.nn.Module:
    """A freshly initialised model of ``family`` (seed it before calling)."""
    cls, config = FAMILIES[family](dropout)
    model = cls._from_config(config, attn_implementation=attn)
    model.train()
    return model


def batch(family: str, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A small training batch with labels, drawn from ``generator`` (a fixed one by default)."""
    g = generator if generator is not None else torch.Generator().manual_seed(1)
    if family in ("vit", "dinov2"):
        return {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (2,), generator=g),
        }
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def train(model: torch.nn.Module, family: str, steps: int = 2, **batch_kwargs: Any) -> None:
    """A few SGD steps on the same batch (the model's own loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(**batch(family, **batch_kwargs)).loss.backward()
        opt.step()
        opt.zero_grad()
