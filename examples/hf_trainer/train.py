"""A Hugging Face Trainer run of a Llama-family model built from a config (nothing is downloaded), with
replay's Trainer callback added (the lines marked `# replay`).

    python train.py --family=llama --max_steps=60           # or --family=qwen2, --family=mistral
    torchrun --nproc-per-node 2 train.py --max_steps=60
    python train.py --max_steps=60 --resume=True            # continue a recording that was killed
    python train.py --max_steps=60 --callback_form=True     # Trainer(callbacks=[recorder]), trainer.train()

The data is a token file (examples/nanogpt/prepare.py writes one) cut into blocks of `block_size + 1`
tokens: sample i is block i. Options are `--name=value` for any setting below; `--record=False` runs it
without its replay lines (`trainer.train()`), `--out=FILE` saves the logged losses and the final weights.
"""

import ast
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

data = "data/train.bin"             # uint16 tokens (bytes here: vocabulary 256)
store = "runs/hf-trainer"           # replay
output_dir = "runs/hf-trainer-out"  # the Trainer's own
family = "llama"                    # llama, qwen2 or mistral
n_layer, n_head, n_kv_head, n_embd, block_size, dropout = 2, 4, 2, 32, 32, 0.0   # dropout: attention's
batch_size, gradient_accumulation_steps, learning_rate, max_steps, checkpoint_every = 4, 2, 3e-3, 60, 20
bf16, fp16 = False, False
dataloader_num_workers = 0
resume = False                      # replay: continue the recording in `store` from its last checkpoint
callback_form = False               # replay: Trainer(..., callbacks=[recorder]) and trainer.train() instead
record = True                       # replay (False: the script without its replay lines, trainer.train())
out = ""                            # a file for each step's logged loss and the final weights (torch.save)
logging_steps = 20                  # the Trainer's (1: every step's loss in `out`)
save_steps = 0                      # the Trainer's own checkpoints (0: none)
attn_implementation = "sdpa"        # eager or sdpa
seed = 1337
samples = 0                         # train on the first `samples` blocks only (0: all of them)
for arg in sys.argv[1:]:
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_"):
        sys.exit(f"unknown setting --{name}")
    current = globals()[name]
    globals()[name] = value if isinstance(current, str) else type(current)(ast.literal_eval(value))


class Blocks(torch.utils.data.Dataset):
    def __init__(self, path: str):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self):
        blocks = (len(self.tokens) - 1) // block_size
        return min(blocks, samples) if samples else blocks

    def __getitem__(self, i):
        x = torch.from_numpy(self.tokens[i * block_size:(i + 1) * block_size].astype(np.int64))
        return {"input_ids": x, "labels": x.clone()}


args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
                         gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=learning_rate,
                         warmup_steps=10, weight_decay=0.1, max_grad_norm=1.0, bf16=bf16, fp16=fp16, seed=seed,
                         logging_steps=logging_steps, save_strategy="steps" if save_steps else "no",
                         save_steps=save_steps or 500,
                         report_to="none", dataloader_num_workers=dataloader_num_workers,
                         dataloader_persistent_workers=dataloader_num_workers > 0,
                         use_cpu=not torch.cuda.is_available())
torch.manual_seed(seed)
config = AutoConfig.for_model(family, vocab_size=256, hidden_size=n_embd, intermediate_size=4 * n_embd,
                              num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                              max_position_embeddings=block_size, attention_dropout=dropout)
model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
if record:                                                                                          # replay
    from replay.recorder.hf_trainer import TrainerRecorder  # replay
    recorder = TrainerRecorder(store, checkpoint_every=checkpoint_every, layout="hf-llama", resume=resume)  # replay
trainer = Trainer(model=model, args=args, train_dataset=Blocks(data),
                  callbacks=[recorder] if record and callback_form else None)                      # replay
if record and not callback_form:                                                                    # replay
    recorder.train(trainer)                                                         # replay: for trainer.train()
else:
    trainer.train()
if out and trainer.is_world_process_zero() and not (record and recorder.loop.replaying):   # a replay writes none
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save({"losses": losses, "model": trainer.model.state_dict()}, out)
