"""A GPT trained from a stream: an `IterableDataset` that reads a token file shard by shard, each rank and
each DataLoader worker process its own shards, in an order shuffled for every pass, through torchdata's
`StatefulDataLoader` (or, with `--stateful=False`, a plain `DataLoader`), with replay's loop API added (the
lines marked `# replay`). There are no dataset indices here: replay records each sample by its place in the
stream and a digest of its tokens.

One process:          python train.py
Two ranks (DDP):      torchrun --standalone --nproc-per-node 2 train.py
Options are `--name=value` for any of the settings below. The token file is the one
examples/nanogpt/prepare.py writes. Run as it is, the script records into --store;
`replay run STORE --from A --to B` starts it again in replay mode (see README.md). `--record=False` runs it
without its replay lines, `--out=FILE` saves each step's loss and the final weights.
"""

import ast
import math
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

# -- settings ------------------------------------------------------------------------------------------
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nanogpt", "data")
store = "runs/streaming"            # replay: where the run is recorded
checkpoint_every = 10               # replay
resume = False                      # replay: continue the run in `store`
record = True                       # replay (False: the script without its replay lines, a plain loop)
out = ""                            # a file for each step's loss and the final weights (torch.save), to compare runs
stateful = True                     # torchdata's StatefulDataLoader (False: torch's DataLoader)
n_layer, n_head, n_embd, block_size, dropout = 2, 2, 32, 32, 0.0
n_shards = 16                       # the token file's windows in this many contiguous shards
n_windows = 600                     # windows of train.bin in the stream (0: all): 40 steps see a pass end
batch_size = 4                      # per rank and micro-batch
gradient_accumulation_steps = 2     # per rank
num_workers = 2                     # DataLoader worker processes per rank
learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 10, 60
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
max_iters, log_interval = 40, 10
seed = 1337
for arg in sys.argv[1:]:            # --name=value, each checked against the settings above
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))


# -- the model -----------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for y in self.c_attn(x).split(n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# -- the data: a stream of windows of block_size + 1 tokens, its shards split over the ranks and workers
class TokenStream(IterableDataset):
    """Window i is tokens i*block_size .. (i+1)*block_size (+1 for the targets). The windows are cut into
    `n_shards` contiguous shards; (rank, worker) number k of K reads shards k, k + K, ..., in an order and
    with windows shuffled by (seed, epoch, k). Stateful, as torchdata asks: a worker's state is how many
    windows it yielded in the pass."""

    def __init__(self, path, rank, world, limit=0):
        self.path, self.rank, self.world = path, rank, world
        n = (len(np.memmap(path, dtype=np.uint16, mode="r")) - 1) // block_size
        self.n = min(n, limit) if limit else n
        self.epoch, self.yielded, self.resume_at = 0, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state):
        self.epoch, self.resume_at = state["epoch"], state["yielded"]

    def _windows(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        k, readers = self.rank * workers + worker, self.world * workers
        g = np.random.default_rng([seed, self.epoch, k])
        edges = np.linspace(0, self.n, n_shards + 1).astype(int)
        shards = [s for s in range(n_shards) if s % readers == k]
        return [w for s in g.permutation(shards) for w in g.permutation(np.arange(edges[s], edges[s + 1]))]

    def __iter__(self):
        tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        windows = self._windows()
        self.yielded, self.resume_at = self.resume_at, 0
        for w in windows[self.yielded:]:
            self.yielded += 1
            chunk = torch.from_numpy(tokens[w * block_size:(w + 1) * block_size + 1].astype(np.int64))
            yield chunk[:-1], chunk[1:]


# -- distributed set-up --------------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
torch.manual_seed(seed + rank)

stream = TokenStream(os.path.join(data_dir, "train.bin"), rank, world, n_windows)
if stateful:
    from torchdata.stateful_dataloader import StatefulDataLoader
    train_loader = StatefulDataLoader(stream, batch_size=batch_size, num_workers=num_workers)
else:
    train_loader = DataLoader(stream, batch_size=batch_size, num_workers=num_workers)

model: nn.Module = GPT(vocab_size=256)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(beta1, beta2))
if ddp:
    model = DDP(model)
layout = {"qkv": "h.{layer}.attn.c_attn.weight", "o": "h.{layer}.attn.c_proj.weight",  # replay: the weights
          "fc": "h.{layer}.mlp.c_fc.weight", "proj": "h.{layer}.mlp.c_proj.weight",   # replay: `replay analyze`
          "orientation": "out_in"}                                                    # replay: reads


def forever(loader):   # the batches, pass after pass
    epoch = 0
    while True:
        stream.set_epoch(epoch)
        yield from loader
        epoch += 1


if record:                                                                                           # replay
    from replay.recorder import Loop  # replay
    loop = Loop(store, model, optimizer, total_steps=max_iters, checkpoint_every=checkpoint_every,  # replay
                layout=layout, resume=resume)                                                        # replay
batches = loop.loader(train_loader) if record else forever(train_loader)  # replay (it starts each pass itself)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- training ------------------------------------------------------------------------------------------
step_losses = []
with loop if record else nullcontext():                            # replay
    for iter_num in loop.steps() if record else range(max_iters):  # replay
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        total = 0.0
        for micro_step in range(gradient_accumulation_steps):
            x, y = next(batches)
            if isinstance(model, DDP):
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            loss = model(x, y) / gradient_accumulation_steps
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(total)
        if record:                                  # replay
            loop.log(loss=total, grad_norm=norm)    # replay
        if iter_num % log_interval == 0 and rank == 0:
            print(f"iter {iter_num}: loss {total:.4f}", file=sys.stderr)
if out and rank == 0 and not (record and loop.replaying):   # a replay writes no files of the script's
    torch.save({"losses": step_losses, "model": model.state_dict()}, out)
if ddp:
    destroy_process_group()
