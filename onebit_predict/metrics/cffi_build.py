"""Build a cffi (API mode) extension once per source and load it from the cache.

Shared by the C kernels of this package (``stats_kernel``) and the policy parity tests
(``ctest_port/cffi_policy.py``). A module is compiled into ``<cache>/cffi/<hash>/``, where
the cache root is ``$ONEBIT_CACHE`` or ``~/.cache/onebit-predict`` and the hash covers
everything that changes the binary: the declarations, the C source given to cffi, the
compiler arguments, the files it includes or compiles, cffi's version and the Python ABI.
Later runs, in any process, load it from there without compiling.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cffi

from ..constants import CACHE_DIR_DEFAULT, ENV_CACHE


class CffiBuildError(RuntimeError):
    """The C compiler could not build a cffi module (missing compiler or headers, a compile error)."""


def cache_root() -> Path:
    """``$ONEBIT_CACHE``, else ``~/.cache/onebit-predict``."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / CACHE_DIR_DEFAULT)


def module_key(cdef: str, source: str, compile_args: Sequence[str], depends: Sequence[Path] = ()) -> str:
    """The cache key (hex) of a module: its inputs, cffi's version and the Python ABI."""
    key = hashlib.sha256()
    for part in (cdef, source, " ".join(compile_args), cffi.__version__, sysconfig.get_config_var("EXT_SUFFIX")):
        key.update(part.encode() + b"\0")
    key.update(b"\0".join(path.read_bytes() for path in depends))
    return key.hexdigest()


def load_cffi_module(
    name: str,
    cdef: str,
    source: str,
    *,
    sources: Sequence[Path] = (),
    depends: Sequence[Path] = (),
    include_dirs: Sequence[Path] = (),
    compile_args: Sequence[str] = (),
    source_extension: str = ".c",
) -> tuple[Any, Any]:
    """``(ffi, lib)`` of the module ``name``: ``source`` (the C text cffi compiles, plus the files
    in ``sources``) behind the declarations ``cdef``, compiled on first use.

    ``depends`` are files whose content goes into the cache key (what ``source`` includes
    and the ``sources``). Raises CffiBuildError, with the compiler's message, if it fails.
    """
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    module_dir = cache_root() / "cffi" / module_key(cdef, source, compile_args, depends)[:16]
    module_path = module_dir / (name + ext_suffix)

    if not module_path.is_file():
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        ffi.set_source(
            name,
            source,
            sources=[str(p) for p in sources],
            source_extension=source_extension,
            include_dirs=[str(p) for p in include_dirs],
            extra_compile_args=list(compile_args),
        )
        module_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=module_dir) as tmp:
            try:
                built = ffi.compile(tmpdir=tmp)
            except (cffi.VerificationError, OSError) as e:
                raise CffiBuildError(f"could not compile the cffi module {name}: {e}") from e
            os.replace(built, module_path)  # atomic: a concurrent run sees all or nothing

    spec = importlib.util.spec_from_file_location(name, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib
