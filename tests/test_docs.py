"""The documentation site (``mkdocs.yml``, ``docs/``) builds with warnings as errors, its reference pages are the
code's own (every key of ``params.yaml``, every command), each Python block it shows is one a named test runs,
and the README is a landing page whose links all lead somewhere.

MkDocs' strict mode fails the build on a page left out of the navigation, a link to a missing page or anchor, and
any warning of mkdocstrings (the API reference is written from the docstrings).
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpml.cli import build_parser
from dpml.config import config_model
from dpml.train.registry import TRAINERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = re.compile(r"<!--[^>]*\bruns: (tests/[\w/]+\.py)::(\w+)[^>]*-->\n```python\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def page_text(site: Path, page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", (site / page / "index.html").read_text(encoding="utf-8")))


def test_the_site_builds_with_warnings_as_errors_and_every_page_is_reached(site: Path) -> None:
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")}
    built = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert {p for p in pages if p != "index"} <= built


def test_the_configuration_reference_lists_every_key_of_every_section(site: Path) -> None:
    text = page_text(site, "reference/configuration")
    keys = [
        f"{name}.{key}"
        for name, field in config_model().model_fields.items()
        if name != "train"
        for key in getattr(field.annotation, "model_fields", {})
    ]
    keys += [f"train.{key}" for trainer in TRAINERS.values() for key in trainer.settings.model_fields]
    assert len(keys) > 100
    assert [key for key in keys if key not in text] == []
    assert "one of add-remove, replace-one" in text  # a choice's allowed words, read from the model


def test_the_command_line_reference_has_every_command(site: Path) -> None:
    text = page_text(site, "reference/cli")
    commands = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    assert [name for name in commands if f"dpml {name}" not in text] == []
    assert "--set" in text and "--json" in text


def test_the_api_reference_is_written_from_the_docstrings(site: Path) -> None:
    text = page_text(site, "reference/api")
    assert "train_private" in text and "target_epsilon" in text and "register_attack" in text


def test_every_python_block_of_the_documentation_names_the_test_that_runs_it() -> None:
    """A ```python block is preceded by ``<!-- runs: tests/FILE.py::TEST -->``, and that test exists."""
    unnamed, missing = [], []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        named = {m.end() for m in MARKER.finditer(text)}
        for block in re.finditer(r"```python\n", text):
            if block.end() not in named:
                unnamed.append(f"{page.relative_to(ROOT)}:{text[: block.start()].count(chr(10)) + 1}")
        for test_file, test in MARKER.findall(text):
            source = ROOT / test_file
            if not source.exists() or not re.search(rf"^def {test}\(", source.read_text(encoding="utf-8"), re.M):
                missing.append(f"{page.relative_to(ROOT)}: {test_file}::{test}")
    assert unnamed == [] and missing == []


def test_the_marker_check_finds_an_unnamed_block_and_a_missing_test() -> None:
    text = "x\n<!-- runs: tests/test_docs.py::no_such_test -->\n```python\nprint(1)\n```\n```python\n2\n```\n"
    found = MARKER.findall(text)
    assert found == [("tests/test_docs.py", "no_such_test")]
    assert not re.search(r"^def no_such_test\(", Path(__file__).read_text(), re.M)
    assert len(re.findall(r"```python\n", text)) == 2 and len({m.end() for m in MARKER.finditer(text)}) == 1


def test_the_readme_is_a_landing_page_whose_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert "bash scripts/pipeline.sh" in readme and "bash scripts/test.sh" in readme
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
