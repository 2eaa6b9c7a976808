"""The one compiled module: CRC-32C of many spans of memory in one call (replay/store/_crc32c.c)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("replay.store._crc32c", ["replay/store/_crc32c.c"], extra_compile_args=["-O3"])])
