"""dpml's compiled CPU kernels, compiled on first use with the system's C compiler into a per-user cache, one
library per source text, and loaded with ctypes: the DP noise draw (``_boxmuller.c``, :func:`compiled_draw`, and its
streams' seeding, :func:`compiled_stream_states`), a
convolution's per-example gradient norms (``_conv_norms.c``, :func:`compiled_conv_norms`) and an LSTM's and a
GRU's scan steps (``_scan_steps.c``, :func:`compiled_scan_steps`).

Compiled on first use rather than at install, so that every checkout of the project (``dpml reproduce``
rebuilds a release in a worktree of its commit) draws with the kernel of its own source, and so that
the package needs no build step. The cache file is named by a hash of the source, the flags, the
compiler and the machine, so a changed source compiles anew; it is written under a temporary name and
renamed into place, so concurrent first uses never load half a file. Where no compiler is found, the
compile fails or the library does not load (no glibc vector math), :func:`compiled_draw` returns None
and :mod:`dpml.train.noise` draws the same construction in NumPy; likewise :func:`compiled_conv_norms`,
and :mod:`dpml.train.clipping_layers` takes its torch routes, and the scan its torch operations.
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
from typing import cast
from pathlib import Path

SOURCE = Path(__file__).with_name("_boxmuller.c")
CONV_SOURCE = Path(__file__).with_name("_conv_norms.c")
SCAN_SOURCE = Path(__file__).with_name("_scan_steps.c")
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
"""-fno-math-errno lets log / sin / cos go to glibc's vector variants (the source declares them SIMD) and
sqrt to one instruction; no -ffast-math: the float32 operations keep their order and rounding. -fopenmp:
the streams run on OpenMP threads, those of the libgomp torch has loaded."""
CONV_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")
"""-fopenmp: the examples run on OpenMP threads, those of the libgomp torch has loaded (``_conv_norms.c``)."""

CompiledDraw = Callable[[int, int, float, int, int], None]
"""``dpml_box_muller_f32(states, q, std, out, threads)``: addresses of the (STREAMS, 4) uint64 SFC64 states and
of the float32 output (2·STREAMS·q numbers) as integers, and the OpenMP threads to draw on (1, 2 or 4: the
numbers are the same); see ``_boxmuller.c``."""


def cache_directory() -> Path:
    """``$XDG_CACHE_HOME/dpml``, else ``~/.cache/dpml``, else (no home directory) a per-user one in the temp
    directory."""
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


def compile_kernel(directory: Path, source_file: Path | None = None, flags: tuple[str, ...] = FLAGS) -> Path | None:
    """The shared library of a C file (``_boxmuller.c``, looked up at the call, by default) in ``directory``,
    compiled with ``flags`` unless already there; None where there is no C compiler or it fails."""
    compiler = c_compiler()
    if compiler is None:
        return None
    source_file = SOURCE if source_file is None else source_file
    try:
        source = source_file.read_bytes()  # absent from an installation that left out the C file
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), " ".join(compiler).encode(), platform.machine().encode()])
        ).hexdigest()[:16]
        target = directory / f"{source_file.stem}-{key}.so"
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}.part"
        done = subprocess.run(
            [*compiler, *flags, "-o", str(partial), str(source_file), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError):
        return None
    return target


def _load(library: Path, name: str, argtypes: list[type], restype: type | None) -> Callable[..., object] | None:
    """The C function ``name`` of a compiled library, typed, or None if the library does not load here."""
    try:
        function = getattr(ctypes.CDLL(str(library)), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function  # type: ignore[no-any-return]


def load_kernel(library: Path) -> CompiledDraw | None:
    """``dpml_box_muller_f32`` from a compiled library, or None if it does not load here."""
    return cast(
        "CompiledDraw | None",
        _load(
            library,
            "dpml_box_muller_f32",
            [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double, ctypes.c_void_p, ctypes.c_int],
            None,
        ),
    )


StreamStates = Callable[[int, int], None]
"""``dpml_sfc64_stream_states(key, states)``: addresses of a draw's key (4 int64 in [0, 2⁶²)) and of the (STREAMS, 4)
uint64 SFC64 states it gives, NumPy's ``SFC64(child)`` for each ``child`` of ``SeedSequence(key).spawn(STREAMS)``;
see ``_boxmuller.c``."""


def load_stream_states(library: Path) -> StreamStates | None:
    """``dpml_sfc64_stream_states`` from a compiled library, or None if it does not load here."""
    return cast("StreamStates | None", _load(library, "dpml_sfc64_stream_states", [ctypes.c_void_p] * 2, None))


@functools.cache
def _draw_library() -> Path | None:
    return compile_kernel(cache_directory())


@functools.cache
def compiled_draw() -> CompiledDraw | None:
    """The compiled draw of this source (compiled into :func:`cache_directory` on first use), or None."""
    library = _draw_library()
    return None if library is None else load_kernel(library)


@functools.cache
def compiled_stream_states() -> StreamStates | None:
    """The compiled seeding of the draw's streams (the library of :func:`compiled_draw`), or None."""
    library = _draw_library()
    return None if library is None else load_stream_states(library)


ConvNorms = Callable[[int, int, int, int, int, int], int]
"""``dpml_conv_norms(x, d, batch, shape, squared, grads)``: see ``_conv_norms.c`` (addresses as integers;
``grads`` 0 for none); returns 0, or −1 when it could not allocate its buffers."""


def load_conv_norms(library: Path) -> ConvNorms | None:
    """``dpml_conv_norms`` from a compiled library, or None if it does not load here."""
    pointer = ctypes.c_void_p
    return cast(
        "ConvNorms | None",
        _load(library, "dpml_conv_norms", [pointer, pointer, ctypes.c_int64, pointer, pointer, pointer], ctypes.c_int),
    )


@functools.cache
def compiled_conv_norms() -> ConvNorms | None:
    """The compiled per-example convolution norms (compiled into :func:`cache_directory` on first use), or None."""
    library = compile_kernel(cache_directory(), CONV_SOURCE, CONV_FLAGS)
    return None if library is None else load_conv_norms(library)


SCAN_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
"""-fno-math-errno lets exp go to glibc's vector variants (the source declares them SIMD); -fopenmp-simd: the
loops' ``omp simd`` pragmas, no threads (a step's rows are a few thousand numbers)."""


def load_scan_steps(library: Path) -> dict[str, Callable[..., object]] | None:
    """``dpml_<cell>_<way>_<t>`` (cell: lstm, gru; way: forward, backward; t: f32, f64) from a compiled library, keyed
    ``<cell>_<way>_<t>``, or None if any does not load here."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    signatures: dict[str, list[type]] = {
        "lstm_forward": [pointer, size, size, pointer, size, *[pointer] * 4],
        "lstm_backward": [size, size, *[pointer] * 10],
        "gru_forward": [pointer, pointer, size, size, pointer, size, pointer, pointer],
        "gru_backward": [size, size, pointer, pointer, pointer, pointer, size, *[pointer] * 3],
    }
    found = {}
    for kind in ("f32", "f64"):
        for name, arguments in signatures.items():
            loaded = _load(library, f"dpml_{name}_{kind}", arguments, None)
            if loaded is None:
                return None
            found[f"{name}_{kind}"] = loaded
    return found


@functools.cache
def compiled_scan_steps() -> dict[str, Callable[..., object]] | None:
    """The compiled LSTM and GRU steps (compiled into :func:`cache_directory` on first use), or None."""
    library = compile_kernel(cache_directory(), SCAN_SOURCE, SCAN_FLAGS)
    return None if library is None else load_scan_steps(library)
