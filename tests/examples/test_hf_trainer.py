"""TrainerRecorder misused: the callback fails in one line before anything trains, in this process (the
Trainer stops at its first event). Its runs recorded and replayed: test_hf_trainer_integration.py."""

from __future__ import annotations

import pytest
import torch

from replay.errors import UsageError


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.arange(8) % 16
        return {"input_ids": x, "labels": x}


@pytest.mark.parametrize("change, message", [
    ({"wrap": False}, "pass the training dataset through recorder.dataset"),
    ({"dataloader_num_workers": 1}, "set dataloader_num_workers=0"),
    ({"samples": 10}, "do not split into batches of 4: set dataloader_drop_last=True"),
    ({"samples": 12, "gradient_accumulation_steps": 2}, r"3 batches do not split into steps of 2"),
])
def test_misuse_is_one_error_before_the_store_exists(tmp_path, change, message):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from replay.recorder.hf_trainer import TrainerRecorder

    config = AutoConfig.for_model("llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True,
                             **{k: v for k, v in change.items() if k not in ("wrap", "samples")})
    recorder = TrainerRecorder(str(tmp_path / "run"))
    data = _Tokens(change.get("samples", 16))
    trainer = Trainer(model=AutoModelForCausalLM.from_config(config), args=args,
                      train_dataset=recorder.dataset(data) if change.get("wrap", True) else data, callbacks=[recorder])
    with pytest.raises(UsageError, match=message):
        trainer.train()
    assert not (tmp_path / "run").exists()
