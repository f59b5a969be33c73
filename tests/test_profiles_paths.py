"""Every `profiles/...` path the READMEs, the docs and the lab notes name exists, so pruning the
results library cannot leave a citation dangling."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"

# A path runs until whitespace, a backtick, a quote or a bracket; trailing sentence punctuation
# is not part of it.
PATH = re.compile(r"(?<![\w/.-])profiles/[^\s`'\"()\[\]<>|,;]*")
TRAILING = ".,:;"


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md", PROFILES / "README.md"]
    files += sorted((ROOT / "docs").glob("**/*.md"))
    files += sorted(PROFILES.glob("**/NOTES.md"))
    return [f for f in files if f.is_file()]


def _named_paths(text: str) -> set[str]:
    paths = set()
    for match in PATH.finditer(text):
        path = match.group(0).rstrip(TRAILING)
        if not path or "{" in path or "<" in text[match.end():match.end() + 1]:
            continue  # a pattern (`{a,b}`) or a placeholder (`profiles/<device>/`)
        paths.add(path)
    return paths


def _exists(path: str) -> bool:
    if any(ch in path for ch in "*?"):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


CITING = _citing_files()


@pytest.mark.parametrize("source", CITING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_profiles_paths_exist(source: Path):
    missing = sorted(p for p in _named_paths(source.read_text(encoding="utf-8"))
                     if not _exists(p))
    assert not missing, f"{source.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_index_paths_exist():
    """profiles/README.md names its folders relative to profiles/: each of those exists too."""
    text = (PROFILES / "README.md").read_text(encoding="utf-8")
    named = {m.rstrip(TRAILING) for m in re.findall(r"`((?:nvidia-h200|compile|capacity|"
                                                    r"selection-overlap)/[^`\s]*)`", text)}
    assert named, "profiles/README.md names no folders"
    missing = sorted(p for p in named if not any(PROFILES.glob(p)) and not (PROFILES / p).exists())
    assert not missing, f"profiles/README.md names paths that do not exist: {missing}"


def test_sources_found():
    names = {p.relative_to(ROOT).as_posix() for p in CITING}
    assert {"README.md", "profiles/README.md"} <= names
    assert sum(n.endswith("NOTES.md") for n in names) >= 40
