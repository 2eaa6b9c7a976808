"""Write train.bin and val.bin: byte-level tokens (uint16, as nanoGPT's prepare scripts write them) of the
Python standard library's own source files, so the example needs no download."""

import argparse
import sysconfig
from pathlib import Path

import numpy as np

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out", default=str(Path(__file__).parent / "data"), help="directory for the .bin files")
parser.add_argument("--bytes", type=int, default=1 << 20, help="tokens in all")
args = parser.parse_args()

text = bytearray()
for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
    text += path.read_bytes()
    if len(text) >= args.bytes:
        break
tokens = np.frombuffer(bytes(text[: args.bytes]), dtype=np.uint8).astype(np.uint16)
split = int(0.9 * len(tokens))
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
tokens[:split].tofile(out / "train.bin")
tokens[split:].tofile(out / "val.bin")
print(f"{split} training and {len(tokens) - split} validation tokens in {out}")
