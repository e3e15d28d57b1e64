"""docs/architecture.md's layer table is the import graph: imports go down the layers or stay within a group."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxcls"


def layers() -> dict[str, tuple[int, str]]:
    """``{module: (layer, group)}`` from the table of docs/architecture.md (modules relative to ``jaxcls``)."""
    table = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            for module in re.findall(r"`([\w.]+)`", cells[2]):
                table[module] = (int(cells[0]), cells[1])
    return table


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        found[name or "jaxcls"] = path
    return found


def is_module(name: str) -> bool:
    path = PACKAGE / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(imported jaxcls module, names taken from it)`` for every import of jaxcls in ``path``: ``import jaxcls``,
    ``import jaxcls.x`` (the package and the module), ``from jaxcls.x import name`` and ``from jaxcls import x``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "jaxcls":
                    out += [(".".join(parts[1:i]) or "jaxcls", []) for i in range(1, len(parts) + 1)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxcls":
            base = node.module.removeprefix("jaxcls").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                out.append((sub, []) if is_module(sub) else (base or "jaxcls", [alias.name]))
    return out


def test_every_module_is_in_the_table_and_every_row_exists():
    assert set(modules()) == set(layers())


def test_imports_are_read_in_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import jaxcls\nimport jaxcls.fc.head\nfrom jaxcls import mesh\nfrom jaxcls.fc import FCHead\n"
                      "def f():\n    from jaxcls.losses.margins import _private\n")
    assert sorted(imports(source)) == sorted([("jaxcls", []), ("jaxcls", []), ("fc", []), ("fc.head", []), ("mesh", []),
                                              ("fc", ["FCHead"]), ("losses.margins", ["_private"])])


def test_no_group_is_a_catch_all():
    """A group of many modules would let them all import one another: each holds one concept (a package, or a few
    flat modules), except the commands, which import no command (next test)."""
    groups = {}
    for module, (_, group) in layers().items():
        groups.setdefault(group, set()).add(module.split(".")[0])
    assert all(len(tops) <= 4 for group, tops in groups.items() if group != "commands"), groups


def test_no_module_imports_a_command():
    table = layers()
    bad = [f"{name} imports the command {target}" for name, path in modules().items()
           for target, _ in imports(path) if target != name and table[target][1] == "commands"]
    assert not bad, "\n".join(bad)


def test_imports_go_down_the_layers_or_stay_in_the_group():
    table, bad = layers(), []
    for name, path in modules().items():
        layer, group = table[name]
        for target, _ in imports(path):
            t_layer, t_group = table[target]
            if target != name and not (t_layer < layer or t_group == group):
                bad.append(f"{name} (layer {layer}, {group}) imports {target} (layer {t_layer}, {t_group})")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_module():
    bad = [f"{name} imports {n} from {target}" for name, path in modules().items()
           for target, names in imports(path) for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)
