"""MkDocs hooks: pages made from the code and from result files, never written twice.

- ``<!-- raylm:flags -->``: every flag of ``raylm train``, from TrainConfig's fields.
- ``<!-- raylm:modules -->``: the code's layout, each module's first docstring sentence.
- ``<!-- raylm:tests -->``: the test modules, each with its docstring's first paragraph.
- ``<!-- raylm:results NAME -->``: the tables benchmarks/report.py makes from
  benchmarks/results/NAME-*.json; its plots are added to the site as generated files.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = re.compile(r"<!-- raylm:results ([\w-]+) -->")


def _load_report():
    """benchmarks/report.py, loaded once for the build (it is not a package module)."""
    spec = importlib.util.spec_from_file_location(
        "raylm_bench_report", os.path.join(ROOT, "benchmarks", "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = _load_report()


def flags_markdown() -> str:
    """One table per ``--help`` group: flag, type, default, help."""
    from raylm.cli.args import GROUP_TITLES, config_flags

    groups: dict[str, list[str]] = {}
    for flag in config_flags():
        names = ", ".join(f"`--{n}`" for n in flag.names)
        text = flag.help.replace("|", "\\|").replace("\n", " ")
        if flag.choices is not None:
            text += " Choices: " + ", ".join(f"`{c}`" for c in flag.choices) + "."
        shown = "" if flag.default in (None, []) else f"`{flag.default}`"
        groups.setdefault(flag.group, []).append(
            f"| <span id=\"{flag.name}\"></span>{names} | {flag.type.__name__} | "
            f"{shown} | {text} |")
    out = []
    for name, rows in groups.items():
        title = GROUP_TITLES[name]
        if not title.startswith("raylm"):  # (the project's name stays lower case)
            title = title[:1].upper() + title[1:]
        out += [f"## {title}", "",
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
        summary = _first_sentence(init)
        if summary:
            out += [summary + ".", ""]
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
    return RESULTS.sub(lambda m: REPORT.tables(m.group(1)), markdown)


def on_files(files, config):
    from mkdocs.structure.files import File

    for name, data in REPORT.plots().items():
        files.append(File.generated(config, f"benchmarks/figures/{name}", content=data))
    return files
