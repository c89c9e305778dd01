"""The README is the user's page: short, linking every docs page, and its file map names
every file of the checkout (tests and the shell tasks' fixtures by their folders)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_links_every_docs_page():
    assert len(README.splitlines()) <= 250
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in README, page.name
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)


def test_the_file_map_names_every_file():
    rows = [line for line in README.split("## Files", 1)[1].splitlines()
            if line.startswith("| `")]
    missing = []
    files = [ROOT / name for name in ("setup.cfg", "pyproject.toml", "LICENSE", ".gitignore")]
    for folder in ("gyre_slurm", "tools", "configs", "docs", "sbatch", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts and p.name != "__init__.py"]
    for path in sorted(files):
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("gyre_slurm", "envs", "tasks"):
            continue  # the shell tasks' own files: the map names tasks/
        folder = f"{rel.parent.as_posix()}/" if rel.parent.parts else ""
        top = f"{rel.parts[0]}/" if len(rel.parts) > 1 else ""
        named = any(rel.as_posix() in row or (rel.name in row and (
            (folder and folder in row) or (top and top in row.split("|")[1])))
            or (not folder and f"`{rel.name}`" in row) for row in rows)
        if not named:
            missing.append(rel.as_posix())
    assert not missing, missing
