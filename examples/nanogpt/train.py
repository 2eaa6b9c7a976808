"""A nanoGPT-style training script, with replay's loop API added (the lines marked `# replay`).

One process:          python train.py --max_iters=200
Two ranks (DDP):      torchrun --nproc-per-node 2 train.py --max_iters=200
Options are `--name=value` for any of the settings below; `--dtype=bfloat16` trains under BF16 autocast.
`--record=False` runs it without its replay lines, `--out=FILE` saves each step's loss and the final weights:
the same run recorded and not, compared (docs/your-loop.md, "What changes when a run is recorded").
Run as it is, the script records into --store; `replay run STORE --from A --to B` starts it again in
replay mode (see README.md).
"""

import ast
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -- settings ------------------------------------------------------------------------------------------
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
store = "runs/nanogpt"              # replay: where the run is recorded
checkpoint_every = 50               # replay
resume = False                      # replay: continue the run in `store`
record = True                       # replay (False: the script without its replay lines, a plain loop)
out = ""                            # a file for each step's loss and the final weights (torch.save), to compare runs
n_layer, n_head, n_embd, block_size, dropout, bias = 2, 2, 32, 32, 0.0, True
batch_size = 4                      # per rank and micro-batch
gradient_accumulation_steps = 2     # per rank
learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 10, 200
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
max_iters, log_interval, eval_interval, eval_iters = 200, 20, 100, 4
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "float32"                   # float32, bfloat16 or float16
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
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for y in self.c_attn(x).split(n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd, bias=bias), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(n_embd, bias=bias), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList(Block() for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd, bias=bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight   # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# -- distributed set-up, data --------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl" if device == "cuda" else "gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
else:
    rank = 0
torch.manual_seed(seed + rank)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    if split == "train" and record:     # replay
        ix = loop.sample_ids(ix)    # replay: the step's sample ids (in a replay, the recorded ones)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


model = GPT(vocab_size=256).to(device)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(beta1, beta2))
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=ptdtype)
if record:                                                                              # replay
    from replay.recorder import Loop  # replay
    loop = Loop(store, model, optimizer, scaler=scaler, total_steps=max_iters,          # replay
                checkpoint_every=checkpoint_every, precision=dtype, layout="nanogpt",  # replay
                resume=resume)                                                          # replay
    ctx = loop.autocast(device_type)                                                    # replay


@torch.no_grad()
def estimate_loss():   # evaluation draws (eval mode, no_grad): the loop neither records nor replaces them
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            with ctx:
                losses[k] = model(x, y).item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- training ------------------------------------------------------------------------------------------
x, y = get_batch("train")            # the first batch, fetched ahead of the first step (as nanoGPT does)
t0 = time.time()
step_losses = []
with loop if record else nullcontext():                            # replay
    for iter_num in loop.steps() if record else range(max_iters):  # replay (was: while True, counting iter_num)
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % eval_interval == 0 and rank == 0:   # rank 0 only: its draws are not training
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", file=sys.stderr)
        total = 0.0
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with ctx:
                loss = model(x, y) / gradient_accumulation_steps
            x, y = get_batch("train")   # the next micro-batch, fetched while this one trains (a prefetch)
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip else math.inf)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(total)
        if record:                                  # replay
            loop.log(loss=total, grad_norm=norm)    # replay
        if iter_num % log_interval == 0 and rank == 0:
            print(f"iter {iter_num}: loss {total:.4f}, {(time.time() - t0) * 1000:.0f} ms", file=sys.stderr)
            t0 = time.time()
if out and rank == 0 and not (record and loop.replaying):   # a replay writes no files of the script's
    torch.save({"losses": step_losses, "model": model.state_dict()}, out)
if ddp:
    destroy_process_group()
