"""The one compiled part of wtransfer (``wtransfer/engines/rounds/_kernels.c``): delta rounds' one-pass gathering
and patching, and copies into a worker's model past the caches.

Optional: where it cannot be built (no C compiler), the install goes on and its callers use numpy;
everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("wtransfer.engines.rounds._kernels", ["wtransfer/engines/rounds/_kernels.c"],
                             extra_compile_args=["-O3"], optional=True)])
