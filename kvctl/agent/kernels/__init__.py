"""The serving path's own CPU kernels (`cpu_ops.cpp`), built once per machine, with torch as the
fallback everywhere they are not.

Two operations where eager PyTorch costs a second pass over memory that a decode step cannot
afford on a CPU (docs/performance.md, "Where a decode step goes"): attention over the pages
where they lie in the pool (instead of gathering them into a buffer first), and small-batch
linear layers over weights repacked into panels (MKL's sgemm reaches about half the memory
bandwidth at 8 rows). Everything else stays torch.

The extension is compiled by torch's `cpp_extension` (a C++ compiler and ninja) on first use, into
a cache directory keyed by the source, torch's version and the compiler flags, so later starts
load it in well under a second; `make setup` builds it ahead. It is used only where it can run:
an x86-64 CPU with AVX-512 (F, BW, VL, DQ). Anywhere else, or when the build fails, or with
`KVCTL_CPU_KERNELS=0`, `cpu_ops()` is None and the model runs on torch alone (the same results
within float rounding; tests run both). The reason is logged once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp")
"""`-march=native`: the build is for this CPU (its cache key names the CPU), tuned for it as
inductor's generated kernels are; measured 15 % faster than generic AVX-512 flags."""
ENV_SWITCH = "KVCTL_CPU_KERNELS"
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")


def cache_dir() -> Path:
    """Where built kernels are kept: `$KVCTL_CACHE_DIR/kernels`, else ~/.cache/kvctl/kernels."""
    root = os.environ.get("KVCTL_CACHE_DIR") or Path.home() / ".cache" / "kvctl"
    return Path(root) / "kernels"


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (None: they can be built and run)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return f"{ENV_SWITCH}=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"they need x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH; install g++"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except (ImportError, RuntimeError):
        return "ninja is not installed (pip install ninja)"
    return None


def build_name(source: Path, torch_version: str, torch_dir: Path) -> str:
    """The extension's name, which names its build directory: one per source text and path,
    torch, flags and CPU. Two environments with the same torch version but their own headers
    (two virtualenvs), or two checkouts of the same source (ninja's build line names the
    source's path), must not share a build: each would rebuild it for the other, and race."""
    identity = [source.read_bytes(), str(source.resolve()).encode(), torch_version.encode()]
    identity.append(" ".join(FLAGS).encode())
    identity += [_cpu_model().encode(), " ".join(sorted(_cpu_flags())).encode()]
    identity.append(str(torch_dir).encode())
    key = hashlib.sha256(b"\0".join(identity)).hexdigest()[:16]
    return f"kvctl_cpu_ops_{key}"


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The built extension, or None (the reason is logged once). Builds it on first use."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("CPU kernels off (%s): attention and linear layers run on torch alone", reason)
        return None
    import torch
    from torch.utils.cpp_extension import load

    name = build_name(SOURCE, torch.__version__, Path(torch.__file__).resolve().parent)
    directory = cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob(f"{name}*.so")):
        log.info("building the CPU kernels once (about 30 s) into %s", directory)
    try:
        with build_lock(directory):
            return load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=list(FLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as error:  # a compiler that fails is a reason to fall back, not to stop
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        log.warning("CPU kernels off: building %s failed (%s)", SOURCE.name, first_line)
        return None


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold the build directory for this process: an advisory lock (`flock`) that the kernel
    drops when its holder exits, however it exits. torch's own lock is a plain file, which a
    build killed halfway (an agent stopped during its first start) leaves behind, and every
    later start then waited for it; once this lock is held no live process is building, so a
    torch lock still there is such a leftover and is removed."""
    with open(directory / "build.flock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the CPU kernels in %s; waiting", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        left = directory / "lock"
        if left.exists():
            log.warning("removing %s, left by a CPU kernel build that did not finish", left)
            left.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpuinfo(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ("" when there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def _cpu_model() -> str:
    return _cpuinfo("model name")
