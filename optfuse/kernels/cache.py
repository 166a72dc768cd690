"""On-disk kernel cache: ``<root>/sm_<arch>/<kernel name>/<key>/`` (see KernelArtifact.save).

The key hashes the source file, the specialization (signature, constexprs/defines, warps...),
the arch, the compiler and its version, and optfuse's kernel ABI version. Root:
``$OPTFUSE_CACHE`` or ``~/.cache/optfuse/kernels``.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from .artifact import KernelArtifact, KernelSource
from .target import arch_name, resolve_arch


def cache_dir() -> Path:
    env = os.environ.get("OPTFUSE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "optfuse" / "kernels"


def compiler_id(lang: str) -> str:
    if lang == "triton":
        from . import triton_aot

        return triton_aot.compiler_id()
    from . import nvrtc

    return nvrtc.compiler_id()


def cache_key(src: KernelSource, arch: int) -> str:
    blob = json.dumps({"spec": src.spec_dict(), "arch": arch, "compiler": compiler_id(src.lang)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def compile_source(src: KernelSource, arch: int) -> KernelArtifact:
    """Compile without the cache."""
    if src.lang == "triton":
        from .triton_aot import compile_triton

        return compile_triton(src, arch)
    from .nvrtc import compile_cuda

    return compile_cuda(src, arch)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "kernel"


class KernelCache:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir()
        self._mem: dict[str, KernelArtifact] = {}

    def path_for(self, src: KernelSource, arch: int, key: str) -> Path:
        return self.root / arch_name(arch) / _safe(src.name) / key[:24]

    def get(self, src: KernelSource, arch: int | str | None = None) -> KernelArtifact | None:
        arch = resolve_arch(arch)
        key = cache_key(src, arch)
        if key in self._mem:
            return self._mem[key]
        path = self.path_for(src, arch, key)
        if (path / "meta.json").exists():
            art = KernelArtifact.load(path)
            if art.key == key:
                self._mem[key] = art
                return art
        return None

    def build(self, src: KernelSource, arch: int | str | None = None, force: bool = False) -> KernelArtifact:
        """The cached artifact for (src, arch), compiling it on a miss."""
        arch = resolve_arch(arch)
        if not force:
            art = self.get(src, arch)
            if art is not None:
                return art
        key = cache_key(src, arch)
        art = compile_source(src, arch)
        art.key = key
        art.metadata.setdefault("source_name", src.name)
        art.save(self.path_for(src, arch, key))
        self._mem[key] = art
        return art

    def build_many(
        self,
        sources: Iterable[KernelSource],
        arch: int | str | None = None,
        jobs: int | None = None,
        force: bool = False,
        isolate: bool = False,
    ) -> list[KernelArtifact]:
        """Build several kernels, compiling the misses in parallel processes (spawned, so safe
        after CUDA was initialised in this process). ``isolate=True`` compiles in a child process
        even for one kernel (Triton's interpreter, once run in a process, breaks later compiles
        there)."""
        arch = resolve_arch(arch)
        sources = list(sources)
        todo = [s for s in sources if force or self.get(s, arch) is None]
        jobs = jobs if jobs is not None else min(len(todo), os.cpu_count() or 1, 16)
        if todo and (isolate or (len(todo) > 1 and jobs > 1)):
            jobs = max(1, jobs)
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futs = [pool.submit(_build_worker, s, arch, str(self.root), force) for s in todo]
                for f in futs:
                    f.result()
        else:
            for s in todo:
                self.build(s, arch, force=force)
        out = []
        for s in sources:
            art = self.get(s, arch)
            if art is None:  # pragma: no cover - the worker saved it
                art = self.build(s, arch)
            out.append(art)
        return out

    def entries(self) -> Iterator[tuple[Path, dict]]:
        """(directory, meta) of every artifact on disk."""
        if not self.root.exists():
            return
        for meta in sorted(self.root.glob("sm_*/*/*/meta.json")):
            try:
                yield meta.parent, json.loads(meta.read_text())
            except (OSError, ValueError):
                continue


def _build_worker(src: KernelSource, arch: int, root: str, force: bool) -> str:
    art = KernelCache(root).build(src, arch, force=force)
    return art.key


_default: KernelCache | None = None


def default_cache() -> KernelCache:
    global _default
    if _default is None or _default.root != cache_dir():
        _default = KernelCache()
    return _default


def build_kernel(src: KernelSource, arch: int | str | None = None, cache: KernelCache | None = None) -> KernelArtifact:
    """Compile (or fetch from the cache) one kernel for ``arch`` (default: the GPU present, else sm_90)."""
    return (cache or default_cache()).build(src, arch)
