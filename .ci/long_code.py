"""Functions over 80 lines and source files over 800, outside the migrations and the CLI's
registration closures (``register()`` in ``cli/`` and the commands it declares), longest first.
A report, not a gate: it exits 0. Usage: .venv/bin/python .ci/long_code.py [FOLDER...]"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("staleflow", "servers", "coordinator", "launch", "cli")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 800


def long_functions(path: Path) -> list[tuple[int, str, int]]:
    """(lines, qualified name, first line) of each function over the limit, nested ones included."""
    found = []
    in_cli = path.relative_to(ROOT).parts[0] == "cli"

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if in_cli and child.name == "register":
                    continue  # the registration closure and every command it declares
                start = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                lines = (child.end_lineno or child.lineno) - start + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append((lines, f"{prefix}{child.name}", child.lineno))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return found


def main(folders: list[str]) -> int:
    files = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    long_files = []
    functions = []
    for path in files:
        rel = path.relative_to(ROOT)
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long_files.append((lines, rel))
        functions += [(n, f"{rel}:{line} {name}") for n, name, line in long_functions(path)]
    print(f"files over {MAX_FILE_LINES} lines: {len(long_files)}")
    for lines, rel in sorted(long_files, reverse=True):
        print(f"  {lines:5d}  {rel}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(functions)}")
    for lines, where in sorted(functions, reverse=True):
        print(f"  {lines:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(FOLDERS)))
