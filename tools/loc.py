"""Lines of Python in the installed package, per folder: ``python tools/loc.py [PATH]``.

Counts physical lines (what ``wc -l`` says), and apart from them the blank lines, comments and
docstrings, so a change can be judged by the code it adds or removes as well as by its length.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

COLUMNS = ("lines", "blank", "comments", "docstrings", "code")


def _docstring_lines(tree: ast.AST) -> int:
    """Lines of module, class and function docstrings, and of attribute docstrings (a string
    right after an assignment)."""
    lines = 0
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for index, statement in enumerate(body):
            is_string = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                and isinstance(statement.value.value, str)
            documents = index == 0 or isinstance(body[index - 1], (ast.Assign, ast.AnnAssign))
            if is_string and documents:
                lines += statement.end_lineno - statement.lineno + 1
    return lines


def count(path: Path) -> dict[str, int]:
    text = path.read_text()
    lines = text.splitlines()
    figures = {
        "lines": len(lines),
        "blank": sum(1 for line in lines if not line.strip()),
        "comments": sum(1 for line in lines if line.lstrip().startswith("#")),
        "docstrings": _docstring_lines(ast.parse(text)),
    }
    figures["code"] = figures["lines"] - figures["blank"] - figures["comments"] - figures["docstrings"]
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Lines of Python per folder (physical, blank, comments, "
                                                 "docstrings, code).")
    parser.add_argument("path", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "wtransfer",
                        help="a package folder (default: this checkout's wtransfer/)")
    root = parser.parse_args(argv).path
    folders: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    for path in sorted(root.rglob("*.py")):
        folder = str(path.parent.relative_to(root.parent))
        for column, value in count(path).items():
            folders[folder][column] += value
            folders["total"][column] += value
    if not folders:
        parser.error(f"no Python files under {root}")
    width = max(len(name) for name in folders)
    print(f"{'folder':<{width}}  " + "  ".join(f"{c:>10}" for c in COLUMNS))
    for name, figures in sorted(folders.items(), key=lambda item: (item[0] == "total", item[0])):
        print(f"{name:<{width}}  " + "  ".join(f"{figures[c]:>10}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
