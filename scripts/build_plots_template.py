"""Build the page template that lets ``dvc plots show`` render offline.

DVC's own page loads vega, vega-lite and vega-embed from a CDN, so without a network it is blank. This
writes a template (``{plot_divs}`` where DVC puts the plots; no ``{scripts}``, so DVC adds no CDN tags)
with the three libraries inlined, taken from their npm packages (``npm pack``, the versions DVC's
renderer is written for):

    python scripts/build_plots_template.py NPM_TARBALL_DIR build/dvc-plots-offline.html
    dvc plots show --html-template build/dvc-plots-offline.html

``scripts/setup.sh`` does both the ``npm pack`` and this.
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

LIBRARIES = {
    "vega-5.20.2.tgz": "package/build/vega.min.js",
    "vega-lite-5.2.0.tgz": "package/build/vega-lite.min.js",
    "vega-embed-6.18.2.tgz": "package/build/vega-embed.min.js",
}
PACKAGES = ("vega@5.20.2", "vega-lite@5.2.0", "vega-embed@6.18.2")  # what `npm pack` fetches


def library(tarball: Path, member: str) -> str:
    """One library's minified JavaScript from its npm tarball, safe to inline in a <script> element."""
    with tarfile.open(tarball) as archive:
        source = archive.extractfile(member)
        if source is None:
            raise ValueError(f"{tarball}: {member} is not a file")
        text = source.read().decode()
    return text.replace("</script", "<\\/script")


def page(scripts: list[str]) -> str:
    inline = "\n".join(f'<script type="text/javascript">\n{text}\n</script>' for text in scripts)
    return (
        '<!DOCTYPE html>\n<html>\n<head>\n{refresh_tag}\n<meta charset="utf-8">\n<title>dpml: DVC plots</title>\n'
        f"{inline}\n<style>table {{ border-spacing: 15px; }}</style>\n"
        "</head>\n<body>\n{plot_divs}\n</body>\n</html>\n"
    )


def main(folder: str, out: str) -> int:
    missing = [name for name in LIBRARIES if not (Path(folder) / name).is_file()]
    if missing:
        print(f"{folder}: missing {', '.join(missing)} (npm pack {' '.join(PACKAGES)})", file=sys.stderr)
        return 1
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(page([library(Path(folder) / name, member) for name, member in LIBRARIES.items()]))
    print(f"wrote {out}: dvc plots show --html-template {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
