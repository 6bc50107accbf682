"""Builds the engine's CPU kernels (sluice/engine/csrc) into the module sluice.engine._C when
the package is installed; everything else about the package is in pyproject.toml.

Each kernel source is compiled once per instruction-set variant of the machine's
architecture (VARIANTS: -march levels, so one build runs on any CPU of that architecture),
each variant's symbols suffixed by its name (csrc/isa.h); the C++ files register the torch
ops, and dispatch.cpp picks the best variant the CPU runs (shm_all_reduce.cpp, the ranks'
shared-memory all-reduce, has one variant). torch's C++ headers are needed, so the
kernels are built only where torch is importable at build time: `pip install
--no-build-isolation` after torch (the Makefile and the engine image do; set
SLUICE_BUILD_KERNELS=1 to make a missing torch an error). Without them the gateway and
operator install as before, and an engine runs its PyTorch paths.
"""

from __future__ import annotations

import os
import platform
import shlex
from pathlib import Path

from setuptools import setup

CSRC = Path("sluice/engine/csrc")
# Per source, the flags that keep its arithmetic as its header comment states.
SOURCES = {
    # Reassociation lets dot products reduce as a tree (3x faster per layer); not
    # -ffast-math as a whole, which would assume no NaN where a bad input must show as NaN.
    "paged_attention.c": ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math",
                          "-fno-signed-zeros", "-fno-trapping-math"],
    # No fused multiply-adds: PyTorch rounds each product on its own.
    "norm_rotary.c": ["-O3", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off"],
    # A float32 sum of products, in any order (as a GEMM's).
    "lora.c": ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math",
               "-fno-signed-zeros", "-fno-trapping-math"],
    # Integer dot products per block; a row's float sum over the blocks in order, and an
    # embedding row dequantized as the gguf package does (no fused multiply-adds).
    "gguf.c": ["-O3", "-fno-math-errno", "-ffp-contract=off"],
    "gguf_k.c": ["-O3", "-fno-math-errno", "-ffp-contract=off"],  # (gguf.c's K-quants)
}
# Best last; the names are those torch_bindings.cpp checks the CPU for.
VARIANTS = {
    "x86_64": {"portable": ["-march=x86-64"], "avx2": ["-march=x86-64-v3"],
               "avx512": ["-march=x86-64-v4"],
               "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16"]},
    "aarch64": {"portable": ["-march=armv8-a"]},
}


def variants() -> dict[str, list[str]]:
    machine = {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
    return VARIANTS.get(machine, {"portable": []})


def kernel_extensions() -> tuple[list, dict]:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        if os.environ.get("SLUICE_BUILD_KERNELS") == "1":
            raise SystemExit("SLUICE_BUILD_KERNELS=1: the CPU kernels need torch at build "
                             "time (pip install torch, then pip install --no-build-isolation)")
        return [], {}

    class BuildKernels(BuildExtension):
        """Compiles every (source, variant) object, then links them with the bindings."""

        def build_extension(self, ext) -> None:
            cc = shlex.split(os.environ.get("CC", "cc"))
            folder = Path(self.build_temp) / "kernels"
            folder.mkdir(parents=True, exist_ok=True)
            objects = []
            for isa, march in variants().items():
                for source, flags in SOURCES.items():
                    obj = folder / f"{Path(source).stem}-{isa}.o"
                    self.spawn([*cc, "-c", str(CSRC / source), "-o", str(obj), "-fPIC",
                                f"-DSLUICE_ISA={isa}", *march, *flags])
                    objects.append(str(obj))
            ext.extra_objects = objects
            super().build_extension(ext)

    isas = " ".join(f"X({isa})" for isa in variants())
    ext = CppExtension(
        "sluice.engine._C", sorted(str(p) for p in CSRC.glob("*.cpp")),
        # rebuilt when any kernel file changes (and shipped in the sdist)
        depends=sorted(str(p) for p in CSRC.iterdir() if p.suffix in (".c", ".h", ".cpp")),
        define_macros=[("SLUICE_ISAS(X)", isas)],
        extra_compile_args=["-O2", "-fopenmp"], extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildKernels}


extensions, commands = kernel_extensions()
setup(ext_modules=extensions, cmdclass=commands)
