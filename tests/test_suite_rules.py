"""Rules the suite keeps about itself, checked on its own source."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).parent


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_torch_settings_change_through_torch_patching_not_monkeypatch():
    """pytest 9.2's monkeypatch.setattr records a module attribute's old value from the module's __dict__; torch's
    config modules keep their settings elsewhere, so the undo deleted the setting and torch hid it for the rest of
    the process. Torch settings in tests change through ``torch._dynamo.config.patch(...)`` and the
    like, which restore them."""
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("setattr", "delattr") and node.args):
                continue
            if _dotted(node.func.value) != "monkeypatch":
                continue
            target = node.args[0]
            name = target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) \
                else _dotted(target)
            if name.startswith("torch.") and ".config" in name:
                offenders.append(f"{path.name}:{node.lineno}: monkeypatch.{node.func.attr}({name}, ...)")
    assert not offenders, "use torch's config .patch(...) instead:\n" + "\n".join(offenders)


def test_oldest_test_constraints_are_the_test_extras_lower_bounds():
    """constraints/oldest-test.txt (what scripts/test_oldest.sh installs) pins each test dependency at the lower bound
    pyproject.toml's `test` extra states, and every test dependency has both bounds."""
    import re
    import tomllib

    root = TESTS.parent
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    lower = {}
    for spec in extra:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+),<([0-9]+)", spec)
        assert m, f"test dependency {spec!r} lacks a lower or an upper bound"
        lower[m[1].lower()] = m[2]
    pinned = {}
    for line in (root / "constraints" / "oldest-test.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.strip().lower()] = version.strip()
    assert pinned == lower
