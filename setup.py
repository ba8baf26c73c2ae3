"""Only the compiled part of the build; everything else is in pyproject.toml.

`asyncrl.protocol.codec._kernels` (protocol/codec/_kernels.c) speeds up the delta codec's class
passes. It is optional: without a C compiler the build goes on and the codec uses its numpy path,
which writes and reads the same bytes (docs/codec.md "Speed").
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("asyncrl.protocol.codec._kernels", ["protocol/codec/_kernels.c"],
                             extra_compile_args=["-O3"], optional=True)])
