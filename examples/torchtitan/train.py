"""torchtitan's parts in a loop of your own, on CPUs: its llama3 "debugmodel" and its Hugging Face text data loader
(a StatefulDataLoader over a packing IterableDataset, each data-parallel rank its shard), with replay's loop
API added (the lines marked `# replay`). torchtitan's own Trainer needs CUDA; its default attention, flex, cannot
train on a CPU, so each layer's inner attention is swapped for its ScaledDotProductAttention (causal; it does not
mask across the packed documents as flex's block mask does).

    python examples/torchtitan/prepare.py
    HF_DATASETS_OFFLINE=1 torchrun --standalone --nproc-per-node 2 examples/torchtitan/train.py --store=runs/titan

Options are `--name=value` for any of the settings below.
"""

import ast
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

from replay.recorder import Loop  # replay

# -- settings ------------------------------------------------------------------------------------------
assets = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
store = "runs/torchtitan"           # replay: where the run is recorded
checkpoint_every = 4                # replay
resume = False                      # replay: continue the run in `store`
steps, seq_len, batch_size, lr = 16, 64, 2, 8e-4
for arg in sys.argv[1:]:            # --name=value, each checked against the settings above
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
tokenizer = HuggingFaceTokenizer(tokenizer_path=os.path.join(assets, "tokenizer"))
dataloader = HuggingFaceTextDataLoader(   # "c4_test": load_dataset(dataset_path) of local json lines, its "text"
    HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=os.path.join(assets, "data"), infinite=True),
    dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch_size)
config = model_registry("debugmodel").model
for layer in config.layers:
    layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
model = config.build()
model.init_states(buffer_device=torch.device("cpu"))
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

with Loop(store, model, optimizer, total_steps=steps, checkpoint_every=checkpoint_every,  # replay
          n_head=16, resume=resume) as loop:                                                # replay
    batches = loop.loader(dataloader)                                                       # replay
    for step in loop.steps():                                                               # replay
        inputs, labels = next(batches)
        logits = model(inputs["input"], positions=inputs["positions"], attention_masks=None)
        loss = cross_entropy_loss(logits, labels) / labels.numel()   # torchtitan's is summed
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loop.log(loss=loss, grad_norm=norm)                                                 # replay
        if rank == 0 and step % 4 == 0:
            print(f"step {step}: loss {loss.item():.4f}", file=sys.stderr)
dist.destroy_process_group()
