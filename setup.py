"""The compiled modules: CRC-32C of many spans of memory in one call (replay/store/_crc32c.c), and the state
digest's watch over dicts (replay/recorder/_watch.c)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("replay.store._crc32c", ["replay/store/_crc32c.c"], extra_compile_args=["-O3"]),
                   Extension("replay.recorder._watch", ["replay/recorder/_watch.c"], extra_compile_args=["-O3"])])
