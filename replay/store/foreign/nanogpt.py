"""nanoGPT's `ckpt.pt`: `torch.save({"model": state_dict, "optimizer": ..., "model_args": {n_layer, n_head,
n_embd, block_size, bias, vocab_size}, "iter_num": ..., "best_val_loss": ..., "config": ...})`. The step is
`iter_num`, read from the file. A compiled model's keys carry torch.compile's `_orig_mod.` prefix, dropped
here as nanoGPT's sample.py drops it.

Every file is loaded with `torch.load(weights_only=True)`: nothing but tensors and plain types is
unpickled, and a file that needs more (a class, a function to call) is refused before any of it runs.
A local file is mapped into memory (`mmap=True`), so only the tensors read are read from disk; an object
is read whole.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import TYPE_CHECKING, Any

from replay.errors import StoreError
from replay.store.foreign.base import ForeignCheckpoint, digest, object_tag
from replay.store.location import Location

if TYPE_CHECKING:
    import torch

NAME = "ckpt.pt"
COMPILED = "_orig_mod."


def is_checkpoint(loc: Location) -> bool:
    return loc.name.endswith(".pt") and loc.exists()


def checkpoint_names(children: list[str], loc: Location) -> list[str]:
    """`*.pt` files in the folder, and subfolders holding a ckpt.pt (as the paths to those files)."""
    files = [c for c in children if c.endswith(".pt") and (loc / c).exists()]
    return files + [f"{c}/{NAME}" for c in children if c not in files and (loc / c / NAME).exists()]


def load(loc: Location) -> dict[str, Any]:
    """The file's dict, checked to be nanoGPT's (its model's keys without `_orig_mod.`)."""
    import torch  # lazy: torch (0.7 s), only where a checkpoint is read

    try:
        if loc.local is not None:
            mapped = zipfile.is_zipfile(loc.local)   # torch.save's format since 1.6; only that one maps
            ckpt = torch.load(loc.local, map_location="cpu", weights_only=True, mmap=mapped)
        else:
            data = loc.read()
            if data is None:
                raise StoreError(f"{loc} is missing")
            ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines()
        what = next((ln.strip() for ln in lines if "global" in ln.lower()), lines[0] if lines else "")
        raise StoreError(f"{loc} needs more than tensors and plain types to unpickle ({what}), so it is not "
                         "read: a nanoGPT checkpoint holds nothing else") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        raise StoreError(f"{loc} is truncated or not a torch.save file: "
                         f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) \
            or not isinstance(ckpt.get("model_args"), dict) or not isinstance(ckpt.get("iter_num"), int):
        raise StoreError(f"{loc} is not a nanoGPT checkpoint (a dict with model, model_args and iter_num)")
    ckpt["model"] = {k.removeprefix(COMPILED): v for k, v in ckpt["model"].items()}
    return ckpt


def checkpoint(loc: Location) -> ForeignCheckpoint:
    step = load(loc)["iter_num"]
    if loc.local is None:
        return ForeignCheckpoint(step, loc, digest(object_tag(loc)))
    if zipfile.is_zipfile(loc.local):
        with zipfile.ZipFile(loc.local) as z:   # its members' CRC-32s: the contents, read without reading them
            members = [f"{i.filename}:{i.file_size}:{i.CRC}" for i in z.infolist()]
    else:   # torch.save's format before 1.6
        members = [digest(loc.local.read_bytes())]
    return ForeignCheckpoint(step, loc, digest(str(loc.local.stat().st_size), *members))


def shapes(loc: Location) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in load(loc)["model"].items()}


def read(loc: Location, names: list[str]) -> dict[str, torch.Tensor]:
    model = load(loc)["model"]
    missing = [n for n in names if n not in model]
    if missing:
        raise StoreError(f"{loc} holds no tensor {missing[0]}")
    return {n: model[n].clone() for n in names}
