"""Local assets for examples/torchtitan/train.py, made here, nothing downloaded: a corpus of 400 short documents
as `DIR/data/train.jsonl` (one {"text": ...} per line, what torchtitan's "c4_test" entry reads) and a byte-level
BPE tokenizer trained on it with `tokenizers` (a transformers dependency) as `DIR/tokenizer/` (tokenizer.json,
and tokenizer_config.json naming its BOS and EOS tokens, which torchtitan's HuggingFaceTokenizer reads).

    python examples/torchtitan/prepare.py --out examples/torchtitan/assets
"""

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = ("a model learns the next token of a sequence from the ones before it and a loss spike is a sudden jump of "
         "its loss during training when the attention of one layer sees tied maxima in low precision").split()

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", type=Path, default=Path(__file__).parent / "assets")
out = parser.parse_args().out
rng = random.Random(0)
documents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + f". Document {i}."
             for i in range(400)]
(out / "data").mkdir(parents=True, exist_ok=True)
(out / "data" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
tokenizer.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=2048, special_tokens=[BOS, EOS],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
(out / "tokenizer").mkdir(exist_ok=True)
tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
(out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
print(f"{len(documents)} documents, a tokenizer of {tokenizer.get_vocab_size()} tokens in {out}")
