"""The one compiled part of wtransfer: delta rounds' one-pass gathering (``wtransfer/engines/rounds/_gather.c``).

Optional: where it cannot be built (no C compiler), the install goes on and delta rounds use their numpy path;
everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("wtransfer.engines.rounds._gather", ["wtransfer/engines/rounds/_gather.c"],
                             extra_compile_args=["-O3"], optional=True)])
