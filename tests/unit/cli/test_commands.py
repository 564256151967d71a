"""The ``tokenfleet`` command table: product commands live in tokenfleet_cli; the dev package registers its own
(the ``tokenfleet.commands`` entry-point group, or its registry module when it is only on the path); and no
product module imports the dev package."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tokenfleet_cli

ROOT = Path(__file__).resolve().parents[3]


def test_product_table_names_no_dev_module():
    assert not [m for m, _, _ in tokenfleet_cli.COMMANDS.values() if m.startswith("tokenfleet_dev")]


def test_dev_commands_are_found_through_the_registry():
    commands = tokenfleet_cli.all_commands()
    for path in (("demo",), ("cluster", "up"), ("bench", "recovery"), ("bench", "fleet")):
        assert commands[path][0].startswith("tokenfleet_dev."), path
    # the dev table's startup adds the plane to the product's benchmark
    assert commands[("bench", "startup")][0] == "tokenfleet_dev.bench.startup_plane"


def test_every_command_target_exists():
    import importlib

    for path, (module, func, _) in tokenfleet_cli.all_commands().items():
        assert callable(getattr(importlib.import_module(module), func)), path


def test_pyproject_registers_the_dev_table():
    import tomllib

    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points[tokenfleet_cli.ENTRY_POINT_GROUP] == {"dev": f"{tokenfleet_cli.DEV_REGISTRY}:COMMANDS"}


def test_without_the_dev_package_its_commands_are_absent(tmp_path):
    """As in an image: only operator/ and serving-image/ on the path, no tokenfleet_dev anywhere."""
    code = ("import sys; sys.meta_path.insert(0, type('NoDev', (), {'find_spec': staticmethod("
            "lambda name, *a: (_ for _ in ()).throw(ModuleNotFoundError(name)) if name.startswith('tokenfleet_dev') "
            "else None)})()); import tokenfleet_cli; sys.exit(tokenfleet_cli.main(sys.argv[1:]))")
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'serving-image'}", "PATH": "/usr/bin:/bin"}
    demo = subprocess.run([sys.executable, "-c", code, "demo"], capture_output=True, text=True, env=env, timeout=120)
    assert demo.returncode == 2 and "serve" in demo.stderr and "demo" not in demo.stderr
    plane = subprocess.run([sys.executable, "-c", code, "bench", "startup", "--plane"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert plane.returncode == 2 and "--plane needs the local control plane of the dev package" in plane.stderr


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_product_module_imports_the_dev_package():
    product = [ROOT / "operator" / "tokenfleet_cli.py", *(ROOT / "operator" / "tokenfleet_operator").rglob("*.py"),
               *(ROOT / "serving-image" / "tokenfleet_serving").rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in product
                 if any(m == "tokenfleet_dev" or m.startswith("tokenfleet_dev.") for m in _imported_modules(p))]
    assert offenders == []
