"""MkDocs hooks: the build fails on a public symbol without a docstring, and the command-line
reference is the parser's own `--help` (so it cannot drift)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re

from mkdocs.exceptions import PluginError

# Modules whose public names the reference documents: meshax's flat API and the library around it.
DOCUMENTED = (
    "meshax",
    "meshax.layers",
    "meshax.optimize",
    "meshax.initializers",
    "meshax.models.transformer",
)


def _public(module) -> list[tuple[str, object]]:
    names = getattr(module, "__all__", None) or [
        n for n in vars(module) if not n.startswith("_")
    ]
    out = []
    for n in names:
        obj = getattr(module, n)
        if inspect.ismodule(obj) or not (
            inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)
        ):
            continue
        if not getattr(obj, "__module__", "").startswith("meshax"):
            continue  # re-exported from elsewhere (typing, dataclasses ...)
        out.append((n, obj))
    return out


def undocumented() -> list[str]:
    """Public functions, classes and their public methods and properties without a docstring."""
    missing = []
    for module_name in DOCUMENTED:
        module = importlib.import_module(module_name)
        for name, obj in _public(module):
            if not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
            if not inspect.isclass(obj):
                continue
            for member, value in vars(obj).items():
                if member.startswith("_") or not (
                    callable(value) or isinstance(value, property | staticmethod)
                ):
                    continue
                if not inspect.getdoc(
                    getattr(obj, member)
                ):  # (inherits the overridden method's docstring)
                    missing.append(f"{module_name}.{name}.{member}")
    return sorted(set(missing))


def on_config(config, **kwargs):
    missing = undocumented()
    if missing:
        raise PluginError(
            f"{len(missing)} public symbol(s) have no docstring; the API reference is built from them:\n  "
            + "\n  ".join(missing)
        )
    return config


def _help(argv: list[str]) -> str:
    from meshax.cli.parser import build_parser

    out = io.StringIO()
    width, os.environ["COLUMNS"] = (
        os.environ.get("COLUMNS"),
        "100",
    )  # argparse wraps to the terminal
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([*argv, "--help"])
    finally:
        if width is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = width
    return out.getvalue()


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    marker = "<!-- meshax --help -->"
    if marker not in markdown:
        return markdown
    sections = []
    for argv in (
        [],
        ["train", "mlp"],
        ["plan", "mlp"],
        ["calibrate"],
        ["launch"],
        ["plot"],
        ["generate", "lm"],
    ):
        command = " ".join(["meshax", *argv[:1]])
        sections.append(
            f"## `{command}`\n\n```text\n$ {command} --help\n{_help(argv[:1])}```\n"
        )
    return markdown.replace(marker, "\n".join(sections))


def on_page_content(html: str, page, **kwargs) -> str:
    """The API page must render every name of `meshax.__all__` (griffe skips what it cannot see)."""
    if page.file.src_uri != "reference/api.md":
        return html
    import meshax

    rendered = set(re.findall(r'id="meshax\.(\w+)"', html))
    modules = {n for n in meshax.__all__ if inspect.ismodule(getattr(meshax, n))}
    missing = sorted(set(meshax.__all__) - modules - rendered)
    if missing:
        raise PluginError(
            f"the API reference does not render {missing}: give them a docstring and a real name"
        )
    return html
