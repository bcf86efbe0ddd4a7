"""The import graph, read with ``ast`` from the source (every import, at the top of a module or inside a function):
the layers of ``lmtrain/__init__.py`` only import downward, the pure-PyTorch layer imports neither Lightning nor
Hydra, and no module imports a command-line tool."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# lowest first; a module may import its own layer and those below it
LAYERS = ("base", "nn", "formats", "training", "parts", "commands")
COMMANDS = {"train", "plan", "report", "generate", "export", "control", "logbook", "replay", "audit", "doctor", "__main__"}
HEAVY = {"lightning", "pytorch_lightning", "hydra", "omegaconf"}


def module_name(path: Path) -> str:
    """The dotted name a file has once installed: the repository's callbacks/ and data/ are lmtrain.callbacks/.data."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("callbacks", "data"):
        parts.insert(0, "lmtrain")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in ("errors", "console"):
        return "base"
    if parts[1] in ("nn", "formats", "training"):
        return parts[1]
    if parts[1] in ("callbacks", "data"):
        return "parts"
    assert parts[1] in COMMANDS, f"{name}: a module outside every layer (add it to lmtrain/__init__.py's picture)"
    return "commands"


def is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "lmtrain":
        return False
    base = ROOT / parts[1] if len(parts) > 1 and parts[1] in ("callbacks", "data") else ROOT / "lmtrain" / Path(*parts[1:2])
    where = base / Path(*parts[2:]) if len(parts) > 2 else base
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {
                f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")
            }  # from lmtrain.formats import checkpoint
    return found


def package_files() -> list[Path]:
    return sorted(p for d in ("lmtrain", "callbacks", "data") for p in (ROOT / d).rglob("*.py"))


def test_layers_only_import_downward():
    upward = []
    for path in package_files():
        me = module_name(path)
        for name in imports(path):
            if name.split(".")[0] != "lmtrain" or name == "lmtrain":
                continue
            if LAYERS.index(layer(name)) > LAYERS.index(layer(me)):
                upward.append(f"{me} ({layer(me)}) imports {name} ({layer(name)})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_a_command_line_tool():
    found = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in package_files()
        for n in imports(p)
        if n.startswith("lmtrain.") and layer(n) == "commands" and module_name(p) != "lmtrain.__main__"
    ]
    assert not found, found


def test_the_pure_pytorch_and_file_format_layers_import_neither_lightning_nor_hydra():
    heavy = {
        str(p.relative_to(ROOT)): sorted({n.split(".")[0] for n in imports(p)} & HEAVY)
        for p in package_files()
        if layer(module_name(p)) in ("nn", "formats")
    }
    assert heavy and not {k: v for k, v in heavy.items() if v}, heavy


def test_the_pure_pytorch_layer_is_torch_and_the_standard_library_only():
    allowed = {"torch", "lmtrain", "__future__", "math", "dataclasses", "collections", "typing", "functools"}
    extra = {
        str(p.relative_to(ROOT)): sorted({n.split(".")[0] for n in imports(p)} - allowed) for p in (ROOT / "lmtrain" / "nn").rglob("*.py")
    }
    assert not {k: v for k, v in extra.items() if v}, extra


def test_the_repository_folders_are_imported_only_under_lmtrain():
    """``callbacks`` and ``data`` as top-level names would load the same files a second time, as other classes."""
    files = [*package_files(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py"), ROOT / "train.py"]
    bare = {str(p.relative_to(ROOT)): sorted({n for n in imports(p) if n.split(".")[0] in ("callbacks", "data")}) for p in files}
    assert not {k: v for k, v in bare.items() if v}, bare
