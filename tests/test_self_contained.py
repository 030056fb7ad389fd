"""The repository cites only itself and public sources: no markdown file it does not hold, no notes of a
development machine, no absolute path of one (docs/platform-facts.md holds the facts those notes gave)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What users read: code, profiles, docs. Recorded run outputs (docs/results/*.json, training logs, the demo
# model's training.json) are verbatim records of where a run read its data, not citations, and stay as written.
SCANNED = [*ROOT.glob("vismmoe_edge/**/*.py"), *ROOT.glob("vismmoe_edge/**/*.toml"), *ROOT.glob("docs/**/*.md")] + [
    *ROOT.glob("profiles/*"),
    *ROOT.glob("systemd/*"),  # the shipped unit and environment file
    ROOT / "README.md",
]
OUTPUT_NAMES = {"analysis.md"}  # a file `vismmoe-edge analyze` writes, not a citation
MD_REF = re.compile(r"(?<![\w/.-])((?:\.\./)?[\w./-]*[\w-]+\.md)\b")
FORBIDDEN = re.compile(
    r"(?<![\w.])/(?:work|root|home)/[\w.-]+"  # an absolute path on a development machine
    r"|\.\./shared|(?<![\w-])notes/[\w-]+|peers\.md|linux-io|transformers-vlmoe|anchors\.md"
)


def _texts() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in SCANNED if p.is_file()]


def test_the_scan_covers_code_docs_and_profiles() -> None:
    names = {p.relative_to(ROOT).as_posix() for p, _ in _texts()}
    assert {"README.md", "docs/platform-facts.md", "vismmoe_edge/hardware/gpu_access.py"} <= names
    assert any(n.startswith("vismmoe_edge/profiles/") for n in names) and "profiles/README.md" in names


def test_every_cited_markdown_file_is_in_the_repository() -> None:
    missing = []
    for path, text in _texts():
        for m in MD_REF.finditer(text):
            ref = m.group(1)
            if ref in OUTPUT_NAMES:
                continue
            if not any((base / ref).exists() for base in (ROOT, path.parent, ROOT / "docs")):
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, "cites files the repository does not hold:\n" + "\n".join(missing)


def test_no_development_machine_paths_or_private_notes() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path, text in _texts()
        for m in FORBIDDEN.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_must() -> None:
    bad = ["see notes/linux-io.md §11", "/work/shared/notes/jetson.md", "(peers.md 6.3)", "/root/out/x.json"]
    assert all(FORBIDDEN.search(s) for s in bad)
    assert not FORBIDDEN.search('startswith(("/home/", "/root/"))')  # code that checks a user's path
    assert MD_REF.search("(notes/linux-io.md)").group(1) == "notes/linux-io.md"
