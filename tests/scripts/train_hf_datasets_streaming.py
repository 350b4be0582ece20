"""A correct custom training loop, knowing nothing of rngcheck: a streaming dataset of Hugging
Face's ``datasets`` split among the ranks with ``split_dataset_by_node`` (the way its docs give
for distributed training), BERT from a tiny config under DDP, and Hugging Face's
``DataCollatorForLanguageModeling``, which pads each rank's batch to its own longest sequence and
masks it from the default generator. Two epochs.

Writes ``result<RANK>.json`` into the directory given as the first argument: a digest of the
trained parameters.
"""

import json
import os
import sys

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _hf  # noqa: E402 - tests/_hf.py: the tiny-config builders (and the offline switch)
import transformers  # noqa: E402


def masking_collator() -> transformers.DataCollatorForLanguageModeling:
    tokenizer = _hf.bert_tokenizer()
    return transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 13, (32,), generator=g).tolist()
    rows = [{"input_ids": torch.randint(5, _hf.VOCAB, (k,), generator=g).tolist()} for k in lengths]
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=4)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    loader = torch.utils.data.DataLoader(stream, batch_size=4, collate_fn=masking_collator())
    model = DDP(_hf.build("bert", dropout=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        stream.set_epoch(epoch)
        for batch in loader:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump({"parameters": _hf.parameters_digest(model)}, f)
    print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
