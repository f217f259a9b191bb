"""The compiled CPU draw of the DP noise (``_boxmuller.c``): compiled on first use with the system's C
compiler into a per-user cache, one library per source text, and loaded with ctypes.

Compiled on first use rather than at install, so that every checkout of the project (``dpml reproduce``
rebuilds a release in a worktree of its commit) draws with the kernel of its own source, and so that
the package needs no build step. The cache file is named by a hash of the source, the flags, the
compiler and the machine, so a changed source compiles anew; it is written under a temporary name and
renamed into place, so concurrent first uses never load half a file. Where no compiler is found, the
compile fails or the library does not load (no glibc vector math), :func:`compiled_draw` returns None
and :mod:`dpml.train.noise` draws the same construction in NumPy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).with_name("_boxmuller.c")
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
"""-fno-math-errno lets log / sin / cos go to glibc's vector variants (the source declares them SIMD) and
sqrt to one instruction; no -ffast-math: the float32 operations keep their order and rounding."""

CompiledDraw = Callable[[int, int, float, int], None]
"""``dpml_box_muller_f32(states, q, std, out)``: addresses of the (STREAMS, 4) uint64 SFC64 states and of the
float32 output (2·STREAMS·q numbers) as integers; see ``_boxmuller.c``."""


def cache_directory() -> Path:
    """``$XDG_CACHE_HOME/dpml``, else ``~/.cache/dpml``, else (no home directory) a per-user one in the temp directory."""
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "dpml"
    try:
        return Path.home() / ".cache" / "dpml"
    except (RuntimeError, KeyError):
        return Path(tempfile.gettempdir()) / f"dpml-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def c_compiler() -> list[str] | None:
    """``$CC`` (a command, possibly with options), else ``cc`` or ``gcc`` on the PATH, else None."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return None if found is None else [found]


def compile_kernel(directory: Path) -> Path | None:
    """The shared library of ``_boxmuller.c`` in ``directory``, compiled unless already there; None where there
    is no C compiler or it fails."""
    compiler = c_compiler()
    if compiler is None:
        return None
    try:
        source = SOURCE.read_bytes()  # absent from an installation that left out the C file
        key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), " ".join(compiler).encode(),
                                         platform.machine().encode()])).hexdigest()[:16]
        target = directory / f"_boxmuller-{key}.so"
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}.part"
        done = subprocess.run([*compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError):
        return None
    return target


def load_kernel(library: Path) -> CompiledDraw | None:
    """``dpml_box_muller_f32`` from a compiled library, or None if it does not load here."""
    try:
        function = ctypes.CDLL(str(library)).dpml_box_muller_f32
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double, ctypes.c_void_p]
    function.restype = None
    return function  # type: ignore[no-any-return]


@functools.cache
def compiled_draw() -> CompiledDraw | None:
    """The compiled draw of this source (compiled into :func:`cache_directory` on first use), or None."""
    library = compile_kernel(cache_directory())
    return None if library is None else load_kernel(library)
