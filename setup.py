"""Build the fastbert C++ extensions (pybind11).

`fastbert._C` holds version/build information and the WordPiece tokenizer core; `fastbert._vocab`
the vocabulary trainer. Set FASTBERT_DEBUG=1 for an unoptimized build.
The tokenizer's Unicode tables are generated first (csrc/tokenizer/gen_unicode.py, from this
Python's unicodedata) into the git-ignored csrc/tokenizer/generated/.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "fastbert" / "__init__.py").read_text()).group(1)
DEBUG = os.environ.get("FASTBERT_DEBUG", "0") == "1"


def cpp_extension(name: str, folder: str) -> Pybind11Extension:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / folder).glob("*.cpp"))
    return Pybind11Extension(
        name,
        sources,
        include_dirs=[f"csrc/{folder}", f"csrc/{folder}/generated"],
        define_macros=[("FASTBERT_VERSION", f'"{VERSION}"')],
        cxx_std=17,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )


# fastbert._C: tokenizer core (csrc/tokenizer); fastbert._vocab: WordPiece vocabulary trainer (csrc/vocab).
ext_modules = [cpp_extension("fastbert._C", "tokenizer")]
if any((ROOT / "csrc" / "vocab").glob("*.cpp")):
    ext_modules.append(cpp_extension("fastbert._vocab", "vocab"))



class BuildExt(build_ext):
    def run(self):
        gen = ROOT / "csrc" / "tokenizer" / "gen_unicode.py"
        subprocess.run([sys.executable, str(gen), str(gen.parent / "generated" / "unicode_data.h")], check=True)
        super().run()


setup(version=VERSION, ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
