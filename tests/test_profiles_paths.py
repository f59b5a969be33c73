"""Every `profiles/...` path the READMEs, the docs and the lab notes name exists, and so does
every archive member they cite (`logs.tar.xz: NAME`), so pruning or packing the results library
cannot leave a citation dangling."""

import fnmatch
import functools
import re
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"

# A path runs until whitespace, a backtick, a quote or a bracket; trailing sentence punctuation
# is not part of it.
PATH = re.compile(r"(?<![\w/.-])profiles/[^\s`'\"()\[\]<>|,;]*")
TRAILING = ".,:;"
# `ARCHIVE: MEMBER`: the archive's path relative to the citing file (or from the repository root
# when it starts with profiles/), then a member: a file, a folder, or a pattern of either.
ARCHIVE_MEMBER = re.compile(r"`([^`\s]+\.tar\.xz): ([^`\s]+)`")


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


@functools.cache
def _members(archive: Path) -> tuple[str, ...]:
    with tarfile.open(archive) as tar:
        return tuple(tar.getnames())


def _in_archive(archive: Path, member: str) -> bool:
    """A file of that name, or a folder holding one; shell patterns allowed in either."""
    name = member.rstrip("/")
    return any(fnmatch.fnmatchcase(m, name) or fnmatch.fnmatchcase(m, name + "/*")
               for m in _members(archive))


def _cited_members(source: Path) -> list[tuple[Path, str]]:
    text = source.read_text(encoding="utf-8")
    return [((ROOT if path.startswith("profiles/") else source.parent) / path, member)
            for path, member in ARCHIVE_MEMBER.findall(text)]


CITING = _citing_files()


@pytest.mark.parametrize("source", CITING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_profiles_paths_exist(source: Path):
    missing = sorted(p for p in _named_paths(source.read_text(encoding="utf-8"))
                     if not _exists(p))
    assert not missing, f"{source.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("source", CITING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_cited_archive_members_exist(source: Path):
    missing = sorted(f"{archive.relative_to(ROOT)}: {member}"
                     for archive, member in _cited_members(source)
                     if not archive.is_file() or not _in_archive(archive, member))
    assert not missing, f"{source.relative_to(ROOT)} cites archive members that do not exist: " \
        f"{missing}"


def test_archive_member_check_reads_files_folders_and_patterns(tmp_path: Path):
    archive = tmp_path / "logs.tar.xz"
    (tmp_path / "call2").mkdir()
    (tmp_path / "call2" / "tune_b1.log").write_text("rc=0\n")
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(tmp_path / "call2", arcname="call2")
    note = tmp_path / "NOTES.md"
    note.write_text("(`logs.tar.xz: call2/tune_b1.log`, `logs.tar.xz: call2/`, "
                    "`logs.tar.xz: call*/tune_*.log`, `logs.tar.xz: call3/`)")
    found = [_in_archive(a, m) for a, m in _cited_members(note)]
    assert found == [True, True, True, False]


def test_index_paths_exist():
    """profiles/README.md names its folders relative to profiles/: each of those exists too."""
    text = (PROFILES / "README.md").read_text(encoding="utf-8")
    tops = "|".join(re.escape(d.name) for d in PROFILES.iterdir() if d.is_dir())
    named = {m.rstrip(TRAILING) for m in re.findall(rf"`((?:{tops})/[^`\s]*)`", text)}
    assert named, "profiles/README.md names no folders"
    missing = sorted(p for p in named if not any(PROFILES.glob(p)) and not (PROFILES / p).exists())
    assert not missing, f"profiles/README.md names paths that do not exist: {missing}"


def test_sources_found():
    names = {p.relative_to(ROOT).as_posix() for p in CITING}
    assert {"README.md", "profiles/README.md"} <= names
    assert sum(n.endswith("NOTES.md") for n in names) >= 40
    assert sum(len(_cited_members(p)) for p in CITING) >= 100
