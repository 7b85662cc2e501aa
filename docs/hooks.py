"""MkDocs hooks: pages made from the code and from result files, never written twice.

- ``<!-- raylm:flags -->``: every flag of ``raylm train``, from TrainConfig's fields.
- ``<!-- raylm:modules -->``: the code's layout, each module's first docstring sentence.
- ``<!-- raylm:tests -->``: the test modules, each with its docstring's first paragraph.
- ``<!-- raylm:results NAME -->``: the tables benchmarks/report.py makes from
  benchmarks/results/NAME-*.json; its plots are added to the site as generated files.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = re.compile(r"<!-- raylm:results ([\w-]+) -->")


def _report():
    spec = importlib.util.spec_from_file_location(
        "raylm_bench_report", os.path.join(ROOT, "benchmarks", "report.py"))
    if spec is None or not os.path.exists(spec.origin):
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and args:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return "list"
    return getattr(tp, "__name__", str(tp))


def flags_markdown() -> str:
    """One table per ``--help`` group: flag, type, default, help."""
    from raylm.cli.args import GROUP_TITLES
    from raylm.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    groups: dict[str, list[str]] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        names = ", ".join(f"`--{n}`" for n in (f.name, *meta.get("aliases", ())))
        text = meta.get("help", "").replace("|", "\\|").replace("\n", " ")
        if "choices" in meta:
            text += " Choices: " + ", ".join(f"`{c}`" for c in meta["choices"]) + "."
        shown = "" if default in (None, []) else f"`{default}`"
        groups.setdefault(meta.get("group", "training"), []).append(
            f"| <span id=\"{f.name}\"></span>{names} | {_type_name(hints[f.name])} | "
            f"{shown} | {text} |")
    out = []
    for name, rows in groups.items():
        out += [f"## {GROUP_TITLES.get(name, name).capitalize()}", "",
                "| flag | type | default | what |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(out)


def _first_paragraph(path: str) -> str:
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _first_sentence(path: str) -> str:
    text = _first_paragraph(path)
    cut = re.search(r"\.(\s|$)", text)
    return text[:cut.start()] if cut else text


def tests_markdown() -> str:
    rows = [f"| `{n}` | {_first_paragraph(os.path.join(ROOT, 'tests', n))} |"
            for n in sorted(os.listdir(os.path.join(ROOT, "tests")))
            if n.startswith("test_") and n.endswith(".py")]
    return "\n".join(["| module | what it checks |", "| --- | --- |", *rows])


def modules_markdown() -> str:
    """One table per package of raylm/: module and what it is (its docstring)."""
    out = []
    for folder, dirs, names in sorted(os.walk(os.path.join(ROOT, "raylm"))):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and d != "sample")
        modules = sorted(n for n in names if n.endswith(".py") and n != "__init__.py")
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        init = os.path.join(folder, "__init__.py")
        if not os.path.exists(init):
            continue
        out += [f"### `{package}`", ""]
        if os.path.exists(init) and _first_sentence(init):
            out += [_first_sentence(init) + ".", ""]
        if modules:
            out += ["| module | what |", "| --- | --- |"]
            out += [f"| `{m[:-3]}` | {_first_sentence(os.path.join(folder, m))} |"
                    for m in modules]
            out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- raylm:flags -->" in markdown:
        markdown = markdown.replace("<!-- raylm:flags -->", flags_markdown())
    if "<!-- raylm:tests -->" in markdown:
        markdown = markdown.replace("<!-- raylm:tests -->", tests_markdown())
    if "<!-- raylm:modules -->" in markdown:
        markdown = markdown.replace("<!-- raylm:modules -->", modules_markdown())
    if RESULTS.search(markdown):
        report = _report()
        if report is None:
            raise RuntimeError("benchmarks/report.py is missing")
        markdown = RESULTS.sub(lambda m: report.tables(m.group(1)), markdown)
    return markdown


def on_files(files, config):
    from mkdocs.structure.files import File

    report = _report()
    if report is not None and hasattr(report, "plots"):
        for name, data in report.plots().items():
            files.append(File.generated(config, f"benchmarks/figures/{name}", content=data))
    return files
