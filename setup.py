"""Builds the optional native page-cache helper; all other metadata lives in pyproject.toml.

``native/vismmoe_native.c`` has no Python API: it is compiled as ``vismmoe_edge/_vmnative*.so`` and loaded
with ctypes by ``vismmoe_edge.experts.pagecache``. A missing compiler (or any build error) only prints a warning:
the install succeeds and the pure-Python fallback is used.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # DistutilsPlatformError and friends when no compiler exists
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, LinkError, OSError
            self._warn(exc)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # a ctypes library, not a Python module: there is no PyInit_ symbol to export

    @staticmethod
    def _warn(exc: Exception) -> None:
        print(f"warning: vismmoe native helper not built ({exc}); using the Python fallback", file=sys.stderr)


native = Extension(
    "vismmoe_edge._vmnative",
    sources=["native/vismmoe_native.c"],
    extra_compile_args=["-O2", "-pthread", "-fvisibility=default"],
    extra_link_args=["-pthread"],
    optional=True,
)

ext_modules = [native] if sys.platform.startswith("linux") else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
