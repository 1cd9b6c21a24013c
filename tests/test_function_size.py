"""No function in evict/ is over MAX_LINES lines (docstring included), outside Triton kernels (@triton.jit: one
kernel is one launch, and splitting it costs registers and memory traffic). Read with ast (CPU, fast)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "evict"
MAX_LINES = 100


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with triton.jit / triton.autotune / triton.heuristics (any of them, called or not)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "triton":
            return True
    return False


def long_functions(root: Path = ROOT, max_lines: int = MAX_LINES) -> list[str]:
    """'path:line name (N lines)' for each function over max_lines, nested ones and methods included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_the_limit():
    assert not long_functions(), long_functions()


def test_the_measure(tmp_path):
    """A long function is found, a long Triton kernel is not (so the test above can fail)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"import triton\n\ndef long():\n{body}\n\n\n@triton.jit\ndef kernel():\n{body}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:3 long ({MAX_LINES + 1} lines)"]
