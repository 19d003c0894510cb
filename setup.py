"""Build the fastbert C++ extensions (pybind11).

`fastbert._wordpiece` holds version/build information and the WordPiece tokenizer core; `fastbert._vocab`
the vocabulary trainer; `fastbert._launch` the Triton launch shortcut's argument binding (fastbert/ops/launch.py).
Set FASTBERT_DEBUG=1 for an unoptimized build.
The tokenizer's Unicode tables are generated first (csrc/tokenizer/gen_unicode.py, from this
Python's unicodedata) into the git-ignored csrc/tokenizer/generated/. `fastbert._wordpiece_cuda` (the GPU
tokenizer, csrc/cuda) is built only when nvcc and a CUDA build of torch are present (FASTBERT_CUDA=0
skips it; FASTBERT_CUDA_ARCH="80;90" picks the GPU architectures, default: the visible GPU's).
`fastbert/_gemm_sm90*.so` (the FFN's GEMMs with the exact GELU in their epilogues on Hopper, csrc/gemm_sm90, a plain
C library that fastbert/ops/gemm_sm90.py loads with ctypes) is built as well when 90 is among those architectures
and CUTLASS's headers are found: $CUTLASS_PATH/include, else the `nvidia-cutlass` package's (pip install
nvidia-cutlass); ~2 minutes of nvcc on 2 cores.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("FASTBERT_BUILD_JOBS").install()  # C++ files compile in parallel (default: all cores)

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "fastbert" / "__init__.py").read_text()).group(1)
DEBUG = os.environ.get("FASTBERT_DEBUG", "0") == "1"


def cpp_extension(name: str, folder: str) -> Pybind11Extension:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / folder).glob("*.cpp"))
    headers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.h"))  # rebuild when one changes
    return Pybind11Extension(
        name,
        sources,
        depends=headers,
        include_dirs=[f"csrc/{folder}", f"csrc/{folder}/generated"],
        define_macros=[("FASTBERT_VERSION", f'"{VERSION}"')],
        cxx_std=17,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )


# fastbert._wordpiece: tokenizer core (csrc/tokenizer); fastbert._vocab: WordPiece vocabulary trainer (csrc/vocab);
# fastbert._launch: the Triton launch shortcut's argument binding (csrc/launch, plain CPython API, fastbert/ops/launch.py).
ext_modules = [cpp_extension("fastbert._wordpiece", "tokenizer"), cpp_extension("fastbert._launch", "launch")]
if any((ROOT / "csrc" / "vocab").glob("*.cpp")):
    ext_modules.append(cpp_extension("fastbert._vocab", "vocab"))


def cuda_extension():
    """fastbert._wordpiece_cuda from csrc/cuda/*.cu (compiled and linked by nvcc in BuildExt), or None and why."""
    if os.environ.get("FASTBERT_CUDA", "1") == "0":
        return None, "FASTBERT_CUDA=0"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} has no CUDA"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not Path(nvcc).exists():
        return None, "nvcc not found (set CUDA_HOME)"
    arch = os.environ.get("FASTBERT_CUDA_ARCH")
    if not arch:
        arch = "".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else "80;90"
    ext = Pybind11Extension("fastbert._wordpiece_cuda", [])
    ext.nvcc = nvcc
    ext.cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    ext.cuda_arch = [a.strip() for a in arch.replace(",", ";").split(";") if a.strip()]
    return ext, None


def cutlass_include():
    """CUTLASS's include folder ($CUTLASS_PATH/include, else the nvidia-cutlass package's), or None."""
    if os.environ.get("CUTLASS_PATH"):
        folder = Path(os.environ["CUTLASS_PATH"]) / "include"
    else:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")  # located, not imported
        if spec is None or spec.origin is None:
            return None
        folder = Path(spec.origin).parent / "source" / "include"
    return folder if (folder / "cutlass" / "cutlass.h").exists() else None


ext, why_not = cuda_extension()
if ext is not None:
    ext_modules.append(ext)
    include = cutlass_include()
    if "90" not in ext.cuda_arch:
        print(f"fastbert: not building fastbert/_gemm_sm90.so: sm_90 is not among {ext.cuda_arch}", file=sys.stderr)
    elif include is None:
        where = f"$CUTLASS_PATH/include ({os.environ['CUTLASS_PATH']}/include) has no cutlass/cutlass.h" \
            if os.environ.get("CUTLASS_PATH") else "pip install nvidia-cutlass, or set CUTLASS_PATH"
        print(f"fastbert: not building fastbert/_gemm_sm90.so: CUTLASS's headers not found ({where})", file=sys.stderr)
    else:
        sm90 = Pybind11Extension("fastbert._gemm_sm90", [])
        sm90.nvcc, sm90.cuda_arch = ext.nvcc, ["90a"]  # no Python module inside: ops/gemm_sm90.py loads it with ctypes
        sm90.cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "gemm_sm90").glob("*.cu"))
        sm90.cuda_flags = [f"-I{include}", "-DNDEBUG"]
        ext_modules.append(sm90)
else:
    print(f"fastbert: not building the CUDA tokenizer (fastbert._wordpiece_cuda): {why_not}", file=sys.stderr)


class BuildExt(build_ext):
    def run(self):
        gen = ROOT / "csrc" / "tokenizer" / "gen_unicode.py"
        subprocess.run([sys.executable, str(gen), str(gen.parent / "generated" / "unicode_data.h")], check=True)
        super().run()

    def build_extension(self, ext):
        if not getattr(ext, "cuda_sources", None):
            return super().build_extension(ext)
        # nvcc compiles and links (CUDA runtime linked statically: no library path to get right).
        import pybind11
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ext.cuda_arch]
        subprocess.run([ext.nvcc, *ext.cuda_sources, "-o", target, "-shared", "-std=c++17", "-O3",
                        "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", f"-I{pybind11.get_include()}",
                        f"-I{sysconfig.get_paths()['include']}", *getattr(ext, "cuda_flags", []), *gencode], check=True)


setup(version=VERSION, ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
