"""A causal language model trained with Hugging Face Accelerate, in the shape of transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py, with replay's loop API added (the lines marked
`# replay`).

One process:          python train.py
Two ranks:            torchrun --standalone --nproc-per-node 2 train.py

A Llama built from a config (no download), token blocks of the file examples/nanogpt/prepare.py writes
(run_clm's `group_texts`, without `datasets`), `accelerator.prepare` of the model, the optimizer, the
DataLoader and the scheduler, `accelerator.accumulate` and `accelerator.backward` as written. Options are
`--name=value` for any of the settings below. Run as it is, the script records into --store; `replay run
STORE --from A --to B` starts it again in replay mode (see README.md). `--record=False` runs it without its
replay lines, `--out=FILE` saves each step's loss and the final weights: the same run recorded and not,
compared (docs/your-loop.md, "What changes when a run is recorded").
"""

import ast
import itertools
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator, get_scheduler

# -- settings ------------------------------------------------------------------------------------------
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nanogpt", "data")
store = "runs/accelerate"            # replay: where the run is recorded
checkpoint_every = 4                 # replay
resume = False                       # replay: continue the run in `store`
record = True                        # replay (False: the script without its replay lines, a plain loop)
out = ""                             # a file for each step's loss and the final weights (torch.save), to compare runs
n_blocks, block_size = 64, 32        # the data set: the first n_blocks blocks of train.bin
per_device_train_batch_size = 4
gradient_accumulation_steps = 2
learning_rate, weight_decay, num_warmup_steps = 3e-3, 0.0, 2
max_train_steps = 12                 # optimizer steps
mixed_precision = ""                 # accelerate's: "no", "bf16" (autocast) or "fp16" (GPU); "": `accelerate launch`'s
use_seedable_sampler = False         # accelerate's DataLoaderConfiguration: default, a synchronised generator
dispatch_batches = False             # ... True: rank 0 fetches the batches of all ranks and sends each its slice
streaming = False                    # run_clm's --streaming: the blocks as a stream (accelerate dispatches its batches)
seed = 1337
for arg in sys.argv[1:]:             # --name=value, each checked against the settings above
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))


class Blocks(Dataset):
    """run_clm's grouped texts: fixed blocks of tokens, the labels the inputs (the model shifts them)."""

    def __init__(self, path: str):
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.blocks = torch.from_numpy(tokens[:n_blocks * block_size].astype(np.int64)).view(n_blocks, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class StreamedBlocks(IterableDataset):
    """The blocks as a stream (what `datasets` gives run_clm with --streaming), shuffled each epoch by its seed."""

    def __init__(self, path: str):
        self.blocks, self.epoch = Blocks(path), 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.blocks), generator=torch.Generator().manual_seed(seed + self.epoch))
        return (self.blocks[i] for i in order.tolist())


accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps,
                          mixed_precision=mixed_precision or None, cpu=not torch.cuda.is_available(),
                          dataloader_config=DataLoaderConfiguration(use_seedable_sampler=use_seedable_sampler,
                                                                    dispatch_batches=dispatch_batches or None))
set_seed(seed)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=block_size,
                     attn_implementation="sdpa")
model = LlamaForCausalLM(config)
train_path = os.path.join(data_dir, "train.bin")
train_dataloader = DataLoader(StreamedBlocks(train_path) if streaming else Blocks(train_path), shuffle=not streaming,
                              collate_fn=default_data_collator, batch_size=per_device_train_batch_size)
no_decay = ["bias", "layer_norm.weight", "norm.weight"]
groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
           "weight_decay": weight_decay},
          {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=learning_rate)
lr_scheduler = get_scheduler("linear", optimizer=optimizer,   # run_clm's: its prepared scheduler steps once a rank
                             num_warmup_steps=num_warmup_steps * accelerator.num_processes,
                             num_training_steps=max_train_steps * accelerator.num_processes)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)

if record:  # replay
    from replay.recorder import Loop  # replay
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(accelerator.mixed_precision, "fp32")  # replay: the Loop's
    loop = Loop(store, model, optimizer, scheduler=lr_scheduler, total_steps=max_train_steps,  # replay
                precision=precision, checkpoint_every=checkpoint_every, layout="hf-llama", resume=resume)  # replay
# accelerate's prepared loader, epoch after epoch (each pass of it is an epoch: it sets the sampler's epoch itself)
plain = (batch for _ in itertools.count() for batch in train_dataloader)
batches = loop.loader(train_dataloader) if record else plain  # replay

step_losses = []
model.train()
with loop if record else nullcontext():  # replay
    for step in loop.steps() if record else range(max_train_steps):  # replay
        for _ in range(gradient_accumulation_steps):
            batch = next(batches)
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        step_losses.append(loss.item())
        if record:  # replay
            loop.log(loss=loss)  # replay
        accelerator.print(f"step {step}: loss {loss.item():.6f}")
if out and accelerator.is_main_process and not (record and loop.replaying):   # a replay writes no files of its own
    torch.save({"losses": step_losses, "model": accelerator.unwrap_model(model).state_dict()}, out)
