import ctypes

import numpy as np

paths: tuple[str, ...]
best: str

def value(data: bytes | bytearray | memoryview | np.ndarray | ctypes.Array[ctypes.c_char],
          path: str | None = None) -> int: ...
def spans(spans: np.ndarray, out: np.ndarray, path: str | None = None) -> None: ...
