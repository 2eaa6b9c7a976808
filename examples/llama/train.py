"""A plain PyTorch loop training a transformers Llama-family model built from a config (nothing is
downloaded), with replay's loop API added (the lines marked `# replay`).

    python train.py --family=llama --max_iters=60            # or --family=qwen2, --family=mistral
    torchrun --nproc-per-node 2 train.py --max_iters=60
    torchrun --nproc-per-node 2 train.py --max_iters=60 --fsdp=True  # sharded with FSDP2 instead of DDP

The model uses grouped-query attention (4 query heads sharing 2 key/value heads). Recorded runs replay
bit for bit through `replay run STORE --from A --to B --verify`; attention overrides (`--attention
"sdpa;1.3=fa2-emu"`) go through transformers' AttentionInterface, head numbers being query heads.
Options are `--name=value` for any setting below; the token file is examples/nanogpt/prepare.py's.
`--record=False` runs it without its replay lines, `--out=FILE` saves each step's loss and the final weights.
"""

import ast
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM

data = "data/train.bin"             # uint16 tokens (bytes here: vocabulary 256)
store = "runs/llama"                # replay
record = True                       # replay (False: the script without its replay lines, a plain loop)
out = ""                            # a file for each step's loss and the final weights (torch.save), to compare runs
family = "llama"                    # llama, qwen2 or mistral
n_layer, n_head, n_kv_head, n_embd, block_size = 2, 4, 2, 32, 32
batch_size, learning_rate, max_iters, checkpoint_every = 4, 3e-3, 60, 20
dtype = "float32"                   # float32 or bfloat16 (autocast)
attn_implementation = "sdpa"        # what the recording runs: eager or sdpa
fsdp = False                        # under torchrun: each decoder layer and the model fully_shard'ed (FSDP2)
device = "cuda" if torch.cuda.is_available() else "cpu"
seed = 1337
for arg in sys.argv[1:]:
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))

ddp = "RANK" in os.environ
if ddp:
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
rank = dist.get_rank() if ddp else 0
if ddp and device == "cuda":
    device = f"cuda:{os.environ['LOCAL_RANK']}"
    torch.cuda.set_device(device)
torch.manual_seed(seed + rank)

config = AutoConfig.for_model(family, vocab_size=256, hidden_size=n_embd, intermediate_size=4 * n_embd,
                              num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                              max_position_embeddings=block_size, attention_dropout=0.0)
model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(device)
if ddp and fsdp:   # before the optimizer: it must hold the sharded parameters
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
if ddp and not fsdp:
    model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])] if device.startswith("cuda") else None)
ctx = nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
if record:                                                                              # replay
    from replay.recorder import Loop  # replay
    loop = Loop(store, model, optimizer, scheduler=scheduler, total_steps=max_iters,    # replay
                checkpoint_every=checkpoint_every, precision=dtype, layout="hf-llama")  # replay
    ctx = loop.autocast(device.split(":")[0])                                           # replay

tokens = np.memmap(data, dtype=np.uint16, mode="r")
step_losses = []
with loop if record else nullcontext():                                             # replay
    for step in loop.steps() if record else range(max_iters):                       # replay
        ix = torch.randint(len(tokens) - block_size, (batch_size,))
        if record:                                                                  # replay
            ix = loop.sample_ids(ix)                                                # replay
        x = torch.stack([torch.from_numpy(tokens[i:i + block_size].astype(np.int64)) for i in ix]).to(device)
        with ctx:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(loss.item())
        if record:                                                                  # replay
            loop.log(loss=loss, grad_norm=norm)                                     # replay
        if rank == 0 and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
if out and not (record and loop.replaying):   # a replay writes no files of the script's
    # FSDP2's parameters are each rank's pieces: whole on every rank
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": step_losses, "model": weights}, out)
if ddp:
    dist.barrier()   # every rank past rank 0's save before the group goes: none tears it down under another
    dist.destroy_process_group()
