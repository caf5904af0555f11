"""The package's folders follow the data flow: a module imports only from the layers before its own
(docs/architecture.md). Checked on the source, so a new import that points back up fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "dsv4"
LAYERS = [{"env", "config", "formats", "chat"}, {"checkpoint"}, {"model"}, {"ops"}, {"cache"}, {"engine"},
          {"parallel"}, {"llm"}, {"serve"}, {"validate", "canary"}, {"cli", "__init__"}]
EXCEPTIONS = {("llm", "canary")}  # the embedded canary's path (canary/__init__.py imports nothing)


def _layer(name: str) -> int:
    return next(i for i, group in enumerate(LAYERS) if name in group)


def _imports(path: Path):
    """Every imported module as a list of its dotted parts (``from .. import a, b``: one per name)."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")
        elif isinstance(node, ast.ImportFrom):
            base = list(parts[: len(parts) - node.level]) if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            if node.module:
                yield module
            else:  # names of a package: each may be a module
                for a in node.names:
                    if a.name != "__version__":  # package metadata, defined before anything is imported
                        yield module + [a.name]


def test_imports_point_down_the_flow():
    bad = []
    for path in ROOT.rglob("*.py"):
        src = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if src == "assets":
            continue
        for target in _imports(path):
            if len(target) < 2 or target[0] != "dsv4":
                continue
            tgt = target[1]
            if not ((ROOT / tgt).is_dir() or (ROOT / f"{tgt}.py").is_file()):
                tgt = "__init__"  # a name of the package itself (``from .. import __version__``)
            if tgt == src or (src, tgt) in EXCEPTIONS:
                continue
            if _layer(tgt) > _layer(src):
                bad.append(f"{path.relative_to(ROOT.parent)} imports dsv4.{tgt}")
    assert not bad, "imports pointing back up the flow:\n" + "\n".join(sorted(bad))
