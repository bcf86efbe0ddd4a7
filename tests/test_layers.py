"""The import graph, read with ``ast`` from the source (every import, at the top of a module or inside a function):
lmtrain is the base that callbacks/ and data/ build on, so it imports neither; its pure-PyTorch and file-format
modules import neither Lightning nor Hydra."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

# the decoder, its loss and optimizer schedule, the tokenizer, and the formats of a run directory and a dataset
PURE = ("model", "loss", "optim", "tokenizer", "manifest", "checkpoint", "corrections", "logbook", "errors")


def imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_lmtrain_does_not_import_the_packages_built_on_it():
    upward = {p.name: sorted(imports(p) & {"callbacks", "data"}) for p in (ROOT / "lmtrain").rglob("*.py")}
    assert not {k: v for k, v in upward.items() if v}, upward


def test_the_pure_layer_imports_neither_lightning_nor_hydra():
    heavy = {
        name: sorted(imports(ROOT / "lmtrain" / f"{name}.py") & {"lightning", "pytorch_lightning", "hydra", "omegaconf"}) for name in PURE
    }
    assert not {k: v for k, v in heavy.items() if v}, heavy
