"""Write the public functions of Mesh-TensorFlow 0.1.21's `ops.py` and `layers.py` (names,
argument names, which have defaults) to tests/data/mtf-0.1.21-api.json, the fixture the
compatibility table (scripts/mtf_compat.py) and its test read. Run once, outside the test suite:

    pip download --no-deps mesh-tensorflow==0.1.21 -d /tmp/mtf
    python scripts/mtf_signatures.py /tmp/mtf/mesh_tensorflow-0.1.21-py3-none-any.whl

Reads the source with `ast` (no TensorFlow needed)."""

import ast
import json
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "mtf-0.1.21-api.json"


def functions(source: str) -> list[dict]:
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            a = node.args
            names = [x.arg for x in a.args]
            required = len(names) - len(a.defaults)
            out.append(
                {
                    "name": node.name,
                    "args": names,
                    "required": names[:required],
                    "varargs": a.vararg.arg if a.vararg else None,
                }
            )
    return out


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        api = {module: functions(z.read(f"mesh_tensorflow/{module}.py").decode()) for module in ("ops", "layers")}
    lines = ['"version": "0.1.21"']
    for module, fns in api.items():
        rows = ",\n  ".join(json.dumps(f) for f in fns)
        lines.append(f'"{module}": [\n  {rows}\n ]')
    OUT.write_text("{\n " + ",\n ".join(lines) + "\n}\n")  # a function a line
    print(f"{OUT}: {len(api['ops'])} functions of ops.py, {len(api['layers'])} of layers.py")


if __name__ == "__main__":
    main(sys.argv[1])
