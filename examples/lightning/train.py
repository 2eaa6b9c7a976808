"""A causal language model trained by Lightning's `Trainer`, with replay's `LightningRecorder` added (the
lines marked `# replay`).

One process:          python train.py
Two ranks (DDP):      torchrun --standalone --nproc-per-node 2 train.py

A `LightningModule` around a Llama built from a config (no download), token blocks of the file
examples/nanogpt/prepare.py writes, a shuffled `DataLoader` (Lightning puts its `DistributedSampler` in
under DDP), AdamW with a warmup schedule stepped every optimizer step, gradient accumulation, clipping and a
validation DataLoader run at every epoch's end, as Lightning's `Trainer` runs them. Options are `--name=value`
for any of the settings below. Run as it is, the script records into --store; `replay run STORE --from A
--to B` starts it again in replay mode (see README.md). `--record=False` runs it without the recorder,
`--out=FILE` saves each step's loss and the final weights: the same run recorded and not, compared.
"""

import ast
import os
import sys

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

# -- settings ------------------------------------------------------------------------------------------
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nanogpt", "data")
store = "runs/lightning"             # replay: where the run is recorded
checkpoint_every = 4                 # replay
resume = False                       # replay: continue the run in `store`
record = True                        # replay (False: the Trainer without the recorder)
out = ""                             # a file for each step's loss and the final weights (torch.save), to compare runs
n_blocks, block_size = 64, 32        # the data set: the first n_blocks blocks of train.bin
batch_size = 4
accumulate_grad_batches = 2
num_workers = 0
learning_rate, warmup = 3e-3, 2
max_steps = 12                       # optimizer steps
precision = "32-true"                # Lightning's: "32-true" or "bf16-mixed"
seed = 1337
for arg in sys.argv[1:]:             # --name=value, each checked against the settings above
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))


class Blocks(Dataset):
    """Fixed blocks of tokens from `first` on, the labels the inputs (the model shifts them)."""

    def __init__(self, path: str, count: int, first: int = 0):
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        span = tokens[first * block_size:(first + count) * block_size].astype(np.int64)
        self.blocks = torch.from_numpy(span).view(count, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class CausalLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=block_size,
                             attn_implementation="sdpa")
        self.model = LlamaForCausalLM(config)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=learning_rate, weight_decay=0.01)
        warmed = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmed, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Blocks(os.path.join(data_dir, "train.bin"), n_blocks), batch_size=batch_size,
                          shuffle=True, num_workers=num_workers)

    def val_dataloader(self):
        return DataLoader(Blocks(os.path.join(data_dir, "val.bin"), 8), batch_size=batch_size)


L.seed_everything(seed, verbose=False)
ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))   # torchrun's; Lightning then launches no process itself
callbacks = []
if record:  # replay
    from replay.recorder.lightning import LightningRecorder  # replay
    callbacks.append(LightningRecorder(store, checkpoint_every=checkpoint_every, layout="hf-llama",  # replay
                                       resume=resume))  # replay
trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=ranks, strategy="ddp" if ranks > 1 else "auto",
                    precision=precision, accumulate_grad_batches=accumulate_grad_batches, gradient_clip_val=1.0,
                    limit_val_batches=2, num_sanity_val_steps=1, callbacks=callbacks, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
module = CausalLM()
trainer.fit(module)
if out and trainer.is_global_zero and not (record and callbacks[0].loop.replaying):   # a replay writes no files
    torch.save({"losses": module.losses, "model": module.model.state_dict()}, out)
