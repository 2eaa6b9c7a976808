"""The torch dtype of each precision a backend can compute in (named in kernels/options.py)."""

import torch

from replay.kernels.options import COMPUTE_DTYPES

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == COMPUTE_DTYPES
